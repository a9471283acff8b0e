"""The measured planner: what it costs to plan, and whether its estimators learn.

Sections (each printed as a table and written to BENCHMARKS.md):

* ``planning`` — wall time of ``fxapprox report torchvision:resnet50 --input-shape 8,3,224,224`` with the
  FLOP policy and with the measured policy, in the same run (subprocesses, one after the other);
* ``estimators`` — the MLP 512→1024→1024→10 on Gaussian inputs (label: argmax of the first 10 features),
  SGD 0.1 / momentum 0.9, batch 128, 60 steps: final loss (exact evaluation on held-out batches) of the
  exact model and of each method under the FLOP policy (budget 0.5, the old default; and
  ``mode="backward"``) and under the measured policy at budget 0.75 (timing off, no tolerance: the
  question is whether the estimators learn at that FLOP level);
* ``calibration`` — eleven fixed plans (one mode, method and keep-ratio on every linear layer of the
  transformer blocks) of the char transformer of ``examples/char_transformer.py``, each trained 400 steps:
  the measured policy's predicted model-gradient error of the plan against the validation loss it reached
  (the ranking the policy's constants were fitted to);
* ``rows`` — on the same MLP, fc2's backward sampled at keep-ratio 0.2 one GEMM at a time with top-k: its
  input gradient over output features, its weight gradient over batch rows, those rows rescaled to the
  batch's score mass, and WTA-CRS over the rows (why ``method="auto"`` uses WTA-CRS for the backward modes);
* ``bits`` — the memory policy measures each saved value at 4 bits and scales to 2 and 8 bits by the
  quantisation step; on a 2-block char transformer it also measures 2 and 8 bits directly and prints
  measured / extrapolated;
* ``attention`` — why attention rebuilds its weights from its saved inputs (``fxapprox/ops/attention.py``)
  and why the memory plan should be made on trained weights too: the char transformer trained exactly for
  ``--attention-steps`` steps; at initialisation and after, each saved value's measured 4-bit cost, and the
  model-gradient error (cross-entropy, 3 draws) of the ``memory_budget=0.125`` plan made at initialisation,
  with attention's own backward (the exact forward's log-sum-exp) and with the rebuilt one, rebuilding the
  cheap ops only (``activation_recompute=True``) and by default (``"auto"``: the first Linear too).

Usage: python benchmarks/bench_planner.py [--only planning,estimators,bits,attention] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import fxapprox  # noqa: E402
from _common import machine_line, markdown_table, print_table, write_section  # noqa: E402
from fxapprox import ApproxConfig  # noqa: E402
from fxapprox.pipeline.records import BIT_ERRORS_KEY  # noqa: E402

METHODS = ("topk", "crs", "bernoulli", "wta_crs", "auto")


def planning(repeats: int) -> str:
    rows = []
    times: dict[str, list[float]] = {"flops": [], "measured": []}
    for _ in range(repeats):
        for policy in times:
            start = time.perf_counter()
            result = subprocess.run([sys.executable, "-m", "fxapprox.cli", "report", "torchvision:resnet50",
                                     "--input-shape", "8,3,224,224", "--policy", policy, "--json"],
                                    capture_output=True, text=True, check=True)
            times[policy].append(time.perf_counter() - start)
            if policy == "measured":
                import json
                note = json.loads(result.stdout)["note"]
    flops, measured = statistics.median(times["flops"]), statistics.median(times["measured"])
    rows.append(["FLOP policy (`--policy flops`)", f"{flops:.1f}", "1.00×"])
    rows.append(["measured policy (default)", f"{measured:.1f}", f"{measured / flops:.2f}×"])
    headers = ["`fxapprox report torchvision:resnet50 --input-shape 8,3,224,224`", "wall s (median)",
               "vs FLOP policy"]
    print_table("planning cost", headers, rows)
    return (f"{machine_line()}; median of {repeats} runs each, whole command (import, model, analysis, plan).\n\n"
            + markdown_table(headers, rows) + f"\n\nMeasured plan's note: {note}\n")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(512, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 10)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


def _mlp_data(seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    xs = torch.randn(60, 128, 512, generator=generator)
    val = torch.randn(2048, 512, generator=generator)
    return xs, xs[..., :10].argmax(-1), val, val[:, :10].argmax(-1)


def _train_mlp(model, data) -> float:
    xs, ys, val_x, val_y = data
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in zip(xs, ys):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        return F.cross_entropy(model(val_x), val_y).item()


def estimators(seeds: int) -> str:
    """Mean over ``seeds`` (data and initial weights) of the final loss of each setting."""
    runs = []
    for seed in range(seeds):
        data = _mlp_data(seed + 1)
        torch.manual_seed(seed)
        base = MLP()
        runs.append((data, base, _train_mlp(fxapprox.approximate(base, 1.0, example_inputs=(data[0][0],)), data)))
    exact = statistics.mean(run[2] for run in runs)
    rows = []
    for method in METHODS:
        row = [method]
        settings = [("flops", 0.5, None), ("flops", 0.5, "backward"), ("measured", 0.75, None)]
        for policy, budget, mode in settings:
            config = ApproxConfig(policy=policy, mode=mode, min_speedup=None, max_grad_error=None, min_gain=None,
                                  check_every=None)
            if policy == "flops" and method == "auto":
                row += ["-", "-"]
                continue
            losses, planned, plans = [], [], []
            for data, base, _ in runs:
                torch.manual_seed(0)
                approx = fxapprox.approximate(base, budget, example_inputs=(data[0][0],), method=method,
                                              config=config)
                losses.append(_train_mlp(approx, data))
                planned.append(approx.plan.achieved)
                plans.append("; ".join(f"{d.target}: {d.mode} {d.method} {d.keep_ratio:.2f}"
                                       for d in approx.plan.approximated) or "exact")
            loss = statistics.mean(losses)
            row += [f"{max(planned):.3f}", f"{loss:.3f} ({loss / exact - 1:+.0%})"]
            if policy == "measured":
                row.append(plans[0])
        rows.append(row)
    headers = ["method", "FLOP policy 0.5: planned", "loss", "FLOP policy 0.5, backward: planned", "loss",
               "measured 0.75: planned (max over seeds)", "loss", "measured plan (first seed)"]
    print_table(f"MLP estimators (exact loss {exact:.3f})", headers, rows)
    return (f"{machine_line()}; mean of {seeds} seeds (data and initial weights). Exact model: final loss "
            f"**{exact:.3f}** (from 2.30). Loss in brackets: against exact. Target: every method within 15% of "
            "exact while planning ≤ 0.75 of the FLOPs.\n\n" + markdown_table(headers, rows) + "\n")


class _OneSampledGEMM(torch.autograd.Function):
    """``F.linear`` whose backward samples one GEMM: ``"dx"`` (top-k output features), ``"dw"`` (top-k rows),
    ``"dw-rescaled"`` (top-k rows scaled to the batch's score mass) or ``"dw-wta"`` (WTA-CRS over rows)."""

    @staticmethod
    def forward(ctx, x, weight, bias, which, ratio):
        ctx.save_for_backward(x, weight)
        ctx.which, ctx.ratio = which, ratio
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        from fxapprox.ops.linear import pair_scores, sampled_rows_product, squared_norms
        from fxapprox.ops.sampling import rounded_count

        x, weight = ctx.saved_tensors
        grad_x, grad_w = grad @ weight, grad.t() @ x
        if ctx.which == "dx":
            scores = pair_scores(squared_norms(grad, 0), squared_norms(weight, 1))
            kept = torch.topk(scores, rounded_count(ctx.ratio, weight.shape[0])).indices
            grad_x = grad[:, kept] @ weight[kept]
        elif ctx.which == "dw-wta":
            grad_w = sampled_rows_product(grad, x, ctx.ratio, "wta_crs")
        else:
            scores = pair_scores(squared_norms(x, 1), squared_norms(grad, 1))
            kept = torch.topk(scores, rounded_count(ctx.ratio, grad.shape[0])).indices
            scale = scores.sum() / scores[kept].sum() if ctx.which == "dw-rescaled" else 1.0
            grad_w = (grad[kept] * scale).t() @ x[kept]
        return grad_x, grad_w, grad.sum(0), None, None


class _SampledFC2(nn.Linear):
    which, ratio = "dx", 0.2

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        return _OneSampledGEMM.apply(x, self.weight, self.bias, self.which, self.ratio)


def rows(seeds: int) -> str:
    results: dict[str, list[float]] = {}
    for seed in range(seeds):
        data = _mlp_data(seed + 1)
        for which in ("exact", "dx", "dw", "dw-rescaled", "dw-wta"):
            torch.manual_seed(seed)
            model = MLP()
            if which != "exact":
                sampled = _SampledFC2(1024, 1024)
                sampled.load_state_dict(model.fc2.state_dict())
                sampled.which = which
                model.fc2 = sampled
            torch.manual_seed(0)
            results.setdefault(which, []).append(_train_mlp(model, data))
    labels = {"exact": "exact", "dx": "top-k dX over output features", "dw": "top-k dW over batch rows",
              "dw-rescaled": "top-k dW rows, rescaled to the batch's score mass", "dw-wta": "WTA-CRS dW over rows"}
    table = [[labels[w], f"{statistics.mean(v):.3f}"] for w, v in results.items()]
    headers = ["fc2's backward at keep-ratio 0.2", f"final loss (mean of {seeds} seeds)"]
    print_table("top-k over rows", headers, table)
    return f"{machine_line()}; the MLP of the estimators section.\n\n" + markdown_table(headers, table) + "\n"


CALIBRATION_PLANS = ("forward topk 0.75", "forward topk 0.5", "weight_grad wta_crs 0.5", "weight_grad wta_crs 0.25",
                     "weight_grad topk 0.5", "weight_grad topk 0.25", "backward wta_crs 0.75",
                     "backward wta_crs 0.5", "backward wta_crs 0.25", "backward topk 0.75", "backward topk 0.5")


def calibration(steps: int) -> str:
    import copy
    from types import SimpleNamespace

    from _text import encode, load_corpus, windows
    from char_transformer import CharTransformer, train

    data, vocab = encode(load_corpus(2_000_000))
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    val_stream = windows(val_data, 128, 32, torch.Generator().manual_seed(2))
    val_batches = [next(val_stream) for _ in range(8)]
    args = SimpleNamespace(seq=128, batch=16, lr=2e-3, warmup=50, steps=steps, eval_every=steps)
    torch.manual_seed(0)
    base = CharTransformer(len(vocab))
    example = (next(windows(train_data, 128, 16, torch.Generator().manual_seed(3)))[0],)
    exact = train(copy.deepcopy(base), args, train_data, val_batches, "exact")[-1][2]
    rows = []
    for label in CALIBRATION_PLANS:
        mode, method, ratio = label.split()
        config = ApproxConfig(min_speedup=None, max_grad_error=None, overrides=(
            fxapprox.LayerOverride(r"blocks\..*", mode=mode, method=method, keep_ratio=float(ratio)),
            fxapprox.LayerOverride(r".*", exclude=True)))
        approx = fxapprox.approximate(copy.deepcopy(base), 0.99, example_inputs=example, config=config)
        loss = train(approx, args, train_data, val_batches, label)[-1][2]
        rows.append((approx.plan.predicted_error, label, approx.plan.achieved, loss))
    rows.sort()
    table = [[label, f"{achieved:.2f}", f"{predicted:.3f}", f"{loss:.4f}", f"{loss / exact - 1:+.1%}"]
             for predicted, label, achieved, loss in rows]
    losses = [loss for *_, loss in rows]
    inversions = sum(1 for i in range(len(losses)) for j in range(i + 1, len(losses)) if losses[j] < losses[i])
    pairs = len(losses) * (len(losses) - 1) // 2
    headers = ["plan (every block linear)", "planned FLOPs", "predicted model-gradient error", "val loss",
               "vs exact"]
    print_table(f"calibration (exact {exact:.4f})", headers, table)
    return (f"{machine_line()}; char transformer (4 blocks, d=256, batch 16×128, AdamW 2e-3), {steps} steps; "
            f"exact: val loss **{exact:.4f}**. Sorted by predicted error; {inversions} of {pairs} pairs ranked "
            "against the measured loss.\n\n" + markdown_table(headers, table) + "\n")


def bits() -> str:
    import fxapprox.passes.memory.measure_saved as measure_saved
    from _text import encode, load_corpus, windows
    from char_transformer import CharTransformer

    data, vocab = encode(load_corpus(500_000))
    torch.manual_seed(0)
    model = CharTransformer(len(vocab), layers=2)
    example = (next(windows(data, 128, 16, torch.Generator().manual_seed(3)))[0],)
    measured = {}
    try:
        for width in (2, 4, 8):
            measure_saved.MEASURED_BITS = width
            approx = fxapprox.approximate(model, 1.0, memory_budget=0.125, example_inputs=example)
            measured[width] = {n.name: n.meta[BIT_ERRORS_KEY] for n in approx.graph.nodes
                               if BIT_ERRORS_KEY in n.meta}
    finally:
        measure_saved.MEASURED_BITS = 4
    ratios = {2: [], 8: []}
    for name, from_four in measured[4].items():
        for width in ratios:
            if from_four[width]["contribution"] > 0:
                ratios[width].append(measured[width][name][width]["contribution"] / from_four[width]["contribution"])
    rows = [[f"{w} bits", str(len(r)), f"{min(r):.2f}", f"{statistics.median(r):.2f}", f"{max(r):.2f}"]
            for w, r in ratios.items()]
    headers = ["width", "values", "measured / extrapolated: min", "median", "max"]
    print_table("bit-width extrapolation", headers, rows)
    return f"{machine_line()}; 2-block char transformer (d=256), batch 16×128.\n\n" + markdown_table(headers, rows)


def _gradient_error(model, batch, draws: int = 3) -> float:
    """Median relative error of the whole parameter gradient of the cross-entropy, approximated vs exact."""
    x, y = batch
    errors = []
    for seed in range(draws):
        grads = []
        for approximate in (True, False):
            torch.manual_seed(seed)
            model.set_approximate(approximate)
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.set_approximate(True)
        got, exact = grads
        errors.append((sum(float((got[n] - exact[n]).square().sum()) for n in exact)
                       / sum(float(exact[n].square().sum()) for n in exact)) ** 0.5)
    return statistics.median(errors)


def attention(steps: int) -> str:
    import contextlib
    import copy
    import math
    from types import SimpleNamespace

    import fxapprox.api as api
    from _text import encode, load_corpus, windows
    from char_transformer import CharTransformer, train

    data, vocab = encode(load_corpus(2_000_000))
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    val_stream = windows(val_data, 128, 32, torch.Generator().manual_seed(2))
    val_batches = [next(val_stream) for _ in range(2)]
    torch.manual_seed(0)
    initial = CharTransformer(len(vocab))
    batch = next(windows(train_data, 128, 16, torch.Generator().manual_seed(3)))
    trained = copy.deepcopy(initial)
    args = SimpleNamespace(seq=128, batch=16, lr=2e-3, warmup=50, steps=steps, eval_every=steps)
    train(trained, args, train_data, val_batches, "exact")

    @contextlib.contextmanager
    def kernel_backward():   # attention kept as F.scaled_dot_product_attention (its own backward)
        original = api.recompute_attention
        api.recompute_attention = lambda gm: gm
        try:
            yield
        finally:
            api.recompute_attention = original

    def plan(model, recompute):
        approx = fxapprox.approximate(copy.deepcopy(model), 1.0, memory_budget=0.125, example_inputs=(batch[0],),
                                      config=ApproxConfig(activation_recompute=recompute))
        costs = {n.name: math.sqrt(n.meta[BIT_ERRORS_KEY][4]["contribution"]) for n in approx.graph.nodes
                 if BIT_ERRORS_KEY in n.meta}
        return approx, costs

    rows = []
    for label, context, recompute in (
            ("kernel's backward (exact log-sum-exp)", kernel_backward, True),
            ("rebuilt from saved inputs", contextlib.nullcontext, True),
            ("rebuilt from saved inputs", contextlib.nullcontext, "auto")):
        with context():
            approx, at_init = plan(initial, recompute)
            _, at_step = plan(trained, recompute)
            error_init = _gradient_error(approx, batch)
            approx.load_state_dict(trained.state_dict())
            error_step = _gradient_error(approx, batch)
        attention_values = [v.node for v in approx.plan.memory.values if v.node in at_init and any(
            s.startswith("scaled_dot_product_attention") for s in v.savers) and not v.node.startswith("scaled")]
        others = [n for n in at_init if n not in attention_values]
        rebuilt = "LayerNorm, GELU" if recompute is True else "LayerNorm, GELU, first Linear (auto)"
        bits = sorted({v.bits for v in approx.plan.memory.values if v.compressed})
        rows.append([label, rebuilt, "/".join(map(str, bits)), f"{max(at_init[n] for n in attention_values):.4f}",
                     f"{max(at_step[n] for n in attention_values):.4f}",
                     f"{max(at_step[n] for n in others):.4f}", f"{error_init:.4f}", f"{error_step:.4f}"])
    headers = ["attention backward", "rebuilt in backward", "widths", "q/k/v 4-bit cost, init (max)",
               f"q/k/v 4-bit cost, step {steps} (max)",
               f"other values, step {steps} (max)", "gradient error of the init plan, init",
               f"same plan, step {steps}"]
    print_table("attention inputs after training", headers, rows)
    return (f"{machine_line()}; char transformer (4 blocks, d=256, 4 heads), batch 16×128, trained exactly "
            f"{steps} steps. Costs: square root of a value's measured contribution to the squared model-gradient "
            "error at 4 bits; gradient error: relative, whole cross-entropy gradient, median of 3 draws.\n\n"
            + markdown_table(headers, rows) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="planning,estimators,rows,calibration,bits,attention")
    parser.add_argument("--attention-steps", type=int, default=1000, help="exact training steps before measuring")
    parser.add_argument("--steps", type=int, default=400, help="training steps per calibration plan")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="planning runs per policy")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the MLP estimator runs")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sections = args.only.split(",")
    if "planning" in sections:
        write_section("planner-cost", "## Planning cost (`benchmarks/bench_planner.py`)\n\n" + planning(args.repeats))
    if "estimators" in sections:
        write_section("planner-estimators", "## Estimators on an MLP (`benchmarks/bench_planner.py`)\n\n"
                      + estimators(args.seeds))
    if "calibration" in sections:
        write_section("planner-calibration", "## Predicted error against training, char transformer "
                      "(`benchmarks/bench_planner.py`)\n\n" + calibration(args.steps))
    if "rows" in sections:
        write_section("planner-rows", "## Top-k over batch rows is biased (`benchmarks/bench_planner.py`)\n\n"
                      + rows(args.seeds))
    if "bits" in sections:
        write_section("planner-bits", "## Saved-value widths: 4-bit measurement scaled to 2 and 8 bits "
                      "(`benchmarks/bench_planner.py`)\n\n" + bits())
    if "attention" in sections:
        write_section("planner-attention", "## Attention's saved inputs after training (`benchmarks/bench_planner.py`)"
                      "\n\n" + attention(args.attention_steps))


if __name__ == "__main__":
    main()

"""Speed benchmark: train steps of sampled Linear / Conv2d / ResNet-50 / transformers against exact, and the share
of the Amdahl bound each reaches.

Each case builds the exact model and ``fxapprox.approximate(model, budget)`` on the same data, then times a full
train step (forward + backward + SGD) of each, interleaved round by round after warm-up. The speed-up is the
median over rounds of the paired ratio (exact ÷ approximate in the same round: the machine's speed drifts 15–20%
between runs, far less within a round). The **Amdahl bound** is what a plan executing ``f`` of the exact FLOPs can
reach when only the FLOP-counted kernels (GEMMs, convolutions, attention) shrink and everything else (norms,
activations, the loss, the optimizer) costs what it costs: ``1 / (1 − s·(1 − f))``, ``s`` their share of the exact
step's time (``torch.profiler`` self time). "Share of bound" is the measured speed-up's fraction of it. "Predicted"
is the plan's own step speed-up (the measured policy times the planned step against the exact one on the example
batch, forward and backward, when it plans). "norms+selection" is the share
of the approximate step spent scoring and choosing pairs of forward-sampled layers.

Cases: ``Linear(2048, 2048)`` on 512 rows and ``Conv2d(256, 256, 3)`` on 16×256×28², each with the default measured
plan and with the FLOP-ranked forward top-k plan (the papers' op); ResNet-50 at batch 16, 160²; the character
transformer of ``examples/char_transformer.py`` (4 blocks, d=256, 16×128 tokens) and the Hugging Face Llama LM of
``examples/llama_lm.py`` (6 blocks, d=384, 8×128 tokens) and a language model on torch's own
``nn.TransformerEncoder`` (4 batch-first ``nn.TransformerEncoderLayer`` s, d=256, 16×128 tokens, causal mask), each
with the default measured plan and with the measured
plan restricted to forward sampling (``ApproxConfig(mode="forward")``), and with the row family (``rows``: the
budget spent by sampling the rows of every block's backward, forward exact, ``ApproxConfig(max_forward_kl=None)``;
``rows 0.5``: every block's backward on half the samples, weight gradients exact). The default plan's modes are the
pay-off model's choice; the forward rows show what the sampled ops give where every sampled GEMM shrinks.

Usage: python benchmarks/bench_sampled_ops.py [--repetitions 15] [--budgets 0.5] [--cases linear,conv,...] [--write]
``--write`` puts the table into BENCHMARKS.md (section ``sampled_ops``) and docs/speed.md; with ``--cases`` the
rows of the cases not run are kept from the table there.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import fxapprox
from fxapprox.ops.sampling import select_pairs
from fxapprox.passes.policy.row_policy import with_ratios
from fxapprox.runtime.modules import APPROX_MODULE_TYPES

from _common import interleaved_samples, machine_line, markdown_table, paired_ratio, print_table, write_section

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

#: kernels whose time a FLOP cut shrinks (torch.profiler names)
FLOP_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mkldnn_convolution",
            "aten::convolution_backward", "aten::_convolution", "aten::mkldnn_rnn_layer",
            "aten::mkldnn_rnn_layer_backward", "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def _train_step(module, inputs, loss_fn):
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_fn(module(**inputs) if isinstance(inputs, dict) else module(*inputs)).backward()
        optimizer.step()
    return step


def _selection_seconds(approx, inputs, loss_fn, repetitions=5) -> float:
    """Seconds per step spent in pair scoring + selection of every forward-sampled layer."""
    captured = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: captured.append((mod, [a.detach() for a in args])))
             for m in approx.modules() if isinstance(m, APPROX_MODULE_TYPES) and m.approximating
             and m.fxapprox_spec.mode == "forward" and hasattr(m, "pair_scores")]
    loss_fn(approx(**inputs) if isinstance(inputs, dict) else approx(*inputs)).backward()
    for hook in hooks:
        hook.remove()
    approx.zero_grad(set_to_none=True)
    if not captured:
        return 0.0

    def select_all():
        for module, args in captured:
            spec = module.fxapprox_spec
            select_pairs(spec.method, module.pair_scores(*args), spec.k, spec.random_share)

    samples = interleaved_samples({"select": select_all}, repetitions, warmup=1)["select"]
    return statistics.median(samples)


def flop_kernel_share(step, steps: int = 3) -> float:
    """Share of the CPU time of ``steps`` steps spent in FLOP-counted kernels (torch.profiler, self time)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    flops = sum(e.self_cpu_time_total for e in events if e.key in FLOP_OPS)
    return flops / total if total else 0.0


def run_case(name, make_model, inputs, loss_fn, budget, policy, repetitions):
    torch.manual_seed(0)
    exact = make_model().train()
    rows = fxapprox.ApproxConfig(max_forward_kl=None, check_every=None, row_check_every=None)
    config = {"flops": fxapprox.ApproxConfig(policy="flops", check_every=None),
              "forward": fxapprox.ApproxConfig(mode="forward", check_every=None),
              "measured": fxapprox.ApproxConfig(check_every=None), "rows": rows, "rows 0.5": rows}[policy]
    start = time.perf_counter()
    approx = fxapprox.approximate(exact, budget, example_inputs=inputs, method="topk" if policy == "flops" else "auto",
                                  config=config)
    planning = time.perf_counter() - start
    approx.train()
    steps = {"exact": _train_step(exact, inputs, loss_fn), "approx": _train_step(approx, inputs, loss_fn)}
    if policy.startswith("rows"):
        steps["approx"]()   # the first step's variance check calibrates the ratios
        if policy == "rows 0.5":   # every block's backward on half the samples, weight gradients on all their tokens
            approx._apply_plan(with_ratios(approx.plan, approx._planning_module(), 0.5, 1.0))
    samples = interleaved_samples(steps, repetitions, warmup=3)
    speedup = paired_ratio(samples, "exact", "approx")
    approx_s = statistics.median(samples["approx"])
    selection = _selection_seconds(approx, inputs, loss_fn)
    share = flop_kernel_share(steps["exact"])
    plan = approx.plan
    bound = 1.0 / (1.0 - share * (1.0 - plan.achieved))
    modes = sorted({f"{d.mode} {d.method}" for d in plan.approximated})
    if plan.rows is not None:
        rows_plan = plan.rows
        modes = [f"rows {min(b.ratio for b in rows_plan.sampled):.2f} / tokens {rows_plan.token_ratio:.2f} "
                 f"(break-even: rows {rows_plan.row_breakeven or 1.0:.2f}, tokens {rows_plan.token_breakeven or 1.0:.2f})"]
    return {"case": name, "policy": policy, "budget": budget, "achieved": plan.achieved,
            "exact_s": statistics.median(samples["exact"]), "approx_s": approx_s, "speedup": speedup,
            "flop_limit": 1.0 / plan.achieved, "share": share, "bound": bound, "of_bound": speedup / bound,
            "predicted": plan.measured_speedup or plan.predicted_speedup, "overhead": selection / approx_s,
            "planning": planning,
            "sampled": f"{len(plan.approximated)}/{len(plan.layers)}", "modes": ", ".join(modes) or "-"}


def _char_transformer():
    from char_transformer import CharTransformer

    tokens = torch.randint(0, 96, (16, 128), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 96, (16, 128), generator=torch.Generator().manual_seed(2))
    return (lambda: CharTransformer(96, 256, 4, 4, 128), (tokens,),
            lambda y: F.cross_entropy(y.flatten(0, 1), targets.flatten()))


def _llama_lm():
    import llama_lm

    ids = torch.randint(0, 96, (8, 128), generator=torch.Generator().manual_seed(1))
    return (lambda: llama_lm.build(96, "full", 128), {"input_ids": ids, "labels": ids}, lambda out: out.loss)


class TorchEncoderLM(nn.Module):
    """A causal language model on torch's own ``nn.TransformerEncoder`` (what tutorials write)."""

    def __init__(self, vocab: int = 96, d: int = 256, layers: int = 4, heads: int = 4, length: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.position = nn.Parameter(torch.zeros(1, length, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(length), persistent=False)

    def forward(self, tokens):
        hidden = self.embed(tokens) + self.position[:, : tokens.shape[1]]
        return self.head(self.encoder(hidden, mask=self.causal, is_causal=True))


def _torch_encoder():
    tokens = torch.randint(0, 96, (16, 128), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 96, (16, 128), generator=torch.Generator().manual_seed(2))
    return TorchEncoderLM, (tokens,), lambda y: F.cross_entropy(y.flatten(0, 1), targets.flatten())


def cases(selected: set):
    linear_x = torch.randn(512, 2048, requires_grad=True)
    conv_x = torch.randn(16, 256, 28, 28, requires_grad=True)
    resnet_x = torch.randn(16, 3, 160, 160)
    labels = torch.randint(0, 1000, (16,))
    if "linear" in selected:
        for policy in ("measured", "flops"):
            yield ("Linear(2048, 2048), batch 512", lambda: nn.Linear(2048, 2048), (linear_x,),
                   lambda y: y.pow(2).mean(), policy)
    if "conv" in selected:
        for policy in ("measured", "flops"):
            yield ("Conv2d(256, 256, 3), 16x256x28x28", lambda: nn.Conv2d(256, 256, 3, padding=1), (conv_x,),
                   lambda y: y.pow(2).mean(), policy)
    if "resnet50" in selected:
        for policy in ("measured", "forward"):
            yield ("ResNet-50, batch 16, 3x160x160", lambda: torchvision.models.resnet50(), (resnet_x,),
                   lambda y: F.cross_entropy(y, labels), policy)
    if "char_transformer" in selected:
        build, inputs, loss = _char_transformer()
        for policy in ("measured", "forward", "rows", "rows 0.5"):
            yield "char transformer (examples), d=256, 4 blocks, 16x128", build, inputs, loss, policy
    if "llama" in selected:
        build, inputs, loss = _llama_lm()
        for policy in ("measured", "forward", "rows", "rows 0.5"):
            yield "Llama LM (examples, HF), d=384, 6 blocks, 8x128", build, inputs, loss, policy
    if "torch_encoder" in selected:
        build, inputs, loss = _torch_encoder()
        for policy in ("measured", "forward", "rows"):
            yield "nn.TransformerEncoder LM, d=256, 4 layers, 16x128", build, inputs, loss, policy


HEADERS = ["case", "plan", "budget", "planned FLOPs", "sampled", "exact ms", "approx ms", "speed-up",
           "predicted", "Amdahl bound", "share of bound", "FLOP-kernel share", "norms+selection", "planning s"]


def _row(r: dict) -> list[str]:
    predicted = "-" if r["predicted"] is None else f"{r['predicted']:.2f}x"
    return [r["case"], f"{r['policy']}: {r['modes']}", f"{r['budget']:g}", f"{r['achieved']:.3f}", r["sampled"],
            f"{r['exact_s'] * 1e3:.1f}", f"{r['approx_s'] * 1e3:.1f}", f"**{r['speedup']:.2f}x**", predicted,
            f"{r['bound']:.2f}x", f"{r['of_bound']:.2f}", f"{r['share']:.0%}", f"{r['overhead']:.1%}",
            f"{r['planning']:.1f}"]


DOC_MARKERS = ("<!-- sampled-ops -->", "<!-- /sampled-ops -->")


def _write_docs(table: str) -> None:
    path = ROOT / "docs" / "speed.md"
    text = path.read_text()
    begin, end = DOC_MARKERS
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"docs/speed.md has no {begin} … {end} block to write the table into")
    path.write_text(pattern.sub(lambda _: f"{begin}\n{table}\n{end}", text))


def _with_rows_not_run(rows: list[list[str]]) -> list[list[str]]:
    """``rows`` and, in the table's order, the rows of BENCHMARKS.md's table whose case was not run now."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    section = re.search(r"<!-- bench:sampled_ops -->(.*?)<!-- /bench:sampled_ops -->", text, re.S)
    if section is None:
        return rows
    run = {row[0] for row in rows}
    merged, placed = [], set()
    for line in section.group(1).splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or cells[0] == HEADERS[0] or len(cells) != len(HEADERS):
            continue
        if cells[0] not in run:
            merged.append(cells)
        elif cells[0] not in placed:   # the new rows where the case's old ones were
            merged += [row for row in rows if row[0] == cells[0]]
            placed.add(cells[0])
    return merged + [row for row in rows if row[0] not in placed]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=15)
    parser.add_argument("--budgets", default="0.5")
    parser.add_argument("--cases", default="linear,conv,resnet50,char_transformer,llama,torch_encoder")
    parser.add_argument("--write", action="store_true", help="write BENCHMARKS.md and docs/speed.md")
    args = parser.parse_args()
    rows = []
    for name, make_model, inputs, loss_fn, policy in cases(set(args.cases.split(","))):
        for budget in (float(b) for b in args.budgets.split(",")):
            start = time.perf_counter()
            result = run_case(name, make_model, inputs, loss_fn, budget, policy, args.repetitions)
            print(f"{name} [{policy}] budget {budget}: {result['speedup']:.2f}x of bound {result['bound']:.2f}x "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)
            rows.append(_row(result))
    print_table("train step (fwd + bwd + SGD), paired medians of interleaved rounds", HEADERS, rows)
    if args.write:
        table = markdown_table(HEADERS, _with_rows_not_run(rows))
        write_section("sampled_ops", "\n\n".join([
            "## Sampled Linear / Conv2d / ResNet-50 / transformer train steps",
            f"`python benchmarks/bench_sampled_ops.py --repetitions {args.repetitions} --write` on {machine_line()}"
            + (f" (last run: `--cases {args.cases}`; the other rows are from an earlier run of the script). "
               if args.cases != parser.get_default("cases") else ". ") +
            "Train step = forward + backward + SGD step; single layers take an input that requires grad (all "
            "three GEMMs run). Speed-up: median over interleaved rounds of the paired exact ÷ approximate ratio. "
            "Amdahl bound = 1 / (1 − s·(1 − f)), s the FLOP-counted kernels' share of the exact step "
            "(torch.profiler self time), f the planned FLOP fraction.",
            table]))
        _write_docs(table)


if __name__ == "__main__":
    main()

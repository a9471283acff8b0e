"""Issue 38 benchmark: the memory frontier — step time against a step's peak memory — of fxapprox's memory plans
and of the tools users already have for activation memory.

Configurations, per model:

* ``exact`` — the model as it is;
* ``checkpoint`` — ``torch.utils.checkpoint`` (non-reentrant) around every block: the items of a container
  (transformer layers, ResNet bottlenecks; the same blocks fxapprox may checkpoint);
* ``selective`` — the same blocks under selective activation checkpointing
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) with a save-matmuls policy: matmul, attention
  and convolution outputs saved, everything else recomputed;
* ``gradient_checkpointing`` / ``gradient_checkpointing reentrant`` — Hugging Face models' own
  ``model.gradient_checkpointing_enable()`` (``use_reentrant`` False / True), what their users call;
* ``compile B`` — ``torch.compile`` with ``torch._functorch.config.activation_memory_budget = B`` (the
  partitioner's knapsack over what to recompute), where it compiles on this machine;
* ``fxapprox M`` — ``fxapprox.approximate(model, 1.0, memory_budget=M)`` (the compute stays exact: only what is
  saved changes), planned on the benchmark's batch.

Measured in one process per model (glibc's ``mmap_threshold`` set low so freed tensors leave the resident set):

* **step time** — forward + backward + SGD, every configuration interleaved round by round; the ratio to exact is
  the median of the per-round ratios (the machine drifts 15–20% between runs, far less within a round);
* **peak memory** — the step's peak resident-set growth: ``/proc/self/clear_refs`` resets the kernel's high-water
  mark before a step, growth = ``VmHWM`` after − ``VmRSS`` before, gradients already allocated (so it is
  activations and temporaries), median of three steps;
* **saved bytes** — what autograd keeps: exact counted by saved-tensor hooks, fxapprox's compressor's own count
  (peers recompute inside backward, so their saved bytes are not comparable and are left out).

Then, on the 4-block transformer of the speed benchmark:

* **fit a bigger batch** — under a cap on the step's memory (exact's peak growth at the benchmark's batch), the
  largest batch each configuration trains: peak growth is measured at two batch sizes and extrapolated linearly,
  then the predicted batch is run and its growth measured (stepping down until it fits); tokens per second at
  that batch (interleaved with exact at the benchmark's batch);
* **quality** — validation loss at equal steps of the char transformer (``benchmarks/workloads.py``,
  ``char_transformer``) and ResNet-18 on digits (``resnet18``), exact vs fxapprox at each memory budget;
* **quality at the end of a schedule** — the final validation loss after warm-up + cosine to zero of the small
  char transformer (``char_transformer_small``) and the Hugging Face Llama LM (``hf_llama``, captured region by
  region), exact vs ``memory_budget=0.125`` (``SCHEDULE_QUALITY``), per seed; and at equal wall-clock where a
  frontier of the same model and batch gives the paired step ratio (``SCHEDULE_PAIRED``): the plan's loss when
  exact's run ends, its planning on the clock.

Results are cached in ``benchmarks/.data/memory_frontier/`` (one JSON per model and section; ``--fresh`` measures
again). ``--write`` puts the tables in BENCHMARKS.md ("memory_frontier") and docs/memory_frontier.md, and the
frontier plots in docs/.

Usage: python benchmarks/bench_memory_frontier.py [--models transformer6,...] [--repetitions 5] [--quick] [--write]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

from _common import (interleaved_samples, machine_line, markdown_table, paired_ratio, print_table,  # noqa: E402
                     step_peak_growth, write_section)

DATA = HERE / ".data" / "memory_frontier"
MEMORY_BUDGETS = (0.5, 0.25, 0.125, 0.0625)
COMPILE_BUDGETS = (0.5, 0.1)
#: the models whose fxapprox rows run under torch.compile too (traced models; the Llama LM is captured region by
#: region, whose memory plan runs eagerly under torch.compile)
COMPILED_SAVING = ("transformer6", "transformer4")
#: the quality runs' lengths where shorter than the workload's own (a short run, several seeds)
QUALITY_STEPS = {"char_transformer": 200}
#: the end-of-schedule runs (warm-up + cosine to zero, the workload's whole length): workload → budgets
SCHEDULE_QUALITY = {"char_transformer_small": (0.125,), "hf_llama": (0.125,)}
#: the frontier whose paired step ratios give a schedule workload's comparison at equal wall-clock (same model and
#: batch): workload → model
SCHEDULE_PAIRED = {"hf_llama": "llama"}
DOC = HERE.parent / "docs" / "memory_frontier.md"


# -- models ------------------------------------------------------------------------------------------------------
def _tokens(batch: int, seq: int, vocab: int = 96):
    generator = torch.Generator().manual_seed(batch * 1000 + seq)
    return (torch.randint(0, vocab, (batch, seq), generator=generator),
            torch.randint(0, vocab, (batch, seq), generator=generator))


def _char_transformer(layers: int, seq: int):
    from char_transformer import CharTransformer

    def build():
        torch.manual_seed(0)
        return CharTransformer(96, 256, 4, layers, seq)

    def batch(size: int):
        tokens, targets = _tokens(size, seq)
        return (tokens,), {}, lambda y: F.cross_entropy(y.flatten(0, 1), targets.flatten())
    return build, batch


def _llama():
    import llama_lm

    def build():
        return llama_lm.build(96, "full", 128)

    def batch(size: int):
        # training builds no KV cache: Hugging Face's gradient_checkpointing_enable() turns it off itself, and a
        # selectively checkpointed region that appends to it recomputes other ops than its forward ran
        ids = _tokens(size, 128)[0]
        return (), {"input_ids": ids, "labels": ids, "use_cache": False}, lambda out: out.loss
    return build, batch


def _resnet50():
    import torchvision

    def build():
        torch.manual_seed(0)
        return torchvision.models.resnet50()

    def batch(size: int):
        generator = torch.Generator().manual_seed(size)
        x = torch.randn(size, 3, 160, 160, generator=generator)
        y = torch.randint(0, 1000, (size,), generator=generator)
        return (x,), {}, lambda out: F.cross_entropy(out, y)
    return build, batch


#: name → (factory of (build, batch), batch size, what the rows call one sample, compile?)
MODELS = {
    "transformer6": (lambda: _char_transformer(6, 256), 32, "token", True),
    "transformer4": (lambda: _char_transformer(4, 128), 16, "token", True),
    "llama": (_llama, 8, "token", True),
    "resnet50": (_resnet50, 16, "image", False),
}
TITLES = {"transformer6": "6-block pre-LN transformer (d=256, T=256, batch 32)",
          "transformer4": "4-block char transformer of the speed benchmark (d=256, T=128, batch 16)",
          "llama": "Llama LM of examples/llama_lm.py (full size, T=128, batch 8)",
          "resnet50": "ResNet-50 (3×160×160, batch 16)"}


# -- the peers ---------------------------------------------------------------------------------------------------
def block_paths(model: nn.Module) -> list[str]:
    """The outermost modules that are items of a container (a path ending in an index): the blocks."""
    paths = []
    for name, _ in model.named_modules():
        if name and name.rsplit(".", 1)[-1].isdigit() and not any(name.startswith(p + ".") for p in paths):
            paths.append(name)
    return paths


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.convolution.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default}


def _save_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(model: nn.Module, selective: bool) -> nn.Module:
    """``model`` with every block's forward under ``torch.utils.checkpoint`` (selective: save-matmuls policy)."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls) if selective else None
    for path in block_paths(model):
        block = model.get_submodule(path)
        forward = block.forward

        def wrapped(*args, _forward=forward, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            if context is None:
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, context_fn=context, **kwargs)
        block.forward = wrapped
    return model


def hf_checkpointed(model: nn.Module, reentrant: bool) -> nn.Module:
    """``model.gradient_checkpointing_enable()`` as a Hugging Face user calls it (``use_reentrant`` given)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def compiled(model: nn.Module, budget: float):
    """``torch.compile(model)`` with ``activation_memory_budget=budget``, compiled now (the budget is read when the
    backward graph is partitioned). Dynamo caches compiled code on the forward's code object, so a second model of
    the same class would reuse the first one's partition: each gets a copy of the code."""
    import torch._functorch.config as functorch_config

    forward = type(model).forward
    fresh = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                               forward.__defaults__, forward.__closure__)
    model.forward = types.MethodType(fresh, model)
    functorch_config.activation_memory_budget = budget
    return torch.compile(model)


def fxapprox_model(model: nn.Module, budget: float, args: tuple, kwargs: dict):
    import fxapprox
    from fxapprox import ApproxConfig

    example = kwargs if kwargs else args
    return fxapprox.approximate(model, 1.0, memory_budget=budget, example_inputs=example,
                                config=ApproxConfig(progress=False, check_every=None))


# -- measuring ---------------------------------------------------------------------------------------------------
def _stepper(module, optimizer, batch):
    args, kwargs, loss = batch

    def step():
        optimizer.zero_grad(set_to_none=False)
        loss(module(*args, **kwargs)).backward()
        optimizer.step()
    return step


def _configurations(name: str, build, args, kwargs, quick: bool) -> dict:
    use_compile = MODELS[name][3]
    configs = {"exact": lambda: build(), "checkpoint": lambda: checkpointed(build(), False),
               "selective": lambda: checkpointed(build(), True)}
    if hasattr(build(), "gradient_checkpointing_enable"):   # a Hugging Face model: its own checkpointing too
        configs["gradient_checkpointing"] = lambda: hf_checkpointed(build(), False)
        configs["gradient_checkpointing reentrant"] = lambda: hf_checkpointed(build(), True)
    if use_compile:
        for budget in COMPILE_BUDGETS[:1] if quick else COMPILE_BUDGETS:
            configs[f"compile {budget:g}"] = functools.partial(lambda b: compiled(build(), b), budget)
    for budget in MEMORY_BUDGETS[::2] if quick else MEMORY_BUDGETS:
        configs[f"fxapprox {budget:g}"] = functools.partial(lambda b: fxapprox_model(build(), b, args, kwargs),
                                                            budget)
    if use_compile and name in COMPILED_SAVING:
        # the memory plan under torch.compile: its copies packed inside the compiled graphs
        for budget in MEMORY_BUDGETS[::2] if quick else MEMORY_BUDGETS:
            configs[f"fxapprox+compile {budget:g}"] = functools.partial(
                lambda b: compiled(fxapprox_model(build(), b, args, kwargs), 1.0), budget)
    return configs


def child_frontier(name: str, repetitions: int, quick: bool) -> dict:
    from fxapprox.runtime.saved_activations import count_saved_bytes

    factory, size, _, _ = MODELS[name]
    build, make_batch = factory()
    size = max(2, size // 4) if quick else size
    batch = make_batch(size)
    args, kwargs, loss = batch
    rows, steps, modules = {}, {}, {}
    for label, make in _configurations(name, build, args, kwargs, quick).items():
        start = time.perf_counter()
        try:
            module = make()
            optimizer = torch.optim.SGD(module.parameters(), lr=1e-4)
            step = _stepper(module, optimizer, batch)
            step()   # compiles (torch.compile, the packer) and allocates gradients
        except Exception as error:   # a peer that does not run on this model: the row says so
            rows[label] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
            print(f"  {name} {label}: FAILED {rows[label]['error']}", file=sys.stderr, flush=True)
            continue
        rows[label] = {"setup_s": time.perf_counter() - start}
        if hasattr(module, "plan") and module.plan.memory is not None:
            memory = module.plan.memory
            rows[label].update(planned=memory.achieved, checkpointed=len(memory.checkpointed),
                               blocks=len(memory.blocks), predicted_time=memory.predicted_time,
                               measured_time=memory.measured_time, note=memory.note,
                               saved=stats.stored_bytes if (stats := module.saved_activation_stats) else None)
        elif label == "exact":
            module.train()
            with count_saved_bytes(module) as counter:
                loss(module(*args, **kwargs)).backward()
            rows[label]["saved"] = counter.bytes
            optimizer.zero_grad(set_to_none=False)
        steps[label], modules[label] = step, module
        print(f"  {name} {label}: set up in {rows[label]['setup_s']:.1f} s", file=sys.stderr, flush=True)
    for label, step in steps.items():
        rows[label]["peak"] = step_peak_growth(step)
    samples = interleaved_samples(steps, repetitions)
    for label in steps:
        rows[label]["seconds"] = statistics.median(samples[label])
        rows[label]["time"] = 1.0 / paired_ratio(samples, "exact", label)
    return {"model": name, "batch": size, "rows": rows}


def child_batch(name: str, label: str, cap: int, quick: bool) -> dict:
    """The largest batch ``label`` trains with a step's peak growth under ``cap``, and its samples per second."""
    factory, size, _, _ = MODELS[name]
    build, make_batch = factory()
    size = max(2, size // 4) if quick else size
    args, kwargs, _ = make_batch(size)
    make = _configurations(name, build, args, kwargs, quick)[label]
    module = make()
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-4)

    def growth_at(batch_size: int) -> int:
        step = _stepper(module, optimizer, make_batch(batch_size))
        step()
        return step_peak_growth(step, repeats=2)

    low, high = size // 2, size
    g_low, g_high = growth_at(low), growth_at(high)
    per_sample = max(1, (g_high - g_low) / (high - low))
    guess = max(1, int(low + (cap - g_low) / per_sample))
    measured = {}
    while guess > 1:
        measured[guess] = growth_at(guess)
        if measured[guess] <= cap:
            break
        guess = max(1, int(guess * cap / measured[guess]) - 1)
    batch = make_batch(guess)
    step = _stepper(module, optimizer, batch)
    exact_module = build()
    exact_step = _stepper(exact_module, torch.optim.SGD(exact_module.parameters(), lr=1e-4), make_batch(size))
    samples = interleaved_samples({"exact": exact_step, label: step}, 3, warmup=1)
    per_second = guess / statistics.median(samples[label])
    exact_per_second = size / statistics.median(samples["exact"])
    return {"label": label, "batch": guess, "growth": measured.get(guess), "per_second": per_second,
            "exact_per_second": exact_per_second, "probes": measured}


def _run_child(*args: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               TORCHINDUCTOR_COMPILE_THREADS="1")
    result = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env,
                            timeout=5400)
    sys.stderr.write(result.stderr[-4000:] if result.returncode else "")
    if result.returncode != 0:
        raise RuntimeError(f"child {args} failed")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _cached(path: Path, fresh: bool, compute):
    if path.exists() and not fresh:
        return json.loads(path.read_text())
    result = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


# -- quality -----------------------------------------------------------------------------------------------------
def quality(workload_name: str, seeds: int, steps: int | None, budgets: tuple) -> dict:
    import _training
    import workloads

    workload = workloads.get(workload_name)
    labels = ["exact"] + [f"memory {b:g}" for b in budgets]
    finals, curves, planning = {}, {}, {}
    for label in labels:
        runs = [_training.train(workload, label, seed, steps) for seed in range(seeds)]
        curves[label] = [[(step, loss) for _, step, loss in run["curve"]] for run in runs]
        planning[label] = [run["planning_s"] for run in runs]
        finals[label] = [curve[-1][1] for curve in curves[label]]
        print(f"  {workload_name} {label}: {finals[label]}", file=sys.stderr, flush=True)
    return {"workload": workload_name, "steps": steps or workload.steps, "seeds": seeds, "final": finals,
            "curves": curves, "planning_s": planning}


def _loss_at(curve: list, step: float) -> float:
    """The validation loss of an evaluated curve ``[(step, loss)]`` at ``step``, linearly between evaluations."""
    for (s0, l0), (s1, l1) in zip(curve, curve[1:]):
        if s0 <= step <= s1:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    return curve[-1][1]


def _equal_wall_clock(result: dict, label: str, ratio: float, exact_step: float) -> float:
    """Mean over seeds of ``label``'s loss when the exact run ends — ``ratio``: its paired step time over exact's
    (> 1), ``exact_step``: exact's step seconds, both from the frontier; its planning counted, evaluation not."""
    losses = []
    for curve, planning in zip(result["curves"][label], result["planning_s"][label]):
        steps = (result["steps"] * exact_step - planning) / (ratio * exact_step)
        losses.append(_loss_at(curve, max(steps, 0.0)))
    return statistics.mean(losses)


# -- tables ------------------------------------------------------------------------------------------------------
QUALITY_HEADER = ["workload", "steps", "configuration", "final val loss (per seed)", "mean vs exact"]
SCHEDULE_HEADER = QUALITY_HEADER + ["at equal wall-clock"]


def _quality_rows(result: dict, frontier: dict | None = None, wall_clock: bool = False) -> list[list[str]]:
    """Rows of a quality run; with ``wall_clock`` a column at equal wall-clock too, from ``frontier`` (the bench's
    frontier of the same model and batch: its paired step ratios and exact's step seconds) where there is one."""
    exact = statistics.mean(result["final"]["exact"])
    rows = []
    for label, finals in result["final"].items():
        mean = statistics.mean(finals)
        row = [result["workload"], str(result["steps"]), label, " / ".join(f"{f:.4f}" for f in finals),
               f"{(mean / exact - 1) * 100:+.2f}%"]
        if wall_clock:
            measured = frontier["rows"].get(label.replace("memory", "fxapprox")) if frontier else None
            if measured is None or "planning_s" not in result or measured["time"] <= 1.0:
                row.append("+0.00%" if label == "exact" and measured is not None else "—")
            else:
                loss = _equal_wall_clock(result, label, measured["time"], frontier["rows"]["exact"]["seconds"])
                row.append(f"{(loss / exact - 1) * 100:+.2f}% (step ratio {measured['time']:.2f}×)")
        rows.append(row)
    return rows


def _mib(value) -> str:
    return "—" if value is None else f"{value / 2**20:.0f} MiB"


def frontier_table(result: dict) -> str:
    rows = []
    exact_peak = result["rows"]["exact"]["peak"]
    for label, row in result["rows"].items():
        if "error" in row:
            rows.append([label, "fails", "—", "—", "—", row["error"]])
            continue
        plan = "—"
        if "planned" in row:
            plan = (f"{row['planned']:.3f} of exact saved; {row['checkpointed']}/{row['blocks']} blocks "
                    f"checkpointed; predicted {row['predicted_time']:.2f}×" if row["predicted_time"] else
                    f"{row['planned']:.3f} of exact saved")
        rows.append([label, f"{row['time']:.2f}×", _mib(row["peak"]), f"{exact_peak / max(row['peak'], 1):.2f}×",
                     _mib(row.get("saved")), plan])
    return markdown_table(["configuration", "step time", "peak growth", "less memory", "saved bytes", "plan"], rows)


def _frontier_verdict(result: dict) -> list[str]:
    """Per fxapprox row: the fastest peer reaching at most its peak, and whether fxapprox is at least as fast."""
    rows = {k: v for k, v in result["rows"].items() if "error" not in v}
    peers = {k: v for k, v in rows.items() if not k.startswith("fxapprox")}
    lines = []
    for label, row in rows.items():
        if not label.startswith("fxapprox"):
            continue
        reaching = [(v["time"], k) for k, v in peers.items() if v["peak"] <= row["peak"]]
        if reaching:
            best_time, best = min(reaching)
            verdict = "as fast or faster" if row["time"] <= best_time * 1.02 else "slower"
            lines.append(f"{label} ({_mib(row['peak'])}, {row['time']:.2f}×): fastest peer at ≤ this memory is "
                         f"{best} ({best_time:.2f}×) — {verdict}")
        else:
            lines.append(f"{label} ({_mib(row['peak'])}, {row['time']:.2f}×): below every peer's memory")
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, row in result["rows"].items():
        if "error" in row:
            continue
        kind = label.split()[0]
        marker = {"exact": "o", "checkpoint": "s", "selective": "D", "compile": "^", "fxapprox": "*",
                  "fxapprox+compile": "P", "gradient_checkpointing": "v"}[kind]
        color = {"exact": "black", "checkpoint": "tab:blue", "selective": "tab:green", "compile": "tab:purple",
                 "fxapprox": "tab:red", "fxapprox+compile": "tab:orange", "gradient_checkpointing": "tab:cyan"}[kind]
        ax.scatter(row["peak"] / 2**20, row["time"], marker=marker, color=color,
                   s=80 if kind.startswith("fxapprox") else 50)
        ax.annotate(label, (row["peak"] / 2**20, row["time"]), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("peak memory growth of a step (MiB)")
    ax.set_ylabel("step time / exact")
    ax.set_title(TITLES[result["model"]], fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smaller batches, fewer configurations (smoke test)")
    parser.add_argument("--fresh", action="store_true", help="measure again instead of reading the cache")
    parser.add_argument("--skip-batch", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-schedule-quality", action="store_true")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        kind, *rest = options.child
        quick = rest[-1] == "quick"
        if kind == "frontier":
            result = child_frontier(rest[0], int(rest[1]), quick)
        else:
            result = child_batch(rest[0], rest[1], int(rest[2]), quick)
        print(json.dumps(result))
        return
    tag = "quick" if options.quick else "full"
    data = DATA / tag
    sections, frontiers = [], {}
    for name in options.models.split(","):
        result = _cached(data / f"{name}.json", options.fresh,
                         lambda: _run_child("frontier", name, str(options.repetitions), tag))
        frontiers[name] = result
        table = frontier_table(result)
        print_table(TITLES[name], *_split(table))
        for line in _frontier_verdict(result):
            print("  " + line)
        sections.append((name, table))
    batch_rows = []
    if not options.skip_batch and "transformer4" in frontiers:
        exact_peak = frontiers["transformer4"]["rows"]["exact"]["peak"]
        for label in frontiers["transformer4"]["rows"]:
            if "compile" in label:   # a batch size of its own per probe: a compile each
                continue
            fit = _cached(data / f"batch-transformer4-{label.replace(' ', '_')}.json", options.fresh,
                          lambda: _run_child("batch", "transformer4", label, str(exact_peak), tag))
            batch_rows.append([label, str(fit["batch"]), f"{fit['per_second'] * 128:.0f}",
                               f"{fit['per_second'] / fit['exact_per_second']:.2f}×"])
        print_table(f"Largest batch under exact's peak growth ({_mib(exact_peak)}), 4-block transformer",
                    ["configuration", "batch", "tokens/s", "throughput vs exact"], batch_rows)
    quality_rows = []
    if not options.skip_quality:
        for workload in ("char_transformer", "resnet18"):
            steps = 60 if options.quick else QUALITY_STEPS.get(workload)
            budgets = MEMORY_BUDGETS[::2] if options.quick else MEMORY_BUDGETS
            result = _cached(data / f"quality-{workload}.json", options.fresh,
                             lambda: quality(workload, 1 if options.quick else options.seeds, steps, budgets))
            quality_rows += _quality_rows(result)
        print_table("Validation loss at equal steps", QUALITY_HEADER, quality_rows)
    schedule_rows = []
    if not options.skip_schedule_quality:
        for workload, budgets in SCHEDULE_QUALITY.items():
            result = _cached(data / f"schedule-{workload}.json", options.fresh,
                             lambda: quality(workload, 1 if options.quick else options.seeds,
                                             60 if options.quick else None, budgets))
            paired = SCHEDULE_PAIRED.get(workload)
            frontier = frontiers.get(paired) or (json.loads((data / f"{paired}.json").read_text())
                                                 if paired and (data / f"{paired}.json").exists() else None)
            schedule_rows += _quality_rows(result, frontier, wall_clock=True)
        print_table("Validation loss at the end of a warm-up + cosine schedule", SCHEDULE_HEADER, schedule_rows)
    if options.write:
        _write(sections, frontiers, batch_rows, quality_rows, schedule_rows, options)


def _split(table: str) -> tuple[list[str], list[list[str]]]:
    lines = [line.strip("|").split("|") for line in table.splitlines()]
    return [c.strip() for c in lines[0]], [[c.strip() for c in line] for line in lines[2:]]


def _written_subsections() -> dict[str, str]:
    """The ``### `` subsections of docs/memory_frontier.md's written block, by heading, in order (image paths
    marked ``PLOTS/`` again)."""
    text = DOC.read_text() if DOC.exists() else ""
    begin, end = "<!-- memory_frontier:begin -->", "<!-- memory_frontier:end -->"
    if begin not in text:
        return {}
    block = text[text.index(begin) + len(begin):text.index(end)].replace("](memory_frontier_",
                                                                          "](PLOTS/memory_frontier_")
    chunks = ["### " + chunk for chunk in block.split("\n### ")[1:]]
    return {chunk.splitlines()[0]: chunk.strip() for chunk in chunks}


def _write(sections, frontiers, batch_rows, quality_rows, schedule_rows, options) -> None:
    """Write the tables and plots; the subsections of models (and of the batch and quality runs) not measured in
    this run are kept from the written page."""
    written = {}
    for name, table in sections:
        heading = f"### {TITLES[name]}"
        plot(frontiers[name], HERE.parent / "docs" / f"memory_frontier_{name}.png")
        written[heading] = (f"{heading}\n\n{table}\n\n" + "\n".join(f"- {line}" for line in
                                                                     _frontier_verdict(frontiers[name]))
                            + f"\n\n![{name}](PLOTS/memory_frontier_{name}.png)")
    if batch_rows:
        heading = "### Fit a bigger batch (4-block transformer, under exact's peak growth at batch 16)"
        written[heading] = heading + "\n\n" + markdown_table(
            ["configuration", "batch", "tokens/s", "throughput vs exact"], batch_rows)
    if quality_rows:
        heading = "### Validation loss at equal steps"
        written[heading] = heading + "\n\n" + markdown_table(QUALITY_HEADER, quality_rows)
    if schedule_rows:
        heading = "### Validation loss at the end of a warm-up + cosine schedule"
        written[heading] = heading + "\n\n" + markdown_table(SCHEDULE_HEADER, schedule_rows)
    kept = _written_subsections()
    merged = {**{h: written.get(h, text) for h, text in kept.items()},
              **{h: text for h, text in written.items() if h not in kept}}
    partial = set(merged) - set(written)
    rounds = f"{options.repetitions} interleaved rounds per model"
    parts = [f"Measured by `benchmarks/bench_memory_frontier.py` on {machine_line()}; "
             + (f"last run `--models {options.models}`, {rounds}; the other subsections are from an earlier run."
                if partial else f"{rounds}.")]
    parts += list(merged.values())
    markdown = "\n\n".join(parts)
    write_section("memory_frontier", markdown.replace("PLOTS/", "docs/"))   # BENCHMARKS.md is at the root
    markdown = markdown.replace("PLOTS/", "")
    text = DOC.read_text() if DOC.exists() else ""
    begin, end = "<!-- memory_frontier:begin -->", "<!-- memory_frontier:end -->"
    if begin in text:
        text = text[:text.index(begin) + len(begin)] + "\n" + markdown + "\n" + text[text.index(end):]
        DOC.write_text(text)


if __name__ == "__main__":
    main()

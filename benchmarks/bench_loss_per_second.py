"""Loss per second: does a plan reach a given validation loss sooner than exact training?

Three parts (``benchmarks/workloads.py`` has the workloads; ``TUNING`` ones set the defaults, ``HELD_OUT`` ones
are reported apart):

* ``calibrate`` — fixed plans (every eligible layer pinned to one mode / method / keep-ratio, no tolerance) on
  the tuning workloads. For each, the **steps multiplier** ``m`` (``s`` ÷ the steps exact training needs to reach
  the loss the plan reached at step ``s``; the median over the second half of the run) against the error the
  guard measured for the plan's family (``passes/policy/payoff.py``): ``cost = (m − 1) / e²``. Prints the fits;
  ``ApproxConfig.backward_error_cost`` and ``forward_error_cost`` are set from them.
* ``compare`` — exact / the default ``approximate(model)`` (``budget="auto"``: the pay-off model and the guard) /
  ``approximate(model, 0.5)`` (the budget spent) with the guard on and off (labels: ``benchmarks/_training.py``),
  several batch orders, interleaved by seed: validation loss at equal steps and at equal
  wall-clock (planning counts), the time each reaches exact's final loss (÷ exact's time), planning seconds,
  guard overhead, re-plans; and a plot of measured vs predicted error over training.
* ``methods`` — the flat MLP (``bench_planner``'s setup, 60 steps): every method at ``budget=0.5`` with
  ``check_every=10`` against exact.

Run one part at a time on a quiet machine; ``--write`` puts the tables in BENCHMARKS.md (and the plot in docs/).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

import fxapprox
from fxapprox import ApproxConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import report_tables  # noqa: E402
from _training import first_reach, loss_at, mean_curve, smoothed, train  # noqa: E402
from workloads import HELD_OUT, TUNING, WORKLOADS, get  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
FIXED = {
    "mlp": ["fixed forward topk 0.5", "fixed weight_grad crs 0.5", "fixed backward crs 0.5",
            "fixed weight_grad wta_crs 0.25"],
    "digits_cnn": ["fixed forward topk 0.5", "fixed weight_grad crs 0.5", "fixed backward crs 0.5"],
    "char_transformer": ["fixed forward topk 0.5", "fixed weight_grad wta_crs 0.5"],
}
COMPARED = ["exact", "auto", "0.5", "0.5 spent"]


def _log(message: str) -> None:
    print(message, flush=True)


def _run_all(workload, labels, seeds, steps=None) -> dict:
    """Every label under every seed, interleaved by seed (drift hits all alike)."""
    runs: dict = {label: [] for label in labels}
    for seed in seeds:
        for label in labels:
            torch.manual_seed(seed)
            runs[label].append(train(workload, label, seed, steps, log=None))
            last = runs[label][-1]["curve"][-1]
            _log(f"{workload.name:24s} {label:32s} seed {seed}: step {last[1]} {last[0]:6.1f} s val {last[2]:.4f}")
    return runs


def steps_multiplier(exact_curve, curve) -> float:
    """Median over the second half of ``curve`` of (exact's step to reach the loss) / (the curve's step)⁻¹."""
    exact_curve = smoothed(exact_curve)
    ratios = []
    half = curve[-1][1] / 2
    for _, step, loss in smoothed(curve):
        if step < half or step == 0:
            continue
        # Past exact's last evaluation (the plan reached a loss exact never did): counted as reached there, so
        # the multiplier is an upper bound (≤ 1) rather than left out.
        reach = min(first_reach(exact_curve, loss, index=1), exact_curve[-1][1])
        ratios.append(step / reach if reach > 0 else math.inf)
    return statistics.median(ratios) if ratios else math.nan


# -- calibrate -----------------------------------------------------------------------------------------------
def calibrate(seeds, write: bool, family_filter: str | None = None) -> dict:
    rows, fits = [], {"backward": [], "forward": []}
    for name in TUNING:
        workload = get(name)
        labels = [label for label in FIXED[name] if family_filter is None or f" {family_filter} " in label
                  or (family_filter == "backward" and " forward " not in label)]
        runs = _run_all(workload, ["exact"] + labels, seeds)
        exact = mean_curve([r["curve"] for r in runs["exact"]])
        for label in labels:
            curve = mean_curve([r["curve"] for r in runs[label]])
            multiplier = steps_multiplier(exact, curve)
            family = "forward" if " forward " in label else "backward"
            records = [c for r in runs[label] for c in r["history"]["records"]]
            measured = statistics.median(c[f"{family}_error"] if family == "backward" else c["output_error"]
                                         for c in records)
            predicted = records[0]["predicted_backward_error" if family == "backward" else "predicted_output_error"]
            model_error = statistics.median(c["model_error"] for c in records)
            fit = (multiplier - 1) / measured ** 2 if measured > 0 else math.nan
            fits[family].append(fit)
            rows.append([name, label.removeprefix("fixed "), f"{runs[label][0]['planned_flops']:.2f}",
                         f"{exact[-1][2]:.4f}", f"{curve[-1][2]:.4f}", f"{multiplier:.2f}", family,
                         f"{predicted:.3f}", f"{measured:.3f}", f"{fit:.1f}", f"{model_error:.3f}",
                         f"{(multiplier - 1) / model_error ** 2:.1f}"])
    summary = [[family, ", ".join(f"{f:.1f}" for f in values),
                f"{statistics.median(values):.1f}" if values else "—"] for family, values in fits.items()]
    tables = [(f"Steps multiplier against error, fixed plans, {len(seeds)} batch orders (error: one step's backward "
               "error for the backward family, output error for the forward one; predicted at planning, measured "
               "by the guard, median over checks)",
               ["workload", "plan", "FLOPs", "exact final", "plan final", "steps ×", "family", "predicted e",
                "measured e", "(m−1)/e²", "model-gradient error", "(m−1)/model²"], rows),
              ("Fitted costs (ApproxConfig.backward_error_cost / forward_error_cost)",
               ["family", "fits", "median"], summary)]
    report_tables(tables, "loss-per-second-calibration" if write else None,
                  "## Error cost calibration (`benchmarks/bench_loss_per_second.py calibrate`)")
    return fits


# -- compare -------------------------------------------------------------------------------------------------
def _overhead(run) -> float | None:
    """Guard seconds (exact reference passes) as a share of the run's training seconds."""
    records = run.get("history", {}).get("records", [])
    if not records:
        return None
    return sum(r["exact_seconds"] for r in records) / run["curve"][-1][0]


def _replans(run) -> str:
    records = [r for r in run.get("history", {}).get("records", []) if r["action"] == "replanned"]
    return "; ".join(f"step {r['step']}: {r['note'].split('→')[-1].strip()[:80]}" for r in records) or "—"


def compare(names, seeds, write: bool, steps=None, labels=None, previous=None) -> dict:
    """``labels`` (default: all of ``COMPARED``) are trained; the others come from ``previous`` (a ``--json``
    dump of an earlier run with the same seeds)."""
    results = {}
    for name in names:
        results[name] = dict((previous or {}).get(name, {}))
        results[name].update(_run_all(get(name), labels or COMPARED, seeds, steps))
        missing = [label for label in COMPARED if label not in results[name]]
        if missing:
            raise SystemExit(f"{name}: no runs of {missing}; train them or pass --merge with a dump that has them")
    for name in names:
        _tables(results, [name], "tuning" if name in TUNING else "held out", seeds, write)
    _plot(results, write)
    return results


def _tables(results, names, group, seeds, write):
    steps_rows, clock_rows, cost_rows = [], [], []
    for name in names:
        runs = results[name]
        exact = [r["curve"] for r in runs["exact"]]
        exact_final_time = statistics.mean(c[-1][0] for c in exact)
        target = statistics.mean(c[-1][2] for c in exact)
        for label in COMPARED:
            curves = [r["curve"] for r in runs[label]]
            mean = mean_curve(curves)
            finals = [c[-1][2] for c in curves]
            spread = f" ± {statistics.stdev(finals):.3f}" if len(finals) > 1 else ""
            steps_rows.append([name, label, f"{mean[-1][2]:.4f}{spread}", f"{mean[-1][0]:.1f}"])
            at = [0.25, 0.5, 0.75, 1.0]
            losses = [statistics.mean(loss_at(c, f * exact_final_time) for c in curves) for f in at]
            reach = first_reach(smoothed(mean), target) / exact_final_time   # the batch orders' mean curve
            clock_rows.append([name, label] + [f"{v:.4f}" for v in losses]
                              + ["never" if math.isinf(reach) else f"{reach:.2f}"])
            if label != "exact":
                run = runs[label][0]
                overheads = [o for o in (_overhead(r) for r in runs[label]) if o is not None]
                planning = statistics.mean(r["planning_s"] for r in runs[label])
                speed = exact_final_time / (mean[-1][0] - planning)
                cost_rows.append([name, label, f"{planning:.1f}", f"{speed:.2f}", f"{run['planned_flops']:.2f}",
                                  f"{statistics.mean(overheads):.1%}" if overheads else "—",
                                  str(sum(len([x for x in r["history"]["records"] if x["action"] == "replanned"])
                                          for r in runs[label])),
                                  _replans(run), run["note"][:160]])
    section = "loss-per-second-" + "-".join(names)
    group = f"{', '.join(names)} ({group})"
    tables = [(f"{group}: validation loss at equal steps (mean of {len(seeds)} batch orders)",
               ["workload", "config", "final val loss", "seconds"], steps_rows),
              (f"{group}: validation loss at equal wall-clock (fractions of exact's training time), and time to "
               "reach exact's final loss ÷ exact's time",
               ["workload", "config", "25%", "50%", "75%", "100%", "to exact's loss"], clock_rows),
              (f"{group}: planning seconds, planned FLOPs, guard overhead, re-plans (first seed's plan)",
               ["workload", "config", "planning s", "step speed-up", "FLOPs at the end", "guard", "re-plans",
                "what changed", "plan note"],
               cost_rows)]
    report_tables(tables, section if write else None,
                  f"## Loss per second: {group} (`benchmarks/bench_loss_per_second.py compare`)")


def summary(results: dict, write: bool) -> None:
    """One row per workload: validation loss at exact's final wall-clock (mean curve of the batch orders) for
    every configuration, as a difference from exact's."""
    rows = []
    for group in ("tuning", "held out"):
        for name, runs in results.items():
            if (name in TUNING) != (group == "tuning"):
                continue
            exact = mean_curve([r["curve"] for r in runs["exact"]])
            clock = exact[-1][0]
            row = [name, group, str(len(runs["exact"])), f"{exact[-1][2]:.4f}"]
            for label in COMPARED[1:]:
                loss = loss_at(mean_curve([r["curve"] for r in runs[label]]), clock)
                row.append(f"{loss:.4f} ({loss / exact[-1][2] - 1:+.1%})")
            default = runs["auto"][0]
            row += [f"{statistics.mean(r['planning_s'] for r in runs['auto']):.1f} / {clock:.0f}",
                    f"{default['planned_flops']:.2f}"]
            rows.append(row)
    report_tables([("Validation loss at exact's wall-clock (its final time), mean curve of the batch orders; in "
                    "brackets against exact",
                    ["workload", "set", "orders", "exact"] + COMPARED[1:]
                    + ["default's planning s / exact's s", "default's FLOPs"], rows)],
                  "loss-per-second-summary" if write else None,
                  "## Loss per second, all workloads (`benchmarks/bench_loss_per_second.py summary`)")


def _plot(results, write: bool) -> None:
    """Measured against predicted model-gradient error over training (first seed), one PNG per workload."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name in (n for n in ("char_transformer", "resnet18") if n in results):
        figure, axis = plt.subplots(figsize=(6.5, 4))
        for label, colour in (("0.5", "tab:blue"), ("auto", "tab:green")):
            records = results[name][label][0].get("history", {}).get("records", [])
            if not records:
                continue
            steps = [r["step"] for r in records]
            axis.plot(steps, [r["model_error"] for r in records], "o-", color=colour, label=f"{label}: measured")
            axis.plot(steps, [math.nan if r["predicted_error"] is None else r["predicted_error"] for r in records],
                      "--", color=colour, label=f"{label}: predicted (one step)")
        axis.set_title(f"{name}: model-gradient error over training")
        axis.set_xlabel("step")
        axis.set_ylabel("‖g − g_exact‖ / ‖g_exact‖ (RMS over layers)")
        axis.legend(fontsize=8)
        figure.tight_layout()
        path = (DOCS if write else Path("/tmp")) / f"guard_error_{name}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        print(f"plot: {path}")


# -- methods -------------------------------------------------------------------------------------------------
def methods(seeds, write: bool) -> None:
    """``bench_planner``'s flat MLP (60 steps): each method at ``budget=0.5`` with ``check_every=10``."""
    from bench_planner import MLP, _mlp_data, _train_mlp

    settings = [(m, None, None) for m in ("topk", "crs", "bernoulli", "wta_crs")] + [("auto", "backward", None)]
    rows, exact_losses, results = [], [], {s: [] for s in settings}
    for seed in seeds:
        data = _mlp_data(seed + 1)
        torch.manual_seed(seed)
        base = MLP()
        exact_losses.append(_train_mlp(copy.deepcopy(base), data))
        for method, mode, gain in settings:
            torch.manual_seed(0)
            approx = fxapprox.approximate(base, 0.5, example_inputs=(data[0][0],), method=method,
                                          config=ApproxConfig(mode=mode, min_gain=gain, check_every=10,
                                                              check_verbose=False))
            planned = approx.plan.achieved
            loss = _train_mlp(approx, data)
            results[(method, mode, gain)].append((loss, planned, approx.plan.achieved, approx.history.replans,
                                            approx.plan.note))
    exact = statistics.mean(exact_losses)
    for (method, mode, gain), runs in results.items():
        loss = statistics.mean(r[0] for r in runs)
        label = method + (f", mode={mode}" if mode else "")
        rows.append([label, f"{max(r[1] for r in runs):.2f}",
                     f"{max(r[2] for r in runs):.2f}", str(sum(r[3] for r in runs)), f"{exact:.3f}", f"{loss:.3f}",
                     f"{loss / exact - 1:+.1%}", runs[0][4][:140]])
    report_tables([(f"Flat MLP, budget 0.5, check_every=10, 60 steps, mean of {len(seeds)} seeds: final loss",
                    ["method", "planned FLOPs", "FLOPs after checks", "re-plans", "exact", "approx", "vs exact",
                     "plan note (first seed)"], rows)],
                  "loss-per-second-mlp-methods" if write else None,
                  "## Every method on the flat MLP (`benchmarks/bench_loss_per_second.py methods`)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=["calibrate", "compare", "methods", "summary"])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (compare)")
    parser.add_argument("--seeds", type=int, default=2, help="batch orders")
    parser.add_argument("--steps", type=int, default=None, help="override each workload's steps (smoke runs)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="write BENCHMARKS.md sections and docs/ plot")
    parser.add_argument("--family", choices=["forward", "backward"], default=None, help="calibrate one family")
    parser.add_argument("--json", type=Path, default=None, help="also dump the raw runs here")
    parser.add_argument("--configs", default=None, help="compare: train only these labels (comma-separated) ...")
    parser.add_argument("--merge", type=Path, action="append", default=None,
                        help="compare: take the other labels from this --json dump; summary: the dumps to read")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = list(range(args.seeds))
    start = time.perf_counter()
    if args.part == "calibrate":
        calibrate(seeds, args.write, args.family)
    elif args.part == "methods":
        methods(seeds, args.write)
    elif args.part == "summary":
        summary({k: v for path in args.merge or () for k, v in json.loads(path.read_text()).items()}, args.write)
    else:
        names = [n for n in args.workloads.split(",") if n]
        unknown = set(names) - set(WORKLOADS)
        if unknown:
            parser.error(f"unknown workloads {sorted(unknown)}; choose from {sorted(WORKLOADS)}")
        labels = [c.strip() for c in args.configs.split(",")] if args.configs else None
        previous = {k: v for path in args.merge or () for k, v in json.loads(path.read_text()).items()} or None
        results = compare(names, seeds, args.write, args.steps, labels, previous)
        if args.json:
            args.json.write_text(json.dumps(results))
    print(f"{time.perf_counter() - start:.0f} s; held-out workloads: {', '.join(HELD_OUT)}")


if __name__ == "__main__":
    main()

"""Same model, less time: final validation loss at the end of a warm-up + cosine schedule, at equal steps and at
equal wall-clock — the headline comparison of fxapprox's training.

Protocol. Every workload trains with linear warm-up and cosine decay to zero over ``N`` steps (``PROTOCOL``), from
the same initial weights, over three batch orders (seeds). Configurations:

* ``exact`` — the plain model over ``N`` steps; also over ``0.7·N`` and ``0.85·N`` (each its own warm-up + cosine
  schedule): the exact final loss at any schedule length between is read by linear interpolation (past ``N``,
  extrapolated from the last two);
* ``0.5`` — ``fxapprox.approximate(model, 0.5, config=ApproxConfig(total_steps=N))``: the budget with the
  default schedule (``"mixed"``: the plan for the first ¾ of the steps, exact after); ``0.5 constant`` /
  ``0.5 anneal`` / ``0.5 noise`` / ``0.5 mixed50`` (half the steps exact) — the other schedules (tuning workloads
  only: the default was chosen on them);
* ``auto`` — ``fxapprox.approximate(model, config=ApproxConfig(total_steps=N))``.

Time. The runs go two at a time (one thread each) on this machine's two cores, so their clocks are not compared:
before them, alone, each workload's approximate step is timed against the exact one paired (the steps of every
configuration interleaved in one process, one thread, median of per-round ratios; the machine drifts 15–20%
between runs), for the plan at full strength and switched off, and each configuration is planned once from a cold
timing cache (its planning seconds). A run's time in exact steps is then: planning ÷ exact step seconds, plus each
step at its schedule strength (step time interpolated between the two measured ends), plus one exact step per
guard check. The error costs depend on whether a schedule ends exactly (``ApproxConfig.error_costs``), so
``0.5 constant`` and ``0.5 noise`` plan the budget apart; that plan is timed the same way, alone, after the runs.
**Equal wall-clock** compares the configuration's final loss with exact trained on its own schedule of that many
steps; **wall-clock less planning** with exact trained as long as the run took after planning (``budget="auto"``'s
target: behind exact by no more than its planning time); **time to exact's loss** is when the configuration's
running-best validation loss first reaches exact(N)'s final loss, as a multiple of exact's time to it.

Calibration (tuning workloads, ``cal`` / ``calmix`` runs): the budget spent on one family of approximation
(``mode="forward"`` or ``"backward"``), on every step or under the mixed schedule, the guard measuring without
acting; each run's final loss is read as the exact schedule length that ends there (a steps multiplier ``m``), and
``(m − 1) / (sampled share · e²)`` against the plan's predicted error ``e`` fits ``backward_error_cost`` /
``forward_error_cost`` (the constant runs) and the tail factors (mixed ÷ constant). ``--calibrate`` prints the fit
from the runs done so far. Exact schedules of ``0.5·N`` steps are added there (a calibration plan may need twice
exact's steps); a workload whose exact final loss does not fall with its schedule length is left out of the fit.

Tuning workloads (the default schedule, ``exact_fraction`` and ``budget="auto"``'s settings were chosen on them):
``digits_cnn`` (a CNN from scratch) and ``char_transformer_small``. Held out (reported apart): ``llama_small`` (a
Llama-style LM from scratch), ``char_lstm`` (the LSTM's sparse backward), ``finetune`` and ``finetune_lora`` (a
pretrained character LM fine-tuned on new text, in full and with PEFT LoRA).

Results are kept under ``benchmarks/.data/time_to_quality/`` (a rerun resumes); ``--write`` puts the tables in
BENCHMARKS.md (section ``time_to_quality``) and docs/loss_per_second.md, and the plots in docs/.

Usage: python benchmarks/time_to_quality.py [--workloads ...] [--seeds 0 1 2] [--workers 2] [--only exact ...]
       [--calibrate] [--write]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import fxapprox  # noqa: E402
from fxapprox import ApproxConfig  # noqa: E402
from _common import interleaved_samples, machine_line, markdown_table, paired_ratio, print_table, write_section  # noqa: E402
import workloads  # noqa: E402
from workloads import warmup_cosine  # noqa: E402
from _training import first_reach, smoothed  # noqa: E402

DATA = HERE / ".data" / "time_to_quality"
DOCS = HERE.parent / "docs"
EXACT_LENGTHS = (0.7, 0.85, 1.0)
#: the tuning workloads also train exact over half the steps: a calibration plan may need twice exact's steps
TUNING_LENGTHS = (0.5,) + EXACT_LENGTHS
#: calibration points of the pay-off model (tuning workloads; ``calibrate``): the budget spent on one family of
#: approximation on every step (``schedule="constant"``), the guard measuring its errors without acting
CALIBRATION = ("cal forward", "cal backward", "calmix forward", "calmix backward")
BUDGET = 0.5
#: the other schedules, tried on the tuning workloads (``mixed50``: the mixed schedule with half the steps exact)
SCHEDULE_VARIANTS = ("constant", "anneal", "noise", "mixed50")


@dataclass(frozen=True)
class Spec:
    """One protocol workload: which ``workloads`` entry, its schedule length and optimizer."""

    workload: str
    steps: int
    optimizer: object
    evaluations: int = 10


def _adamw(lr: float, warmup: float = 0.05):
    return warmup_cosine(lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01), warmup)


PROTOCOL = {
    "digits_cnn": Spec("digits_cnn", 1500, warmup_cosine(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))),
    "char_transformer_small": Spec("char_transformer_small", 400, _adamw(3e-3)),
    "llama_small": Spec("llama_small", 400, _adamw(2e-3)),
    "char_lstm": Spec("char_lstm", 400, warmup_cosine(lambda p: torch.optim.Adam(p, lr=3e-3))),
    "finetune": Spec("finetune", 300, _adamw(1e-3, 0.1)),
    "finetune_lora": Spec("finetune_lora", 300, _adamw(2e-3, 0.1)),
}
TUNING = ("digits_cnn", "char_transformer_small")
HELD_OUT = ("llama_small", "char_lstm", "finetune", "finetune_lora")


def configs(name: str) -> list[str]:
    if name in TUNING:
        return ([f"exact@{f}" for f in TUNING_LENGTHS] + [f"{BUDGET}"] + [f"{BUDGET} {kind}" for kind in SCHEDULE_VARIANTS]
                + ["auto"] + list(CALIBRATION))
    return [f"exact@{f}" for f in EXACT_LENGTHS] + [f"{BUDGET}", "auto"]


def family(label: str) -> str:
    """The plan a configuration runs (its measured step times): the error costs depend on whether the schedule
    ends exactly (``ApproxConfig.error_costs``), so ``constant`` and ``noise`` plan the budget apart."""
    if label == "auto":
        return "auto"
    return f"{BUDGET}c" if label in (f"{BUDGET} constant", f"{BUDGET} noise") else str(BUDGET)


def cache_family(label: str) -> str:
    """The timing cache a configuration plans from (the candidates' timings do not depend on the schedule)."""
    return "auto" if label == "auto" else str(BUDGET)


def approximate(model: nn.Module, label: str, example: tuple, steps: int, cache: Path, guard: bool = True):
    if label.startswith("exact"):
        return model
    if label.startswith("cal"):
        schedule = "mixed" if label.startswith("calmix") else "constant"
        config = ApproxConfig(mode=label.split()[1], schedule=schedule, total_steps=steps, check_verbose=False,
                              timing_cache=str(cache / cache_family(label)), check_every=25, check_replan=False)
        return fxapprox.approximate(model, BUDGET, example_inputs=example, config=config)
    schedule = label.split()[1] if " " in label else None
    extra = {"schedule": "mixed", "exact_fraction": 0.5} if schedule == "mixed50" else {"schedule": schedule}
    config = ApproxConfig(total_steps=steps, timing_cache=str(cache / cache_family(label)), check_verbose=False,
                          check_every=ApproxConfig().check_every if guard else None, **extra)
    budget = "auto" if label == "auto" else BUDGET
    return fxapprox.approximate(model, budget, example_inputs=example, config=config)


def trainable(model: nn.Module) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def train_step(workload, model, optimizer, scheduler, x, y) -> None:
    optimizer.zero_grad(set_to_none=True)
    workload.loss(model(x), y).backward()
    if workload.clip:
        nn.utils.clip_grad_norm_(trainable(model), workload.clip)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()


# -- one training run (a worker process) ---------------------------------------------------------------------------
def run(task: tuple) -> dict:
    name, label, seed, cache = task
    torch.set_num_threads(1)
    spec = PROTOCOL[name]
    workload = workloads.get(spec.workload)
    steps = spec.steps if not label.startswith("exact@") else round(float(label[6:]) * spec.steps)
    torch.manual_seed(1000 + seed)
    model = approximate(workload.build(), label, workload.example, steps, Path(cache))
    optimizer, scheduler = spec.optimizer(trainable(model), steps)
    batches = workload.batches(seed)
    every = max(1, steps // spec.evaluations)
    curve = [(0, workload.evaluate(model))]
    strengths = []
    start = time.perf_counter()
    train_seconds = 0.0
    for step in range(1, steps + 1):
        x, y = next(batches)
        began = time.perf_counter()
        train_step(workload, model, optimizer, scheduler, x, y)
        train_seconds += time.perf_counter() - began
        state = getattr(model, "_fxapprox_state", None)
        sampling = state is not None and bool(state.plan.approximated) and state.enabled
        strengths.append(state.strength if sampling else 0.0)
        if step % every == 0 or step == steps:
            curve.append((step, workload.evaluate(model)))
    result = {"workload": name, "config": label, "seed": seed, "steps": steps, "curve": curve,
              "strengths": strengths, "seconds": time.perf_counter() - start, "train_seconds": train_seconds}
    if hasattr(model, "plan"):
        plan = model.plan
        result.update(planned_flops=plan.achieved, executed_flops=model.executed_flops,
                      check_steps=[r.step for r in model.history], replans=model.history.replans,
                      noise=[(r.step, r.noise_scale, r.strength) for r in model.history if r.noise_scale is not None],
                      sampled=len(plan.approximated), layers=len(plan.layers),
                      modes=sorted({f"{d.mode} {d.method}" for d in plan.approximated}),
                      predicted_gain=plan.predicted_gain, auto_advice=plan.auto_advice,
                      errors=[(r.step, r.backward_error, r.output_error, r.model_error) for r in model.history],
                      predicted=[(r.step, r.predicted_backward_error, r.predicted_output_error) for r in model.history],
                      # the row family's variance checks: their cost, the ratios after each and what it measured
                      check_seconds=[(r.step, r.check_seconds) for r in model.history if r.check_seconds is not None],
                      row_checks=[(r.step, r.row_ratio, r.token_ratio, r.variance_ratio, r.noise_scale,
                                   r.checked_ratio, r.checked_token_ratio) for r in model.history
                                  if r.sgd_variance is not None],
                      rows=None if plan.rows is None else {"ratio": min((b.ratio for b in plan.rows.sampled),
                                                                        default=1.0),
                                                           "token_ratio": plan.rows.token_ratio,
                                                           "blocks": len(plan.rows.sampled)})
    return result


# -- measured alone: planning seconds and paired step times ----
def _stepper(spec: Spec, workload, model: nn.Module, batch: tuple, switch: bool | None = None):
    """One training step of ``model`` on ``batch`` (its own optimizer); with ``switch``, approximation set to it for
    the step (``False``: the approximated model run exactly)."""
    optimizer, scheduler = spec.optimizer(trainable(model), 10 ** 6)

    def step():
        if switch is not None:
            model.set_approximate(switch)
        train_step(workload, model, optimizer, scheduler, *batch)
        if switch is not None:
            model.set_approximate(True)
    return step


def measure(name: str, cache: Path, rounds: int) -> dict:
    """Each family's planning seconds from a cold timing cache, and its step time against exact (paired,
    interleaved, one thread): the plan at full strength (``on``) and switched off (``off``)."""
    torch.set_num_threads(1)
    spec = PROTOCOL[name]
    workload = workloads.get(spec.workload)
    planning, models = {}, {}
    for label in (str(BUDGET), "auto"):
        shutil.rmtree(cache / family(label), ignore_errors=True)
        model = workload.build()
        start = time.perf_counter()
        models[label] = approximate(model, label, workload.example, spec.steps, cache, guard=False)
        planning[label] = time.perf_counter() - start
    exact = workload.build()
    batch = next(workload.batches(999))
    steps = {"exact": _stepper(spec, workload, exact, batch)}
    for label, model in models.items():
        steps[f"{label} on"] = _stepper(spec, workload, model, batch)
        steps[f"{label} off"] = _stepper(spec, workload, model, batch, switch=False)
    samples = interleaved_samples(steps, rounds, warmup=3)
    ratios = {key: paired_ratio(samples, "exact", key) for key in steps if key != "exact"}
    plans = {label: {"achieved": m.plan.achieved, "sampled": len(m.plan.approximated), "layers": len(m.plan.layers),
                     "measured_speedup": m.plan.measured_speedup,
                     "row_breakeven": m.plan.rows.row_breakeven if m.plan.rows is not None else None}
             for label, m in models.items()}
    return {"planning": planning, "ratios": ratios, "exact_step": statistics.median(samples["exact"]),
            "plans": plans}


def measure_untailed(name: str, cache: Path, rounds: int) -> dict:
    """The tuning workloads' third plan, the budget under ``schedule="constant"`` (``0.5c``: ``constant`` and
    ``noise``): its planning seconds from a cold cache (a scratch one) and its step time against exact, paired,
    on the plan the runs made (the shared cache)."""
    import tempfile

    torch.set_num_threads(1)
    spec = PROTOCOL[name]
    workload = workloads.get(spec.workload)
    label = f"{BUDGET} constant"
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        approximate(workload.build(), label, workload.example, spec.steps, Path(scratch), guard=False)
        planning = time.perf_counter() - start
    model = approximate(workload.build(), label, workload.example, spec.steps, cache, guard=False)
    batch = next(workload.batches(999))
    samples = interleaved_samples({"exact": _stepper(spec, workload, workload.build(), batch),
                                   "on": _stepper(spec, workload, model, batch),
                                   "off": _stepper(spec, workload, model, batch, switch=False)}, rounds, warmup=3)
    family_name = family(label)
    return {"planning": planning, "ratios": {f"{family_name} on": paired_ratio(samples, "exact", "on"),
                                              f"{family_name} off": paired_ratio(samples, "exact", "off")},
            "plan": {"achieved": model.plan.achieved, "sampled": len(model.plan.approximated)}}


# -- reading the runs ------------------------------------------------------------------------------------------------
def time_in_exact_steps(result: dict, timing: dict) -> list[float]:
    """Cumulative time after each step (index 0: before the first), in exact steps: planning, each step at its
    strength, and each check: one exact step per guard check; a row plan's variance check at its measured seconds,
    converted at the run's own seconds per exact step (its training steps' seconds less the checks', over the steps'
    cost in exact steps)."""
    label = result["config"]
    if label.startswith("exact"):
        return [float(i) for i in range(result["steps"] + 1)]
    fam = family(label)
    on, off = 1.0 / timing["ratios"][f"{fam} on"], 1.0 / timing["ratios"][f"{fam} off"]
    costs = [off + strength * (on - off) for strength in result["strengths"]]
    checks = {step: 1.0 for step in result.get("check_steps", ())}
    measured = dict(result.get("check_seconds", ()))
    if measured and result.get("train_seconds"):
        per_step = (result["train_seconds"] - sum(measured.values())) / sum(costs)
        checks.update({step: seconds / per_step for step, seconds in measured.items()})
    elapsed = [timing["planning"][fam] / timing["exact_step"]]
    for step, cost in enumerate(costs, start=1):
        elapsed.append(elapsed[-1] + cost + checks.get(step, 0.0))
    return elapsed


def exact_final_at(exact_runs: dict, length: float) -> float:
    """Exact training's final loss for a schedule of ``length`` steps (linear between the measured lengths)."""
    points = sorted((r["steps"], r["curve"][-1][1]) for r in exact_runs.values())
    for (s0, l0), (s1, l1) in zip(points, points[1:]):
        if length <= s1 or (s1, l1) == points[-1]:
            return l0 + (l1 - l0) * (length - s0) / (s1 - s0)
    return points[-1][1]


def exact_length_for(exact_runs: dict, loss: float) -> float:
    """The exact schedule length whose final loss is ``loss`` (the inverse of :func:`exact_final_at`; outside the
    measured lengths, extrapolated from the nearest two)."""
    points = sorted((r["steps"], r["curve"][-1][1]) for r in exact_runs.values())
    pairs = list(zip(points, points[1:]))
    for (s0, l0), (s1, l1) in pairs:
        if min(l0, l1) <= loss <= max(l0, l1) and l0 != l1:
            return s0 + (s1 - s0) * (l0 - loss) / (l0 - l1)
    (s0, l0), (s1, l1) = pairs[0] if loss > points[0][1] else pairs[-1]
    return max(1.0, s0 + (s1 - s0) * (l0 - loss) / (l0 - l1)) if l0 != l1 else float(s1)


def calibration_rows(name: str, results: dict, seeds: list[int]) -> tuple[list, dict]:
    """Per calibration run: the steps multiplier ``m`` (the run's steps ÷ the exact schedule length reaching its
    final loss), the family's error measured by the guard (median over checks) and the extra steps per squared
    error and sampled step, ``(m − 1) / (sampled share · e²)``; the fits by configuration."""
    rows, fits = [], {label: [] for label in CALIBRATION}
    exact_fraction = ApproxConfig().exact_fraction
    for label in CALIBRATION:
        family_name = label.split()[1]
        sampled_share = 1.0 - exact_fraction if label.startswith("calmix") else 1.0
        for seed in seeds:
            exact_runs = {k: results[(k, seed)] for k in configs(name) if k.startswith("exact@")}
            run_ = results[(label, seed)]
            final = run_["curve"][-1][1]
            finals = [loss for _, loss in sorted((r["steps"], r["curve"][-1][1]) for r in exact_runs.values())]
            if any(b >= a for a, b in zip(finals, finals[1:])):
                # a longer exact schedule does not end lower (the model overfits its data): no schedule length
                # stands for a steps multiplier, so the point is left out
                rows.append([name, label, str(seed), f"{run_['planned_flops']:.2f}",
                             f"{results[('exact@1.0', seed)]['curve'][-1][1]:.4f}", f"{final:.4f}", "–", "–",
                             "left out: exact's final loss does not fall with its schedule length"])
                continue
            multiplier = run_["steps"] / exact_length_for(exact_runs, final)
            # the plan's predicted error of the family (what the planner weighs the costs against; the errors the
            # guard measures during training differ from it, for the forward family by up to 5x)
            index = 2 if family_name == "forward" else 1
            error = statistics.median(e[index] for e in run_["predicted"])
            fit = (multiplier - 1) / (sampled_share * error ** 2) if error > 0 else math.nan
            fits[label].append(fit)
            rows.append([name, label, str(seed), f"{run_['planned_flops']:.2f}",
                         f"{results[('exact@1.0', seed)]['curve'][-1][1]:.4f}", f"{final:.4f}",
                         f"{multiplier:.2f}", f"{error:.3f}", f"{fit:.3f}"])
    return rows, fits


def fitted_costs(fits: dict) -> list[list[str]]:
    """Each family's cost (median over the constant-schedule runs) and tail factor (the mixed runs' median ÷ it)."""
    rows = []
    for family_name in ("backward", "forward"):
        constant = statistics.median(fits[f"cal {family_name}"])
        mixed = statistics.median(fits[f"calmix {family_name}"])
        rows.append([family_name, ", ".join(f"{v:.3f}" for v in fits[f"cal {family_name}"]), f"{constant:.3f}",
                     ", ".join(f"{v:.3f}" for v in fits[f"calmix {family_name}"]), f"{mixed:.3f}",
                     f"{min(1.0, mixed / constant):.3f}"])
    return rows


CALIBRATION_HEADERS = ["workload", "plan", "seed", "FLOPs", "exact final", "plan final", "steps ×",
                       "predicted e", "fit"]


def time_to_reach(times: list[float], curve: list, target: float) -> float:
    """When a curve's running-best validation loss first reaches ``target`` (``_training.first_reach`` on the
    curve in this protocol's time); ``inf`` if never."""
    return first_reach(smoothed([(times[step], step, loss) for step, loss in curve]), target)


@dataclass
class Row:
    config: str
    whole_run_flops: float
    speedup: float
    equal_steps: list
    equal_time: list
    less_planning: list
    reach: list
    planning: float
    guard: float
    note: str


def summarise(name: str, results: dict, timing: dict, seeds: list[int]) -> list[Row]:
    spec = PROTOCOL[name]
    rows = []
    for label in configs(name):
        if (label.startswith("exact@") and label != "exact@1.0") or label.startswith("cal"):
            continue
        equal_steps, equal_time, less_planning, reach, flops, guard = [], [], [], [], [], []
        for seed in seeds:
            exact_runs = {k: results[(k, seed)] for k in configs(name) if k.startswith("exact@")}
            exact = results[("exact@1.0", seed)]
            run_ = results[(label, seed)]
            target = exact["curve"][-1][1]
            exact_reach = time_to_reach(time_in_exact_steps(exact, timing), exact["curve"], target)
            times = time_in_exact_steps(run_, timing)
            final = run_["curve"][-1][1]
            equal_steps.append(100 * (final / target - 1))
            equal_time.append(100 * (final / exact_final_at(exact_runs, times[-1]) - 1))
            planning_steps = times[0]
            less_planning.append(100 * (final / exact_final_at(exact_runs, times[-1] - planning_steps) - 1))
            reach.append(time_to_reach(times, run_["curve"], target) / exact_reach)
            flops.append(run_.get("executed_flops", 1.0))
            steps_ = time_in_exact_steps(run_, timing)
            plain = time_in_exact_steps({**run_, "check_steps": (), "check_seconds": ()}, timing)
            guard.append((steps_[-1] - plain[-1]) * timing["exact_step"])
        first = results[(label, seeds[0])]
        fam = family(label)
        exact_label = label == "exact@1.0"
        speedup = 1.0 if exact_label else timing["ratios"][f"{fam} on"]
        note = "" if exact_label else (f"{first.get('sampled', 0)}/{first.get('layers', 0)} layers "
                                       f"({', '.join(first.get('modes', [])) or 'none'}), plan "
                                       f"{first.get('planned_flops', 1.0):.2f}")
        if first.get("noise"):
            note += "; noise scale " + ", ".join(f"{n:.2g}@{s}→{st:g}" for s, n, st in first["noise"][:4])
        if first.get("rows"):
            ends = [results[(label, seed)]["rows"] for seed in seeds]
            note += (f"; rows: {first['rows']['blocks']} blocks, at the end samples "
                     f"{statistics.fmean(e['ratio'] for e in ends):.2f} / tokens "
                     f"{statistics.fmean(e['token_ratio'] for e in ends):.2f}")
            planned = timing.get("plans", {}).get(fam, {})
            if label == "auto" and planned.get("row_breakeven") is not None:
                note += f" (a row-sampled step is faster below {planned['row_breakeven']:.2f} of the samples)"
            checks = [c for seed in seeds for c in results[(label, seed)].get("row_checks", ())[1:]
                      if c[3] is not None]
            if checks:
                note += (f", sampling variance {statistics.median(c[3] for c in checks):.2g}× SGD's at the checked "
                         f"samples {statistics.median(c[5] for c in checks):.2f} / tokens "
                         f"{statistics.median(c[6] for c in checks):.2f} (medians over checks after the first)")
        rows.append(Row("exact" if exact_label else label, statistics.fmean(flops), speedup, equal_steps,
                        equal_time, less_planning, reach, 0.0 if exact_label else timing["planning"][fam], statistics.fmean(guard), note))
    return rows


def _mean_spread(values: list, percent: bool = True) -> str:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "never"
    mean = statistics.fmean(finite)
    unit = "%" if percent else "×"
    text = (f"{mean:+.1f}% ({min(finite):+.1f}…{max(finite):+.1f})" if percent
            else f"{mean:.2f}{unit} ({min(finite):.2f}…{max(finite):.2f})")
    missing = len(values) - len(finite)
    return text + (f", {missing} never" if missing else "")


HEADERS = ["config", "whole-run FLOPs", "sampled step", "Δ loss, equal steps", "Δ loss, equal wall-clock",
           "Δ, wall-clock less planning", "time to exact's loss", "planning s", "guard s", "plan"]


def table_rows(rows: list[Row]) -> list[list[str]]:
    return [[r.config, f"{r.whole_run_flops:.3f}", f"{r.speedup:.2f}×", _mean_spread(r.equal_steps),
             _mean_spread(r.equal_time), _mean_spread(r.less_planning), _mean_spread(r.reach, percent=False), f"{r.planning:.1f}",
             f"{r.guard:.1f}", r.note] for r in rows]


def plot(name: str, results: dict, timing: dict, seeds: list[int]) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    seconds = timing["exact_step"]
    for label in configs(name):
        if (label.startswith("exact@") and label != "exact@1.0") or label.startswith("cal"):
            continue
        runs = [results[(label, seed)] for seed in seeds]
        times = [time_in_exact_steps(r, timing) for r in runs]
        points = len(runs[0]["curve"])
        xs = [statistics.fmean(t[r["curve"][i][0]] for t, r in zip(times, runs)) * seconds for i in range(points)]
        ys = [statistics.fmean(r["curve"][i][1] for r in runs) for i in range(points)]
        ax.plot(xs, ys, marker="o", markersize=3, label="exact" if label == "exact@1.0" else label)
    finals = sorted(statistics.fmean(results[(label, s)]["curve"][-1][1] for s in seeds) for label in configs(name)
                    if not label.startswith("cal"))
    spread = finals[-1] - finals[0]
    ax.set_ylim(finals[0] - 0.5 * spread - 0.02, finals[0] + 6 * spread + 0.2)
    ax.set(xlabel="training seconds (one thread; planning and guard included)", ylabel="validation loss",
           title=f"{name}: warm-up + cosine, mean of {len(seeds)} seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = DOCS / f"time_to_quality_{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_row_checks(all_results: dict, seeds: list[int]) -> Path | None:
    """The row family's variance checks over training (seed ``seeds[0]``): the keep-ratios after each check (samples,
    tokens) and the sampling variance it measured ÷ the minibatch's, for every run that sampled rows."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = [(name, label, results[(label, seeds[0])]) for name, results in all_results.items()
            for label in ("auto", str(BUDGET)) if (label, seeds[0]) in results
            and results[(label, seeds[0])] and results[(label, seeds[0])].get("row_checks")]
    if not runs:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, label, run_ in runs:
        checks = run_["row_checks"]
        steps = [c[0] for c in checks]
        line, = axes[0].plot(steps, [c[1] for c in checks], marker="o", markersize=3, label=f"{name} {label}: samples")
        axes[0].plot(steps, [c[2] for c in checks], linestyle="--", color=line.get_color(), label="tokens")
        axes[1].plot(steps, [c[3] for c in checks], marker="o", markersize=3, color=line.get_color(),
                     label=f"{name} {label}")
    axes[0].set(xlabel="training step", ylabel="keep-ratio after the check", title="ratios (solid: samples, dashed: "
                "tokens)")
    axes[1].set(xlabel="training step", ylabel="sampling variance ÷ minibatch variance", yscale="log",
                title="variance measured at each check")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, ncol=2)
    axes[1].legend(fontsize=7)
    path = DOCS / "row_checks.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_doc_section(path: Path, name: str, markdown: str) -> None:
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = path.read_text()
    if begin not in text:
        raise SystemExit(f"{path} has no {begin} … {end} block to write the table into")
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{markdown.strip()}\n{end}{tail}")


# -- driver ------------------------------------------------------------------------------------------------------------
def load(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(PROTOCOL), choices=list(PROTOCOL))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--only", nargs="+", default=None,
                        help="run only the configurations starting with these (e.g. exact); the tables need all")
    parser.add_argument("--calibrate", action="store_true",
                        help="only print the error-cost fits from the calibration runs done so far")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.write:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--write draws the plots in docs/: pip install matplotlib (the [plots] extra)") from None
    torch.set_num_threads(1)   # what every run and timing uses (and what the machine line says)
    DATA.mkdir(parents=True, exist_ok=True)
    cache = DATA / "timing_cache"
    timings = {}
    for name in args.workloads:   # alone, before any run: these are the clocks the comparison uses
        path = DATA / f"{name}_timing.json"
        timings[name] = load(path)
        if timings[name] is None:
            print(f"{name}: planning from a cold cache and timing steps paired ...", flush=True)
            timings[name] = measure(name, cache / name, args.rounds)
            path.write_text(json.dumps(timings[name], indent=1))
        print(f"{name}: {json.dumps(timings[name])}", flush=True)
    tasks = []
    for name in [] if args.calibrate else args.workloads:
        for label in configs(name):
            for seed in args.seeds:
                wanted = args.only is None or any(label.startswith(prefix) for prefix in args.only)
                if wanted and not (DATA / f"{name}_{label}_{seed}.json").exists():
                    tasks.append((name, label, seed, str(cache / name)))
    # the tuning workloads first (the default schedule is chosen on them), the longest runs first within each
    tasks.sort(key=lambda t: (t[0] not in TUNING, t[0] == "digits_cnn", -PROTOCOL[t[0]].steps))
    print(f"{len(tasks)} runs to do, {args.workers} at a time", flush=True)
    context = multiprocessing.get_context("spawn")
    with context.Pool(max(1, min(args.workers, len(tasks))), maxtasksperchild=1) as pool:
        for result in pool.imap_unordered(run, tasks):
            path = DATA / f"{result['workload']}_{result['config']}_{result['seed']}.json"
            path.write_text(json.dumps(result))
            print(f"  {result['workload']} {result['config']} #{result['seed']}: final "
                  f"{result['curve'][-1][1]:.4f} ({result['seconds']:.0f} s)", flush=True)
    if args.only is not None:
        return
    for name in TUNING:   # alone, after the runs: the third plan of the tuning workloads
        if name in args.workloads and f"{BUDGET}c on" not in timings[name]["ratios"]:
            print(f"{name}: timing the plan under schedule='constant' paired ...", flush=True)
            extra = measure_untailed(name, cache / name, args.rounds)
            timings[name]["ratios"].update(extra["ratios"])
            timings[name]["planning"][f"{BUDGET}c"] = extra["planning"]
            timings[name]["plans"][f"{BUDGET}c"] = extra["plan"]
            (DATA / f"{name}_timing.json").write_text(json.dumps(timings[name], indent=1))
    tables = []
    fits = {label: [] for label in CALIBRATION}
    calibration = []
    for name in TUNING:
        if name not in args.workloads:
            continue
        results = {(label, seed): load(DATA / f"{name}_{label}_{seed}.json") for label in configs(name)
                   for seed in args.seeds}
        rows, fitted = calibration_rows(name, results, args.seeds)
        calibration += rows
        for key in fits:
            fits[key] += fitted[key]
    if calibration:
        tables += [("Error costs fitted on the protocol (tuning workloads; the budget spent on one family of "
                    "approximation, on every step (cal) or under the mixed schedule (calmix); e: the plan's predicted "
                    "one-step backward error or output error; fit: extra steps per squared error and sampled step)",
                    CALIBRATION_HEADERS, calibration),
                   ("Fitted costs: ApproxConfig.backward_error_cost / forward_error_cost (median of the constant "
                    "runs) and backward_tail_factor / forward_tail_factor (mixed ÷ constant)",
                    ["family", "constant fits", "cost", "mixed fits", "mixed cost", "tail factor"],
                    fitted_costs(fits))]
        for title, headers, rows in tables:
            print_table(title, headers, rows)
    if args.calibrate:
        return
    all_results = {}
    for group, names in (("tuning", TUNING), ("held out", HELD_OUT)):
        for name in names:
            if name not in args.workloads:
                continue
            results = {}
            for label in configs(name):
                for seed in args.seeds:
                    results[(label, seed)] = load(DATA / f"{name}_{label}_{seed}.json")
            all_results[name] = results
            timing = timings[name]
            rows = summarise(name, results, timing, args.seeds)
            title = (f"{name} ({group}; {PROTOCOL[name].steps} steps; exact step {timing['exact_step'] * 1000:.0f} ms, "
                     f"one thread; seeds {' '.join(map(str, args.seeds))})")
            tables.append((title, HEADERS, table_rows(rows)))
            print_table(title, HEADERS, table_rows(rows))
            if args.write:
                plot(name, results, timing, args.seeds)
    if args.write:
        plot_row_checks(all_results, args.seeds)
        markdown = "\n\n".join(f"**{title}**\n\n{markdown_table(headers, rows)}" for title, headers, rows in tables)
        heading = (f"`python benchmarks/time_to_quality.py --write` — {machine_line()} (runs one thread each, two at a "
                   f"time; step-time ratios measured alone). Δ loss: mean over seeds against exact, the seeds' range "
                   f"in brackets; time to exact's loss: a multiple of exact's time to it")
        write_section("time_to_quality", f"## Time to quality\n\n{heading}\n\n{markdown}")
        plots = " ".join(f"![{name}](time_to_quality_{name}.png)" for name in args.workloads)
        write_doc_section(DOCS / "loss_per_second.md", "time_to_quality", f"{heading}\n\n{markdown}\n\n{plots}")

if __name__ == "__main__":
    main()

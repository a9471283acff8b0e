"""Issue 3 coverage: every torchvision classification model, approximated at budget 0.5.

Runs ``tests/test_torchvision_zoo.check_model`` (the check the slow test set
runs) for each name in ``torchvision.models.list_models(module=torchvision.models)``,
one after another, catching exceptions, each in a child process
(``--in-process`` to run them all in this one; that needs the per-model memory
leak of ``fxapprox.approximate`` fixed, see the test module): approximate at 0.5 with
a batch of 2 small images, compare ``eval()`` outputs with the original's bit
for bit (before any training), run one train step and check every gradient is
finite. Prints a table and writes it to BENCHMARKS.md (section ``zoo_coverage``).

Usage: python benchmarks/zoo_coverage.py [--models resnet18,vit_b_16] [--no-write] [--in-process]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.test_torchvision_zoo import (BATCH, BUDGET, EXPECTED_EXACT, MODEL_KWARGS, MODELS, SKIPPED,  # noqa: E402
                                        check_model, input_size, run_isolated)

from _common import machine_line, markdown_table, print_table, write_section  # noqa: E402

HEADERS = ["model", "params (M)", "input", "sampled / layers", "achieved", "budget reached",
           "untraceable: captured / exact", "step OK", "eval exact", "seconds", "result / error"]


def _yes(value) -> str:
    return "–" if value is None else ("yes" if value else "**no**")


def run(name: str, in_process: bool) -> dict:
    result: dict = {"name": name}
    if name in SKIPPED:
        result["error"] = f"skipped: {SKIPPED[name]}"
        return result
    if not in_process:
        child_result, error, trace = run_isolated(name)
        result.update(child_result)
        if error is not None and not error.startswith("AssertionError") and trace:
            print(trace, file=sys.stderr)
    else:
        start, error = time.perf_counter(), None
        try:
            check_model(name, result)
        except Exception as exc:  # noqa: BLE001 — the table reports it
            error = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, AssertionError):
                traceback.print_exc()
        result["seconds"] = time.perf_counter() - start
        gc.collect()
    result["ok"] = error is None
    if error is not None:
        message = " ".join(error.split()).removeprefix("AssertionError: ")
        result["error"] = message.removeprefix(f"{name}: ")
    return result


def untraceable_cell(r: dict) -> str:
    """How many submodules torch.fx could not trace had their layers captured, and how many stayed exact leaves
    (they hold no approximable layer: the checks fail otherwise)."""
    if "untraced_captured" not in r:
        return "–"
    captured, kept = len(r["untraced_captured"]), len(r["untraced_exact"])
    return "none" if not captured and not kept else f"{captured} / {kept}"


def row(r: dict) -> list[str]:
    has_plan = "layers" in r
    return [
        r["name"],
        f"{r['params_m']:.1f}" if "params_m" in r else "–",
        f"{BATCH}x3x{r['size']}x{r['size']}" if "size" in r else "–",
        f"{r['sampled']} / {r['layers']}" if has_plan else "–",
        f"{r['achieved']:.3f}" if has_plan else "–",
        r.get("budget_reached", "–"),
        untraceable_cell(r),
        _yes(r.get("step_ok")),
        _yes(r.get("eval_exact")),
        f"{r['seconds']:.1f}" if "seconds" in r else "–",
        "pass" if r.get("ok") else r.get("error", "").replace("|", "\\|")[:300],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated subset (default: the whole zoo)")
    parser.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    parser.add_argument("--in-process", action="store_true",
                        help="check every model in this process (default: each in a child process, since "
                             "fxapprox.approximate currently leaks each model and the zoo does not fit in 24 GiB)")
    args = parser.parse_args()
    names = args.models.split(",") if args.models else list(MODELS)

    start = time.perf_counter()
    results = []
    for name in names:
        print(f"[{len(results) + 1}/{len(names)}] {name} ...", flush=True)
        results.append(run(name, args.in_process))
        r = results[-1]
        print(f"    {'pass' if r.get('ok') else r.get('error', '')[:200]} ({r.get('seconds', 0):.1f} s)", flush=True)
    total = time.perf_counter() - start

    rows = [row(r) for r in results]
    passed = sum(bool(r.get("ok")) for r in results)
    skipped = sum(r["name"] in SKIPPED for r in results)
    not_met = [r["name"] for r in results if r.get("budget_met") is False]
    summary = (f"{passed} of {len(results)} models pass ({skipped} skipped, {len(results) - passed - skipped} fail); "
               f"budget 0.5 reached by {sum(bool(r.get('budget_met')) for r in results)}; untraceable submodules in "
               f"{sum(bool(r.get('untraced_captured') or r.get('untraced_exact')) for r in results)} models, "
               f"{sum('holds approximable layers' in r.get('error', '') for r in results)} with a layer left exact "
               f"by it; total {total / 60:.1f} min")
    print_table("torchvision zoo coverage", HEADERS, rows)
    print(summary)

    kwargs = ", ".join(f"`{n}`: `{k}`" for n, k in MODEL_KWARGS.items())
    notes = [
        f"Each model: `torchvision.models.get_model(name, weights=None, num_classes=10)` (extra kwargs: {kwargs}), "
        f"`fxapprox.approximate(model, {BUDGET}, example_inputs=(x,), "
        "config=ApproxConfig(policy=\"flops\"))` "
        "(the FLOP-ranked plan samples every eligible layer: the widest test of the rewrite) "
        f"with a batch of {BATCH} random images, "
        "then `eval()` outputs compared with the original's at `rtol=0, atol=0` (before any training), then one "
        "train step (cross-entropy on random labels) with every parameter's gradient finite. "
        "The same check is `tests/test_torchvision_zoo.py` (`python -m pytest -m slow tests/test_torchvision_zoo.py`).",
        "\"achieved\" is the plan's training FLOPs (fwd+bwd) as a fraction of the exact model's; \"budget "
        "reached\" says, where it is not, why the layers with the most exact FLOPs cannot be sampled (the FLOP-ranked "
        "policy samples every eligible layer at one keep-ratio: depthwise/grouped convolutions, 3-channel stems and "
        "activation×activation matmuls stay exact). \"untraceable\": submodules torch.fx could not trace whose "
        "layers were captured region by region / that stayed exact leaves (they hold no approximable layer).",
    ]
    if not_met:
        notes.append(f"Budget not met (the model still trains approximated): {', '.join(not_met)}.")
    if SKIPPED:
        notes.append("Skipped: " + "; ".join(f"{n} ({why})" for n, why in SKIPPED.items()) + ".")
    if EXPECTED_EXACT:
        notes.append("Nothing to sample: " + "; ".join(f"{n} ({why})" for n, why in EXPECTED_EXACT.items()) + ".")
    command = " ".join(["python benchmarks/zoo_coverage.py"] + sys.argv[1:])
    markdown = "\n\n".join([
        "## torchvision zoo coverage",
        f"`{command}` — {machine_line()}. Input {BATCH}x3x{input_size('resnet18')}x{input_size('resnet18')} "
        "unless the model needs its native size (the \"input\" column).",
        f"**{summary}.**",
        markdown_table(HEADERS, rows),
        *notes,
    ])
    if not args.no_write:
        write_section("zoo_coverage", markdown)
        print("wrote BENCHMARKS.md section zoo_coverage")


if __name__ == "__main__":
    main()

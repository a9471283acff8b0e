"""Issue 14 coverage: timm architecture families and Hugging Face transformers, approximated at budget 0.5.

Runs ``tests/test_timm_hf_zoo.check`` (what the zoo tests run) for every model there, each in a child
process: build with random weights, approximate (FLOP-ranked policy), ``eval()`` output against the
original's (atol 1e-4), one train step with finite gradients. Where submodules torch.fx cannot trace hold
approximable layers the model is captured region by region; the table counts them (captured / kept as exact
leaves, which hold no approximable layer). Prints a table and writes it to BENCHMARKS.md (section ``zoo_timm_hf``).

Usage: python benchmarks/zoo_coverage_timm_hf.py [--models resnet18,bert] [--no-write]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.test_timm_hf_zoo import HF_MODELS, TIMM_MODELS, run_isolated  # noqa: E402

from _common import machine_line, markdown_table, print_table, write_section  # noqa: E402
from zoo_coverage import untraceable_cell  # noqa: E402

HEADERS = ["zoo", "model", "params (M)", "sampled / layers", "achieved", "budget reached",
           "untraceable: captured / exact", "eval ≤ 1e-4", "step OK", "seconds", "result / error"]


def _yes(value) -> str:
    return "–" if value is None else ("yes" if value else "**no**")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None, help="comma-separated subset")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    wanted = None if args.models is None else set(args.models.split(","))
    jobs = [("timm", n) for n in TIMM_MODELS] + [("hf", n) for n in HF_MODELS]
    jobs = [job for job in jobs if wanted is None or job[1] in wanted]
    rows, passed = [], {"timm": 0, "hf": 0}
    totals = {"timm": 0, "hf": 0}
    reached = {"timm": 0, "hf": 0}
    for zoo, name in jobs:
        result, error, _ = run_isolated(zoo, name)
        totals[zoo] += 1
        passed[zoo] += error is None
        reached[zoo] += result.get("budget_reached") == "yes"
        message = "ok" if error is None else " ".join(error.split()).removeprefix("AssertionError: ")[:160]
        print(f"{zoo} {name}: {message} ({result.get('seconds', 0):.0f} s)", flush=True)
        rows.append([zoo, name, f"{result['params_m']:.1f}" if "params_m" in result else "–",
                     f"{result['sampled']}/{result['layers']}" if "sampled" in result else "–",
                     f"{result['achieved']:.3f}" if "achieved" in result else "–",
                     result.get("budget_reached", "–"), untraceable_cell(result),
                     _yes(result.get("eval_exact")), _yes(result.get("step_ok")),
                     f"{result.get('seconds', 0):.0f}", message])
    summary = ", ".join(f"{zoo}: {passed[zoo]}/{totals[zoo]} pass, budget 0.5 reached by {reached[zoo]}"
                        for zoo in totals if totals[zoo])
    print_table(f"timm and Hugging Face at budget 0.5 — {summary}", HEADERS, rows)
    if not args.no_write and wanted is None:
        write_section("zoo_timm_hf", "\n\n".join([
            "## timm and Hugging Face coverage",
            f"`python benchmarks/zoo_coverage_timm_hf.py` on {machine_line()}: random weights, budget 0.5 "
            "(FLOP-ranked policy), batch 2; eval output vs the original's within atol 1e-4; one train step with "
            f"finite gradients. Hugging Face models traced with `transformers.utils.fx.symbolic_trace` where "
            "transformers has it (before 5), else captured as they are. \"budget reached\": where not, why the "
            "layers with the most exact FLOPs cannot be sampled. \"untraceable\": submodules torch.fx could not "
            "trace whose layers were captured region by region / that stayed exact leaves (no approximable layer "
            f"in them). **{summary}.**",
            markdown_table(HEADERS, rows)]))


if __name__ == "__main__":
    main()

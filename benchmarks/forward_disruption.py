"""How much sampling the forward moves each protocol workload's predictions, and which family budget 0.5 takes.

For every workload of ``benchmarks/time_to_quality.py`` (its model as the protocol builds it — the fine-tuning ones
pretrained — and its example batch), in training mode: ``KL(p_exact ‖ p_sampled)`` of the output's softmax, nats per
output row, every linear layer's forward top-k at keep 0.5
(``fxapprox.passes.measurement.measure_rows.forward_disruption``, what ``ApproxConfig.max_forward_kl`` is compared
with), the output's entropy beside it, and the family ``approximate(model, 0.5)`` plans (rows, or the measured
policy's, and why). ``--write`` puts the table into BENCHMARKS.md (section ``forward_disruption``).

Usage: python benchmarks/forward_disruption.py [--write]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import fxapprox  # noqa: E402
from fxapprox.passes.measurement.measure_rows import forward_disruption  # noqa: E402
from _common import machine_line, markdown_table, print_table, write_section  # noqa: E402
import workloads  # noqa: E402
from time_to_quality import PROTOCOL, TUNING  # noqa: E402

HEADERS = ["workload", "weights", "KL at keep 0.5 (nats)", "output entropy (nats)", "budget 0.5 plans", "why"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, spec in PROTOCOL.items():
        workload = workloads.get(spec.workload)
        model = workload.build().train()
        example = workload.example
        kl = forward_disruption(lambda: model(*example), 0.5, fxapprox.ApproxConfig().min_channels)
        with torch.no_grad():
            scores = model(*example).float()
        entropy = float(-(F.softmax(scores, -1) * F.log_softmax(scores, -1)).sum(-1).mean())
        config = fxapprox.ApproxConfig(check_every=None, check_verbose=False, timing_cache=False, min_speedup=None)
        plan = fxapprox.approximate(workload.build(), 0.5, example_inputs=example, config=config).plan
        family = "rows" if plan.rows is not None else "measured policy (" + ", ".join(
            sorted({d.mode for d in plan.approximated})) + ")"
        why = plan.note.split("row sampling not used: ")[-1] if "row sampling not used" in plan.note else (
            "sampled forwards move its predictions by more than max_forward_kl" if plan.rows is not None
            else "no row blocks")
        weights = "pretrained" if name.startswith("finetune") else "initial"
        rows.append([name + (" (tuning)" if name in TUNING else ""), weights,
                     "-" if kl is None else f"{kl:.4f}", f"{entropy:.3f}", family, why])
        print(rows[-1], flush=True)
    print_table("forward disruption", HEADERS, rows)
    if args.write:
        write_section("forward_disruption", "\n\n".join([
            "## Sampled forwards and the model's predictions (`benchmarks/forward_disruption.py`)",
            f"`python benchmarks/forward_disruption.py --write` on {machine_line()}. KL(p_exact ‖ p_sampled) of the "
            "output's softmax with every linear layer's forward top-k at keep 0.5, on the protocol's example batch "
            "(training mode); the family budget 0.5 then plans (`max_forward_kl` = 0.1).",
            markdown_table(HEADERS, rows)]))


if __name__ == "__main__":
    main()

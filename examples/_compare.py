"""Shared by the examples: compare learning curves at equal steps and at equal wall-clock."""

from __future__ import annotations


def loss_at_time(curve, seconds: float) -> float:
    """The validation loss a curve had reached at ``seconds`` of training (linear between evaluations)."""
    for (t0, _, l0), (t1, _, l1) in zip(curve, curve[1:]):
        if t0 <= seconds <= t1:
            return l0 + (l1 - l0) * (seconds - t0) / (t1 - t0) if t1 > t0 else l1
    return curve[-1][2]


def compare(results: dict, reference: str = "exact") -> list[dict]:
    """Per configuration: final loss, and its change against ``reference`` at equal steps and at equal
    wall-clock — both curves read at the shorter of the two runs' training times (a faster run is compared
    with what the reference had reached when it finished; a slower one with where it stood when the
    reference finished)."""
    base = results[reference]["curve"]
    rows = []
    for label, result in results.items():
        seconds, _, loss = result["curve"][-1]
        when = min(seconds, base[-1][0])
        mine, theirs = loss_at_time(result["curve"], when), loss_at_time(base, when)
        rows.append({"config": label, "planned_flops": result.get("achieved", 1.0),
                     "predicted_error": result.get("predicted_error"), "val_loss": loss,
                     "vs_exact_equal_steps": loss / base[-1][2] - 1, "train_s": seconds,
                     "step_speedup": base[-1][0] / seconds, "equal_time_s": when, "loss_at_equal_time": mine,
                     "exact_loss_at_equal_time": theirs, "vs_exact_equal_time": mine / theirs - 1})
    return rows


def print_rows(rows: list[dict]) -> None:
    print("\n| config | planned FLOPs | predicted grad error | final loss | vs exact, equal steps | train s | "
          "speed-up | at equal wall-clock (s): loss vs exact's |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        error = "-" if r["predicted_error"] is None else f"{r['predicted_error']:.3f}"
        print(f"| {r['config']} | {r['planned_flops']:.3f} | {error} | {r['val_loss']:.4f} | "
              f"{r['vs_exact_equal_steps']:+.1%} | {r['train_s']:.1f} | {r['step_speedup']:.2f}× | "
              f"{r['equal_time_s']:.0f} s: {r['loss_at_equal_time']:.4f} vs {r['exact_loss_at_equal_time']:.4f} "
              f"({r['vs_exact_equal_time']:+.1%}) |")

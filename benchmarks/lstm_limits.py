"""Issue 5, what limits the sparse LSTM backward on this CPU: the per-step building blocks, measured alone.

For the benchmark's LSTM (batch 64, hidden 512, input 512) at gate keep-ratio 1, 0.5 and 0.25
(``4k`` = 2048, 1024, 512 kept gate columns), one time step of the backward does:

* ``dh_{t-1} = dZ_kept · W_hh[kept]`` and ``dx_t = dZ_kept · W_ih[kept]``: (64 × 4k)·(4k × 512);
* ``dW[kept] += dZ_keptᵀ · h_{t-1}`` (and ``x_t``): (4k × 64)·(64 × 512), inner dimension 64;
* a gather of the kept ``W`` rows and an ``index_add_`` of the weight-gradient rows (4k × 512 floats each).

Each product is timed through oneDNN (``torch.ops.mkldnn._linear_pointwise``, what ``fxapprox.ops.lstm``
uses) and through ``torch.mm`` (MKL), with the dense (T·B = 3200)-row products of the keep-ratio-1 path for
comparison; the gather and scatter are also timed with the cache flushed first (a 48 MiB pass), as they are in
the backward, whose working set (gates, states, both weights and their gradients) is larger than the cache.
Streaming-copy bandwidth at growing sizes closes the table.

Usage: python benchmarks/lstm_limits.py [--threads N] [--repetitions 9]  (its own BENCHMARKS.md section per --threads)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _common import machine_line, markdown_table, print_table, write_section

BATCH, HIDDEN, STEPS = 64, 512, 50


def _seconds(call, repetitions: int, inner: int) -> float:
    """Median seconds of one ``call``, ``inner`` calls per sample."""
    for _ in range(3):
        call()
    samples = []
    for _ in range(repetitions):
        start = time.perf_counter()
        for _ in range(inner):
            call()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def _seconds_after_flush(call, flush, repetitions: int) -> float:
    """Median over samples of time(flush + call) − time(flush), each pair taken back to back: the flush
    takes milliseconds and varies, so its time is subtracted pairwise, not as a separate median."""
    call()
    differences = []
    for _ in range(repetitions):
        start = time.perf_counter()
        flush()
        call()
        middle = time.perf_counter()
        flush()
        end = time.perf_counter()
        differences.append((middle - start) - (end - middle))
    return statistics.median(differences)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repetitions", type=int, default=9)
    args = parser.parse_args()
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        raise SystemExit("this torch build has no oneDNN linear (torch.ops.mkldnn._linear_pointwise)")
    onednn = torch.ops.mkldnn._linear_pointwise
    torch.manual_seed(0)
    reps = args.repetitions

    def gemm_row(label, a, b, inner):
        """Time ``a @ b`` through oneDNN (weight = bᵀ) and torch.mm."""
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        with torch.no_grad():
            t_dnn = _seconds(lambda: onednn(a, b.t(), None, "none", [], ""), reps, inner)
            t_mm = _seconds(lambda: torch.mm(a, b), reps, inner)
        return [label, f"{tuple(a.shape)}·{tuple(b.shape)}", f"{t_dnn * 1e6:.0f}", f"{flops / t_dnn / 1e9:.0f}",
                f"{t_mm * 1e6:.0f}", f"{flops / t_mm / 1e9:.0f}"]

    gemm_rows = []
    for kept in (2048, 1024, 512):
        dz = torch.randn(BATCH, kept)
        gemm_rows.append(gemm_row(f"dh / dx, 4k={kept}", dz, torch.randn(kept, HIDDEN), 50))
        gemm_rows.append(gemm_row(f"dW rows, 4k={kept}", dz.t(), torch.randn(BATCH, HIDDEN), 50))
    dz_all = torch.randn(STEPS * BATCH, 4 * HIDDEN)
    gemm_rows.append(gemm_row("dense dx (T·B rows)", dz_all, torch.randn(4 * HIDDEN, HIDDEN), 3))
    gemm_rows.append(gemm_row("dense dW (T·B inner)", torch.randn(HIDDEN, STEPS * BATCH), dz_all, 3))

    flush_buffer = torch.empty(12 * 2**20)   # 48 MiB, more than the 32 MiB L3

    def flush():
        flush_buffer.fill_(1.0)

    memory_rows = []
    weight = torch.randn(4 * HIDDEN, HIDDEN)
    grad = torch.zeros(4 * HIDDEN, HIDDEN)
    for kept_count in (1024, 512):
        kept = torch.randperm(4 * HIDDEN)[:kept_count].sort().values
        rows = torch.randn(kept_count, HIDDEN)
        out = torch.empty(kept_count, HIDDEN)
        megabytes = kept_count * HIDDEN * 4 / 2**20
        for label, call in ((f"gather W rows (index_select), 4k={kept_count}",
                             lambda kept=kept, out=out: torch.index_select(weight, 0, kept, out=out)),
                            (f"scatter dW rows (index_add_), 4k={kept_count}",
                             lambda kept=kept, rows=rows: grad.index_add_(0, kept, rows))):
            warm = _seconds(call, reps, 20)
            cold = _seconds_after_flush(call, flush, 5 * reps)
            memory_rows.append([label, f"{megabytes:.0f} MiB", f"{warm * 1e6:.0f}", f"{max(cold, 0) * 1e6:.0f}"])
    bandwidth_rows = []
    for mebibytes in (1, 4, 16, 64, 256):
        source = torch.randn(mebibytes * 2**20 // 4)
        target = torch.empty_like(source)
        seconds = _seconds(lambda: target.copy_(source), reps, max(1, 64 // mebibytes))
        bandwidth_rows.append([f"{mebibytes} MiB", f"{2 * mebibytes / 1024 / seconds:.1f}"])

    gemm_headers = ["product", "shape", "oneDNN µs", "oneDNN GFLOP/s", "torch.mm µs", "torch.mm GFLOP/s"]
    memory_headers = ["operation", "rows moved", "warm cache µs", "after cache flush µs"]
    bandwidth_headers = ["copy size", "GB/s (read + write)"]
    print_table("Per-step products of the LSTM backward (batch 64, hidden 512)", gemm_headers, gemm_rows)
    print_table("Row gather / scatter, per call", memory_headers, memory_rows)
    print_table("Streaming copy bandwidth", bandwidth_headers, bandwidth_rows)
    command = "python benchmarks/lstm_limits.py" + (f" --threads {args.threads}" if args.threads else "")
    section, heading = ("lstm_limits", "") if args.threads is None else (
        f"lstm_limits_threads{args.threads}", f", {args.threads} thread(s)")
    write_section(section, f"## What limits the sparse LSTM backward{heading}\n\n`{command}` — "
                                 f"{machine_line()}\n\n**Per-step products** (median of {reps})\n\n"
                  + markdown_table(gemm_headers, gemm_rows)
                  + "\n\n**Row gather / scatter, per call**\n\n" + markdown_table(memory_headers, memory_rows)
                  + "\n\n**Streaming copy bandwidth**\n\n" + markdown_table(bandwidth_headers, bandwidth_rows))


if __name__ == "__main__":
    main()

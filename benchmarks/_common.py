"""Shared helpers of the benchmark scripts: interleaved timing, tables, BENCHMARKS.md sections."""

from __future__ import annotations

import platform
import re
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def interleaved_samples(steps: dict, repetitions: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds of each callable in ``steps`` per round, run round-robin so drift hits all alike."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repetitions):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - start)
    return samples


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in samples.items()}


def interleaved_medians(steps: dict, repetitions: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds of each callable in ``steps``, run round-robin so drift hits all alike."""
    return medians(interleaved_samples(steps, repetitions, warmup))


def paired_ratio(samples: dict[str, list[float]], base: str, name: str) -> float:
    """Median over rounds of ``base``'s time / ``name``'s time in the same round: steadier than a ratio of
    medians when the machine's speed drifts between rounds."""
    return statistics.median(b / v for b, v in zip(samples[base], samples[name]))


def machine_line() -> str:
    return (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def print_table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    table = Table(title=title)
    console = Console(width=220)
    for header in headers:
        table.add_column(header)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def write_section(name: str, markdown: str) -> None:
    """Replace (or append) the section ``name`` of BENCHMARKS.md."""
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else (
        "# Benchmarks\n\nEvery table below is written by the script named in its section; rerun it to refresh.\n")
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS_MD.write_text(text)


def report_tables(tables: list, section: str | None, heading: str) -> None:
    """Print ``tables`` (``(title, headers, rows)`` each) and, unless ``section`` is ``None``, write them to that
    section of BENCHMARKS.md under ``heading`` (the machine line is added after it)."""
    for title, headers, rows in tables:
        print_table(title, headers, rows)
    if section is None:
        return
    markdown = "\n\n".join(f"**{title}**\n\n{markdown_table(headers, rows)}" for title, headers, rows in tables)
    write_section(section, f"{heading} — {machine_line()}\n\n{markdown}")


def proc_status(field: str) -> int:
    """A byte count from ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``VmSize``, …)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def step_peak_growth(step, repeats: int = 3, prepare=None) -> int:
    """The median over ``repeats`` runs of ``step()``'s peak resident-set growth: the kernel's high-water mark is
    reset (``/proc/self/clear_refs``) before the step, growth = ``VmHWM`` after − ``VmRSS`` before. ``prepare()``
    runs before each (outside the measurement). Run with glibc's ``MALLOC_MMAP_THRESHOLD_`` low, so freed tensors
    leave the resident set."""
    import gc

    growths = []
    for _ in range(repeats):
        if prepare is not None:
            prepare()
        gc.collect()
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        before = proc_status("VmRSS")
        step()
        growths.append(proc_status("VmHWM") - before)
    return sorted(growths)[len(growths) // 2]

"""The rewrite report: a summary a person reads first, then, on request, every layer.

The summary fits a 120-column terminal: the budget asked and achieved, the layers sampled (grouped by how), what the
pay-off model predicts and what ``budget="auto"`` would do, the warnings, the exact layers grouped by reason, and
the memory plan and the guard when there are any. The per-layer table (every layer, its plan and why) is behind
``verbose`` (``report.show(verbose=True)``, ``fxapprox report --verbose``) and in the export.

``str(report)`` is the summary as plain text, ``report.text(verbose=True)`` adds the tables, ``report.show()``
prints with rich colours, ``report.to_dict()`` is JSON-serialisable.
"""

from __future__ import annotations

import io

from collections import Counter

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fxapprox.passes.capture.regions import LIBRARY_LEAF, short_reason
from fxapprox.plan import Plan, exact_reason_groups

#: the width the plain-text report is laid out for (a terminal's, when the report is shown in one)
WIDTH = 120


def _flops(value: int) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return str(value)


def budget_text(budget) -> str:
    """``0.5`` → ``"0.5"``; ``"auto"`` stays."""
    return budget if isinstance(budget, str) else f"{budget:g}"


def _bytes(value: int) -> str:
    return f"{value / 2**20:.2f}" if value else "-"


def _input_saving(decision) -> str:
    kept = {"gathered": "a copy of its input's kept columns", "reference": "its input itself"}.get(decision.save_input)
    return f"; keeps {kept} ({decision.save_input_reason})" if kept else ""


def _untraced_lines(plan: Plan) -> str:
    """The submodules torch.fx could not trace, grouped by where and why: kept exact (a traced model) or run
    eagerly with their layers captured (a model captured region by region)."""
    groups: dict[tuple, list[str]] = {}
    for u in plan.untraced:
        groups.setdefault((u["module_type"], u.get("source_line"), short_reason(u["reason"])), []).append(u["module"])
    how = "ran eagerly, their layers captured" if plan.regions else "kept exact"
    lines = []
    for (module_type, source_line, reason), paths in groups.items():
        named = ", ".join(repr(p) for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        verb = "did not trace" if reason == LIBRARY_LEAF else "could not trace"
        lines.append(f"\n{how}, torch.fx {verb} {named} ({module_type})"
                     + (f" at {source_line}" if source_line else "") + f": {reason}")
    return "".join(lines)


def _region_lines(plan: Plan) -> str:
    """What hierarchical capture made of a model whose own code does not trace (empty for a traced model)."""
    if not plan.regions:
        return ""
    kinds = {kind: [r for r in plan.regions if r["kind"] == kind] for kind in ("traced", "leaf", "eager")}
    eager_flops = sum(d.exact_flops for d in plan.layers if d.reason.startswith("runs eagerly"))
    share = eager_flops / plan.total_exact_flops if plan.total_exact_flops else 0.0
    root = next((r for r in kinds["eager"] if r["path"] == ""), None)
    why = f" ({root['reason']})" if root is not None else ""
    return (f"\ncaptured region by region, the model's own code runs eagerly{why}: {len(kinds['traced'])} traced "
            f"region(s), {len(kinds['leaf'])} layer(s) swapped in place, {len(kinds['eager'])} module(s) run eagerly "
            f"and exactly ({share:.1%} of the training FLOPs)")


def _rows_text(rows) -> str:
    """The row family's line: how many blocks, the ratios, what the last variance check measured."""
    ratio = min((b.ratio for b in rows.sampled), default=1.0)
    text = (f"{len(rows.sampled)} of {len(rows.blocks)} block(s) run their backward on {ratio:.0%} of the samples, "
            f"weight gradients on {rows.token_ratio:.0%} of their tokens; forward exact")
    if rows.tau is not None:
        text += f"; budget auto: each part of the sampling variance held at tau={rows.tau:g} × the minibatch's"
    if rows.variance_ratio is not None:
        text += (f"; last check (step {rows.checked_step}): sampling variance {rows.variance_ratio:.3g} × the "
                 f"minibatch's at {rows.checked_ratio:.2f} / {rows.checked_token_ratio:.2f}, noise scale B_noise/B "
                 f"{rows.noise_scale:.3g}")
    else:
        text += "; the first training step calibrates the ratios"
    refused = [b for b in rows.blocks if not b.sampled]
    if refused:
        text += "; not sampled: " + ", ".join(f"{b.name} ({b.reason})" for b in refused[:3])
    return text


def _check_summary(check) -> str:
    if check.sgd_variance is not None:
        return (f"sampling variance {check.variance_ratio:.3g} × the minibatch's at rows {check.checked_ratio:.2f} / "
                f"tokens {check.checked_token_ratio:.2f}; {check.action}: {check.note}")
    predicted = "-" if check.predicted_error is None else f"{check.predicted_error:.3f}"
    return (f"model-gradient error measured {check.model_error:.3f} (one step; predicted {predicted}), backward "
            f"{check.backward_error:.3f} (predicted {check.predicted_backward_error:.3f}), output "
            f"{check.output_error:.3f} (predicted {check.predicted_output_error:.3f}); step {check.speedup:.2f}x "
            f"faster than exact; {check.action}: {check.note}")


class Report:
    """What :func:`fxapprox.approximate` planned for a model.

    Example::

        >>> approx = fxapprox.approximate(model, 0.5, example_inputs=(x,))
        >>> print(approx.report)                 # the summary, plain text
        >>> approx.report.show(verbose=True)     # rich, in the terminal, with every layer
        >>> json.dumps(approx.report.to_dict())
    """

    def __init__(self, plan: Plan, model_name: str, input_shapes: list, history=None) -> None:
        self.plan = plan
        self.model_name = model_name
        self.input_shapes = input_shapes
        #: the guard's checks (:class:`~fxapprox.runtime.guard.TrainingHistory`, shared with the module: it grows as
        #: training runs); the report shows the last check's measured errors beside the predicted ones
        self.history = history

    # -- data -------------------------------------------------------------
    def to_dict(self) -> dict:
        plan = self.plan.to_dict()
        total = self.plan.total_exact_flops or 1
        for layer in plan["layers"]:
            layer["flops_share"] = layer["exact_flops"] / total
        data = {"model": self.model_name, "input_shapes": self.input_shapes, **plan}
        if self.history:
            data["history"] = self.history.to_dict()
        return data

    # -- the summary ------------------------------------------------------
    def _summary_rows(self) -> list[tuple[str, str, str | None]]:
        """``(label, text, style)`` rows of the summary."""
        plan = self.plan
        rows = []
        met = "met" if plan.budget_met else "NOT met"
        asked = "auto (the pay-off model chooses)" if plan.budget == "auto" else f"{budget_text(plan.budget)} asked"
        rows.append(("budget", f"{asked}: {plan.achieved:.3f} of exact training FLOPs planned"
                               + ("" if plan.budget == "auto" else f" ({met})")
                               + f", {_flops(plan.total_planned_flops)} of {_flops(plan.total_exact_flops)} per step",
                     None if plan.budget_met else "yellow"))
        rows.append(("sampled", _sampled_text(plan), "green" if plan.approximated else None))
        if plan.rows is not None:
            rows.append(("rows", _rows_text(plan.rows), "green" if plan.rows.sampled else None))
        if plan.schedule and plan.approximated and (plan.schedule["kind"] != "constant"
                                                    or plan.schedule["total_steps"] is not None):
            rows.append(("schedule", _schedule_text(plan.schedule), None))
        predicted = _predicted_text(plan)
        if predicted:
            rows.append(("predicted", predicted, None))
        if plan.check:
            rows.append(("checked", _check_text(plan.check), None))
        if plan.auto_advice:
            rows.append(("auto", plan.auto_advice, None))
        for warning in plan.warnings:
            rows.append(("warning", warning, "yellow"))
        groups = exact_reason_groups(plan.layers)
        if groups:
            shown = [f"{len(members)} layer(s): {reason} ({_names(members)})" for reason, members in groups[:6]]
            if len(groups) > 6:
                shown.append(f"{sum(len(m) for _, m in groups[6:])} more layer(s) for {len(groups) - 6} other "
                             "reason(s): see the per-layer table")
            rows.append(("exact", "\n".join(shown), "dim"))
        # A met budget's note says what the rows above say; any other (out of reach, auto, re-planned) is news.
        if not plan.note.startswith(f"budget {budget_text(plan.budget)} met:") or _untraced_lines(plan) \
                or _region_lines(plan):
            rows.append(("note", plan.note + _untraced_lines(plan) + _region_lines(plan), None))
        memory = plan.memory
        if memory is not None:
            rows.append(("memory", _memory_text(memory) + f"; {memory.note}", None))
        if self.history:
            last = self.history[-1]
            rows.append(("guard", f"{len(self.history)} check(s), {self.history.replans} re-plan(s); last at step "
                                  f"{last.step}: {_check_summary(last)}", None))
        rows.append(("layers", "every layer's plan and why: report.show(verbose=True), fxapprox report --verbose, "
                               "or fxapprox.export", "dim"))
        return rows

    def _summary(self, plain: bool) -> Table:
        config = self.plan.config
        title = (f"fxapprox plan for {self.model_name} (inputs {self.input_shapes}): "
                 f"{config.get('policy', 'flops')} policy, method {self.plan.method}")
        grid = Table.grid(padding=(0, 2))
        grid.title = title
        grid.title_justify = "left"
        grid.add_column(justify="left", no_wrap=True, style=None if plain else "bold")
        grid.add_column(justify="left", overflow="fold")
        for label, text, style in self._summary_rows():
            grid.add_row(label, escape(text), style=None if plain else style)
        return grid

    # -- the tables (verbose) ---------------------------------------------
    def _table(self, plain: bool) -> Table:
        plan = self.plan
        total = plan.total_exact_flops or 1
        table = Table(title="every layer", box=box.SIMPLE if plain else box.SIMPLE_HEAVY, show_lines=False,
                      title_justify="left", pad_edge=False)
        # The measured error and speed-up are in the "why" of a sampled layer (and in the JSON): columns of their
        # own would leave the reasons too narrow for 120 columns.
        table.add_column("layer", justify="left", overflow="fold", max_width=32)
        for name in ("op", "train FLOPs", "plan"):
            table.add_column(name, justify="left" if name != "train FLOPs" else "right", no_wrap=True)
        table.add_column("why", justify="left", overflow="fold", ratio=1, min_width=40)
        for d in plan.layers:
            style = None if plain else ("green" if d.approximate else "dim")
            how = f"{d.mode} {d.method} {d.keep_ratio:.2f}" if d.approximate else "exact"
            table.add_row(d.target, d.op_kind or "-", f"{_flops(d.exact_flops)} {d.exact_flops / total:5.1%}",
                          how, escape(d.reason + _input_saving(d)), style=style)
        return table

    def _memory_table(self, plain: bool) -> Table | None:
        memory = self.plan.memory
        if memory is None:
            return None
        table = Table(title="saved activations (what autograd keeps for backward)", title_justify="left",
                      box=box.ASCII if plain else box.SIMPLE_HEAVY, caption=escape(memory.note),
                      caption_justify="left")
        for name, justify in (("value", "left"), ("shape", "left"), ("dtype", "left"), ("saved by", "left"),
                              ("exact MiB", "right"), ("bits", "right"), ("planned MiB", "right"),
                              ("why", "left")):
            table.add_column(name, justify=justify, overflow="fold")
        for v in memory.values:
            rebuilt = v.recomputed_from is not None
            style = None if plain else ("green" if v.compressed or rebuilt else "dim")
            bits = ("in block" if v.checkpointed_in is not None else "rebuilt" if rebuilt
                    else f"{v.bits}{' (sign-exact)' if v.sign_exact else ''}")
            style = style if v.checkpointed_in is None or plain else "green"
            table.add_row(v.node, "x".join(map(str, v.shape)) if v.shape else "-", v.dtype, ", ".join(v.savers),
                          f"{v.exact_bytes / 2**20:.2f}", bits, f"{v.planned_bytes / 2**20:.2f}", escape(v.reason),
                          style=style)
        table.add_row("(temporaries)", "-", "-", "batch stats, kept-column indices of sampled layers, masks",
                      f"{memory.internal_bytes / 2**20:.2f}", "-", "-", "kept (boolean ones bit-packed)",
                      style=None if plain else "dim")
        table.add_row("total", "", "", "", f"{memory.total_exact_bytes / 2**20:.2f}", "",
                      f"{memory.total_planned_bytes / 2**20:.2f}",
                      f"{memory.achieved:.3f} of exact ({'met' if memory.budget_met else 'NOT met'})")
        return table

    def _blocks_table(self, plain: bool) -> Table | None:
        memory = self.plan.memory
        if memory is None or not memory.blocks:
            return None
        measured = "" if memory.measured_time is None else f"; measured step {memory.measured_time:.2f}x exact's"
        table = Table(title="blocks (checkpointed: keep their inputs, run again in backward)", title_justify="left",
                      box=box.ASCII if plain else box.SIMPLE_HEAVY, caption_justify="left",
                      caption=escape(f"{len(memory.checkpointed)} of {len(memory.blocks)} checkpointed{measured}"))
        for name, justify in (("block", "left"), ("nodes", "right"), ("frees MiB", "right"),
                              ("inputs MiB", "right"), ("re-run ms", "right"), ("why", "left")):
            table.add_column(name, justify=justify, overflow="fold")
        for b in memory.blocks:
            table.add_row(b.name, str(len(b.nodes)), f"{b.interior_bytes / 2**20:.2f}", f"{b.input_bytes / 2**20:.2f}",
                          f"{b.recompute_seconds * 1e3:.1f}", escape(b.reason),
                          style=None if plain else ("green" if b.checkpointed else "dim"))
        return table

    def _guard_table(self, plain: bool) -> Table | None:
        if not self.history:
            return None
        last = self.history[-1]
        table = Table(title=f"guard: {len(self.history)} check(s), {self.history.replans} re-plan(s); last at step "
                            f"{last.step}", title_justify="left", box=box.ASCII if plain else box.SIMPLE_HEAVY)
        for name, justify in (("layer", "left"), ("method", "left"), ("mode", "left"), ("keep", "right"),
                              ("planned error (alone)", "right"), ("measured error (in the model)", "right")):
            table.add_column(name, justify=justify, overflow="fold")
        for layer in last.layers:
            table.add_row(layer.target, layer.method or "exact", layer.mode or "-", f"{layer.keep_ratio:.2f}",
                          "-" if layer.planned_error is None else f"{layer.planned_error:.3f}",
                          "-" if layer.measured_error is None else f"{layer.measured_error:.3f}")
        return table

    def _renderables(self, plain: bool, verbose: bool) -> list:
        parts = [self._summary(plain)]
        if verbose:
            parts += [t for t in (self._table(plain), self._memory_table(plain), self._blocks_table(plain),
                                  self._guard_table(plain)) if t is not None]
        return parts

    def text(self, verbose: bool = False, width: int = WIDTH) -> str:
        """The report as plain text laid out for ``width`` columns: the summary, and with ``verbose`` every layer,
        every saved value and the guard's last check."""
        buffer = io.StringIO()
        console = Console(file=buffer, width=width, color_system=None, force_terminal=False, highlight=False)
        for part in self._renderables(plain=True, verbose=verbose):
            console.print(part)
            console.print()
        return "\n".join(line.rstrip() for line in buffer.getvalue().rstrip().splitlines()) + "\n"

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        memory = self.plan.memory
        saved = "" if memory is None else f", saved_activations={memory.achieved:.3f}"
        return (f"Report(model={self.model_name!r}, budget={budget_text(self.plan.budget)}, "
                f"achieved={self.plan.achieved:.3f}, sampled={len(self.plan.approximated)}/{len(self.plan.layers)}"
                f"{saved})")

    def show(self, console: Console | None = None, verbose: bool = False) -> None:
        """Print the report with rich colours: the summary, and with ``verbose`` every layer."""
        if console is None:
            console = Console(highlight=False)
            if not console.is_terminal:  # piped: the plain-text report's width
                console = Console(width=WIDTH, highlight=False)
        for part in self._renderables(plain=False, verbose=verbose):
            console.print(part)
            console.print()


def _names(members, limit: int = 3) -> str:
    names = [d.target for d in members[:limit]]
    return ", ".join(names) + (f" and {len(members) - limit} more" if len(members) > limit else "")


def _sampled_text(plan: Plan) -> str:
    sampled = plan.approximated
    if not sampled:
        return f"none of {len(plan.layers)} layers: the model trains exactly"
    how = Counter((d.mode, d.method) for d in sampled)
    parts = []
    for (mode, method), count in how.most_common():
        ratios = [d.keep_ratio for d in sampled if (d.mode, d.method) == (mode, method)]
        keep = f"keep {min(ratios):.2f}" + ("" if max(ratios) - min(ratios) < 5e-3 else f"–{max(ratios):.2f}")
        parts.append(f"{mode} {method} ×{count} ({keep})")
    share = sum(d.exact_flops for d in sampled) / (plan.total_exact_flops or 1)
    return f"{len(sampled)} of {len(plan.layers)} layers ({share:.0%} of the FLOPs): " + ", ".join(parts)


def _predicted_text(plan: Plan) -> str:
    parts = []
    if plan.predicted_speedup is not None and plan.predicted_steps is not None:
        speedup = plan.measured_speedup or plan.predicted_speedup
        gain = speedup / plan.predicted_steps
        timing = f"{gain:.2f}x sooner" if gain >= 1 else f"{1 / gain:.2f}x later" if gain > 0 else "never"
        measured = "" if plan.measured_speedup is None else \
            f" (measured on the example batch; the layers' timings add up to {plan.predicted_speedup:.2f}x)"
        parts.append(f"{speedup:.2f}x faster per step{measured}, {plan.predicted_steps:.2f}x the steps: "
                     f"{timing} to the same loss than exact training")
    if plan.predicted_error is not None and plan.approximated:
        tolerance = plan.config.get("max_grad_error")
        parts.append(f"model-gradient error {plan.predicted_error:.3f}"
                     + (f" (max_grad_error {tolerance:g})" if tolerance else ""))
    return "; ".join(parts)


def _check_text(check: dict) -> str:
    text = (f"on the example batch against exact training: one-step model-gradient error {check['model_error']:.3g}, "
            f"output error {check['output_error']:.3g} (predicted {check['predicted_output_error']:.3g}); calibrated "
            f"model-gradient error {check['calibrated_error']:.3g}")
    calibration = check.get("calibration")
    if check.get("replans"):
        factors = ", ".join(f"{family} family ×{factor:.3g}" for family, factor in calibration.items() if factor != 1)
        text += (f"; re-planned {check['replans']} time(s) with the errors measured where they passed the "
                 f"predictions ({factors})")
    return text


def _memory_text(memory) -> str:
    widths = Counter("rebuilt" if v.recomputed_from is not None else f"{v.bits}-bit"
                     for v in memory.values if v.compressed or v.recomputed_from is not None)
    how = ", ".join(f"{width} ×{count}" for width, count in widths.most_common())
    if memory.checkpointed:
        how = ", ".join(p for p in (how, f"{len(memory.checkpointed)} of {len(memory.blocks)} blocks checkpointed")
                        if p)
    return (f"saved activations {memory.total_exact_bytes / 2**20:.1f} MiB → {memory.total_planned_bytes / 2**20:.1f}"
            f" MiB ({memory.achieved:.3f} of exact, {'met' if memory.budget_met else 'NOT met'})"
            + (f": {how}" if how else ""))


def _schedule_text(schedule: dict) -> str:
    from fxapprox.schedule import ScheduleRecord

    return ScheduleRecord(**schedule).describe()

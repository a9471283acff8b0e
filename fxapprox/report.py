"""The rewrite report: per layer what was done (or why not), and the totals.

``str(report)`` is a plain-text table, ``report.show()`` prints it with rich
colours, ``report.to_dict()`` is JSON-serialisable.
"""

from __future__ import annotations

import io

from rich import box
from rich.console import Console
from rich.table import Table

from fxapprox.plan import Plan


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
    lines = [f"\nkept exact, torch.fx could not trace {u['module']!r} ({u['module_type']})"
             + (f" at {u['source_line']}" if u.get("source_line") else "") + f": {u['reason']}"
             for u in plan.untraced]
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


def _check_summary(check) -> str:
    predicted = "-" if check.predicted_error is None else f"{check.predicted_error:.3f}"
    return (f"model-gradient error measured {check.model_error:.3f} (one step; predicted {predicted}), backward "
            f"{check.backward_error:.3f} (predicted {check.predicted_backward_error:.3f}), output "
            f"{check.output_error:.3f} (predicted {check.predicted_output_error:.3f}); step {check.speedup:.2f}x "
            f"faster than exact; {check.action}: {check.note}")


class Report:
    """What :func:`fxapprox.approximate` planned for a model.

    Example::

        >>> approx = fxapprox.approximate(model, 0.5, example_inputs=(x,))
        >>> print(approx.report)            # plain text
        >>> approx.report.show()            # rich, in the terminal
        >>> json.dumps(approx.report.to_dict())
    """

    def __init__(self, plan: Plan, model_name: str, input_shapes: list, history=None) -> None:
        self.plan = plan
        self.model_name = model_name
        self.input_shapes = input_shapes
        #: the guard's checks (:class:`~fxapprox.guard.TrainingHistory`, shared with the module: it grows as
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

    # -- rendering --------------------------------------------------------
    def _table(self, plain: bool) -> Table:
        plan = self.plan
        total = plan.total_exact_flops or 1
        table = Table(title=f"fxapprox plan for {self.model_name} (inputs {self.input_shapes})",
                      box=box.ASCII if plain else box.SIMPLE_HEAVY, show_lines=False,
                      caption=self._caption(), caption_justify="left")
        for name, justify in (("rank", "right"), ("layer", "left"), ("op", "left"), ("out shape", "left"),
                              ("in→out", "right"), ("train FLOPs", "right"), ("share", "right"),
                              ("method", "left"), ("mode", "left"), ("keep", "right"), ("planned", "right"),
                              ("pred. error", "right"), ("speed-up", "right"), ("saved act MiB", "right"),
                              ("why", "left")):
            table.add_column(name, justify=justify, overflow="fold")
        for d in plan.layers:
            style = None if plain else ("green" if d.approximate else "dim")
            channels = f"{d.in_channels}→{d.out_channels}" if d.in_channels is not None else "-"
            table.add_row(
                str(d.rank) if d.rank is not None else "-", d.target, d.op_kind or "-",
                "x".join(map(str, d.shape)) if d.shape and all(isinstance(s, int) for s in d.shape) else "-",
                channels, _flops(d.exact_flops), f"{d.exact_flops / total:.1%}",
                d.method or "exact", d.mode or "-", f"{d.keep_ratio:.2f}" if d.approximate else "1",
                _flops(d.planned_flops), "-" if d.predicted_error is None else f"{d.predicted_error:.3f}",
                "-" if d.measured_speedup is None else f"{d.measured_speedup:.2f}x", _bytes(d.saved_bytes),
                d.reason + _input_saving(d), style=style)
        return table

    def _memory_table(self, plain: bool) -> Table | None:
        memory = self.plan.memory
        if memory is None:
            return None
        table = Table(title="saved activations (what autograd keeps for backward)",
                      box=box.ASCII if plain else box.SIMPLE_HEAVY, caption=memory.note, caption_justify="left")
        for name, justify in (("value", "left"), ("shape", "left"), ("dtype", "left"), ("saved by", "left"),
                              ("exact MiB", "right"), ("bits", "right"), ("planned MiB", "right"),
                              ("why", "left")):
            table.add_column(name, justify=justify, overflow="fold")
        for v in memory.values:
            rebuilt = v.recomputed_from is not None
            style = None if plain else ("green" if v.compressed or rebuilt else "dim")
            bits = "rebuilt" if rebuilt else f"{v.bits}{' (sign-exact)' if v.sign_exact else ''}"
            table.add_row(v.node, "x".join(map(str, v.shape)) if v.shape else "-", v.dtype, ", ".join(v.savers),
                          f"{v.exact_bytes / 2**20:.2f}", bits, f"{v.planned_bytes / 2**20:.2f}", v.reason,
                          style=style)
        table.add_row("(temporaries)", "-", "-", "batch stats, kept-column indices of sampled layers, masks",
                      f"{memory.internal_bytes / 2**20:.2f}", "-", "-", "kept (boolean ones bit-packed)",
                      style=None if plain else "dim")
        table.add_row("total", "", "", "", f"{memory.total_exact_bytes / 2**20:.2f}", "",
                      f"{memory.total_planned_bytes / 2**20:.2f}",
                      f"{memory.achieved:.3f} of exact ({'met' if memory.budget_met else 'NOT met'})")
        return table

    def _guard_table(self, plain: bool) -> Table | None:
        if not self.history:
            return None
        last = self.history[-1]
        table = Table(title=f"guard: {len(self.history)} check(s), {self.history.replans} re-plan(s); last at step "
                            f"{last.step}", box=box.ASCII if plain else box.SIMPLE_HEAVY,
                      caption=_check_summary(last), caption_justify="left")
        for name, justify in (("layer", "left"), ("method", "left"), ("mode", "left"), ("keep", "right"),
                              ("planned error (alone)", "right"), ("measured error (in the model)", "right")):
            table.add_column(name, justify=justify, overflow="fold")
        for layer in last.layers:
            table.add_row(layer.target, layer.method or "exact", layer.mode or "-", f"{layer.keep_ratio:.2f}",
                          "-" if layer.planned_error is None else f"{layer.planned_error:.3f}",
                          "-" if layer.measured_error is None else f"{layer.measured_error:.3f}")
        return table

    def _caption(self) -> str:
        plan = self.plan
        error = "" if plan.predicted_error is None else (
            f" | predicted model-gradient error {plan.predicted_error:.3f}"
            + (f" (max_grad_error {plan.config['max_grad_error']:g})" if plan.config.get("max_grad_error") else ""))
        return (f"training FLOPs (fwd+bwd) exact {_flops(plan.total_exact_flops)}, planned "
                f"{_flops(plan.total_planned_flops)} | budget asked {budget_text(plan.budget)}, achieved "
                f"{plan.achieved:.3f} ({'met' if plan.budget_met else 'NOT met'}) | "
                f"{len(plan.approximated)}/{len(plan.layers)} layers sampled ({plan.method}, "
                f"{plan.config.get('policy', 'flops')} policy){error}\n{plan.note}{_untraced_lines(plan)}"
                f"{_region_lines(plan)}")

    def __str__(self) -> str:
        buffer = io.StringIO()
        console = Console(file=buffer, width=400, color_system=None, force_terminal=False, highlight=False)
        console.print(self._table(plain=True))
        for extra in (self._memory_table(plain=True), self._guard_table(plain=True)):
            if extra is not None:
                console.print(extra)
        return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()) + "\n"

    def __repr__(self) -> str:
        memory = self.plan.memory
        saved = "" if memory is None else f", saved_activations={memory.achieved:.3f}"
        return (f"Report(model={self.model_name!r}, budget={budget_text(self.plan.budget)}, "
                f"achieved={self.plan.achieved:.3f}, sampled={len(self.plan.approximated)}/{len(self.plan.layers)}"
                f"{saved})")

    def show(self, console: Console | None = None) -> None:
        """Print the report as a rich table."""
        if console is None:
            console = Console()
            if not console.is_terminal:  # piped: do not fold the table into 80 columns
                console = Console(width=240)
        console.print(self._table(plain=False))
        for extra in (self._memory_table(plain=False), self._guard_table(plain=False)):
            if extra is not None:
                console.print(extra)

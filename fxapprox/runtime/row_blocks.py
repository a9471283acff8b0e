"""Runtime of row-sampled blocks (``fxapprox.ops.rows``): the row-sampled call given in place to a block module of
a model captured region by region (a traced model's blocks become :class:`~fxapprox.ops.rows.RowSampledBlock` s in
its training forward, ``fxapprox.passes.rewrite_rows``), and the variance checks.

Both call :func:`fxapprox.ops.rows.row_sampled_call` while the model trains with its sampler active, and run as
plain code otherwise (evaluation, ``no_grad``, ``set_approximate(False)``, the guard's exact reference pass). The
parameters a block uses go through the call (their gradients come back from it), so ``named_parameters``, the
optimizer, DDP's hooks and ``state_dict`` keys see the model as before.
"""

from __future__ import annotations

import dataclasses
import math
import time
import types
from dataclasses import dataclass

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten

from fxapprox.ops.rows import RowSampler, batch_of, row_sampled_call, sampling

__all__ = ["RowForward", "RowRuntime", "VarianceCheck", "measure_variance", "row_forward_of", "unwrap_row_block",
           "wrap_row_block"]


class RowForward:
    """The ``forward`` a block module of a region-captured model is given in place (:func:`wrap_row_block`): an
    instance attribute, which shadows its class's ``forward``, running it row-sampled while the model trains.

    An attribute rather than a subclass: a block may be a traced region (a ``GraphModule``, whose class is made per
    instance and whose copies are rebuilt from their graph), and the model wraps its blocks again whenever it finds
    them unwrapped (a copy, a pickle), so nothing depends on how a copy treats the attribute."""

    def __init__(self, module: nn.Module, name: str, sampler: RowSampler, previous=None) -> None:
        self.module, self.name, self.sampler = module, name, sampler
        #: a ``forward`` the module had as an attribute already (accelerate's hooks put one there): called instead
        #: of its class's
        self.previous = previous

    def __call__(self, *args, **kwargs):
        module = self.module
        base_forward = self.previous if self.previous is not None else type(module).forward.__get__(module)
        if not sampling(self.sampler) or not module.training:
            return base_forward(*args, **kwargs)
        batch = batch_of(list(args) + list(kwargs.values()))
        return row_sampled_call(self.name, self.sampler, base_forward, args, kwargs, list(module.parameters()), batch)


def row_forward_of(module: nn.Module) -> RowForward | None:
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, RowForward) and forward.module is module else None


def wrap_row_block(module: nn.Module, name: str, sampler: RowSampler) -> None:
    """Give ``module`` (a block of a region-captured model, named ``name``) the row-sampled call, in place."""
    current = row_forward_of(module)
    previous = current.previous if current is not None else module.__dict__.get("forward")
    module.__dict__["forward"] = RowForward(module, name, sampler, previous)


def unwrap_row_block(module: nn.Module) -> None:
    """Undo :func:`wrap_row_block`."""
    current = row_forward_of(module)
    if current is None:
        return
    if current.previous is not None:
        module.__dict__["forward"] = current.previous
    else:
        del module.__dict__["forward"]


# -- variance checks ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VarianceCheck:
    """What one variance check measured over the sampled blocks' parameters, on one batch.

    ``sgd_variance``: the variance of the minibatch's exact gradient (from ``groups`` disjoint parts of the batch:
    ``m/(m−1) Σ‖g_j − g/m‖²`` with ``g = Σ g_j``); ``row_variance`` / ``token_variance``: what sampling adds at
    ``ratio`` / ``token_ratio`` (``E‖ĝ − g‖²`` over ``draws`` sampled backward passes, the tokens' part from its
    Horvitz–Thompson formula); ``gradient_sq``: ``‖g‖²``; ``noise_scale``: ``B_noise / B`` (``V / (‖g‖² − V)``).
    """

    ratio: float
    token_ratio: float
    sgd_variance: float
    row_variance: float
    token_variance: float
    gradient_sq: float
    seconds: float
    #: one draw's relative error ‖ĝ − g‖ / ‖g‖ and cosine with g (what the guard's records hold)
    draw_error: float
    draw_cosine: float
    #: the forward and the exact backward (the group passes), and the forward and one sampled backward, in seconds
    exact_seconds: float = 0.0
    sampled_seconds: float = 0.0

    @property
    def noise_scale(self) -> float:
        signal = self.gradient_sq - self.sgd_variance
        return self.sgd_variance / signal if signal > 0 else math.inf

    @property
    def row_part(self) -> float:
        """Rows' sampling variance ÷ the SGD variance."""
        return _share(self.row_variance, self.sgd_variance)

    @property
    def token_part(self) -> float:
        """Tokens' sampling variance ÷ the SGD variance."""
        return _share(self.token_variance, self.sgd_variance)


def _share(part: float, whole: float) -> float:
    if whole > 0:
        return part / whole
    return math.inf if part > 0 else 0.0


def _grads(outputs, grad_outputs, params) -> list[torch.Tensor]:
    found = torch.autograd.grad(outputs, params, grad_outputs, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach().double() for g, p in zip(found, params)]


def _sq(tensors) -> float:
    return float(sum(t.pow(2).sum() for t in tensors))


def measure_variance(forward, backward_outputs, sampler: RowSampler, params: list, batch: int, settings: list,
                     groups: int = 4, draws: int = 1) -> list[VarianceCheck]:
    """Measure the SGD variance of one batch and the sampling variance of each of ``settings`` (``(ratios by
    block, token_ratio)`` pairs) on it (see :class:`VarianceCheck`).

    ``forward()`` runs the model's row-sampled training forward on the batch and returns its output;
    ``backward_outputs(output)`` gives ``(tensors, gradients)`` to backpropagate (the user's output gradients, or
    the planning's projection loss). One forward, ``groups`` exact passes over disjoint parts of the batch (one
    exact backward in all) and ``draws`` sampled passes per setting, all on the same graph; ``sampler`` is left as
    it was.
    """
    start = time.perf_counter()
    saved = (dict(sampler.ratios), sampler.token_ratio, sampler.given_rows, sampler.record, sampler.active,
             sampler.force)
    checks = []
    try:
        sampler.active = sampler.force = True
        output = forward()
        outputs, grad_outputs = backward_outputs(output)
        forward_seconds = time.perf_counter() - start
        groups = min(groups, batch)
        if groups < 2:
            raise ValueError(f"a variance check needs a batch of at least 2 samples (got {batch}): the minibatch's "
                             f"variance comes from disjoint parts of it")
        total, squares = None, 0.0
        sampler.token_ratio = 1.0
        for part in torch.randperm(batch).chunk(groups):
            sampler.given_rows = part.sort().values
            found = _grads(outputs, grad_outputs, params)
            squares += _sq(found)
            total = found if total is None else [t + f for t, f in zip(total, found)]
        sgd = groups / (groups - 1) * max(0.0, squares - _sq(total) / groups)
        exact_seconds = time.perf_counter() - start
        norm = math.sqrt(_sq(total))
        sampler.given_rows = None
        for ratios, token_ratio in settings:
            sampler.ratios, sampler.token_ratio = dict(ratios), token_ratio
            spread = token = error = cosine = draw_seconds = 0.0
            for draw in range(draws):
                sampler.record = {}
                began = time.perf_counter()
                found = _grads(outputs, grad_outputs, params)
                draw_seconds += (time.perf_counter() - began) / draws
                difference = _sq(f - t for f, t in zip(found, total))
                spread += difference / draws
                token += sampler.record.get("token_variance", 0.0) / draws
                if draw == 0 and norm > 0:
                    error = math.sqrt(difference) / norm
                    dot = float(sum((f * t).sum() for f, t in zip(found, total)))
                    cosine = dot / (norm * math.sqrt(max(_sq(found), 1e-300)))
            checks.append(VarianceCheck(
                ratio=min(ratios.values()) if ratios else 1.0, token_ratio=token_ratio, sgd_variance=sgd,
                row_variance=max(0.0, spread - token), token_variance=min(token, spread), gradient_sq=norm ** 2,
                seconds=0.0, draw_error=error, draw_cosine=cosine, exact_seconds=exact_seconds,
                sampled_seconds=forward_seconds + draw_seconds))
    finally:
        sampler.ratios, sampler.token_ratio, sampler.given_rows, sampler.record, sampler.active, sampler.force = saved
    seconds = time.perf_counter() - start
    return [dataclasses.replace(check, seconds=seconds) for check in checks]


# -- the model at training time -------------------------------------------------------------------------------------
class RowCheckStep:
    """One training step with a variance check: the user's forward and backward run as they are; their output
    gradients are kept, and when the backward ends ``on_done(args, kwargs, outputs, gradients)`` runs the check."""

    def __init__(self, args: tuple, kwargs: dict, on_done) -> None:
        self.args, self.kwargs, self.on_done = args, kwargs, on_done
        self.grads: dict[int, torch.Tensor] = {}
        self.handles: list = []
        self.queued = self.done = False

    def run(self, call):
        output = call()
        leaves = tree_flatten(output)[0]
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                self.handles.append(leaf.register_hook(self._hook(index)))
        return output

    def _hook(self, index: int):
        def hook(grad):
            self.grads[index] = grad.detach()
            if not self.queued:
                self.queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        return hook

    def cancel(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.done = [], True

    def _finish(self) -> None:
        if self.done:
            return
        self.cancel()
        self.on_done(self.args, self.kwargs, dict(self.grads))


class RowRuntime:
    """Mixin of :class:`~fxapprox.runtime.model.ApproxRuntime`: the row family while the model trains — the blocks
    in force with the plan's ratios at the schedule's strength, and a variance check every
    ``ApproxConfig.row_check_every`` steps, which under ``budget="auto"`` moves the ratios
    (``fxapprox.passes.policy.row_policy``) and is recorded in ``history``. The class it is mixed into provides
    ``_plain_call(args, kwargs)`` (the module's own call) and ``_record_row_check(step, check, action, note)``."""

    def _row_sampler(self) -> RowSampler:
        state = self._fxapprox_state
        if state.row_sampler is None:
            state.row_sampler = RowSampler()
        return state.row_sampler

    def _sync_rows(self) -> None:
        """The sampler's ratios: the plan's at the schedule's strength (1: the plan, 0: every row)."""
        state = self._fxapprox_state
        rows = state.plan.rows if state.plan is not None else None
        if rows is None:
            return
        sampler, strength = self._row_sampler(), state.strength
        sampler.ratios = {b.name: 1.0 - strength * (1.0 - b.ratio) for b in rows.sampled}
        sampler.token_ratio = 1.0 - strength * (1.0 - rows.token_ratio)
        sampler.active = state.enabled and not state.rows_off

    def _row_call(self, call):
        """``call()`` (the module's own call) with the row-sampled blocks in force: a traced model runs its
        row-sampled training forward (built once per graph and plan), a region-captured one has its blocks wrapped
        (again, where a copy or a pickle lost the wrapping)."""
        from fxapprox.passes.analysis.row_blocks import row_blocks_of
        from fxapprox.passes.rewrite_rows import row_sampled_forward

        state = self._fxapprox_state
        self._sync_rows()
        sampler = self._row_sampler()
        names = tuple(b.name for b in state.plan.rows.sampled)
        if not isinstance(self, torch.fx.GraphModule):
            for name in names:
                module = self.get_submodule(name)
                current = row_forward_of(module)
                if current is None or current.sampler is not sampler:
                    wrap_row_block(module, name, sampler)
            return call()
        cached = state.row_forward
        if cached is None or cached[0] is not self.code or cached[1] != names:
            blocks = [b for b in row_blocks_of(self._planning_module()) if b.name in names]
            state.row_forward = (self.code, names, row_sampled_forward(self, blocks, sampler))
        self.__dict__["forward"] = types.MethodType(state.row_forward[2], self)
        try:
            return call()
        finally:
            del self.__dict__["forward"]

    def _row_parameters(self) -> list:
        """The parameters of the sampled blocks (what the variance checks measure over)."""
        names = tuple(b.name + "." for b in self._fxapprox_state.plan.rows.sampled)
        return [p for n, p in self.named_parameters() if p.requires_grad and n.startswith(names)]

    def _row_check_due(self, step: int) -> bool:
        """The first step (its loss calibrates the ratios), then every ``rows.check_interval`` steps after the last
        check (``row_check_every``, doubled after each ``"auto"`` check that left nothing to sample); not while the
        schedule trains exactly."""
        state = self._fxapprox_state
        rows = state.plan.rows
        if state.strength <= 0 or not rows.sampled:
            return False
        if rows.checked_step is None:
            return True
        interval = rows.check_interval or state.config.row_check_every
        return bool(interval) and step >= rows.checked_step + interval

    def _rows_training_call(self, step: int, args: tuple, kwargs: dict):
        """A training step of a row plan, with a variance check when one is due; where nothing is sampled (every
        ratio 1), the model's own call."""
        call = lambda: self._plain_call(args, kwargs)  # noqa: E731
        if not self._row_check_due(step) or batch_of(tree_flatten((args, kwargs))[0]) < 2:
            # a batch of one sample has no minibatch variance to measure: the check waits for a larger batch
            if not self._fxapprox_state.plan.rows.saved_flops:
                return call()
            return self._row_call(call)
        check = RowCheckStep(args, kwargs, lambda a, k, grads: self._row_checked(step, a, k, grads))
        self._fxapprox_state.check = check
        return check.run(lambda: self._row_call(call))

    def measure_rows(self, args: tuple, kwargs: dict, backward_outputs, settings: list) -> list[VarianceCheck]:
        """:func:`measure_variance` of ``settings`` on the batch ``(args, kwargs)`` (buffers, RNG and modes left as
        they were)."""
        buffers = {name: b.detach().clone() for name, b in self.named_buffers()}
        modes = {module: module.training for module in self.modules()}
        batch = batch_of(tree_flatten((args, kwargs))[0])
        try:
            with torch.random.fork_rng(devices=[]), torch.enable_grad():
                self.train()
                return measure_variance(lambda: self._row_call(lambda: self._plain_call(args, kwargs)),
                                        backward_outputs, self._row_sampler(), self._row_parameters(), batch, settings)
        finally:
            for module, mode in modes.items():
                module.training = mode
            with torch.no_grad():
                for name, buffer in self.named_buffers():
                    buffer.copy_(buffers[name])

    def _row_checked(self, step: int, args: tuple, kwargs: dict, grads: dict) -> None:
        """A due variance check, at the end of the step's backward, on the step's batch and the gradients its loss
        gave the outputs. The first calibrates: a numeric budget takes the token ratio (of its options) of least
        variance, ``"auto"`` the ratios its bound allows; later ones move ``"auto"``'s ratios toward its bound
        (``fxapprox.passes.policy.row_policy``) and leave a numeric budget's FLOPs as they are."""
        from fxapprox.passes.policy.row_policy import choose_for_budget, next_ratios, probe_setting, with_ratios
        from fxapprox.pipeline.row_planning import row_note

        state = self._fxapprox_state
        state.check = None
        plan = state.plan
        rows = plan.rows
        first = rows.checked_step is None

        def backward_outputs(output):
            leaves = tree_flatten(output)[0]
            pairs = [(leaves[i], g) for i, g in grads.items()
                     if i < len(leaves) and isinstance(leaves[i], torch.Tensor) and leaves[i].requires_grad]
            return [p[0] for p in pairs], [p[1] for p in pairs]

        ratio, token_ratio = min((b.ratio for b in rows.sampled), default=1.0), rows.token_ratio
        device = next(iter(self.parameters())).device
        if first and rows.tau is None and len(rows.options) > 1:
            settings = [({b.name: r for b in rows.sampled}, t) for t, r in rows.options]
            checks = [mean_check_over_ranks(c, device)
                      for c in self.measure_rows(args, kwargs, backward_outputs, settings)]
            measured = {t: (r, c.row_variance + c.token_variance) for (t, r), c in zip(rows.options, checks)}
            token_ratio = choose_for_budget(measured)
            ratio = measured[token_ratio][0]
            check = checks[[t for t, _ in rows.options].index(token_ratio)]
            action, note = "replanned", "first check: " + ", ".join(
                f"tokens {t:.2f} with rows {r:.2f}: variance {v / c.sgd_variance:.3g} × SGD's"
                for (t, (r, v)), c in zip(measured.items(), checks)) + f"; took tokens {token_ratio:.2f}"
        else:
            check = mean_check_over_ranks(
                self.measure_rows(args, kwargs, backward_outputs, [probe_setting(rows, ratio, token_ratio)])[0],
                device)
            action = "kept"
            note = f"numeric budget: its FLOPs kept (variance {check.row_part + check.token_part:.3g} × SGD's)"
            if rows.tau is not None:
                breakeven = rows.row_breakeven or 1.0
                new_ratio, new_token = next_ratios(ratio, token_ratio, check, rows.tau, state.config,
                                                   calibrating=first, breakeven=breakeven,
                                                   token_breakeven=rows.token_breakeven or 1.0)
                action = "replanned" if (new_ratio, new_token) != (ratio, token_ratio) else "kept"
                note = (f"sampling variance rows {check.row_part:.3g} / tokens {check.token_part:.3g} × SGD's at "
                        f"{check.ratio:.2f} / {check.token_ratio:.2f} (tau {rows.tau:g} each): rows {ratio:.2f} → "
                        f"{new_ratio:.2f}, tokens {token_ratio:.2f} → {new_token:.2f}")
                ratio, token_ratio = new_ratio, new_token
        new = with_ratios(plan, self._planning_module(), ratio, token_ratio, check, step)
        interval = state.config.row_check_every
        if rows.tau is not None and not new.rows.saved_flops and interval:
            # nothing left to sample within the bound: look again later, less often (the noise grows in training)
            interval = 2 * (rows.check_interval or interval) if not first else interval
        new = dataclasses.replace(new, rows=dataclasses.replace(new.rows, check_interval=interval))
        self._apply_plan(dataclasses.replace(new, note=row_note(new)))
        self._record_row_check(step, check, action, note)


def mean_check_over_ranks(check: VarianceCheck, device) -> VarianceCheck:
    """Under DDP, every rank's check averaged (each measured its own shard): every rank then decides alike."""
    from fxapprox.pipeline.ranks import mean_over_ranks

    fields = ("sgd_variance", "row_variance", "token_variance", "gradient_sq", "draw_error", "draw_cosine")
    values = mean_over_ranks([getattr(check, f) for f in fields], device)
    return dataclasses.replace(check, **dict(zip(fields, values)))

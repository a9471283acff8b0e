"""Sampled-gradient AllReduce: two gloo processes on 127.0.0.1, different data per rank."""

from __future__ import annotations

import copy
import dataclasses
import json
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fxapprox
from fxapprox.distributed import plan_fingerprint, register_sampled_allreduce

#: the FLOP-ranked policy: these tests are about the rewrite, not about which layers the measured policy picks
FLOPS = fxapprox.ApproxConfig(policy="flops")

WORLD = 2
STEPS = 12


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def _batches(rank: int, shape: tuple, teacher: nn.Module, count: int = 3):
    generator = torch.Generator().manual_seed(100 + rank)   # different data on every rank
    batches = []
    for _ in range(count):
        x = torch.randn(*shape, generator=generator)
        with torch.no_grad():
            y = teacher(x).argmax(1)
        batches.append((x, y))
    return batches


def _flat_grads(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()])


def _train(rank: int, model: nn.Module, shape: tuple, dtype: torch.dtype | None = None) -> dict:
    torch.manual_seed(0)
    teacher = copy.deepcopy(model)
    example = torch.randn(*shape)
    approx = fxapprox.approximate(model, budget=0.5, example_inputs=(example,), config=FLOPS)
    ddp = DistributedDataParallel(approx)
    state = register_sampled_allreduce(ddp, dtype=dtype)
    batches = _batches(rank, shape, teacher)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    losses, grad_error = [], None
    for step in range(STEPS):
        x, y = batches[step % len(batches)]
        if step == 0:   # the hook's result must be the average of the local (sparse) gradients
            local = copy.deepcopy(approx)
            nn.functional.cross_entropy(local(x), y).backward()
            local_grads = _flat_grads(local)
            dist.all_reduce(local_grads)
            expected = local_grads / WORLD
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        if step == 0:
            grad_error = float(((_flat_grads(approx) - expected).abs() / (expected.abs().max() + 1e-12)).max())
        optimizer.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().reshape(-1) for p in approx.parameters()])
    gathered = [torch.empty_like(params) for _ in range(WORLD)]
    dist.all_gather(gathered, params)
    sampled_layers = len(state.sampled)
    return {"losses": losses, "bytes_sent": state.bytes_sent, "bytes_dense": state.bytes_dense,
            "identical": all(torch.equal(gathered[0], g) for g in gathered[1:]), "grad_error": grad_error,
            "sampled_layers": sampled_layers}


def _errors(rank: int) -> dict:
    outcome = {}
    plain = DistributedDataParallel(_mlp())
    try:
        register_sampled_allreduce(plain)
    except TypeError as error:
        outcome["not_approximated"] = str(error)
    try:
        register_sampled_allreduce(_mlp())
    except TypeError as error:
        outcome["not_ddp"] = str(error)
    try:
        register_sampled_allreduce(DistributedDataParallel(
            fxapprox.approximate(_mlp(), budget=0.5, example_inputs=(torch.randn(16, 64),), config=FLOPS)),
            dtype=torch.int8)
    except TypeError as error:
        outcome["bad_dtype"] = str(error)
    torch.manual_seed(0)
    example = torch.randn(16, 64)
    budget = 0.5 if rank == 0 else 0.25   # rank-dependent plans: refused on every rank
    ddp = DistributedDataParallel(fxapprox.approximate(_mlp(), budget=budget, example_inputs=(example,), config=FLOPS))
    try:
        register_sampled_allreduce(ddp)
    except ValueError as error:
        outcome["plans_differ"] = str(error)
    unused = DistributedDataParallel(fxapprox.approximate(_mlp(), budget=0.5, example_inputs=(example,), config=FLOPS),
                                     find_unused_parameters=True)
    try:
        register_sampled_allreduce(unused)
    except ValueError as error:
        outcome["find_unused"] = str(error)
    return outcome


def _fsdp(rank: int) -> dict:
    """An approximated model trains under FSDP2 (``fully_shard``) on CPU: the plan is kept, eval is exact, and
    the sampled AllReduce refuses it with a message that says why."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _mlp()
    teacher = copy.deepcopy(model)
    approx = fxapprox.approximate(copy.deepcopy(model), budget=0.5, example_inputs=(torch.randn(32, 64),),
                                  config=FLOPS)
    plan = approx.plan.to_dict()
    fully_shard(approx, mesh=init_device_mesh("cpu", (WORLD,)))
    outcome = {"plan_kept": approx.plan.to_dict() == plan,
               "approximating": sum(m.approximating for m in approx.modules()
                                    if isinstance(m, fxapprox.runtime.modules.APPROX_MODULE_TYPES))}
    optimizer = torch.optim.SGD(approx.parameters(), lr=0.1, momentum=0.9)
    batches = _batches(rank, (32, 64), teacher)
    losses = []
    for step in range(STEPS):
        x, y = batches[step % len(batches)]
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(approx(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    outcome["losses"] = losses
    full = {name: tensor.full_tensor() for name, tensor in approx.state_dict().items()}
    model.load_state_dict(full)
    x = torch.randn(16, 64)
    approx.eval()
    model.eval()
    with torch.no_grad():
        outcome["eval_exact"] = float((approx(x) - model(x)).abs().max())
    try:
        register_sampled_allreduce(approx)
    except TypeError as error:
        outcome["refused"] = str(error)
    return outcome


def _guarded(rank: int) -> dict:
    """The guard under DDP: each rank checks its own batch; a re-plan must come out the same on every rank."""
    torch.manual_seed(0)
    model = _mlp()
    teacher = copy.deepcopy(model)
    example = torch.randn(32, 64)
    config = fxapprox.ApproxConfig(min_speedup=None, min_gain=None, max_grad_error=0.5, mode="backward",
                                   min_channels=8, check_every=2, check_verbose=False)
    approx = fxapprox.approximate(model, 0.5, example_inputs=(example,), config=config)
    approx._fxapprox_state.config = dataclasses.replace(config, divergence_error=0.05)   # force a re-plan
    ddp = DistributedDataParallel(approx)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches(rank, (32, 64), teacher, count=4):
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    return {"plan": approx.plan.to_dict(), "history": approx.history.to_dict()}


def _default_plans(rank: int) -> dict:
    """Default (measured) configs under DDP, each rank planning on its own batch and timing its own candidates:
    the ranks train with one plan (rank 0's), so the sampled AllReduce can be registered."""
    outcome = {}
    for name, config in (("default", fxapprox.ApproxConfig()), ("spent", fxapprox.ApproxConfig(min_gain=None))):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        torch.manual_seed(100 + rank)
        approx = fxapprox.approximate(model, 0.5, example_inputs=(torch.randn(64, 256),), config=config)
        ddp = DistributedDataParallel(approx)
        register_sampled_allreduce(ddp)   # raises "the ranks' plans differ" where they do
        nn.functional.cross_entropy(ddp(torch.randn(64, 256)), torch.randint(0, 10, (64,))).backward()
        outcome[name] = {"fingerprint": plan_fingerprint(approx), "sampled": len(approx.plan.approximated)}
    return outcome


def _rows(rank: int) -> dict:
    """A row plan under DDP: each rank samples its own rows; the variance checks average over the ranks, so the
    ratios move alike, and the sampled AllReduce (nothing forward-sampled here) sends the gradients whole."""
    from tests.test_rows import LM, VOCAB

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, VOCAB, (8, 17), generator=generator) for _ in range(4)]
    config = fxapprox.ApproxConfig(max_forward_kl=None, row_check_every=2, check_every=None, check_verbose=False,
                                   min_speedup=None)
    approx = fxapprox.approximate(LM(), 0.5, example_inputs=(batches[0][:, :-1],), config=config)
    ddp = DistributedDataParallel(approx)
    register_sampled_allreduce(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for ids in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
        optimizer.step()
    keys = ("step", "row_ratio", "token_ratio", "sgd_variance", "action")
    return {"rows": approx.plan.rows.to_dict(), "history": [{k: r.to_dict()[k] for k in keys} for r in approx.history],
            "parameters": float(sum(p.double().sum() for p in approx.parameters()))}


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        results = {"mlp": _train(rank, _mlp(), (32, 64))}
        torch.manual_seed(0)
        results["cnn"] = _train(rank, SmallCNN(), (8, 3, 16, 16))
        torch.manual_seed(0)
        results["mlp bf16"] = _train(rank, _mlp(), (32, 64), dtype=torch.bfloat16)
        results["errors"] = _errors(rank)
        results["fsdp"] = _fsdp(rank)
        results["guard"] = _guarded(rank)
        results["default plans"] = _default_plans(rank)
        results["rows"] = _rows(rank)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD, join=True)
    return [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize("model", ["mlp", "cnn", "mlp bf16"])
def test_replicas_stay_identical_and_learn(results, model):
    for rank_result in results:
        run = rank_result[model]
        assert run["sampled_layers"] >= 2
        assert run["identical"], "parameters differ between ranks"
        first, last = sum(run["losses"][:3]) / 3, sum(run["losses"][-3:]) / 3
        assert last < 0.85 * first, run["losses"]


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_sends_at_most_60_percent_at_budget_half(results, model):
    for rank_result in results:
        run = rank_result[model]
        assert run["bytes_dense"] > 0
        assert run["bytes_sent"] <= 0.6 * run["bytes_dense"], run


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_hook_result_is_the_average_of_local_gradients(results, model):
    for rank_result in results:
        assert rank_result[model]["grad_error"] < 1e-5


def test_bf16_transport_halves_the_bytes_again_and_stays_close_to_the_average(results):
    for rank_result in results:
        full, bf16 = rank_result["mlp"], rank_result["mlp bf16"]
        assert bf16["bytes_sent"] * 2 == full["bytes_sent"]          # the same elements, half the width each
        assert 1e-5 < bf16["grad_error"] < 2 ** -7   # bf16's rounding: visible, within its 8-bit mantissa


def test_an_approximated_model_trains_under_fsdp(results):
    for rank_result in results:
        fsdp = rank_result["fsdp"]
        assert fsdp["plan_kept"] and fsdp["approximating"] >= 2
        assert sum(fsdp["losses"][-3:]) < 0.85 * sum(fsdp["losses"][:3]), fsdp["losses"]
        assert fsdp["eval_exact"] < 1e-5
        assert "DistributedDataParallel" in fsdp["refused"] and "FSDP" in fsdp["refused"]


def test_guard_replans_the_same_on_every_rank(results):
    keys = ("step", "model_error", "calibrated_error", "action", "note", "planned_flops")
    histories = [[{k: record[k] for k in keys} for record in r["guard"]["history"]["records"]] for r in results]
    assert histories[0] and histories[0][0]["action"] == "replanned"
    assert all(h == histories[0] for h in histories[1:])   # the ranks' mean errors, the same decisions
    assert all(r["guard"]["plan"] == results[0]["guard"]["plan"] for r in results[1:])


def test_default_measured_plans_agree_across_ranks(results):
    for name in ("default", "spent"):
        plans = [r["default plans"][name] for r in results]
        assert all(p == plans[0] for p in plans[1:]), name
    assert results[0]["default plans"]["spent"]["sampled"] > 0


def test_a_row_plan_trains_under_ddp_with_the_ranks_in_agreement(results):
    first = results[0]["rows"]
    assert [r["step"] for r in first["history"]] == [1, 3] and first["rows"]["blocks"]
    for other in results[1:]:
        assert other["rows"]["history"] == first["history"]   # the ranks' mean variances, the same ratios
        assert other["rows"]["rows"]["token_ratio"] == first["rows"]["token_ratio"]
        assert other["rows"]["parameters"] == first["parameters"]


def test_clear_errors(results):
    for rank_result in results:
        errors = rank_result["errors"]
        assert "fxapprox.approximate" in errors["not_approximated"]
        assert "DistributedDataParallel" in errors["not_ddp"]
        assert "plans differ" in errors["plans_differ"] and "[0]" in errors["plans_differ"]
        assert "find_unused_parameters" in errors["find_unused"]
        assert "dtype" in errors["bad_dtype"] and "floating-point" in errors["bad_dtype"]


class _BranchingRoot(torch.nn.Module):
    """Data-dependent control flow in the root's own code: captured region by region."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        x = self.fc1(x)
        if x.sum() > 0:
            x = x * 2
        return self.fc2(x)


def test_sampled_allreduce_refuses_a_region_captured_model_and_says_why(tmp_path):
    approx = fxapprox.approximate(_BranchingRoot(), 0.5, example_inputs=(torch.randn(8, 32),),
                                  config=fxapprox.ApproxConfig(policy="flops", min_channels=4))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(approx)
        with pytest.raises(TypeError, match="captured region by region"):
            register_sampled_allreduce(ddp)
    finally:
        dist.destroy_process_group()

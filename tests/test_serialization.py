"""torch.save / torch.load, pickle and copy.deepcopy of approximated modules: every plan kind survives (the
class, the plan, the memory plan's markers) and the copy trains identically."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxapprox
from fxapprox.api import ApproxGraphModule


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 32, 3, padding=1)
        self.lstm = nn.LSTM(32, 64)
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 10)

    def forward(self, x):
        features = F.relu(self.conv(x)).mean((2, 3))
        hidden = self.lstm(features.unsqueeze(0).expand(3, -1, -1))[0][-1]
        return self.fc2(F.gelu(self.fc1(hidden)))


def _torch_save_load(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"torch.save": _torch_save_load, "pickle": lambda m: pickle.loads(pickle.dumps(m)), "deepcopy": copy.deepcopy}
PLANS = {"compute": dict(budget=0.5), "memory": dict(budget=1.0, memory_budget=0.125),
         "compute+memory": dict(budget=0.5, memory_budget=0.25)}


def _step(module, x, seed=3):
    module.train()
    torch.manual_seed(seed)
    loss = module(x).logsumexp(1).mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    module.zero_grad()
    return loss.detach(), grads


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("how", sorted(COPIES))
def test_copies_keep_the_plan_and_train_identically(how, plan):
    model = _Net()
    x = torch.randn(64, 8, 8, 8)
    approx = fxapprox.approximate(model, example_inputs=(x,), config=fxapprox.ApproxConfig(policy="flops"),
                                  **PLANS[plan])
    approx_modules = fxapprox.runtime.modules.APPROX_MODULE_TYPES
    assert any(isinstance(m, approx_modules) for m in approx.modules()) or plan == "memory"
    loss, grads = _step(approx, x)
    stats = approx.saved_activation_stats
    if "memory" in plan:
        assert stats.packed_tensors > 0   # the plan does compress, so the markers must survive the copy
    loaded = COPIES[how](approx)
    assert isinstance(loaded, ApproxGraphModule)
    assert loaded.plan.to_dict() == approx.plan.to_dict()
    assert loaded.code == approx.code
    loaded_loss, loaded_grads = _step(loaded, x)
    torch.testing.assert_close(loaded_loss, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(loaded_grads[name], grad, msg=name)
    assert loaded.saved_activation_stats == stats
    loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model.eval()(x))
    model.train()
    # the copy owns its parameters: training it leaves the original alone
    with torch.no_grad():
        next(loaded.parameters()).add_(1.0)
    assert not torch.equal(next(loaded.parameters()), next(approx.parameters()))


def test_an_unplanned_module_pickles_and_plans_on_its_first_batch():
    approx = fxapprox.approximate(_Net(), budget=0.5)
    loaded = _torch_save_load(approx)
    x = torch.randn(16, 8, 8, 8)
    loaded.train()(x).sum().backward()
    assert loaded.plan is not None


def test_a_model_saved_before_the_typed_state_is_refused_with_what_to_do():
    approx = fxapprox.approximate(_Net(), 0.5, example_inputs=(torch.randn(4, 8, 6, 6),),
                                  config=fxapprox.ApproxConfig(min_speedup=None, check_every=None))
    rebuild, args = approx.__reduce__()
    body = dict(args[1])
    body["_fxapprox_state"] = vars(body["_fxapprox_state"]).copy()   # the dict earlier versions pickled
    with pytest.raises(ValueError, match="load its state_dict"):
        rebuild(args[0], body, *args[2:])


def test_a_copy_and_its_original_keep_their_own_records():
    from fxapprox.pipeline.records import decision_of, norms_of, write_norms

    approx = fxapprox.approximate(_Net(), 0.5, example_inputs=(torch.randn(4, 8, 6, 6),),
                                  config=fxapprox.ApproxConfig(min_speedup=None, check_every=None))
    clone = copy.deepcopy(approx)
    node = next(n for n in approx.graph.nodes if n.name == "fc1")
    copied = next(n for n in clone.graph.nodes if n.name == "fc1")
    before = norms_of(node)
    write_norms(copied, input_grad=123.0)
    assert norms_of(node) == before and norms_of(copied).input_grad == 123.0
    assert decision_of(node) == decision_of(copied)

"""Hugging Face models on transformers 5, as users have them: hierarchical capture (``fxapprox.pipeline.eager``).

transformers 5 models do not trace whole (``**kwargs`` signatures, masks built with ``vmap``); they run their own
code eagerly with their traceable children as regions and their projections swapped in place. Tiny configs,
random weights.
"""

from __future__ import annotations

import copy
import io
import json
import math

import pytest
import torch

import fxapprox
from fxapprox.pipeline._projection import projection_loss
from fxapprox.plan import Plan

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("hierarchical capture of HF models is tested on transformers 5", allow_module_level=True)

FLOPS = fxapprox.ApproxConfig(policy="flops", check_every=None)
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def build(name: str):
    """``(model, keyword inputs)`` of a tiny random ``name`` model in training mode."""
    hf = transformers
    torch.manual_seed(0)
    ids = torch.randint(2, 100, (2, 16))
    if name == "gpt2":
        model = hf.GPT2LMHeadModel(hf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                                 bos_token_id=1, eos_token_id=1))
    elif name == "llama":
        model = hf.LlamaForCausalLM(hf.LlamaConfig(**SMALL, num_key_value_heads=2, vocab_size=128,
                                                   max_position_embeddings=64, bos_token_id=1, eos_token_id=1))
    elif name == "qwen2":
        model = hf.Qwen2ForCausalLM(hf.Qwen2Config(**SMALL, num_key_value_heads=2, vocab_size=128,
                                                   max_position_embeddings=64, bos_token_id=1, eos_token_id=1))
    elif name == "bert":
        model = hf.BertForSequenceClassification(hf.BertConfig(**SMALL, vocab_size=128, num_labels=3))
        return model.train(), {"input_ids": ids, "labels": torch.tensor([0, 2])}
    elif name == "vit":
        model = hf.ViTForImageClassification(hf.ViTConfig(**SMALL, image_size=32, patch_size=8, num_labels=3))
        return model.train(), {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([0, 2])}
    else:
        raise ValueError(name)
    return model.train(), {"input_ids": ids, "labels": ids}


def counted_step_flops(model, inputs) -> int:
    """FLOPs of one exact training step of ``model`` (forward + backward of the projection loss), counted."""
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        loss = projection_loss(model(**inputs))
        torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    return int(counter.get_total_flops())


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "bert", "vit"])
def test_hf_models_approximate_as_their_own_class(name):
    model, inputs = build(name)
    approx = fxapprox.approximate(model, 0.5, example_inputs=inputs, config=FLOPS)
    assert type(approx).__name__ == type(model).__name__ and isinstance(approx, type(model))
    plan = approx.plan
    kinds = {r["kind"] for r in plan.regions}
    assert {"traced", "leaf", "eager"} <= kinds, kinds
    assert plan.approximated and plan.achieved <= 0.5 + 1e-6
    assert plan.total_exact_flops == counted_step_flops(model, inputs)
    assert set(approx.state_dict()) == set(model.state_dict())
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).regions == plan.regions
    assert "eager" in str(approx.report)

    model.eval(), approx.eval()
    with torch.no_grad():
        torch.testing.assert_close(approx(**inputs).logits, model(**inputs).logits, atol=1e-4, rtol=0)
    approx.train()
    approx(**inputs).loss.backward()
    grads = [p.grad for p in approx.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_gpt2_conv1d_projections_are_sampled_and_the_tied_head_stays_tied():
    model, inputs = build("gpt2")
    config = fxapprox.ApproxConfig(policy="uniform", keep_ratio=0.5, mode="backward", check_every=None)
    approx = fxapprox.approximate(model, 0.5, example_inputs=inputs, config=config)
    kinds = {d.op_kind for d in approx.plan.approximated}
    assert "conv1d_hf" in kinds
    assert type(approx.transformer.h[0].attn.c_attn).__name__ == "ApproxConv1D"
    assert approx.lm_head.weight is approx.transformer.wte.weight
    approx(**inputs).loss.backward()
    assert torch.isfinite(approx.transformer.wte.weight.grad).all()


@pytest.mark.parametrize("mode", ["forward", "backward", "weight_grad"])
@pytest.mark.parametrize("method", ["topk", "crs", "wta_crs"])
def test_sampled_conv1d_equals_conv1d_at_keep_ratio_one(mode, method):
    from transformers.pytorch_utils import Conv1D

    from fxapprox.runtime.modules import ApproxConv1D, SamplingSpec, _linear

    torch.manual_seed(0)
    layer = Conv1D(24, 16)
    x = torch.randn(3, 5, 16, requires_grad=True)
    spec = SamplingSpec(method=method, k=16, n=16, mode=mode)
    approx = ApproxConv1D.from_conv1d(copy.deepcopy(layer), spec)
    x2 = x.detach().clone().requires_grad_(True)
    expected = layer(x)
    got = _linear(spec, x2, approx.weight.t(), approx.bias)   # the sampled path itself, at k = n
    torch.testing.assert_close(got, expected)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(x2.grad, x.grad)
    torch.testing.assert_close(approx.weight.grad, layer.weight.grad)
    torch.testing.assert_close(approx.bias.grad, layer.bias.grad)


def test_save_pretrained_round_trip_and_generate(tmp_path):
    model, inputs = build("llama")
    approx = fxapprox.approximate(model, 0.5, example_inputs=inputs, config=FLOPS)
    optimizer = torch.optim.SGD(approx.parameters(), lr=0.1)
    approx(**inputs).loss.backward()
    optimizer.step()
    approx.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    assert type(reloaded) is type(model)
    approx.eval(), reloaded.eval()
    prompt = inputs["input_ids"][:, :4]
    with torch.no_grad():
        torch.testing.assert_close(approx(input_ids=prompt).logits, reloaded(input_ids=prompt).logits)
    generated = approx.generate(prompt, max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(generated, reloaded.generate(prompt, max_new_tokens=4, do_sample=False))
    # the original class loads the approximated model's weights directly too
    fresh = type(model)(model.config)
    fresh.load_state_dict(approx.state_dict())


def test_default_plan_guard_copy_and_pickle_of_an_eager_model():
    model, inputs = build("llama")
    approx = fxapprox.approximate(model, 0.5, config=fxapprox.ApproxConfig(check_every=2, check_verbose=False,
                                                                            min_gain=None, min_speedup=None))
    optimizer = torch.optim.SGD(approx.parameters(), lr=0.05)
    for _ in range(4):   # planned lazily on the first batch; the guard checks steps 2 and 4
        optimizer.zero_grad()
        approx(**inputs).loss.backward()
        optimizer.step()
    assert approx.plan.approximated and len(approx.history) == 2
    assert all(record.model_error >= 0 for record in approx.history)
    approx.eval()
    with torch.no_grad():
        expected = approx(**inputs).logits
        buffer = io.BytesIO()
        torch.save(approx, buffer)
        buffer.seek(0)
        for clone in (copy.deepcopy(approx), torch.load(buffer, weights_only=False)):
            assert type(clone) is type(approx) and clone.plan.to_dict() == approx.plan.to_dict()
            torch.testing.assert_close(clone(**inputs).logits, expected)
    approx.train().set_approximate(False)
    approx(**inputs).loss.backward()


def test_peft_lora_frozen_base_layers_sampled_adapters_exact(tmp_path):
    peft = pytest.importorskip("peft")
    model, inputs = build("llama")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"],
                                                      lora_dropout=0.0, task_type="CAUSAL_LM"))
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    approx = fxapprox.approximate(lora, 0.5, example_inputs=inputs, config=FLOPS)
    assert type(approx).__name__ == type(lora).__name__ and approx.plan.approximated
    assert {n for n, p in approx.named_parameters() if p.requires_grad} == trainable
    decisions = {d.target: d for d in approx.plan.layers}
    base = "base_model.model.model.layers.0.self_attn.q_proj.base_layer"
    assert decisions[base].approximate and decisions[base].mode != "weight_grad"
    assert not any(d.approximate for t, d in decisions.items() if ".lora_" in t)
    regions = {r["path"]: r for r in approx.plan.regions}
    assert regions["base_model.model.model.layers.0.self_attn.q_proj.lora_A"]["reason"].startswith("PEFT adapter")
    # frozen layers: no weight-gradient FLOPs in the plan, and none computed
    assert approx.plan.total_exact_flops == counted_step_flops(lora, inputs)
    approx(**inputs).loss.backward()
    for name, parameter in approx.named_parameters():
        if name in trainable:
            assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
        else:
            assert parameter.grad is None, name
    approx.save_pretrained(tmp_path)   # the adapter alone, under PEFT's keys
    fresh, _ = build("llama")
    reloaded = peft.PeftModel.from_pretrained(fresh, tmp_path)
    adapters = {n: p for n, p in approx.state_dict().items() if "lora_" in n}
    assert adapters and all(torch.equal(reloaded.state_dict()[n], p) for n, p in adapters.items())


def test_hf_gradient_checkpointing_keeps_working():
    model, inputs = build("llama")
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    config = fxapprox.ApproxConfig(policy="uniform", keep_ratio=0.5, mode="forward", check_every=None)
    approx = fxapprox.approximate(model, 0.5, example_inputs=inputs, config=config)
    assert approx.plan.approximated
    torch.manual_seed(1)
    approx(**inputs).loss.backward()
    grads = {n: p.grad.clone() for n, p in approx.named_parameters()}
    # the recomputed forward draws what the first one drew (checkpoint restores the RNG): the same gradients
    # as the same draws without checkpointing
    approx.zero_grad()
    getattr(approx, "activation_checkpointing_disable", approx.gradient_checkpointing_disable)()
    torch.manual_seed(1)
    approx(**inputs).loss.backward()
    for name, parameter in approx.named_parameters():
        torch.testing.assert_close(parameter.grad, grads[name], msg=name)


def test_transformers_trainer_trains_an_approximated_model(tmp_path):
    pytest.importorskip("accelerate")
    model, inputs = build("llama")
    # the FLOP policy: a plan that does not depend on timings (and that the guard measures, not re-plans)
    approx = fxapprox.approximate(model, 0.5, config=fxapprox.ApproxConfig(policy="flops", check_every=2,
                                                                            check_verbose=False))
    ids = torch.randint(2, 100, (8, 16))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                                          report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
                                          learning_rate=1e-3)
    trainer = transformers.Trainer(model=approx, args=args, train_dataset=dataset)
    output = trainer.train()
    assert math.isfinite(output.training_loss)
    assert approx.planned and approx.plan.approximated and len(approx.history) == 2


def test_peft_lora_under_the_default_config_spends_the_budget():
    peft = pytest.importorskip("peft")
    model, inputs = build("llama")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"],
                                                      lora_dropout=0.0, task_type="CAUSAL_LM"))
    approx = fxapprox.approximate(lora, 0.5, example_inputs=inputs,
                                  config=fxapprox.ApproxConfig(check_every=None, check_verbose=False))
    # the planning graph holds no trainable weight (the adapters run in eager code): the plan is not checked
    assert approx.plan.approximated and approx.plan.check is None and approx.plan.budget_met
    approx(**inputs).loss.backward()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_llama_decoder_layers_are_row_sampled(lora):
    """The row family on a Hugging Face Llama: its decoder layers are the blocks (captured region by region), the
    backward on the kept samples, the forward and evaluation exact; under PEFT LoRA the frozen base layers get no
    weight gradient and the rows are still sampled."""
    model, _ = build("llama")
    ids = torch.randint(2, 100, (8, 16), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids}
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"],
                                                           lora_dropout=0.0, task_type="CAUSAL_LM"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    config = fxapprox.ApproxConfig(max_forward_kl=None, check_every=None, row_check_every=2, check_verbose=False,
                                   min_speedup=None)
    approx = fxapprox.approximate(model, 0.8 if lora else 0.5, example_inputs=inputs, config=config)
    rows = approx.plan.rows
    assert rows is not None and len(rows.sampled) == 2, approx.plan.note
    assert all(b.name.endswith(("layers.0", "layers.1")) for b in rows.sampled)
    assert approx.plan.budget_met, approx.plan.note
    for _ in range(3):
        approx.zero_grad(set_to_none=True)
        approx(**inputs).loss.backward()
    assert [r.step for r in approx.history] == [1, 3] and all(r.sgd_variance > 0 for r in approx.history)
    for name, parameter in approx.named_parameters():
        assert (parameter.grad is not None) == (name in trainable), name
        assert parameter.grad is None or torch.isfinite(parameter.grad).all(), name
    approx.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(approx(**inputs).logits, model(**inputs).logits)

"""Every Hugging Face transformers family from its auto mapping, approximated at budget 0.5 (hierarchical capture).

Walks ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` of the installed transformers (every causal-LM model type) and a few
encoder / vision / seq2seq families (bert, roberta, deberta-v2, vit, swin, clip, t5). Each family is built on CPU
from a tiny config (``AutoConfig.for_model(model_type, **SMALL)``, generic extra keys shrunk where the config has
them, the few per-family exceptions in :data:`SPECIAL`), with random weights, in ``train()`` mode; then::

    approx = fxapprox.approximate(model, 0.5, example_inputs=kwargs, config=ApproxConfig(policy="flops"))

and checks (a) ``eval()`` outputs equal the original's (logits or first tensor, atol 1e-4); (b) one training step
of ``approx`` gives finite gradients; (c) the plan's exact FLOPs equal those ``FlopCounterMode`` counts over a real
exact step of the original under the root module's key (forward + ``autograd.grad`` of ``projection_loss``, or
``.backward()`` where ``autograd.grad`` fails under the counter; within 1%); (d) some layer is sampled. A family
whose config cannot be made tiny, whose model cannot be built on CPU, or whose *original* model fails on the
standard inputs is skipped with a one-line reason (not a failure of fxapprox).

Usage: python benchmarks/zoo_coverage_hf.py [--families llama,gpt2] [--json PATH] [--write]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import BENCHMARKS_MD, machine_line, markdown_table  # noqa: E402
from tests.zoo_checks import budget_reached  # noqa: E402

import fxapprox  # noqa: E402
from fxapprox.pipeline._projection import projection_loss  # noqa: E402

BUDGET = 0.5
BATCH, SEQ = 2, 16
ATOL = 1e-4
FLOPS_TOLERANCE = 0.01
MEMORY_BUDGET = 0.5
#: saved bytes: the plan's against a real step's (bit-packed boolean temporaries round differently)
BYTES_TOLERANCE = 0.01
#: a built model above this many parameters means its config could not be made tiny
MAX_PARAMS = 20_000_000

#: applied to every family's config
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=128, max_position_embeddings=64, head_dim=16)
#: applied where the family's default config has the key (MoE, MLA, linear attention, SSM, enc-dec sizes ...)
EXTRA = dict(
    # token ids inside the tiny vocabulary (inputs use ids in [2, 100))
    pad_token_id=0, bos_token_id=1, eos_token_id=1, decoder_start_token_id=0, sep_token_id=1, cls_token_id=1,
    # mixture of experts
    moe_intermediate_size=32, shared_expert_intermediate_size=32, shared_intermediate_size=32,
    moe_shared_expert_intermediate_size=32, expert_ffn_hidden_size=32, dense_intermediate_size=128,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    num_experts_per_token=2, moe_topk=2, n_group=1, topk_group=1, first_k_dense_replace=1,
    # multi-head latent attention / sparse index attention
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, qk_head_dim=32, v_head_dim=16,
    index_head_dim=16, index_n_heads=2, index_topk=8,
    # linear attention / state-space layers
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_head_dim=16, linear_num_heads=4,
    # encoder-decoder and other spellings of the sizes
    d_model=64, d_ff=128, d_kv=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, ffn_dim=128, embedding_size=64,
    pooler_hidden_size=64, word_embed_proj_dim=64, max_source_positions=64, max_target_positions=64,
    d_head=16, d_inner=128, num_codebooks=1, rotary_dim=8, n_shared_experts=1, index_num_heads=2,
    encoder_hash_byte_group_vocab=128, adapter_in_dim=64, num_encoder_attention_heads=4,
    num_decoder_attention_heads=4,
    # hybrids with a layer period (an attention / expert layer among the 2)
    attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
    # per-layer inputs and shared KV caches (gemma3n)
    vocab_size_per_layer_input=128, hidden_size_per_layer_input=16, num_kv_shared_layers=0,
)
#: per-layer type lists, cut to the tiny depth keeping every kind of layer (see ``_layer_pattern``)
LAYER_LISTS = ("layer_types", "layers_block_type", "mlp_layer_types")
#: the few families that need more than SMALL + EXTRA: config kwargs (``None``: leave SMALL's key out; a dict:
#: kwargs of that sub-config)
SPECIAL = {
    "vit": dict(image_size=32, patch_size=8),
    "swin": dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
                 hidden_size=None, num_hidden_layers=None, num_attention_heads=None, head_dim=None),
    "clip": dict(vision_config=dict(image_size=32, patch_size=8)),
    "reformer": dict(is_decoder=True, axial_pos_shape=[4, 4], axial_pos_embds_dim=[32, 32], local_attn_chunk_length=8,
                     lsh_attn_chunk_length=8, attention_head_size=16, feed_forward_size=128, num_buckets=2),
    "t5": dict(decoder_start_token_id=0),
    "xlnet": dict(max_position_embeddings=None),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "mamba2": dict(num_heads=8),   # hidden_size * expand == num_heads * head_dim
    "prophetnet": dict(num_hidden_layers=None, num_encoder_layers=2, num_decoder_layers=2),
    "zaya": dict(num_experts_per_tok=1),
    "gemma4_assistant": dict(text_config=dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)),
    # hybrids whose default (or 2-layer) pattern has no attention layer
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "bamba": dict(attn_layer_indices=[1]),
}

#: non-causal families: ``name: (model_type, model class, input kind)``
OTHER_FAMILIES = {
    "bert:cls": ("bert", "BertForSequenceClassification", "text-cls"),
    "roberta:cls": ("roberta", "RobertaForSequenceClassification", "text-cls"),
    "deberta-v2:cls": ("deberta-v2", "DebertaV2ForSequenceClassification", "text-cls"),
    "vit:cls": ("vit", "ViTForImageClassification", "image-cls"),
    "swin:cls": ("swin", "SwinForImageClassification", "image-cls"),
    "clip:cls": ("clip", "CLIPForImageClassification", "image-cls"),
    "t5:seq2seq": ("t5", "T5ForConditionalGeneration", "seq2seq"),
}
FAST = ("llama", "gpt2", "bert:cls")

HEADERS = ["family", "model class", "params (M)", "regions traced/leaf/eager", "sampled/layers", "achieved FLOPs",
           "budget reached", "eval equal", "train finite", "FLOPs match", f"memory plan {MEMORY_BUDGET}: planned / eager / vs original",
           "result/reason"]
MARKERS = ("<!-- zoo-hf:start -->", "<!-- zoo-hf:end -->")
HEADING = "## Hugging Face transformers 5: every family from its auto mapping"


class Skip(Exception):
    """The family cannot be checked here (not an fxapprox failure)."""


def families() -> dict[str, tuple[str, str, str]]:
    """``{family: (model_type, model class name, input kind)}``: every causal LM of the auto mapping, then the rest."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = {t: (t, c, "causal-lm") for t, c in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}
    found.update(OTHER_FAMILIES)
    return found


def select(names: list[str] | None) -> dict[str, tuple[str, str, str]]:
    """The families named (a name matches a family or every family of that model type)."""
    everything = families()
    if not names:
        return everything
    chosen = {f: v for f, v in everything.items() if f in names or v[0] in names}
    unknown = [n for n in names if n not in everything and not any(v[0] == n for v in everything.values())]
    if unknown:
        raise SystemExit(f"unknown families: {unknown}")
    return chosen


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()] or [""]
    first = lines[0] if not lines[0].endswith(":") or len(lines) == 1 else f"{lines[0]} {lines[1]}"
    return f"{type(error).__name__}: {first[:200]}"


def _tiny_kwargs(default, special: dict, root: bool = True) -> dict:
    """Config kwargs for a tiny version of ``default`` (a config of the family's defaults): SMALL (in a sub-config:
    where it has the key), EXTRA where ``default`` has the key and it is not 0 (a feature switched off), per-layer
    type lists mixed (:func:`_layer_pattern`), ``special`` over them (``None`` drops a key) and, as dicts, the same
    for every sub-config. Read-only (derived) attributes are left out."""
    kwargs = {key: value for key, value in SMALL.items() if root or _has(default, key)}
    kwargs.update({key: value for key, value in EXTRA.items() if _has(default, key) and not _is_zero(default, key)})
    if _has(default, "kv_lora_rank"):   # multi-head latent attention has a key and value per head
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    depth = special.get("num_hidden_layers", SMALL["num_hidden_layers"])
    for attribute in LAYER_LISTS:
        if _read_only(default, attribute):
            continue
        pattern = _layer_pattern(getattr(default, attribute, None), depth)
        if pattern is not None:
            kwargs[attribute] = pattern
    for name in getattr(default, "sub_configs", {}) or {}:
        sub = getattr(default, name, None)
        if sub is not None and hasattr(sub, "to_dict") and sub is not default:
            sub_kwargs = _tiny_kwargs(sub, special.get(name, {}), root=False)
            if sub_kwargs:   # (an empty dict would replace what the parent config fills in)
                kwargs[name] = sub_kwargs
    kwargs = {key: value for key, value in kwargs.items() if not _read_only(default, key)}
    for key, value in special.items():
        if not isinstance(value, dict):
            kwargs[key] = value
    return {key: value for key, value in kwargs.items() if value is not None}


def _is_zero(config, key: str) -> bool:
    try:
        value = getattr(config, key, None)
    except Exception:  # noqa: BLE001 — e.g. a per-layer attribute of a heterogeneous config
        return False
    return type(value) is int and value == 0


def _read_only(config, key: str) -> bool:
    """A property without a setter (a value the config derives), under ``key`` or what it maps to."""
    target = getattr(config, "attribute_map", {}).get(key, key)
    attribute = getattr(type(config), target, None)
    return isinstance(attribute, property) and attribute.fset is None


def _layer_pattern(value, depth):
    """A per-layer type list (``layer_types`` ...) of ``depth`` layers holding the kinds the default list has, in
    order of first appearance, a (non-linear) attention kind among them where there is one (so a hybrid model of
    2 layers keeps e.g. its full-attention layer)."""
    if not isinstance(value, (list, tuple)) or not value or not isinstance(depth, int):
        return None
    kinds = list(dict.fromkeys(value))
    if len(kinds) < 2:   # one kind: the config derives the list for the tiny depth itself
        return None
    attention = [k for k in kinds if isinstance(k, str) and "attention" in k and "linear" not in k]
    if attention and attention[0] not in kinds[:depth]:
        kinds.remove(attention[0])
        kinds.insert(depth - 1, attention[0])
    return type(value)((kinds + [kinds[-1]] * depth)[:depth])


def _has(config, key: str) -> bool:
    return key in getattr(config, "attribute_map", {}) or key in config.__dict__


def tiny_config(model_type: str):
    """``AutoConfig.for_model(model_type, **SMALL)`` with EXTRA, per-layer type lists and SPECIAL (sub-configs
    too, see :func:`_tiny_kwargs`)."""
    from transformers import AutoConfig

    special = SPECIAL.get(model_type, {})
    try:
        try:
            default = AutoConfig.for_model(model_type)
        except Exception:  # noqa: BLE001 — a default that only validates with the family's special values
            default = AutoConfig.for_model(model_type, **{k: v for k, v in special.items() if v is not None})
        config = AutoConfig.for_model(model_type, **_tiny_kwargs(default, special))
    except Exception as error:  # noqa: BLE001
        raise Skip(f"config: {_one_line(error)}") from error
    return config


def build(family: str, spec: tuple[str, str, str]):
    """``(model, kwargs)``: the tiny model (seed 0, random init, train mode) and its inputs."""
    import transformers

    model_type, class_name, kind = spec
    config = tiny_config(model_type)
    model_class = getattr(transformers, class_name, None)
    if model_class is None:
        raise Skip(f"transformers has no class {class_name}")
    expected = getattr(model_class, "config_class", None)
    if isinstance(expected, type) and not isinstance(config, expected) and hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)   # e.g. Llama4ForCausalLM on llama4's text config
    torch.manual_seed(0)
    try:
        model = model_class(config)
    except ImportError as error:
        raise Skip(f"needs a package: {_one_line(error)}") from error
    except Exception as error:  # noqa: BLE001
        raise Skip(f"build from config: {_one_line(error)}") from error
    params = sum(p.numel() for p in model.parameters())
    if params > MAX_PARAMS:
        largest = max(model.named_parameters(), key=lambda kv: kv[1].numel())
        raise Skip(f"config not tiny: {params / 1e6:.0f}M parameters (largest {largest[0]} "
                   f"{tuple(largest[1].shape)})")
    model.train()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 100, (BATCH, SEQ), generator=generator)
    if kind == "causal-lm":
        kwargs = {"input_ids": ids, "labels": ids}
    elif kind == "text-cls":
        kwargs = {"input_ids": ids, "labels": torch.tensor([0, 1])}
    elif kind == "image-cls":
        size = getattr(getattr(config, "vision_config", config), "image_size", 32)
        kwargs = {"pixel_values": torch.randn(BATCH, 3, size, size, generator=generator),
                  "labels": torch.tensor([0, 1])}
    else:  # seq2seq
        kwargs = {"input_ids": ids, "labels": ids[:, :8].contiguous()}
    return model, kwargs


def _logits(output) -> torch.Tensor:
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    items = output.to_tuple() if hasattr(output, "to_tuple") else (
        output if isinstance(output, (tuple, list)) else (output,))
    loss = getattr(output, "loss", None)
    for item in items:
        if isinstance(item, torch.Tensor) and item is not loss:
            return item
    raise TypeError(f"no tensor in the output {type(output).__name__}")


def _train_loss(output) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    return _logits(output).float().square().mean()


def _exact_step_flops(model, kwargs, backward: bool = False) -> tuple[int, int]:
    """FLOPs of one exact step of ``model`` (train mode): forward + ``autograd.grad`` of ``projection_loss`` w.r.t.
    the trainable parameters (or, with ``backward``, ``projection_loss(...).backward()``: the same gradients):
    ``(all ops counted, under the root module's key)``. The check uses all ops: the projection loss itself has no
    FLOP-counted op, and FlopCounterMode leaves some models' backward ops (T5's, Moshi's) outside the root's key."""
    from torch.utils.flop_counter import FlopCounterMode

    model.train()
    parameters = [p for p in model.parameters() if p.requires_grad]
    with FlopCounterMode(display=False) as counter:
        loss = projection_loss(model(**kwargs))
        if backward:
            loss.backward()
        else:
            torch.autograd.grad(loss, parameters, allow_unused=True)
    model.zero_grad(set_to_none=True)
    counts = counter.get_flop_counts().get(type(model).__name__, {})
    return int(counter.get_total_flops()), int(sum(counts.values()))


def check_family(family: str, spec: tuple[str, str, str] | None = None) -> dict:
    """Build, approximate and check one family: a dict with ``status`` ("pass", "fail", "skipped"), ``reason``
    (one line), ``traceback`` (of the first exception, if any) and the measurements."""
    spec = families()[family] if spec is None else spec
    result = {"family": family, "model_type": spec[0], "model_class": spec[1], "status": "fail", "reason": "",
              "traceback": None}
    start = time.perf_counter()
    problems: list[str] = []
    note = ""

    def failed(what: str, error: BaseException) -> None:
        problems.append(f"{what}: {_one_line(error)}")
        if result["traceback"] is None:
            result["traceback"] = traceback.format_exc()

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                model, kwargs = build(family, spec)
            except Skip:
                raise
            except Exception as error:  # noqa: BLE001
                raise Skip(f"build: {_one_line(error)}") from error
            result["model_class"] = type(model).__name__
            result["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
            # a copy of the untouched original runs the standard inputs first (a train step, then an eval
            # forward; if it fails the family is skipped) and is counted for check (c); approximate() gets the
            # original as built, never run
            probe = copy.deepcopy(model)
            try:
                probe.train()
                _train_loss(probe(**kwargs)).backward()
                bad = [n for n, p in probe.named_parameters()
                       if p.grad is not None and not torch.isfinite(p.grad).all()]
                probe.zero_grad(set_to_none=True)
                probe.eval()
                with torch.no_grad():
                    _logits(probe(**kwargs))
            except Exception as error:  # noqa: BLE001
                result["traceback"] = traceback.format_exc()
                raise Skip(f"original model fails on the standard inputs: {_one_line(error)}") from error
            if bad:
                raise Skip(f"original model's own gradients are non-finite ({len(bad)}, e.g. {bad[0]})")
            # the reference count of check (c): FlopCounterMode over a real exact step (train mode)
            exact_flops, note = None, ""
            try:
                exact_flops, total_flops = _exact_step_flops(probe, kwargs)
            except Exception as error:  # noqa: BLE001 — count the same step with backward() instead
                result["grad_count_error"] = _one_line(error)
                result["grad_count_traceback"] = traceback.format_exc()
                note = (" (reference counted with backward(): autograd.grad under FlopCounterMode raises "
                        f"{_one_line(error)[:80]})")
                try:
                    exact_flops, total_flops = _exact_step_flops(probe, kwargs, backward=True)
                except Exception as error2:  # noqa: BLE001
                    failed("exact-step FLOP count of the original (FlopCounterMode)", error2)
            if exact_flops is not None:
                result["counted_flops"], result["counted_root_key_flops"] = exact_flops, total_flops
            del probe
            model.train()
            try:
                approx = fxapprox.approximate(model, BUDGET, example_inputs=kwargs,
                                              config=fxapprox.ApproxConfig(policy="flops"))
            except Exception as error:  # noqa: BLE001
                failed("approximate", error)
                return result
            plan = approx.plan
            kinds = [r.get("kind") for r in plan.regions]
            result.update(regions={k: kinds.count(k) for k in ("traced", "leaf", "eager")},
                          sampled=len(plan.approximated), layers=len(plan.layers), achieved=plan.achieved,
                          budget_met=plan.budget_met, budget_reached=budget_reached(plan),
                          plan_exact_flops=plan.total_exact_flops, plan_planned_flops=plan.total_planned_flops)
            # (a) eval outputs equal the original's
            try:
                model.eval(), approx.eval()
                with torch.no_grad():
                    expected = _logits(model(**kwargs))
                    got = _logits(approx(**kwargs))
                if got.shape != expected.shape:
                    result["eval_equal"] = False
                    problems.append(f"eval output shape {tuple(got.shape)} != {tuple(expected.shape)}")
                else:
                    diff = (got.float() - expected.float()).abs().max().item()
                    result["eval_max_diff"] = diff
                    result["eval_equal"] = bool(torch.allclose(got, expected, atol=ATOL, rtol=0))
                    if not result["eval_equal"]:
                        problems.append(f"eval output differs (max abs diff {diff:.3g})")
            except Exception as error:  # noqa: BLE001
                result["eval_equal"] = False
                failed("eval forward", error)
            # (b) one training step with finite gradients
            try:
                approx.train()
                approx.zero_grad(set_to_none=True)
                _train_loss(approx(**kwargs)).backward()
                grads = [(n, p.grad) for n, p in approx.named_parameters() if p.grad is not None]
                nonfinite = [n for n, g in grads if not torch.isfinite(g).all()]
                result["train_finite"] = bool(grads) and not nonfinite
                if nonfinite:
                    problems.append(f"{len(nonfinite)} non-finite gradient(s), e.g. {nonfinite[0]}")
                elif not grads:
                    problems.append("no parameter got a gradient")
            except Exception as error:  # noqa: BLE001
                result["train_finite"] = False
                failed("train step", error)
            # (c) plan FLOPs against a counted exact step
            if exact_flops is not None:
                ratio = plan.total_exact_flops / exact_flops if exact_flops else float("nan")
                result["flops_ratio"] = ratio
                result["flops_match"] = bool(exact_flops) and abs(ratio - 1) <= FLOPS_TOLERANCE
                if not result["flops_match"]:
                    problems.append(f"plan exact FLOPs {plan.total_exact_flops:,} vs counted {exact_flops:,} "
                                    f"(ratio {ratio:.4f}; under the root's key: {total_flops:,})")
            else:
                result["flops_match"] = False
            # (d) something sampled
            if not plan.approximated:
                problems.append(f"no layer sampled ({len(plan.layers)} layers; {plan.note})")
            del approx
            # (e) a memory plan whose totals a real step keeps: reported on its own (not part of the status)
            try:
                _check_memory_plan(model.train(), kwargs, result)
            except Exception as error:  # noqa: BLE001
                result["memory_match"] = False
                result["memory_reason"] = f"memory plan (memory_budget={MEMORY_BUDGET}): {_one_line(error)}"
            result["status"] = "fail" if problems else "pass"
    except Skip as skip:
        result["status"], result["reason"] = "skipped", str(skip)
        if result["traceback"] is None and skip.__cause__ is not None:
            result["traceback"] = "".join(traceback.format_exception(skip.__cause__))
        return result
    except Exception as error:  # noqa: BLE001
        failed("harness", error)
    finally:
        result["seconds"] = time.perf_counter() - start
        if result["status"] == "fail" and not result["reason"]:
            result["reason"] = "; ".join(problems) or "unknown"
        if result["status"] == "pass":
            result["reason"] = "pass"
        if result["status"] != "skipped" and note:
            result["reason"] += note
    return result


def _check_memory_plan(model, kwargs: dict, result: dict) -> None:
    """``memory_budget`` on the family: the plan's exact bytes are what the approximated model saves in a training
    forward with approximation off (``count_saved_bytes``), and what it keeps in a training step with it on is
    what the plan planned. What the original model saves is recorded beside (a region traced through a custom
    ``autograd.Function`` saves what its ops save, not what the function saved)."""
    with fxapprox.count_saved_bytes(model) as original:
        model(**kwargs)
    # activation_min_bytes=0: the tiny models' values are all below the default floor
    approx = fxapprox.approximate(model, 1.0, memory_budget=MEMORY_BUDGET, example_inputs=kwargs,
                                  config=fxapprox.ApproxConfig(check_every=None, activation_min_bytes=0))
    memory = approx.plan.memory
    approx.set_approximate(False)
    with fxapprox.count_saved_bytes(approx) as exact:
        approx(**kwargs)
    approx.set_approximate(True).zero_grad(set_to_none=True)
    _train_loss(approx(**kwargs)).backward()
    stored = approx.saved_activation_stats.stored_bytes
    result.update(memory_achieved=memory.achieved, memory_eager_share=memory.eager_bytes / memory.total_exact_bytes,
                  memory_exact_ratio=memory.total_exact_bytes / exact.bytes,
                  memory_stored_ratio=stored / memory.total_planned_bytes,
                  memory_original_ratio=exact.bytes / original.bytes)
    result["memory_match"] = (abs(result["memory_exact_ratio"] - 1) <= BYTES_TOLERANCE
                              and abs(result["memory_stored_ratio"] - 1) <= BYTES_TOLERANCE)
    if not result["memory_match"]:
        result["memory_reason"] = (f"memory plan: exact {memory.total_exact_bytes:,} B vs counted {exact.bytes:,} B, "
                                   f"planned {memory.total_planned_bytes:,} B vs kept {stored:,} B")


def _yes(value) -> str:
    return "–" if value is None else ("yes" if value else "**no**")


def _row(r: dict) -> list[str]:
    regions = r.get("regions")
    ratio = r.get("flops_ratio")
    match = "–" if ratio is None else f"{'yes' if r.get('flops_match') else '**no**'} ({ratio:.3f})"
    reason = r["reason"].replace("|", "\\|")
    reason = reason if r["status"] == "pass" else f"{r['status']}: {reason}"
    return [r["family"], r.get("model_class", "–"), f"{r['params_m']:.2f}" if "params_m" in r else "–",
            "/".join(str(regions[k]) for k in ("traced", "leaf", "eager")) if regions else "–",
            f"{r['sampled']}/{r['layers']}" if "sampled" in r else "–",
            f"{r['achieved']:.3f}" if "achieved" in r else "–", r.get("budget_reached", "–"),
            _yes(r.get("eval_equal")), _yes(r.get("train_finite")), match, _memory_cell(r), reason[:220]]


def _memory_cell(r: dict) -> str:
    if "memory_achieved" not in r:
        return f"**no**: {r['memory_reason'][:100]}" if "memory_reason" in r else "–"
    cell = f"{r['memory_achieved']:.2f} / {r['memory_eager_share']:.2f} / {r['memory_original_ratio']:.2f}"
    if r["memory_match"]:
        return cell
    return (f"**no** ({cell}; exact {r['memory_exact_ratio']:.3f}, kept {r['memory_stored_ratio']:.3f} of "
            f"planned)")


def summary_line(results: list[dict]) -> str:
    import transformers

    checked = [r for r in results if r["status"] != "skipped"]
    passed = sum(r["status"] == "pass" for r in checked)
    skipped = len(results) - len(checked)
    version = ".".join(transformers.__version__.split(".")[:2])
    percent = 100 * passed / len(checked) if checked else 0.0
    memory = [r for r in checked if "memory_match" in r]
    matched = sum(bool(r["memory_match"]) for r in memory)
    reached = sum(bool(r.get("budget_met")) for r in checked)
    return (f"{passed} of {len(checked)} families pass ({percent:.0f}%) on transformers {version}; {skipped} "
            f"skipped; budget 0.5 reached by {reached}; memory plan totals match a real step (1%) on {matched} of {len(memory)}")


def _skipped_markdown(results: list[dict]) -> str:
    skipped = [r for r in results if r["status"] == "skipped"]
    if not skipped:
        return "No family was skipped."
    lines = [f"**{len(skipped)} skipped** (not counted as failures):", ""]
    lines += [f"- `{r['family']}`: {r['reason'].replace('|', '/')[:240]}" for r in skipped]
    return "\n".join(lines)


def write_markdown(results: list[dict], seconds: float) -> None:
    import transformers

    begin, end = MARKERS
    body = "\n\n".join([
        f"`python benchmarks/zoo_coverage_hf.py --write` on {machine_line()}, transformers "
        f"{transformers.__version__}, {seconds / 60:.1f} min in one process. Every entry of "
        "`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` plus bert/roberta/deberta-v2 (sequence classification), vit/swin/clip "
        "(image classification) and t5 (seq2seq), each from a tiny config (`AutoConfig.for_model(model_type, "
        "hidden_size=64, num_hidden_layers=2, ...)`, random weights, batch 2×16 tokens or 2×3×32×32 images), "
        "approximated at budget 0.5 (FLOP-ranked policy) by hierarchical capture. Checks (a family passes on the "
        "first four): eval output equals the original's (atol 1e-4); one train step gives finite gradients; the "
        "plan's exact FLOPs equal `FlopCounterMode` over a real exact step (forward + gradient of "
        "`projection_loss`, within 1%; the ratio in brackets); at least one layer sampled. Then, reported on its "
        "own: a memory plan at `memory_budget=0.5` (default measured policy, `activation_min_bytes=0`) whose exact "
        "bytes equal what the approximated model saves in a training forward with approximation off "
        "(`count_saved_bytes`) and whose planned bytes equal what a training step with it on keeps (within 1%); "
        "the cell: planned fraction / share of the exact bytes saved by eager code (kept exact) / the exact bytes "
        "against the original model's (above 1 where a traced region saves more than the original code, e.g. a "
        "custom `autograd.Function` traced through). Regions: how many parts of the model are traced graphs, "
        "swapped leaves, or eager code. \"budget reached\": where not, why the layers with the most exact FLOPs "
        "cannot be sampled.",
        f"**{summary_line(results)}.**",
        markdown_table(HEADERS, [_row(r) for r in results]),
        _skipped_markdown(results)])
    block = f"{begin}\n{body}\n{end}"
    text = BENCHMARKS_MD.read_text()
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + f"\n\n{HEADING}\n\n{block}\n"
    BENCHMARKS_MD.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=None, help="comma-separated subset (family or model type)")
    parser.add_argument("--json", default=None, help="write every result (with tracebacks) to this file")
    parser.add_argument("--write", action="store_true", help="replace the zoo-hf section of BENCHMARKS.md")
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    chosen = select(None if args.families is None else args.families.split(","))
    start = time.perf_counter()
    results = []
    for family, spec in chosen.items():
        result = check_family(family, spec)
        results.append(result)
        print(f"{family}: {result['status']} {'' if result['status'] == 'pass' else result['reason']} "
              f"({result['seconds']:.1f} s)", flush=True)
        gc.collect()
    seconds = time.perf_counter() - start
    print()
    print(markdown_table(HEADERS, [_row(r) for r in results]))
    print()
    print(_skipped_markdown(results))
    print()
    print(f"{summary_line(results)} ({seconds:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary_line(results), "seconds": seconds,
                                               "transformers": transformers.__version__, "results": results},
                                              indent=1, default=str))
    if args.write:
        if args.families is not None:
            print("--write ignored: it needs the whole family list (drop --families)")
        else:
            write_markdown(results, seconds)
            print(f"wrote {BENCHMARKS_MD}")


if __name__ == "__main__":
    main()

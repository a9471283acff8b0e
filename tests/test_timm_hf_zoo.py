"""Zoos beyond torchvision: timm architecture families and Hugging Face transformers built from configs.

Each model is built with random weights, approximated at budget 0.5 (FLOP-ranked policy), compared in
``eval()`` with the original (atol 1e-4), and trained one step (every gradient finite). timm models are traced
by fxapprox itself (with timm's own no-trace registries; untraceable blocks stay exact leaves); Hugging Face
models on transformers 5 are approximated as they are (hierarchical capture, ``fxapprox.pipeline.eager``), on
transformers 4 traced with the library's fx tracer (``transformers.utils.fx.symbolic_trace``), the GraphModule then
handed to ``approximate``.

One model per family runs by default when timm / transformers are installed (``pip install fxapprox[zoo]``);
the rest are marked ``slow``. ``benchmarks/zoo_coverage_timm_hf.py`` runs all of them and writes the table.
"""

from __future__ import annotations

import time
import traceback

import pytest
import torch
import torch.nn.functional as F

import fxapprox
from tests.zoo_checks import budget_reached, untraceable_modules

FLOPS = fxapprox.ApproxConfig(policy="flops")
BUDGET = 0.5
BATCH = 2
NUM_CLASSES = 10
ATOL = 1e-4

#: one small model per timm architecture family
TIMM_MODELS = (
    "resnet18", "resnetv2_50", "resnest14d", "res2net50_14w_8s", "seresnext26d_32x4d", "skresnet18", "dla34",
    "dpn68", "densenet121", "vgg11", "repvgg_a0", "regnetx_002", "cspresnet50", "darknet17", "selecsls42b",
    "ese_vovnet19b_dw", "hrnet_w18_small", "xception41", "inception_v3", "efficientnet_b0", "mobilenetv3_small_100",
    "mobilenetv4_conv_small", "ghostnet_100", "mixnet_s", "fbnetc_100", "lcnet_050", "tinynet_a", "rexnet_100",
    "hardcorenas_a", "gernet_s", "convnext_atto", "convnextv2_atto", "nfnet_l0", "dm_nfnet_f0", "vit_tiny_patch16_224",
    "deit_tiny_patch16_224", "cait_xxs24_224", "xcit_nano_12_p16_224", "beit_base_patch16_224",
    "eva02_tiny_patch14_224", "swin_tiny_patch4_window7_224", "swinv2_cr_tiny_ns_224", "twins_pcpvt_small",
    "pvt_v2_b0", "levit_128s", "pit_ti_224", "crossvit_tiny_240", "coat_lite_tiny", "visformer_tiny",
    "poolformer_s12", "mixer_s16_224", "resmlp_12_224", "gmlp_ti16_224", "mobilevit_xxs", "edgenext_xx_small",
    "efficientformer_l1", "efficientformerv2_s0", "fastvit_t8", "efficientvit_b0", "tiny_vit_5m_224",
    "davit_tiny", "gcvit_xxtiny", "maxvit_tiny_tf_224", "focalnet_tiny_srf", "inception_next_tiny",
    "nest_tiny", "sequencer2d_s", "convmixer_768_32", "tresnet_m", "hiera_tiny_224", "starnet_s1",
    "repghostnet_050", "mambaout_femto",
)
TIMM_FAST = ("resnet18", "vit_tiny_patch16_224", "nfnet_l0", "swin_tiny_patch4_window7_224")

#: Hugging Face configs (tiny, random weights) and the inputs their fx tracer is given
HF_MODELS = ("bert", "gpt2", "vit", "t5", "distilbert", "roberta")
HF_FAST = ("bert",)


def _timm_build(name: str):
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=NUM_CLASSES)
    size = model.pretrained_cfg.get("input_size", (3, 224, 224))
    x = torch.randn(BATCH, *size)
    return model, (x,), torch.randint(0, NUM_CLASSES, (BATCH,))


def _hf_build(name: str):
    import transformers as hf
    try:
        from transformers.utils.fx import symbolic_trace
    except ImportError:   # transformers 5 removed its fx tracer: the model as it is (hierarchical capture)
        symbolic_trace = None

    torch.manual_seed(0)
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    tokens = torch.randint(2, 100, (BATCH, 16))
    if name == "vit":
        config = hf.ViTConfig(image_size=32, patch_size=8, num_labels=NUM_CLASSES, **small)
        model = hf.ViTForImageClassification(config)
        names, inputs = ["pixel_values"], (torch.randn(BATCH, 3, 32, 32),)
    elif name == "gpt2":
        config = hf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=32,
                               num_labels=NUM_CLASSES, pad_token_id=0)
        model = hf.GPT2ForSequenceClassification(config)
        names, inputs = ["input_ids"], (tokens,)
    elif name == "t5":
        config = hf.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=100,
                             decoder_start_token_id=0)
        model = hf.T5ForConditionalGeneration(config)
        names, inputs = ["input_ids", "decoder_input_ids"], (tokens, tokens[:, :8])
    else:
        config_class, model_class = {
            "bert": (hf.BertConfig, hf.BertForSequenceClassification),
            "distilbert": (hf.DistilBertConfig, hf.DistilBertForSequenceClassification),
            "roberta": (hf.RobertaConfig, hf.RobertaForSequenceClassification),
        }[name]
        kwargs = dict(small, vocab_size=100, max_position_embeddings=64, num_labels=NUM_CLASSES)
        if name == "distilbert":
            kwargs = dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=100,
                          max_position_embeddings=64, num_labels=NUM_CLASSES)
        model = model_class(config_class(**kwargs))
        names, inputs = ["input_ids"], (tokens,)
    model.config.use_cache = False if hasattr(model.config, "use_cache") else None

    # the original is called by keyword (T5's second positional argument is its attention mask)
    def original(*args):
        return model(**dict(zip(names, args)))

    if symbolic_trace is None:
        return model, model, inputs, torch.randint(0, NUM_CLASSES, (BATCH,)), original, names
    try:
        traced = symbolic_trace(model, input_names=names)
    except Exception as error:   # noqa: BLE001 — reported as the library tracer's failure, not ours
        raise RuntimeError(f"transformers {hf.__version__}'s own fx tracer fails on {type(model).__name__}: "
                           f"{type(error).__name__}: {str(error).splitlines()[0][:120]}") from error
    return model, traced, inputs, torch.randint(0, NUM_CLASSES, (BATCH,)), original, None


def _logits(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        for key in ("logits", "last_hidden_state"):
            if key in output:
                return output[key]
    return output[0]


def _loss(output, labels):
    logits = _logits(output)
    if logits.dim() == 2 and logits.shape[-1] == NUM_CLASSES:
        return F.cross_entropy(logits, labels)
    return logits.float().square().mean()


class _ByKeyword:
    """An approximated Hugging Face model called by keyword, as the original is."""

    def __init__(self, module, names) -> None:
        self.module, self.names = module, names

    def __call__(self, *args):
        return self.module(**dict(zip(self.names, args)))

    def __getattr__(self, name):
        return getattr(self.module, name)


def check(zoo: str, name: str, result: dict | None = None) -> dict:
    """Approximate one model, compare eval outputs (atol 1e-4), run one train step; raise on a failure."""
    result = {} if result is None else result
    start = time.perf_counter()
    names = None
    if zoo == "timm":
        model, inputs, labels = _timm_build(name)
        source, original = model, model
    else:
        model, source, inputs, labels, original, names = _hf_build(name)
    result["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    if names is not None:   # a model approximated as it is: called by keyword, like the original
        approx = _ByKeyword(fxapprox.approximate(source, BUDGET, example_inputs=dict(zip(names, inputs)),
                                                 config=FLOPS), names)
    else:
        approx = fxapprox.approximate(source, BUDGET, example_inputs=inputs, config=FLOPS)
    plan = approx.plan
    captured, kept = untraceable_modules(original if zoo == "timm" else source, plan)
    result.update(sampled=len(plan.approximated), layers=len(plan.layers), achieved=plan.achieved,
                  budget_reached=budget_reached(plan), untraced_captured=captured, untraced_exact=kept)
    problems = []
    model.eval(), approx.eval()
    with torch.no_grad():
        expected, got = _logits(original(*inputs)), _logits(approx(*inputs))
    if expected.shape != got.shape or not torch.allclose(expected, got, atol=ATOL, rtol=ATOL):
        diff = (expected - got).abs().max().item() if expected.shape == got.shape else float("nan")
        problems.append(f"eval output differs from the original's (max abs diff {diff:.3g})")
    result["eval_exact"] = not problems
    approx.train()
    _loss(approx(*inputs), labels).backward()
    params = dict(approx.named_parameters())
    nonfinite = [n for n, p in params.items() if p.grad is not None and not torch.isfinite(p.grad).all()]
    if nonfinite:
        problems.append(f"{len(nonfinite)} parameter(s) got a non-finite gradient: {nonfinite[:3]}")
    if not plan.approximated:
        problems.append(f"no layer sampled: {plan.note}")
    result["step_ok"] = not nonfinite
    result["seconds"] = time.perf_counter() - start
    assert not problems, f"{name}: " + "; ".join(problems)
    return result


def _child(zoo: str, name: str, conn) -> None:
    result: dict = {}
    try:
        check(zoo, name, result)
        conn.send((result, None, None))
    except BaseException as error:  # noqa: BLE001 — reported to the parent
        conn.send((result, f"{type(error).__name__}: {error}", traceback.format_exc()))
    conn.close()


def run_isolated(zoo: str, name: str) -> tuple[dict, str | None, str | None]:
    """:func:`check` in a child process (as the torchvision zoo does): ``(result, error, traceback)``."""
    from tests.test_torchvision_zoo import run_in_child

    return run_in_child(_child, (zoo, name))


def _params(names, fast):
    return [pytest.param(n, marks=() if n in fast else pytest.mark.slow, id=n) for n in names]


@pytest.mark.parametrize("name", _params(TIMM_MODELS, TIMM_FAST))
def test_timm_model(name):
    pytest.importorskip("timm")
    result, error, trace = run_isolated("timm", name)
    assert error is None, f"{error}\n--- child traceback ---\n{trace}"


@pytest.mark.parametrize("name", _params(HF_MODELS, HF_FAST))
def test_hugging_face_model(name):
    pytest.importorskip("transformers")
    result, error, trace = run_isolated("hf", name)
    assert error is None, f"{error}\n--- child traceback ---\n{trace}"

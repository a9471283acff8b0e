"""The training workloads the loss-per-second benchmarks run: model, data, optimizer, evaluation.

Every workload trains from data on this machine (scikit-learn's digits, the CPython standard library's sources,
seeded Gaussian features) and a model built from a seed, so every configuration of a comparison sees the same
initial weights and, for a given ``seed``, the same batches. ``TUNING`` are the workloads the planner's defaults
were set on; ``HELD_OUT`` were not looked at while setting them and are reported apart (for
``bench_loss_per_second.py``; ``time_to_quality.py`` has its own split, in which ``char_transformer_small`` tunes).

* ``mlp`` — MLP 512→1024→1024→10 on flat Gaussian features (label: argmax of the first 10), SGD 0.1 / 0.9;
* ``digits_cnn`` — ``examples/digits_cnn.py``'s CNN on the digits, SGD 0.05 / 0.9;
* ``char_transformer`` — ``examples/char_transformer.py``'s model (4 pre-LN blocks, d=256, 16×128 characters),
  AdamW 2e-3, constant after warm-up;
* ``char_transformer_small`` (held out) — 3 blocks, d=192, 6 heads, 32×64 characters, AdamW 3e-3, cosine decay;
* ``llama`` (held out) — a Llama-style decoder in plain PyTorch: RMSNorm, SwiGLU, rotary attention with grouped
  query heads, untied head; 4 blocks, d=256, 16×128 characters, AdamW 1e-3, cosine; ``llama_small`` (held out):
  3 blocks, d=192, 6 query / 3 key-value heads, 32×64 characters;
* ``hf_llama`` (held out) — ``examples/llama_lm.py``'s Hugging Face ``LlamaForCausalLM`` (d=384, 6 layers, captured
  region by region), 8×128 characters, AdamW 1e-3, warm-up + cosine, 300 steps;
* ``char_lstm`` (held out) — ``examples/char_lstm.py``'s LSTM language model (hidden 512), 32×64 characters, Adam;
* ``resnet18`` (held out) — torchvision's ResNet-18 (10 classes) on the digits upsampled to 3×32×32, SGD;
* ``finetune`` / ``finetune_lora`` (held out) — a character LM pretrained exactly once on the standard library's
  sources, fine-tuned on Python's documentation in full or with PEFT LoRA (AdamW, warm-up + cosine to zero).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from _text import encode, load_corpus, windows  # noqa: E402
from bench_planner import MLP as FlatMLP  # noqa: E402

__all__ = ["HELD_OUT", "TUNING", "WORKLOADS", "Workload", "get"]


@dataclass
class Workload:
    """One training setup. ``batches(seed)`` yields ``(input, target)``; ``loss(output, target)``;
    ``optimizer(params, steps)`` returns ``(optimizer, scheduler or None)``; ``evaluate(model)`` is the
    exact validation loss."""

    name: str
    build: Callable[[], nn.Module]
    batches: Callable[[int], object]
    loss: Callable
    optimizer: Callable
    evaluate: Callable
    example: tuple
    steps: int
    eval_every: int
    clip: float | None = None


# -- data ------------------------------------------------------------------------------------------------------
_CACHE: dict = {}


def _text(seq: int, batch: int, batch_first: bool = True):
    if "text" not in _CACHE:
        data, vocab = encode(load_corpus(2_000_000))
        split = int(0.9 * len(data))
        _CACHE["text"] = (data[:split], data[split:], len(vocab))
    train, val, vocab = _CACHE["text"]
    val_stream = windows(val, seq, 32, torch.Generator().manual_seed(2), batch_first=batch_first)
    val_batches = [next(val_stream) for _ in range(8)]
    example = (next(windows(train, seq, batch, torch.Generator().manual_seed(3), batch_first=batch_first))[0],)

    def batches(seed: int):
        return windows(train, seq, batch, torch.Generator().manual_seed(seed), batch_first=batch_first)
    return vocab, batches, val_batches, example


def _token_loss(output, target):
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def _evaluate_batches(loss, batches):
    def evaluate(model) -> float:
        model.eval()
        with torch.no_grad():
            values = [loss(model(x), y).item() for x, y in batches]
        model.train()
        return sum(values) / len(values)
    return evaluate


def _digits(size: int | None = None, channels: int = 1):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if size is not None:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = x.expand(-1, channels, -1, -1).contiguous()
    y = torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    return (x[order[360:]], y[order[360:]]), (x[order[:360]], y[order[:360]])


def _epochs(x, y, batch: int):
    def batches(seed: int):
        generator = torch.Generator().manual_seed(seed)
        while True:
            order = torch.randperm(len(y), generator=generator)
            for b in range(len(y) // batch):   # full batches only: every step sees the planned shape
                index = order[b * batch:(b + 1) * batch]
                yield x[index], y[index]
    return batches


def _schedule(warmup: int, steps: int, cosine: bool):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if not cosine:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
    return factor


def _adamw(lr: float, warmup: int, cosine: bool):
    def make(params, steps):
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(warmup, steps, cosine))
    return make


def warmup_cosine(make_optimizer, warmup_share: float = 0.05):
    """``optimizer(params, steps)`` with linear warm-up over ``warmup_share`` of the steps and cosine decay to zero
    at the last step: the schedule users train with and papers report the end of (benchmarks/time_to_quality.py)."""
    def make(params, steps):
        optimizer = make_optimizer(params)
        warmup = max(1, round(warmup_share * steps))

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return make


def _sgd(lr: float, momentum: float = 0.9):
    def make(params, steps):
        return torch.optim.SGD(params, lr=lr, momentum=momentum), None
    return make


# -- models ----------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x, cos, sin):
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.attention_norm, self.mlp_norm = RMSNorm(width), RMSNorm(width)
        self.q = nn.Linear(width, width, bias=False)
        self.kv = nn.Linear(width, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x, cos, sin):
        batch, steps, width = x.shape
        h = self.attention_norm(x)
        q = self.q(h).view(batch, steps, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(batch, steps, 2 * self.kv_heads, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attention.transpose(1, 2).reshape(batch, steps, width))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int, width: int = 256, heads: int = 8, kv_heads: int = 4, layers: int = 4,
                 hidden: int = 688, context: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([LlamaBlock(width, heads, kv_heads, hidden) for _ in range(layers)])
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        head_dim = width // heads
        frequencies = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(context).float(), frequencies)
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, dim=-1), persistent=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        # torch.narrow rather than slicing: under torch.fx the length is a Proxy, which a plain slice of a buffer
        # cannot take
        steps = tokens.shape[1]
        cos, sin = torch.narrow(self.cos, 0, 0, steps), torch.narrow(self.sin, 0, 0, steps)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


# -- the workloads ---------------------------------------------------------------------------------------------
def mlp() -> Workload:
    generator = torch.Generator().manual_seed(1)
    val_x = torch.randn(2048, 512, generator=generator)
    val_y = val_x[:, :10].argmax(-1)

    def batches(seed: int):
        generator = torch.Generator().manual_seed(100 + seed)
        while True:
            x = torch.randn(128, 512, generator=generator)
            yield x, x[:, :10].argmax(-1)

    def build():
        torch.manual_seed(0)
        return FlatMLP()   # bench_planner's MLP 512→1024→1024→10
    example = (next(batches(0))[0],)
    return Workload("mlp", build, batches, F.cross_entropy, _sgd(0.1), _evaluate_batches(F.cross_entropy,
                    [(val_x, val_y)]), example, steps=400, eval_every=25)


def digits_cnn() -> Workload:
    from digits_cnn import DigitsCNN

    (x, y), (x_test, y_test) = _digits()

    def build():
        torch.manual_seed(0)
        return DigitsCNN()
    return Workload("digits_cnn", build, _epochs(x, y, 64), F.cross_entropy, _sgd(0.05),
                    _evaluate_batches(F.cross_entropy, [(x_test, y_test)]), (x[:64],), steps=500, eval_every=25)


def _language_model(name: str, make, seq: int, batch: int, optimizer, steps: int) -> Workload:
    """A character language model on the CPython sources: ``make(vocab)`` builds it from seed 0."""
    vocab, batches, val_batches, example = _text(seq, batch)

    def build():
        torch.manual_seed(0)
        return make(vocab)
    return Workload(name, build, batches, _token_loss, optimizer, _evaluate_batches(_token_loss, val_batches),
                    example, steps=steps, eval_every=25, clip=1.0)


def char_transformer() -> Workload:
    from char_transformer import CharTransformer

    return _language_model("char_transformer", lambda vocab: CharTransformer(vocab, 256, 4, 4, 128), 128, 16,
                           _adamw(2e-3, 50, cosine=False), 400)


def char_transformer_small() -> Workload:
    from char_transformer import CharTransformer

    return _language_model("char_transformer_small", lambda vocab: CharTransformer(vocab, 192, 6, 3, 64), 64, 32,
                           _adamw(3e-3, 30, cosine=True), 500)


def llama() -> Workload:
    return _language_model("llama", TinyLlama, 128, 16, _adamw(1e-3, 30, cosine=True), 400)


def llama_small() -> Workload:
    return _language_model("llama_small", lambda vocab: TinyLlama(vocab, 192, 6, 3, 3, 512, 64), 64, 32,
                           _adamw(1e-3, 30, cosine=True), 400)


def hf_llama() -> Workload:
    """``examples/llama_lm.py``'s Hugging Face Llama (captured region by region), no KV cache in training."""
    vocab, batches, val_batches, example = _text(128, 8)

    def build():
        import llama_lm

        model = llama_lm.build(vocab, "full", 128)
        model.config.use_cache = False
        return model

    def loss(output, target):
        return _token_loss(output.logits, target)
    return Workload("hf_llama", build, batches, loss, _adamw(1e-3, 30, cosine=True),
                    _evaluate_batches(loss, val_batches), example, steps=300, eval_every=25, clip=1.0)


def char_lstm() -> Workload:
    from char_lstm import CharLM

    vocab, batches, val_batches, example = _text(64, 32, batch_first=False)

    def build():
        torch.manual_seed(0)
        return CharLM(vocab, hidden=512)

    def adam(params, steps):
        return torch.optim.Adam(params, lr=2e-3), None
    return Workload("char_lstm", build, batches, _token_loss, adam, _evaluate_batches(_token_loss, val_batches),
                    example, steps=300, eval_every=25, clip=1.0)


def resnet18() -> Workload:
    import torchvision

    (x, y), (x_test, y_test) = _digits(size=32, channels=3)

    def build():
        torch.manual_seed(0)
        return torchvision.models.resnet18(num_classes=10)
    return Workload("resnet18", build, _epochs(x, y, 32), F.cross_entropy, _sgd(0.02),
                    _evaluate_batches(F.cross_entropy, [(x_test, y_test)]), (x[:32],), steps=300, eval_every=25)


def _fine_tuning(name: str, lora: bool) -> Workload:
    """``benchmarks/output_layer.py``'s character LM (blocks torch.fx cannot trace), pretrained exactly once on the
    standard library's sources (cached under ``benchmarks/.data/``), fine-tuned on Python's documentation
    (``pydoc_data.topics``): in full, or with PEFT LoRA (r 16 on every block's Linear layers, the head trained)."""
    import output_layer as pretraining

    text = pretraining.ascii_ids(pretraining.documentation())
    cut = int(0.9 * len(text))
    train, val = text[:cut], text[cut:]
    val_stream = pretraining.batches(val, 2)
    val_batches = [next(val_stream) for _ in range(8)]
    base = pretraining.pretrained()

    def build():
        import copy

        model = copy.deepcopy(base)
        if not lora:
            return model
        import peft

        torch.manual_seed(0)
        config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["qkv", "proj", "mlp.0",
                                                                                       "mlp.2"],
                                 modules_to_save=["head"])
        return peft.get_peft_model(model, config)

    def batches(seed: int):
        return pretraining.batches(train, seed)
    lr = 2e-3 if lora else 1e-3
    return Workload(name, build, batches, _token_loss,
                    warmup_cosine(lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01), 0.1),
                    _evaluate_batches(_token_loss, val_batches), (next(pretraining.batches(train, 3))[0],),
                    steps=300, eval_every=25, clip=1.0)


def finetune() -> Workload:
    return _fine_tuning("finetune", lora=False)


def finetune_lora() -> Workload:
    return _fine_tuning("finetune_lora", lora=True)


WORKLOADS = {w.__name__: w for w in (mlp, digits_cnn, char_transformer, char_transformer_small, llama, char_lstm,
                                     resnet18, finetune, finetune_lora, llama_small, hf_llama)}
#: the workloads the defaults were set on
TUNING = ("mlp", "digits_cnn", "char_transformer")
#: reported apart: not looked at while setting the defaults
HELD_OUT = ("char_transformer_small", "llama", "llama_small", "char_lstm", "resnet18", "finetune", "finetune_lora",
            "hf_llama")


def get(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name]()

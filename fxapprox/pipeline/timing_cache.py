"""Measured timings kept per machine, so the same model, batch and seed plan the same way on every run.

The measured policy times each candidate against the exact op and the exact model's whole step. On a CPU those
timings move 15–20% between runs (frequency, other processes, memory placement), enough to flip a candidate
across ``min_speedup`` or reorder the walk, so two runs of the same script could plan differently. The first plan
on a machine times what it needs and writes it here; later plans of the same shapes read it back and decide the
same way. This is what inductor does with its autotuning results and cuDNN with its benchmark cache: a timing is
a property of (machine, op, shapes), measured once.

The file is JSON, one per machine (CPU model, thread count, torch version, device), in
``ApproxConfig(timing_cache=...)``'s directory: ``$FXAPPROX_CACHE_DIR``, else ``$XDG_CACHE_HOME/fxapprox`` or
``~/.cache/fxapprox``. Deleting it makes the next plan time afresh. Writes merge with what another process wrote
meanwhile (DDP ranks, parallel jobs) and replace the file atomically.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path

import torch

__all__ = ["TimingCache", "cache_directory", "machine_key", "step_key"]

#: the environment variable naming the cache directory (``ApproxConfig(timing_cache=True)``)
CACHE_ENV = "FXAPPROX_CACHE_DIR"
_VERSION = 1


def cache_directory(setting: bool | str) -> Path | None:
    """The directory ``ApproxConfig.timing_cache`` names (``None``: no cache)."""
    if setting is False:
        return None
    if isinstance(setting, str):
        return Path(setting).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "fxapprox"


@functools.lru_cache(maxsize=None)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def machine_key(device: torch.device) -> str:
    """What a timing depends on besides the op: the processor, the threads torch uses, torch, the device."""
    parts = [platform.machine(), _cpu_model(), f"{torch.get_num_threads()} threads", torch.__version__, device.type]
    if device.type == "cuda":
        parts.append(torch.cuda.get_device_name(device))
    return " | ".join(parts)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}:{value.dtype}:{value.requires_grad}"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_describe(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}={_describe(v)}" for k, v in sorted(value.items())) + "}"
    return repr(value)


def step_key(module: torch.nn.Module, inputs) -> str:
    """The key of a whole model's timed step: its code (a GraphModule's) or class, its trainable parameters'
    shapes and its inputs' shapes and dtypes."""
    code = module.code if isinstance(module, torch.fx.GraphModule) else type(module).__qualname__
    parameters = [(name, tuple(p.shape), str(p.dtype)) for name, p in module.named_parameters() if p.requires_grad]
    text = f"{code}\n{parameters}\n{_describe(inputs)}"
    return "step:" + hashlib.sha256(text.encode()).hexdigest()


class TimingCache:
    """A per-machine store of timings (``get`` / ``put`` by key, ``save`` at the end of a plan); a no-op when
    ``directory`` is ``None``."""

    def __init__(self, directory: Path | None, device: torch.device) -> None:
        self.machine = machine_key(device)
        self.path = None
        self.entries: dict = {}
        self._added: dict = {}
        if directory is not None:
            digest = hashlib.sha256(self.machine.encode()).hexdigest()[:16]
            self.path = directory / f"timings-{digest}.json"
            self.entries = self._read()

    @classmethod
    def for_config(cls, setting: bool | str, device: torch.device) -> "TimingCache":
        return cls(cache_directory(setting), device)

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if data.get("version") != _VERSION or data.get("machine") != self.machine:
            return {}
        return dict(data.get("entries", {}))

    def get(self, key: str):
        return self.entries.get(key)

    def put(self, key: str, value) -> None:
        self.entries[key] = value
        self._added[key] = value

    def save(self) -> None:
        """Write what this plan added, merged with what the file holds now (another process may have written)."""
        if self.path is None or not self._added:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            entries = {**self._read(), **self._added}
            text = json.dumps({"version": _VERSION, "machine": self.machine, "entries": entries}, sort_keys=True)
            handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".timings-", suffix=".tmp")
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                out.write(text)
            os.replace(temporary, self.path)
            self._added = {}
        except OSError as error:   # a read-only home: plans still work, they are just timed afresh next time
            import warnings

            warnings.warn(f"fxapprox: could not write the timing cache {self.path} ({error}); plans will be timed "
                          f"afresh (ApproxConfig(timing_cache=False) silences this)", RuntimeWarning, stacklevel=2)
            self.path = None

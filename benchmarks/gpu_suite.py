"""The GPU suite: the ``cuda`` tests and the GPU figures of BENCHMARKS.md in one command (a few minutes on one GPU).

Runs, on the first CUDA device:

1. ``pytest -m cuda`` (the tests marked ``cuda``: autocast on the GPU, ``fxapprox.bench`` on the GPU);
2. sampled ops: a 3 × Linear(4096) MLP, a Conv2d stack and ResNet-50, exact against ``approximate(model, b)``
   at b = 0.5 and 0.25 (the default measured plan, which spends the budget), eager and compiled
   (inductor), train-step times (forward + backward + SGD) in interleaved rounds;
3. compressed activations on ResNet-50 and the char transformer (``memory_budget`` 0.25 and 0.125): planned
   bytes, peak ``torch.cuda.max_memory_allocated`` of a step, step time against exact;
4. the sparse-backward LSTM against ``nn.LSTM`` (cuDNN) at keep-ratios 0.5 and 0.25;
5. bf16 and fp16 autocast: exact and approximated steps, the loss finite;
6. the sync check: ``torch.cuda.set_sync_debug_mode("error")`` around a training step of the default plan (with
   and without a memory plan), and ``fxapprox.count_host_syncs`` over it.

Without a CUDA device it says so and exits 0. ``--allow-cpu`` runs the same measurements at tiny sizes on the
CPU (a smoke test of this script; nothing is written). ``--quick`` uses smaller models.

Usage: python benchmarks/gpu_suite.py [--quick] [--no-write] [--allow-cpu] [--repetitions 10]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
import torch.nn.functional as F
import torchvision
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _common import interleaved_samples, markdown_table, medians, paired_ratio, print_table, write_section  # noqa: E402

import fxapprox  # noqa: E402
from fxapprox.runtime.modules import ApproxLSTM, SamplingSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPENT = fxapprox.ApproxConfig(check_every=None)
#: every eligible layer sampled (no timing filter): the sync check must see sampled ops at any size
EVERY_LAYER = fxapprox.ApproxConfig(check_every=None, min_speedup=None)


class Suite:
    def __init__(self, device: torch.device, quick: bool, repetitions: int) -> None:
        self.device, self.quick, self.repetitions = device, quick, repetitions
        self.tables: list[tuple[str, list[str], list[list[str]]]] = []
        self.small = quick or device.type == "cpu"

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, module, inputs, loss_fn, autocast_dtype=None):
        optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1e-4)

        def run():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(self.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = loss_fn(module(*inputs))
            loss.backward()
            optimizer.step()
            self.sync()
            return loss
        return run

    def time(self, steps: dict) -> tuple[dict, dict]:
        samples = interleaved_samples(steps, self.repetitions, warmup=3)
        return samples, medians(samples)

    # -- 1. the cuda tests ------------------------------------------------------------------------------------
    def cuda_tests(self) -> None:
        if self.device.type != "cuda":
            return
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"],
                              cwd=ROOT, capture_output=True, text=True)
        summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
        print(done.stdout[-3000:])
        self.tables.append(("`pytest -m cuda`", ["result", "exit code", "seconds"],
                            [[summary, str(done.returncode), f"{time.perf_counter() - start:.0f}"]]))

    # -- 2. sampled ops ---------------------------------------------------------------------------------------
    def sampled_ops(self) -> None:
        d = self.device
        width, batch = (256, 64) if self.small else (4096, 4096)
        images = (2, 32) if self.small else (64, 224)
        conv_batch = (4, 16, 16) if self.small else (64, 64, 56)
        cases = [
            ("3 × Linear", lambda: nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                                                 nn.ReLU(), nn.Linear(width, width)),
             (torch.randn(batch, width, device=d),), lambda y: y.square().mean()),
            ("Conv2d stack", lambda: nn.Sequential(*[m for _ in range(3) for m in (
                nn.Conv2d(conv_batch[1], conv_batch[1], 3, padding=1), nn.ReLU())]),
             (torch.randn(conv_batch[0], conv_batch[1], conv_batch[2], conv_batch[2], device=d),),
             lambda y: y.square().mean()),
            ("ResNet-50" if not self.small else "ResNet-18", torchvision.models.resnet18 if self.small
             else torchvision.models.resnet50, (torch.randn(images[0], 3, images[1], images[1], device=d),),
             lambda y: y.square().mean()),
        ]
        rows = []
        for name, make, inputs, loss_fn in cases:
            for budget in (0.5, 0.25):
                torch.manual_seed(0)
                exact = make().to(d).train()
                approx = fxapprox.approximate(exact, budget, example_inputs=inputs, config=SPENT)
                torch._dynamo.reset()
                steps = {"exact": self.step(exact, inputs, loss_fn), "approx": self.step(approx, inputs, loss_fn),
                         "compiled exact": self.step(torch.compile(exact), inputs, loss_fn),
                         "compiled approx": self.step(torch.compile(approx), inputs, loss_fn)}
                samples, middle = self.time(steps)
                rows.append([name, f"{budget:g}", f"{approx.plan.achieved:.3f}", f"{middle['exact'] * 1e3:.2f}",
                             f"{middle['approx'] * 1e3:.2f}",
                             f"**{paired_ratio(samples, 'exact', 'approx'):.2f}×**",
                             f"{middle['compiled exact'] * 1e3:.2f}", f"{middle['compiled approx'] * 1e3:.2f}",
                             f"**{paired_ratio(samples, 'compiled exact', 'compiled approx'):.2f}×**"])
        self.tables.append(("Sampled ops: train step (fwd + bwd + SGD), measured plan with the budget spent",
                            ["model", "budget", "planned FLOPs", "exact ms", "approx ms", "speed-up",
                             "compiled exact ms", "compiled approx ms", "compiled speed-up"], rows))

    # -- 3. compressed activations ----------------------------------------------------------------------------
    def peak_step(self, run) -> int:
        if self.device.type != "cuda":
            return 0
        torch.cuda.reset_peak_memory_stats(self.device)
        run()
        return torch.cuda.max_memory_allocated(self.device)

    def compressed_activations(self) -> None:
        from char_transformer import CharTransformer

        d = self.device
        images = (2, 32) if self.small else (32, 224)
        tokens = (2, 32) if self.small else (32, 256)
        ids = torch.randint(0, 100, tokens, device=d)
        targets = torch.randint(0, 100, tokens, device=d)
        cases = [("ResNet-50" if not self.small else "ResNet-18",
                  torchvision.models.resnet18 if self.small else torchvision.models.resnet50,
                  (torch.randn(images[0], 3, images[1], images[1], device=d),), lambda y: y.square().mean()),
                 ("char transformer", lambda: CharTransformer(100, 256, 4, 4, tokens[1]), (ids,),
                  lambda y: F.cross_entropy(y.reshape(-1, y.shape[-1]), targets.reshape(-1)))]
        rows = []
        for name, make, inputs, loss_fn in cases:
            torch.manual_seed(0)
            exact = make().to(d).train()
            exact_step = self.step(exact, inputs, loss_fn)
            for budget in (0.25, 0.125):
                approx = fxapprox.approximate(exact, 1.0, memory_budget=budget, example_inputs=inputs,
                                              config=fxapprox.ApproxConfig(check_every=None))
                approx_step = self.step(approx, inputs, loss_fn)
                exact_step(), approx_step()
                exact_peak, approx_peak = self.peak_step(exact_step), self.peak_step(approx_step)
                samples, middle = self.time({"exact": exact_step, "approx": approx_step})
                memory = approx.plan.memory
                rows.append([name, f"{budget:g}", f"{memory.total_exact_bytes / 2**20:.1f}",
                             f"{memory.total_planned_bytes / 2**20:.1f}", f"{exact_peak / 2**20:.0f}",
                             f"{approx_peak / 2**20:.0f}", f"{middle['exact'] * 1e3:.2f}",
                             f"{middle['approx'] * 1e3:.2f}",
                             f"{1 / paired_ratio(samples, 'exact', 'approx'):.2f}×"])
        self.tables.append(("Compressed activations: saved bytes, peak memory of a step, step time",
                            ["model", "memory_budget", "exact saved MiB", "planned MiB", "exact peak MiB",
                             "approx peak MiB", "exact ms", "approx ms", "time / exact"], rows))

    # -- 4. LSTM against cuDNN --------------------------------------------------------------------------------
    def lstm(self) -> None:
        d = self.device
        hidden, steps, batch = (64, 16, 4) if self.small else (1024, 128, 64)
        x = torch.randn(steps, batch, hidden, device=d)
        rows = []
        for keep in (0.5, 0.25):
            torch.manual_seed(0)
            dense = nn.LSTM(hidden, hidden, num_layers=2).to(d)
            sparse = ApproxLSTM.from_lstm(dense, SamplingSpec("topk", max(1, int(keep * hidden)), hidden)).to(d)
            loss_fn = lambda out: out[0].square().mean()   # noqa: E731
            samples, middle = self.time({"cudnn": self.step(dense, (x,), loss_fn),
                                         "sparse": self.step(sparse, (x,), loss_fn)})
            rows.append([f"{keep:g}", f"{middle['cudnn'] * 1e3:.2f}", f"{middle['sparse'] * 1e3:.2f}",
                         f"**{paired_ratio(samples, 'cudnn', 'sparse'):.2f}×**"])
        self.tables.append((f"Sparse-backward LSTM against nn.LSTM (2 layers, hidden {hidden}, {steps} steps, batch "
                            f"{batch})", ["keep-ratio", "nn.LSTM ms", "sparse ms", "speed-up"], rows))

    # -- 5. autocast ------------------------------------------------------------------------------------------
    def autocast(self) -> None:
        d = self.device
        width, batch = (256, 64) if self.small else (4096, 4096)
        x = torch.randn(batch, width, device=d)
        rows = []
        dtypes = (torch.bfloat16,) if d.type == "cpu" else (torch.bfloat16, torch.float16)
        for dtype in dtypes:
            torch.manual_seed(0)
            exact = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)).to(d)
            with torch.autocast(d.type, dtype=dtype):
                approx = fxapprox.approximate(exact, 0.5, memory_budget=0.25, example_inputs=(x,), config=SPENT)
                approx(x)
            exact_step = self.step(exact, (x,), lambda y: y.float().square().mean(), dtype)
            approx_step = self.step(approx, (x,), lambda y: y.float().square().mean(), dtype)
            samples, middle = self.time({"exact": exact_step, "approx": approx_step})
            finite = bool(torch.isfinite(approx_step()).item())
            rows.append([str(dtype).removeprefix("torch."), f"{middle['exact'] * 1e3:.2f}",
                         f"{middle['approx'] * 1e3:.2f}", f"{paired_ratio(samples, 'exact', 'approx'):.2f}×",
                         "yes" if finite else "**no**"])
        self.tables.append(("Autocast: 2 × Linear, budget 0.5 + memory_budget 0.25",
                            ["dtype", "exact ms", "approx ms", "speed-up", "loss finite"], rows))

    # -- 6. host synchronisation ------------------------------------------------------------------------------
    def sync_check(self) -> None:
        d = self.device
        width, batch = (256, 64) if self.small else (2048, 1024)
        x = torch.randn(batch, width, device=d)
        rows = []
        for name, memory_budget in (("default plan", None), ("default plan + memory_budget 0.25", 0.25)):
            for config_name, config in (("default", fxapprox.ApproxConfig(check_every=None)),
                                        ("every layer sampled", EVERY_LAYER)):
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.ReLU(),
                                      nn.Linear(width, 10)).to(d)
                approx = fxapprox.approximate(model, 0.5, memory_budget=memory_budget, example_inputs=(x,),
                                              config=config)
                approx(x).square().mean().backward()   # warm: kernels loaded, caches filled
                error = ""
                with fxapprox.count_host_syncs() as syncs:
                    if d.type == "cuda":
                        torch.cuda.set_sync_debug_mode("error")
                    try:
                        approx(x).square().mean().backward()
                    except RuntimeError as caught:
                        error = str(caught).splitlines()[0][:120]
                    finally:
                        if d.type == "cuda":
                            torch.cuda.set_sync_debug_mode("default")
                rows.append([f"{name}, {config_name}", f"{len(approx.plan.approximated)}/{len(approx.plan.layers)}",
                             str(syncs.total), "–" if d.type != "cuda" else ("**raised**: " + error if error
                                                                              else "no sync")])
        self.tables.append(("Host synchronisation in a training step (forward + backward)",
                            ["model / config", "sampled / layers", "count_host_syncs", "set_sync_debug_mode"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller models")
    parser.add_argument("--no-write", action="store_true", help="print, do not write BENCHMARKS.md")
    parser.add_argument("--allow-cpu", action="store_true", help="without a GPU, run on the CPU at tiny sizes "
                        "(a smoke test of the script; never written)")
    parser.add_argument("--repetitions", type=int, default=10)
    args = parser.parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    elif args.allow_cpu:
        device = torch.device("cpu")
    else:
        print("gpu_suite: needs a CUDA device (none is available here); nothing was run. "
              "`--allow-cpu` runs a CPU smoke test of the script.")
        return
    suite = Suite(device, args.quick, args.repetitions)
    start = time.perf_counter()
    for part in (suite.cuda_tests, suite.sampled_ops, suite.compressed_activations, suite.lstm, suite.autocast,
                 suite.sync_check):
        part_start = time.perf_counter()
        part()
        print(f"{part.__name__}: {time.perf_counter() - part_start:.0f} s", flush=True)
    for title, headers, rows in suite.tables:
        print_table(title, headers, rows)
    seconds = time.perf_counter() - start
    print(f"gpu_suite: {seconds:.0f} s on {device}")
    if device.type == "cuda" and not args.no_write:
        name = torch.cuda.get_device_name(device)
        body = "\n\n".join(f"**{title}**\n\n{markdown_table(headers, rows)}" for title, headers, rows in suite.tables)
        write_section("gpu-suite", f"## GPU suite (`python benchmarks/gpu_suite.py{' --quick' if args.quick else ''}`)"
                                   f" — {name}, torch {torch.__version__}, {seconds / 60:.1f} min\n\n{body}")


if __name__ == "__main__":
    main()

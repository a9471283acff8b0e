"""Command line: ``fxapprox report MODEL ...``, ``fxapprox export MODEL -o DIR ...`` and ``fxapprox bench MODEL ...``.

MODEL is ``torchvision:NAME`` (randomly initialised, no download) or
``package.module:callable`` (called with no arguments, must return an
``nn.Module``). Errors are one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import torch
from torch import nn

from fxapprox.errors import AnalysisError, FxApproxError


class CliError(Exception):
    """A user error: printed as one line, no traceback."""


def load_model(spec: str) -> nn.Module:
    """Build the model a ``MODEL`` argument names."""
    if ":" not in spec:
        raise CliError(f"model {spec!r}: expected torchvision:NAME or package.module:callable")
    source, name = spec.split(":", 1)
    if source == "torchvision":
        import torchvision

        available = torchvision.models.list_models()
        if name not in available:
            raise CliError(f"unknown torchvision model {name!r} (see torchvision.models.list_models())")
        return torchvision.models.get_model(name, weights=None)
    try:
        module = importlib.import_module(source)
    except ImportError as error:
        raise CliError(f"model {spec!r}: cannot import {source!r}: {error}") from None
    factory = getattr(module, name, None)
    if factory is None:
        raise CliError(f"model {spec!r}: {source!r} has no attribute {name!r}")
    model = factory() if callable(factory) and not isinstance(factory, nn.Module) else factory
    if not isinstance(model, nn.Module):
        raise CliError(f"model {spec!r}: {name} returned {type(model).__name__}, not an nn.Module")
    return model


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise CliError(f"--input-shape {text!r}: expected comma-separated integers, e.g. 8,3,224,224") from None
    if not shape or any(d < 0 for d in shape):
        raise CliError(f"--input-shape {text!r}: dimensions must be non-negative integers")
    return shape


def _parse_budget(text: str, flag: str = "--budget", auto: bool = False) -> float | str:
    if auto and text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        expected = "a number in (0, 1] or 'auto'" if auto else "a number in (0, 1]"
        raise CliError(f"{flag} {text!r}: expected {expected}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxapprox", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub):
        sub.add_argument("model", help="torchvision:NAME or package.module:callable")
        sub.add_argument("--budget", default="auto",
                         help="fraction of exact training FLOPs the step executes, in (0, 1], or auto: the plan the "
                              "pay-off model predicts reaches a given loss soonest (auto)")
        sub.add_argument("--input-shape", default="8,3,224,224", help="example input shape (8,3,224,224)")
        sub.add_argument("--memory-budget", default=None,
                         help="fraction of exact saved-activation bytes, in (0, 1] (none: not compressed)")
        sub.add_argument("--method", default="auto", help="pair selection method: topk, crs, bernoulli, wta_crs or "
                                                          "auto (the measured policy picks per layer; auto)")
        sub.add_argument("--policy", default="measured",
                         help="measured (least measured error for the budget), flops or uniform (measured)")
        sub.add_argument("--max-grad-error", default="0.3",
                         help="measured policy: predicted model-gradient error a budget is spent within where it can "
                              "be (past it, the plan warns; auto never passes it), or 'none' (0.3)")
        sub.add_argument("--min-speedup", default="1.05",
                         help="measured policy: a candidate should run this much faster than the exact op (slower "
                              "ones only where a budget needs them), or 'none' to skip timing (1.05)")
        sub.add_argument("--min-gain", default="1.05",
                         help="--budget auto: predicted speed-up / predicted extra steps a plan must reach to be "
                              "used (1.05)")
        sub.add_argument("--seed", type=int, default=0, help="seed for the random model and input (0)")

    report = commands.add_parser("report", help="plan a model and print the rewrite report")
    common(report)
    report.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    report.add_argument("-v", "--verbose", action="store_true",
                        help="after the summary, every layer's plan and why (and the saved activations)")
    export = commands.add_parser("export", help="plan a model and write the transformed graph to a directory")
    common(export)
    export.add_argument("-o", "--output", required=True, help="directory to write into")
    bench = commands.add_parser("bench", help="time exact vs approximated train steps; gradient fidelity per layer")
    common(bench)
    bench.add_argument("--steps", type=int, default=10, help="timed train steps of each model (10)")
    bench.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    bench.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return parser


def _optional_number(text: str, flag: str) -> float | None:
    if text.lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise CliError(f"{flag} {text!r}: expected a number or 'none'") from None


def _checked_arguments(args, progress: bool = False):
    """Shape, budget, memory budget and config, validated before the model is built (bad arguments fail fast)."""
    import fxapprox
    from fxapprox._validate import check_choice, check_fraction, check_int
    from fxapprox.ops.sampling import METHODS

    shape = parse_shape(args.input_shape)
    try:
        budget = _parse_budget(args.budget, auto=True)
        if budget != "auto":
            budget = check_fraction("budget", budget)
        memory_budget = None if args.memory_budget is None else check_fraction(
            "memory_budget", _parse_budget(args.memory_budget, "--memory-budget"))
        check_choice("method", args.method, set(METHODS) | {"auto"})
        if args.command == "bench":
            check_int("steps", args.steps, minimum=1)
            check_int("warmup", args.warmup, minimum=0)
        config = fxapprox.ApproxConfig(
            policy=args.policy, progress=progress,
            max_grad_error=_optional_number(args.max_grad_error, "--max-grad-error"),
            min_speedup=_optional_number(args.min_speedup, "--min-speedup"),
            min_gain=_optional_number(args.min_gain, "--min-gain"))
    except (TypeError, ValueError) as error:
        raise CliError(str(error)) from None
    return shape, budget, memory_budget, config


def _approximate(args, progress: bool):
    import fxapprox

    shape, budget, memory_budget, config = _checked_arguments(args, progress)
    torch.manual_seed(args.seed)
    model = load_model(args.model)
    example = torch.randn(shape)
    try:
        return fxapprox.approximate(model, budget, example_inputs=(example,), memory_budget=memory_budget,
                                    method=args.method, config=config)
    except (TypeError, ValueError) as error:  # argument validation: one line, no traceback
        raise CliError(str(error)) from None


def _bench(args) -> None:
    import fxapprox

    progress = not args.json and sys.stderr.isatty()
    shape, budget, memory_budget, config = _checked_arguments(args, progress)
    torch.manual_seed(args.seed)
    model = load_model(args.model)
    example = torch.randn(shape)
    result = fxapprox.bench(model, (example,), budget=budget, memory_budget=memory_budget, steps=args.steps,
                            warmup=args.warmup, method=args.method, config=config, progress=progress)
    if args.json:
        print(result.to_json())
    else:
        result.show()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "bench":
            _bench(args)
        elif args.command == "report":
            approx = _approximate(args, progress=not args.json and sys.stderr.isatty())
            if args.json:
                print(json.dumps(approx.report.to_dict(), indent=1))
            else:
                approx.report.show(verbose=args.verbose)
        else:
            import fxapprox

            approx = _approximate(args, progress=sys.stderr.isatty())
            paths = fxapprox.export(approx, args.output)
            for kind, path in paths.items():
                print(f"{kind:8s} {path}")
    except CliError as error:
        print(f"fxapprox: error: {error}", file=sys.stderr)
        return 2
    except FxApproxError as error:
        print(f"fxapprox: error: {str(error).splitlines()[0]} (--input-shape {args.input_shape})"
              if isinstance(error, AnalysisError) else f"fxapprox: error: {str(error).splitlines()[0]}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The configuration reference (docs/configuration.md), made from :class:`ApproxConfig` itself: every field with its
default and the paragraph of the class docstring that describes it, in the docstring's sections (the order of the
fields in the code: ``tests/test_docs.py`` checks that too).

``python -m fxapprox.config_docs > docs/configuration.md`` writes it; ``tests/test_docs.py`` checks that the
committed page is what this prints, so the reference cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

from fxapprox.config import ApproxConfig

__all__ = ["configuration_reference", "documented_fields"]

_BULLET = re.compile(r"^- ((?:``\w+``(?: / )?)+): ?(.*)$")


def _described() -> list[tuple[str, list[tuple[list[str], str]]]]:
    """``[(section title, [(field names, description)])]`` from the class docstring's sections (a line ending in
    ``:``) and their bullet lists."""
    groups: list[tuple[str, list[tuple[list[str], str]]]] = []
    current: list | None = None
    for line in inspect.cleandoc(ApproxConfig.__doc__).splitlines():
        stripped = line.strip()
        bullet = _BULLET.match(stripped)
        if bullet:
            if not groups:
                raise RuntimeError("ApproxConfig's docstring lists a field before its first section heading")
            current = [re.findall(r"``(\w+)``", bullet.group(1)), bullet.group(2)]
            groups[-1][1].append(current)
        elif stripped.endswith(":") and not line.startswith(" ") and not stripped.startswith("Example"):
            groups.append((stripped[:-1], []))
            current = None
        elif stripped and line.startswith("  ") and current is not None:
            current[1] += " " + stripped
        else:
            current = None
    return [(title, [(names, text.strip()) for names, text in items]) for title, items in groups]


def documented_fields() -> list[str]:
    """The field names in the order the docstring's sections list them."""
    return [name for _, items in _described() for names, _ in items for name in names]


def _markdown(text: str) -> str:
    """reST's double backticks and cross-reference roles as Markdown's single backticks."""
    text = re.sub(r":(?:class|meth|func|mod|attr):`~?([^`]+)`", r"`\1`", text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def _default(field: dataclasses.Field) -> str:
    value = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    return f"`{value!r}`"


def configuration_reference() -> str:
    """The Markdown page: one table per group, every field of :class:`ApproxConfig` exactly once."""
    fields = {f.name: f for f in dataclasses.fields(ApproxConfig)}
    lines = ["# Configuration reference (`fxapprox.ApproxConfig`)", "",
             "Made by `python -m fxapprox.config_docs` from the dataclass and its docstring (a test keeps them "
             "equal). Every field is a keyword argument: `fxapprox.approximate(model, 0.5, "
             "config=fxapprox.ApproxConfig(max_grad_error=0.2))`; a bad value raises an error naming the field "
             "and the allowed range.", ""]
    seen: set[str] = set()
    for title, items in _described():
        lines += ["## " + _markdown(title), "", "| field | default | meaning |", "|---|---|---|"]
        for names, text in items:
            known = [n for n in names if n in fields]
            seen.update(known)
            defaults = " / ".join(_default(fields[n]) for n in known)
            text = _markdown(text).replace("|", "\\|")
            lines.append(f"| {' / '.join(f'`{n}`' for n in known)} | {defaults} | {text} |")
        lines.append("")
    missing = [name for name in fields if name not in seen]
    if missing:
        raise RuntimeError(f"ApproxConfig fields without a description in its docstring: {missing}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(configuration_reference())

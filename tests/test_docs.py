"""The documentation matches the code it describes."""

import dataclasses
import re
from pathlib import Path

import fxapprox
from fxapprox.config_docs import configuration_reference, documented_fields

ROOT = Path(__file__).resolve().parents[1]


def test_the_configuration_reference_is_the_one_the_code_makes():
    assert (ROOT / "docs" / "configuration.md").read_text().strip() == configuration_reference().strip(), (
        "docs/configuration.md is stale: run `python -m fxapprox.config_docs > docs/configuration.md`")
    page = configuration_reference()
    for field in dataclasses.fields(fxapprox.ApproxConfig):
        assert f"`{field.name}`" in page


def test_the_docstring_sections_list_the_fields_in_code_order():
    assert documented_fields() == [f.name for f in dataclasses.fields(fxapprox.ApproxConfig)]


def test_readme_is_a_landing_page_whose_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target
    for page in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith("http"):
                assert (page.parent / target).exists(), (page.name, target)


_SECTION = re.compile(r"<!-- (?:bench:)?([\w-]+)(?::begin|:start)? -->(.*?)<!-- (?:/bench:\1|/\1|\1:end) -->", re.S)


def _normalised(text: str) -> str:
    return text.replace("×", "x").replace("−", "-").replace("**", "")


def _generated_sections() -> list[str]:
    """Every table section a benchmark script writes (``<!-- bench:name -->`` … ``<!-- /bench:name -->`` and the
    docs' own markers), in BENCHMARKS.md and docs/."""
    sections = []
    for page in [ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")]:
        sections += [match.group(0) for match in _SECTION.finditer(page.read_text())]
    return sections


def test_readme_results_are_the_figures_their_scripts_wrote():
    """Each bold figure of README's results table appears in a table its row's script writes (a section of
    BENCHMARKS.md or docs/ naming the script): rerunning a script and forgetting README fails here."""
    readme = (ROOT / "README.md").read_text()
    table = [line for line in readme.splitlines() if line.startswith("| ") and "`benchmarks/" in line]
    assert table, "README's results table names no benchmark script"
    sections = _generated_sections()
    for row in table:
        script = re.search(r"`benchmarks/([\w.]+)`", row).group(1)
        written = _normalised(" ".join(s for s in sections if script in s))
        assert written, f"no generated section of BENCHMARKS.md or docs/ names {script}"
        for figure in re.findall(r"\*\*([^*]+)\*\*", row):
            assert _normalised(figure) in written, (f"README's {figure!r} ({script}) is not in the tables "
                                                    f"{script} writes: rerun it and copy the figure")

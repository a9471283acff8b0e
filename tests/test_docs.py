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

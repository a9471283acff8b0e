"""The examples run end to end (tiny settings): they are how users first see the measured planner."""

import importlib
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def load(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))   # the examples import their helpers (_text, _compare)

    def loader(name):
        return importlib.import_module(name)
    return loader


def test_char_lstm_example_runs(load):
    example = load("char_lstm")
    out = example.main(["--steps", "6", "--hidden", "32", "--eval-every", "3", "--corpus-bytes", "50000",
                        "--batch", "4", "--seq", "16", "--configs", "dense,sparse,mixed,measured 0.7"])
    results, rows = out["results"], out["comparison"]
    assert set(results) == {"dense", "sparse", "mixed", "measured 0.7"}
    curve = results["dense"]["curve"]
    assert curve[-1][2] < curve[0][2]  # it learns something in 6 steps
    assert {row["config"] for row in rows} == set(results)
    assert all("vs_exact_equal_time" in row and "vs_exact_equal_steps" in row for row in rows)


def test_char_transformer_example_runs(load, tmp_path):
    example = load("char_transformer")
    out = example.main(["--steps", "4", "--eval-every", "2", "--corpus-bytes", "50000", "--batch", "4", "--seq", "32",
                        "--width", "32", "--heads", "2", "--layers", "1", "--configs", "exact,flops 0.5,measured 0.7",
                        "--json", str(tmp_path / "out.json")])
    results = out["results"]
    assert results["flops 0.5"]["achieved"] <= 0.5 + 1e-9
    assert results["measured 0.7"]["predicted_error"] is not None
    assert (tmp_path / "out.json").exists()
    row = {r["config"]: r for r in out["comparison"]}["exact"]
    assert row["vs_exact_equal_steps"] == 0 and row["vs_exact_equal_time"] == 0


def test_digits_example_runs(load):
    pytest.importorskip("sklearn")
    example = load("digits_cnn")
    out = example.main(["--epochs", "1", "--seeds", "1"])
    assert set(out["results"]) == set(example.CONFIGS)
    assert out["results"]["flops 0.5"]["achieved"] < 0.6


def test_llama_lm_example_runs(load):
    pytest.importorskip("transformers")
    example = load("llama_lm")
    out = example.main(["--quick", "--no-lora", "--configs", "exact", "DropBP 0.5", "fxapprox 0.5"])
    results = out["results"]
    assert set(results) == {"exact", "DropBP 0.5", "fxapprox 0.5"}
    assert abs(results["DropBP 0.5"]["achieved"] - 0.5) < 0.02   # the baseline runs at the FLOPs of budget 0.5
    assert all(0.0 <= rate <= 0.95 for rate in results["DropBP 0.5"]["rates"].values())
    assert results["fxapprox 0.5"]["achieved"] <= 1.0 and results["fxapprox 0.5"]["note"]


def test_dropbp_allocation_meets_the_flops_and_prefers_insensitive_blocks(load):
    dropbp = load("_dropbp")
    scores = {"a": 1.0, "b": 0.1, "c": 0.5}
    flops = {"a": 100.0, "b": 100.0, "c": 200.0}
    rates = dropbp.allocate(scores, flops, 0.5, spread=0.25)
    assert abs(sum(flops[n] * rates[n] for n in rates) - 0.5 * sum(flops.values())) < 1e-6
    assert rates["b"] >= rates["c"] >= rates["a"] and all(0.25 <= r <= 0.75 for r in rates.values())

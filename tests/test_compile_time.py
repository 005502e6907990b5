"""bench.compile_time: the measured process trains through optimize() and says so in its result."""

import math

import pytest

from qlora_nb_utils.bench import compile_time


def test_measure_trains_through_optimize_and_records_its_description(tmp_path):
    r = compile_time.measure(scope="whole", cache_dir=tmp_path / "whole", seq_len=64, steps=2)
    opt = r["optimize"]
    assert opt["description"].startswith("optimize: ")
    assert "scope=whole" in opt["description"]
    assert opt["choices"]["scope"] == "whole"
    assert opt["choices"]["device"] == "cpu"
    assert all(isinstance(v, str) for v in opt["choices"].values())  # JSON-safe
    assert r["compilations"] == 1, r["recompile_reasons"]  # fixed shapes, whole model: one graph
    # the package's shared artifact folder is off: a case starts only from the caches measure() gives it
    assert opt["choices"]["compile_cache"] == "False" and "compile_cache=False (asked for)" in opt["description"]
    assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
    assert r["first_step_s"] > 0 and r["process_s"] > r["first_step_s"]
    # where a start goes: each import, the load, optimize(), the first step, on the parent's clock
    assert list(r["imports"]) == [*compile_time.IMPORTS, "qlora_nb_utils"]
    assert r["import_s"] == pytest.approx(sum(r["imports"].values()), abs=1e-2)
    assert r["load_s"] > 0 and r["optimize_s"] >= 0 and r["spawn_to_main_s"] >= 0
    parts = r["spawn_to_main_s"] + r["import_s"] + r["load_s"] + r["optimize_s"] + r["first_step_s"]
    assert parts <= r["time_to_first_step_s"] + 0.05 and r["time_to_first_step_s"] < r["process_s"]
    # a cold cache: the AOTAutograd cache saved the graph (warm_cache="auto" takes its Functions)
    assert opt["choices"]["warm_cache"] == "True"
    aot = r["cache_counters"]["aot_autograd"]
    assert aot.get("autograd_cache_miss", 0) >= 1 and not aot.get("autograd_cache_bypass"), aot


def test_load_case_gives_the_batches_the_process_trains(tmp_path):
    model, batches = compile_time.load_case(seq_len=64, steps=2)
    assert len(batches) == 2
    assert tuple(batches[0]["input_ids"].shape) == (2, 64)
    assert any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("kwargs, message", [({"scope": "layers"}, "scope must be"), ({"steps": 1}, "steps must be"),
                                             ({"warm_cache": "yes"}, "warm_cache must be"),
                                             ({"scope": "auto"}, "a measurement names what it compiles")])
def test_measure_refuses_bad_options_before_starting_a_process(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        compile_time.measure(cache_dir=tmp_path, **kwargs)

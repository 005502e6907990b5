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
    assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
    assert r["first_step_s"] > 0 and r["process_s"] > r["first_step_s"]


def test_load_case_gives_the_batches_the_process_trains(tmp_path):
    model, batches = compile_time.load_case(seq_len=64, steps=2)
    assert len(batches) == 2
    assert tuple(batches[0]["input_ids"].shape) == (2, 64)
    assert any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("kwargs, message", [({"scope": "layers"}, "scope must be"), ({"steps": 1}, "steps must be")])
def test_measure_refuses_bad_options_before_starting_a_process(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        compile_time.measure(cache_dir=tmp_path, **kwargs)

"""Tests for qlora_nb_utils.diagnostics: each number it reports must match what Dynamo did."""

import inspect
import json
import logging
import types

import pytest
import torch

from qlora_nb_utils.compile import counting
from qlora_nb_utils.diagnostics import (
    CompileCounter,
    check_fullgraph,
    diagnose_model,
    format_report,
    graph_breaks,
)


def _break_in_middle(x):
    y = torch.sin(x)
    torch._dynamo.graph_break()  # BREAK-LINE
    return torch.cos(y)


def _print_in_middle(x):
    y = torch.sin(x)
    print("side effect")  # BREAK-LINE
    return torch.cos(y)


def _clean(x):
    return torch.cos(torch.sin(x)) * 2


def _line_of(fn, marker="BREAK-LINE"):
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, ln in enumerate(lines) if marker in ln)


def _matmul_sum(x, w):
    return (x @ w).relu().sum()


@pytest.mark.parametrize("fn", [_break_in_middle, _print_in_middle])
def test_graph_break_in_middle_is_one_break_with_reason_and_location(fn):
    report = graph_breaks(fn, torch.randn(4))
    assert (report.graph_count, report.graph_break_count) == (2, 1)
    assert len(report.break_reasons) == 1
    reason = report.break_reasons[0]
    assert reason["reason"].strip()
    assert "Hint:" not in reason["reason"]
    assert reason["location"] == f"{__file__}:{_line_of(fn)}"
    assert report.reasons_source == "explain"
    json.dumps(report.to_dict())


def test_check_fullgraph_names_the_break_and_its_line():
    result = check_fullgraph(_break_in_middle, torch.randn(4))
    assert result.ok is False
    assert result.error_type == "Unsupported"
    assert "graph_break" in result.error
    assert result.location == f"{__file__}:{_line_of(_break_in_middle)}"


def test_clean_function_has_no_break_and_passes_fullgraph():
    report = graph_breaks(_clean, torch.randn(4))
    assert (report.graph_count, report.graph_break_count) == (1, 0)
    assert report.break_reasons == [] and report.reasons_source == "none"
    assert report.counted_breaks == 0
    assert check_fullgraph(_clean, torch.randn(4)).ok is True


def test_check_fullgraph_leaves_no_compiled_code_behind():
    calls = []

    def backend(gm, example_inputs):
        calls.append(1)
        return gm.forward

    assert check_fullgraph(_clean, torch.randn(4), backend=backend).ok
    torch.compile(_clean, backend=backend)(torch.randn(4))
    assert len(calls) == 2  # the second compile was not served from check_fullgraph's cache


def test_break_before_any_op_is_invisible_to_explain_but_reported():
    def fn(x):
        torch._dynamo.graph_break()
        return torch.sin(x)

    report = graph_breaks(fn, torch.randn(4))
    assert report.graph_break_count == 0  # explain: one graph, so "no break"
    assert report.counted_breaks == 1
    assert report.reasons_source == "counters"
    assert "graph_break" in report.break_reasons[0]["reason"]


def test_explain_count_without_reasons_falls_back_to_fullgraph(monkeypatch):
    fake = types.SimpleNamespace(graph_count=2, graph_break_count=1, break_reasons=[], op_count=2)
    monkeypatch.setattr(torch._dynamo, "explain", lambda fn: (lambda *a, **k: fake))
    report = graph_breaks(_break_in_middle, torch.randn(4))
    assert report.graph_break_count == 1
    assert report.reasons_source == "fullgraph"
    assert "graph_break" in report.break_reasons[0]["reason"]
    assert report.break_reasons[0]["location"].endswith(f":{_line_of(_break_in_middle)}")


@pytest.mark.parametrize("reasons_from", ["metrics", "logs"])
def test_static_shapes_recompile_once_per_new_shape_with_the_guard(reasons_from):
    with CompileCounter(backend="eager", reasons_from=reasons_from) as counter:
        fn = counter.compile(_clean, dynamic=False)
        fn(torch.randn(3, 64))
        fn(torch.randn(3, 64))
        assert (counter.compilations, counter.recompilations) == (1, 0)
        fn(torch.randn(3, 80))
    assert (counter.compilations, counter.recompilations) == (2, 1)
    assert counter.reasons_source == reasons_from
    assert len(counter.recompile_reasons) == 1
    assert "size mismatch at index 1. expected 64, actual 80" in counter.recompile_reasons[0]
    assert not counter.recompile_reasons[0].startswith("0/")


def test_dynamic_none_recompiles_once_then_reuses_the_dynamic_graph():
    counter = CompileCounter(backend="eager")
    fn = counter.compile(torch.sin, dynamic=None)
    fn(torch.randn(8))
    fn(torch.randn(16))
    assert (counter.compilations, counter.recompilations) == (2, 1)
    assert "size mismatch at index 0. expected 8, actual 16" in counter.recompile_reasons[0]
    fn(torch.randn(24))
    assert (counter.compilations, counter.recompilations) == (2, 1)


def test_mark_dynamic_avoids_recompilation():
    counter = CompileCounter(backend="eager")
    fn = counter.compile(torch.sin, dynamic=False)
    for n in (8, 16, 24):
        x = torch.randn(n)
        torch._dynamo.mark_dynamic(x, 0)
        fn(x)
    assert (counter.compilations, counter.recompilations, counter.recompile_reasons) == (1, 0, [])


def test_graph_break_gives_two_compilations_and_counts_only_this_counters_graphs():
    torch.compile(torch.cos, backend="eager")(torch.randn(3))  # another compile, not counted
    counter = CompileCounter(backend="eager")
    counter.compile(_break_in_middle)(torch.randn(4))
    assert (counter.compilations, counter.recompilations) == (2, 0)
    assert counter.compile_s >= counter.backend_s >= 0


def test_aot_backend_counts_the_lazy_backward_compile():
    counter = CompileCounter(backend="aot_eager")
    fn = counter.compile(_matmul_sum, dynamic=False)
    w = torch.randn(8, 4, requires_grad=True)
    fn(torch.randn(5, 8), w).backward()
    fn(torch.randn(5, 8), w).backward()
    assert (counter.compilations, counter.backward_compilations) == (1, 1)
    assert counter.compile_s > 0
    assert set(json.loads(json.dumps(counter.to_dict()))) >= {"compilations", "recompile_reasons"}


@pytest.mark.skipif(not counting._metrics_supported(), reason="this torch keeps no compilation metrics")
def test_a_trace_under_a_reused_compile_id_is_not_counted():
    # what a graph-break check between torch.compiler.reset() calls does: another trace gets the id 0/0
    counter = CompileCounter(backend="aot_eager")
    torch.compiler.reset()
    w = torch.randn(8, 4, requires_grad=True)
    torch.compile(_matmul_sum, backend="aot_eager", dynamic=False)(torch.randn(5, 8), w).backward()
    torch.compiler.reset()
    fn = counter.compile(_matmul_sum, dynamic=False)
    fn(torch.randn(5, 8), w).backward()
    same_id = [m for m in counting._compilation_metrics() if str(m.compile_id) == "0/0"]
    assert len(same_id) >= 4  # two forwards and two backwards under one id
    mine = counter._metrics()
    assert [m.is_forward for m in mine] == [True, False]
    assert all(m.start_time_us >= same_id[1].end_time_us for m in mine)  # the counter's own, after the other
    assert counter.compile_s == pytest.approx(
        mine[0].entire_frame_compile_time_s + mine[1].duration_us / 1e6)


def test_a_record_without_times_is_judged_by_its_id_alone():
    record = types.SimpleNamespace(start_time_us=None, end_time_us=None, is_forward=True)
    assert counting._handed_over(record, [1.0])
    timed = types.SimpleNamespace(start_time_us=2_000_000, end_time_us=3_000_000, is_forward=True)
    assert counting._handed_over(timed, [2.5]) and not counting._handed_over(timed, [1.0, 3.5])
    backward = types.SimpleNamespace(start_time_us=4_000_000, end_time_us=5_000_000, is_forward=False)
    assert counting._handed_over(backward, [2.5]) and not counting._handed_over(backward, [6.0])


class _ScaledAttention(torch.nn.Module):
    """SDPA with a float attribute as ``scale``, like a transformers attention module."""

    def __init__(self) -> None:
        super().__init__()
        self.scaling = 0.25

    def forward(self, q):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=self.scaling)


def test_a_restarted_trace_is_counted_as_a_restart_under_the_same_compile_id():
    """dynamic=True makes ``self.scaling`` a SymFloat; SDPA needs a Python float, so AOTAutograd's
    tensorify pass restarts Dynamo: two graphs reach the backend, both compile id 0/0."""
    counter = CompileCounter(backend="aot_eager")
    fn = counter.compile(_ScaledAttention(), dynamic=True, fullgraph=True)
    fn(torch.randn(1, 2, 8, 4))
    fn(torch.randn(1, 2, 12, 4))
    assert (counter.compilations, counter.recompilations, counter.recompile_reasons) == (2, 0, [])
    assert counter.restarts == 1 and counter.restart_reasons == ["0/0: TensorifyScalarRestartAnalysis"]
    assert counter.to_dict()["restarts"] == 1
    with torch._dynamo.config.patch(specialize_float=True):  # what ops.static_floats.with_static_floats sets
        torch.compiler.reset()
        counter = CompileCounter(backend="aot_eager")
        fn = counter.compile(_ScaledAttention(), dynamic=True, fullgraph=True)
        fn(torch.randn(1, 2, 8, 4))
        fn(torch.randn(1, 2, 12, 4))
    assert (counter.compilations, counter.recompilations, counter.restarts) == (1, 0, 0)


def test_mode_and_options_reach_the_backend():
    seen = []

    def backend(gm, example_inputs, mode=None):
        seen.append(mode)
        return gm.forward

    counter = CompileCounter(backend=backend)
    counter.compile(_clean, mode="max-autotune")(torch.randn(4))
    assert seen == ["max-autotune"] and counter.compilations == 1

    inductor = CompileCounter().as_backend(mode="reduce-overhead")
    inner = inductor._inner
    config = getattr(inner, "config", None) or inner.keywords["config_patches"]
    assert config.get("triton.cudagraphs") is True


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="reasons_from"):
        CompileCounter(reasons_from="stderr")
    with pytest.raises(ValueError, match="unknown backend"):
        CompileCounter(backend="no-such-backend").as_backend()
    with pytest.raises(ValueError, match="not both"):
        CompileCounter().as_backend(mode="max-autotune", options={"max_autotune": True})
    with pytest.raises(ValueError, match="inductor mode"):
        CompileCounter().as_backend(mode="fastest-please")
    with pytest.raises(ValueError, match="make_batch"):
        diagnose_model(torch.nn.Identity(), {}, seq_lens=[8])
    with pytest.raises(ValueError, match="compile_kwargs"):
        diagnose_model(torch.nn.Identity(), {}, compile_kwargs={"fulgraph": True})


def test_log_capture_restores_logging_state_and_prints_nothing(capfd):
    from torch._logging import _internal

    log = counting._RecompileLogCapture._logger()
    before = (log.level, log.propagate, list(log.handlers), set(_internal._get_log_state().artifact_names))
    with CompileCounter(backend="eager", reasons_from="logs") as counter:
        assert any(isinstance(h, logging.Handler) and h is counter._capture for h in log.handlers)
        fn = counter.compile(torch.sin, dynamic=False)
        fn(torch.randn(2))
        fn(torch.randn(3))
    after = (log.level, log.propagate, list(log.handlers), set(_internal._get_log_state().artifact_names))
    assert after == before
    assert "Recompiling" not in capfd.readouterr().err
    assert counter.recompile_reasons == ["tensor 'args[0]' size mismatch at index 0. expected 2, actual 3"]


def test_format_report_shows_counts_and_reasons():
    d = {"graph_breaks": 1, "break_reasons": [{"reason": "Call to graph_break\nExplanation: x", "location": "a.py:3"}],
         "fullgraph_ok": False, "fullgraph_error": "Call to graph_break", "compilations": 3,
         "recompilations": 2, "recompile_reasons": ["tensor 'x' size mismatch"], "compile_s": 1.5, "seq_lens": [8, 16]}
    text = format_report(d)
    for needle in ("FAILS", "Call to graph_break (a.py:3)", "size mismatch", "1.50 s", "8, 16"):
        assert needle in text
    assert "-" in format_report({"graph_breaks": 0, "fullgraph_ok": True})


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def _batch(seq_len):
    ids = torch.randint(0, 128, (2, seq_len), generator=torch.Generator().manual_seed(seq_len))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def test_tiny_llama_diagnosis_matches_a_counter_run():
    model = _tiny_llama()
    d = diagnose_model(model, _batch(16), compile_kwargs={"backend": "eager"},
                       seq_lens=[16, 24, 32], make_batch=_batch)
    json.dumps(d)
    assert d["graph_breaks"] == 0 and d["break_reasons"] == []
    assert d["fullgraph_ok"] is True and d["fullgraph_error"] is None
    assert (d["compilations"], d["recompilations"]) == (2, 1)  # static, then one dynamic graph
    assert len(d["recompile_reasons"]) == 1
    assert "size mismatch at index 1. expected 16, actual 24" in d["recompile_reasons"][0]
    assert d["compile_s"] > 0 and d["seq_lens"] == [16, 24, 32]
    assert all(p.grad is None for p in model.parameters())

    counter = CompileCounter(backend="eager")
    compiled = counter.compile(model)
    for seq_len in (16, 24, 32):
        compiled(**_batch(seq_len)).loss.backward()
    assert (counter.compilations, counter.recompilations, counter.recompile_reasons) == (
        d["compilations"], d["recompilations"], d["recompile_reasons"])


@pytest.mark.slow
def test_inductor_backend_counts_like_eager():
    counter = CompileCounter()  # inductor
    fn = counter.compile(lambda x: (x.sin() * 2).sum(), dynamic=False, mode="default")
    fn(torch.randn(8))
    fn(torch.randn(9))
    assert (counter.compilations, counter.recompilations) == (2, 1)
    assert counter.backend_s > 0


def test_counter_still_counts_when_log_capture_cannot_install(monkeypatch):
    def broken(self):
        raise AttributeError("log_state moved")

    monkeypatch.setattr(counting._RecompileLogCapture, "__enter__", broken)
    with pytest.warns(RuntimeWarning, match="recompile reasons unavailable"):
        with CompileCounter(backend="eager", reasons_from="logs") as counter:
            fn = counter.compile(torch.sin, dynamic=False)
            fn(torch.randn(2))
            fn(torch.randn(3))
    assert (counter.compilations, counter.recompilations, counter.recompile_reasons) == (2, 1, [])

"""The compile matrix on the tiny model: every cell clean, counted and written as it goes."""

import json

import pytest
import torch

from qlora_nb_utils.bench import matrix


@pytest.fixture(scope="module")
def small_matrix(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix") / "m.json"
    # LoRA only: notebooks/03_qlora_graph_breaks.ipynb runs the qlora cells with these very options
    # (its "ci" profile) and asserts the same of each, so CI runs them once
    res = matrix.run_matrix("tiny", configs=["lora"], steps=3, batch_size=2, max_len=192, device="cpu",
                            backend="eager", warmup=1, out=out, log=lambda *_: None)
    return res, out


def test_every_cell_has_zero_breaks_and_few_compilations(small_matrix):
    res, _ = small_matrix
    assert len(res["cells"]) == 2 * 2 * 2
    for cell in res["cells"]:
        where = {k: cell[k] for k in ("config", "grad_ckpt", "lengths", "scope")}
        assert cell["graph_breaks"] == 0 and cell["fullgraph_ok"] and cell["compiled_error"] is None, where
        assert cell["compilations"] == 1, (where, cell["recompile_reasons"])
        assert cell["max_abs_loss_diff"] <= 1e-4, where  # fp32, the eager backend: same kernels
    assert {c["lengths"]: c["distinct_lengths"] for c in res["cells"]}["fixed"] == 1


def test_cells_are_written_to_json_with_the_required_fields(small_matrix):
    res, out = small_matrix
    on_disk = json.loads(out.read_text())
    assert len(on_disk["cells"]) == len(res["cells"]) and {"device", "versions"} <= set(on_disk)
    required = {"model", "quant", "lora", "grad_ckpt", "lengths", "scope", "graph_breaks", "fullgraph_ok",
                "compilations", "max_abs_loss_diff", "peak_mem_gib", "median_step_ms", "eager_losses", "losses",
                "first_step_loss_diff", "steady_peak_mem_gib", "eager_steady_peak_mem_gib"}
    assert all(required <= set(cell) for cell in on_disk["cells"])
    for cell in on_disk["cells"]:  # the steady peak leaves steps out; it cannot exceed the run's peak
        assert 0 < cell["steady_peak_mem_gib"] <= cell["peak_mem_gib"]
        assert 0 < cell["eager_steady_peak_mem_gib"] <= cell["eager_peak_mem_gib"]
    assert matrix.summary_frame(res).shape[0] == len(res["cells"])
    assert on_disk["options"]["eager_numerics"] is False


def test_cells_keep_the_per_step_losses_of_both_runs(small_matrix):
    res, _ = small_matrix
    steps = res["options"]["steps"]
    for cell in res["cells"]:
        eager, compiled = cell["eager_losses"], cell["losses"]
        assert len(eager) == len(compiled) == steps
        assert all(type(x) is float for x in eager + compiled)
        diffs = [abs(a - b) for a, b in zip(eager, compiled)]
        assert cell["first_step_loss_diff"] == pytest.approx(diffs[0], abs=1e-12)
        assert cell["max_abs_loss_diff"] == pytest.approx(max(diffs), abs=1e-12)


def test_eager_numerics_reaches_prepare_for_compile_and_the_options(monkeypatch):
    """One cell with eager_numerics=True (the eager backend ignores it; the break check, which
    the module's matrix covers, is stubbed out to keep this test at a few seconds)."""
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("eager_numerics"))
        return prepare_for_compile(*args, **kwargs)

    prepare_for_compile = matrix.prepare_for_compile
    monkeypatch.setattr(matrix, "prepare_for_compile", spy)
    monkeypatch.setattr(matrix, "_break_check", lambda *a: {"graph_breaks": 0, "fullgraph_ok": True})
    res = matrix.run_matrix("tiny", configs=["lora"], grad_ckpts=[False], lengths=["fixed"], scopes=["whole"],
                            steps=2, batch_size=2, max_len=192, device="cpu", backend="eager", warmup=1,
                            eager_numerics=True, log=lambda *_: None)
    assert res["options"]["eager_numerics"] is True and seen == [True]
    (cell,) = res["cells"]
    assert len(cell["eager_losses"]) == len(cell["losses"]) == 2 and cell["first_step_loss_diff"] <= 1e-4
    with pytest.raises(ValueError, match="eager_numerics"):
        matrix.run_matrix("tiny", configs=["lora"], eager_numerics="yes")


def test_base_fp32_master_trains_fp32_weights_under_autocast(monkeypatch):
    """Full fine-tuning with fp32 master weights: the weights stay fp32, the forward runs under
    bf16 autocast (logits come out bf16), eager and compiled alike; LoRA configs are untouched."""
    monkeypatch.setattr(matrix, "_break_check", lambda *a: {"graph_breaks": 0, "fullgraph_ok": True})
    seen = []
    real_train = matrix.train

    def spy_train(model, batches, cfg, forward=None, label="eager"):
        b = {k: v for k, v in batches[0].items()}
        with torch.no_grad():
            seen.append((label, next(model.parameters()).dtype, forward(**b).logits.dtype))
        return real_train(model, batches, cfg, forward=forward, label=label)

    monkeypatch.setattr(matrix, "train", spy_train)
    kw = dict(grad_ckpts=[False], lengths=["fixed"], scopes=["whole"], steps=2, batch_size=2, max_len=192,
              device="cpu", dtype="bfloat16", backend="eager", warmup=1, log=lambda *_: None)
    res = matrix.run_matrix("tiny", configs=["base"], base_fp32_master=True, **kw)
    assert res["options"]["base_fp32_master"] is True
    assert res["cells"][0]["weights_dtype"] == "float32 (autocast)"
    assert seen == [("eager", torch.float32, torch.bfloat16), ("compiled-whole", torch.float32, torch.bfloat16)]
    seen.clear()
    res = matrix.run_matrix("tiny", configs=["base"], base_fp32_master=False, **kw)
    assert res["cells"][0]["weights_dtype"] == "bfloat16" and {s[1] for s in seen} == {torch.bfloat16}
    with pytest.raises(ValueError, match="base_fp32_master"):
        matrix.run_matrix("tiny", configs=["base"], base_fp32_master=1)


def test_cli_passes_eager_numerics_and_base_fp32_master(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(matrix, "run_matrix", lambda *a, **k: calls.append(k) or {"cells": []})
    for flags in ([], ["--eager-numerics"], ["--base-fp32-master"]):
        assert matrix.main([*flags, "--out", str(tmp_path / "m.json")]) == 0
    assert [(c["eager_numerics"], c["base_fp32_master"]) for c in calls] == [(False, False), (True, False),
                                                                              (False, True)]


def test_base_lr_trains_only_the_base_cells_at_their_own_rate(monkeypatch):
    """`base_lr` reaches the full fine-tune's optimizer and nothing else; each cell records its lr."""
    monkeypatch.setattr(matrix, "_break_check", lambda *a: {"graph_breaks": 0, "fullgraph_ok": True})
    seen = []
    real_train = matrix.train
    monkeypatch.setattr(matrix, "train", lambda model, batches, cfg, forward=None, label="eager":
                        seen.append(cfg.lr) or real_train(model, batches, cfg, forward=forward, label=label))
    res = matrix.run_matrix("tiny", configs=["lora", "base"], grad_ckpts=[False], lengths=["fixed"],
                            scopes=["whole"], steps=2, batch_size=2, max_len=192, device="cpu", backend="eager",
                            warmup=1, lr=2e-4, base_lr=2e-5, log=lambda *_: None)
    assert seen == [2e-4, 2e-4, 2e-5, 2e-5]  # eager then compiled, per config
    assert [(c["config"], c["lr"]) for c in res["cells"]] == [("lora", 2e-4), ("base", 2e-5)]
    assert res["options"]["lr"] == 2e-4 and res["options"]["base_lr"] == 2e-5
    for bad in (0, -1e-4, "2e-5", True):
        with pytest.raises(ValueError, match="base_lr must be a positive number"):
            matrix.run_matrix("tiny", configs=["base"], base_lr=bad)
    with pytest.raises(ValueError, match="lr must be a positive number"):
        matrix.run_matrix("tiny", configs=["lora"], lr=0.0)


def test_cli_passes_the_learning_rates(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(matrix, "run_matrix", lambda *a, **k: calls.append(k) or {"cells": []})
    assert matrix.main(["--out", str(tmp_path / "m.json")]) == 0
    assert matrix.main(["--lr", "1e-4", "--base-lr", "2e-5", "--out", str(tmp_path / "m.json")]) == 0
    assert [(c["lr"], c["base_lr"]) for c in calls] == [(2e-4, None), (1e-4, 2e-5)]


def test_merging_checks_base_lr_only_where_there_are_base_cells(small_matrix):
    res, _ = small_matrix  # lora cells only: one scope's become the base cells
    lora, other = _split(res, "scope")
    base = {**other, "cells": [dict(c, config="base") for c in other["cells"]]}
    merged = matrix.merge_results([lora, {**base, "options": {**base["options"], "base_lr": 2e-5}}])
    assert merged["options"]["base_lr"] == 2e-5  # the lora part's base_lr (None) does not count
    with pytest.raises(ValueError, match="base_lr"):
        matrix.merge_results([{**lora, "cells": [dict(c, config="base") for c in lora["cells"]]},
                              {**base, "options": {**base["options"], "base_lr": 2e-5}}])


def test_time_budget_stops_early():
    res = matrix.run_matrix("tiny", configs=["lora"], steps=2, batch_size=2, max_len=192, device="cpu",
                            backend="eager", warmup=1, time_budget_s=0.0, log=lambda *_: None)
    assert res["cells"] == []


def test_unknown_names_are_rejected():
    with pytest.raises(ValueError, match="qlora"):
        matrix.run_matrix("tiny", configs=["full"])
    with pytest.raises(ValueError, match="regional"):
        matrix.run_matrix("tiny", scopes=["layerwise"])


def _split(res, key):
    """The run split into one part per value of `key`, each shaped like a run_matrix result."""
    parts = {}
    for cell in res["cells"]:
        parts.setdefault(cell[key], {**res, "cells": []})["cells"].append(cell)
    return list(parts.values())


def test_merging_parts_gives_back_the_matrix_in_order(small_matrix):
    res, _ = small_matrix
    parts = _split(res, "scope")[::-1]  # regional part first: the merge must reorder
    merged = matrix.merge_results(parts, command="cmd")
    assert merged["cells"] == res["cells"] and merged["command"] == "cmd" and merged["parts"] == 2


def test_merging_refuses_duplicates_and_mismatches(small_matrix):
    res, _ = small_matrix
    with pytest.raises(ValueError, match="more than one part"):
        matrix.merge_results([res, res])
    other = {**res, "options": {**res["options"], "steps": 99}}
    with pytest.raises(ValueError, match="steps"):
        matrix.merge_results([res, other])
    with pytest.raises(ValueError, match="nothing|no matrix"):
        matrix.merge_results([])


def test_merging_refuses_mixed_eager_numerics_and_reads_a_missing_one_as_off(small_matrix):
    res, _ = small_matrix
    regional, whole = _split(res, "scope")
    with pytest.raises(ValueError, match="eager_numerics"):
        matrix.merge_results([regional, {**whole, "options": {**whole["options"], "eager_numerics": True}}])
    older = {k: v for k, v in whole["options"].items() if k != "eager_numerics"}  # written before the option
    assert len(matrix.merge_results([regional, {**whole, "options": older}])["cells"]) == len(res["cells"])


def _cell(config, losses, eager, **kw):
    return {"config": config, "grad_ckpt": False, "lengths": "fixed", "scope": "whole", "losses": losses,
            "eager_losses": eager, **kw}


def test_parity_table_sets_compiled_against_eager_next_to_the_eager_floor_at_the_same_lr():
    result = {"options": {"lr": 2e-4, "base_lr": 2e-5, "base_fp32_master": True},
              "cells": [_cell("lora", [1.0, 2.004, 3.0], [1.0, 2.0, 3.001]),      # max 4e-3, mean 5/3e-3
                        _cell("lora", [1.0, 2.0, 3.006], [1.0, 2.0, 3.0]),        # max 6e-3: over the target, mean 2e-3
                        _cell("base", [5.0, 4.002], [5.0, 4.0])]}                 # no per-cell lr: base_lr
    noise = {"options": {"lr": 2e-4},  # an older file: one lr for every config, none per cell
             "cells": [{"config": "lora", "losses": {"eager": [1.0, 2.0, 3.0], "eager_again": [1.0, 2.0, 3.0],
                                                      "eager_rows_reversed": [1.0, 2.003, 3.0],
                                                      "eager_flipped": [1.0, 2.0, 3.0]}},
                       {"config": "base-fp32", "losses": {"eager": [5.0, 4.0], "eager_sdpa_math": [5.0, 4.5]}}]}
    noise_base = {"options": {"lr": 2e-4, "base_lr": 2e-5},
                  "cells": [{"config": "base-fp32", "lr": 2e-5,
                             "losses": {"eager": [5.0, 4.0], "eager_sdpa_math": [5.0, 4.001]}}]}
    t = matrix.parity_table(result, [noise, noise_base])
    assert list(t.index) == ["base", "lora"]  # the matrix's config order
    lora, base = t.loc["lora"], t.loc["base"]
    assert lora["cells"] == 2 and lora["cells within 0.005"] == 1
    assert lora["max diff min"] == pytest.approx(4e-3) and lora["max diff max"] == pytest.approx(6e-3)
    assert lora["mean diff min"] == pytest.approx(5e-3 / 3) and lora["mean diff max"] == pytest.approx(2e-3)
    # the repeat and the flag that changed nothing are not samples of the floor
    assert lora["eager runs"] == 1 and lora["eager max max"] == pytest.approx(3e-3)
    # base trained at 2e-5: only the 2e-5 floor counts, not the old file's 2e-4 base-fp32 run
    assert base["lr"] == "2e-05" and base["eager runs"] == 1 and base["eager max max"] == pytest.approx(1e-3)
    assert matrix.cell_lr(result, result["cells"][2]) == 2e-5 and matrix.cell_lr(result, result["cells"][0]) == 2e-4
    assert matrix.cell_lr(result, {**result["cells"][0], "lr": 1e-3}) == 1e-3
    empty = matrix.parity_table(result)  # no noise files: the floor columns are empty
    assert empty.loc["lora", "eager runs"] == 0 and empty.loc["lora", "eager max max"] is None


def test_largest_matrix_picks_the_fullest_file_of_the_folder_it_is_given(tmp_path):
    """The caller names the folder (the product assumes no layout); a missing or empty one gives None."""
    from qlora_nb_utils.bench.matrix_results import largest_matrix

    assert largest_matrix(tmp_path / "absent") is None
    assert largest_matrix(tmp_path) is None
    (tmp_path / "compile_matrix_small.json").write_text(json.dumps({"cells": [{}]}))
    (tmp_path / "compile_matrix_big.json").write_text(json.dumps({"cells": [{}, {}]}))
    (tmp_path / "other.json").write_text(json.dumps({"cells": [{}, {}, {}]}))  # not a matrix file
    assert largest_matrix(tmp_path) == tmp_path / "compile_matrix_big.json"
    assert largest_matrix(str(tmp_path)) == tmp_path / "compile_matrix_big.json"

"""`qlora-nb report` on FSDP2 results: the table is the file's numbers, the loss PNG, the diag file kept apart."""

import json
import re
import shutil
from pathlib import Path

import pytest

from lab.report import fsdp as fsdp_report
from lab.report.__main__ import main as lab_report

RESULTS = Path(__file__).resolve().parents[2] / "lab" / "results" / "fsdp"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _fsdp2(**over) -> dict:
    res = {
        "world_size": 2, "per_gpu_batch": {"1": 3, "2": 3}, "seq_len": 512, "model": "tiny", "dtype": "bfloat16",
        "nf4": "replicate", "quant_storage": "bfloat16",
        "tokens_per_s": {"1": 1000.4, "2": 1900.6}, "scaling": 1900.6 / 1000.4,
        "peak_mem_gib_per_gpu": {"1": 4.321, "2": 3.456}, "max_abs_loss_diff": 0.00123,
        "losses": {"1": [3.0, 2.5, 2.0, 1.8], "2": [3.0, 2.501, 1.999, 1.80123]},
        "graph_breaks": {"1": {"total": 0}, "2": {"total": 1}},
        "compile": {"1": {"compilations": 4}, "2": {"compilations": 5}},
        "first_step_s": {"1": 6.34, "2": 8.26},
        "device": {"name": "Fake GPU"}, "date": "2026-01-02T03:04:05+00:00", "command": "lab/gpu/fsdp/gpu_fsdp.sh",
        "versions": {"torch": "2.11.0", "transformers": "5.17.0", "peft": "0.21.2", "bitsandbytes": "0.50.2"},
    }
    res.update(over)
    return res


def test_report_prints_the_fsdp2_table_and_writes_the_loss_png(tmp_path, capsys):
    path = tmp_path / "fsdp2_fake.json"
    path.write_text(json.dumps(_fsdp2()))
    assert lab_report([str(path)]) == 0
    out, err = capsys.readouterr()
    head = next(line for line in out.splitlines() if line.startswith("`fsdp2_fake.json`"))
    for part in ("Fake GPU", "torch 2.11.0", "transformers 5.17.0", "peft 0.21.2", "bitsandbytes 0.50.2",
                 "2026-01-02T03:04:05+00:00", "tiny", "seq len 512", "NF4 replicate"):
        assert part in head, part
    assert "| 1 | 3 | 1000 | 1.00x | 4.32 | 0 | 4 | 6.3 |" in out
    assert f"| 2 | 3 | 1901 | {1900.6 / 1000.4:.2f}x | 3.46 | 1 | 5 | 8.3 |" in out
    assert "Max |loss diff| 1 vs 2 GPUs over the 4 steps: 1.2e-03" in out
    png = tmp_path / "fsdp2_fake_loss.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert f"wrote {png}" in err


def test_missing_figures_are_dashes_not_crashes():
    res = _fsdp2(tokens_per_s={"1": 0.0, "2": 500.0}, compile={}, first_step_s={"1": None, "2": 1.0},
                 max_abs_loss_diff=None)
    table = fsdp_report.markdown_table(res, "x.json")
    assert "| 1 | 3 | 0 | -x | 4.32 | 0 | - | - |" in table
    assert "| 2 | 3 | 500 | -x | 3.46 | 1 | - | 1.0 |" in table
    assert table.endswith("over the 4 steps: -\n")


def test_the_committed_fsdp2_file_renders_with_its_scaling(tmp_path, capsys):
    # a copy, so that the committed PNG is not rewritten by the test
    path = tmp_path / "fsdp2_h200.json"
    shutil.copy(RESULTS / "fsdp2_h200.json", path)
    res = json.loads(path.read_text())
    assert fsdp_report.is_fsdp2_file(res)
    assert lab_report([str(path)]) == 0
    out = capsys.readouterr().out
    assert f"| {res['scaling']:.2f}x |" in out and f"| {res['world_size']} |" in out
    assert f"{res['max_abs_loss_diff']:.1e}" in out
    assert (tmp_path / "fsdp2_h200_loss.png").read_bytes()[:8] == PNG_MAGIC


def test_the_diag_file_is_skipped_with_a_note(tmp_path, capsys):
    diag = json.loads((RESULTS / "fsdp2_h200_diag.json").read_text())
    assert fsdp_report.is_fsdp2_diag_file(diag) and not fsdp_report.is_fsdp2_file(diag)
    shutil.copy(RESULTS / "fsdp2_h200_diag.json", tmp_path / "fsdp2_h200_diag.json")
    shutil.copy(RESULTS / "fsdp2_h200.json", tmp_path / "fsdp2_h200.json")
    assert lab_report([str(tmp_path / "fsdp2_h200_diag.json"), str(tmp_path / "fsdp2_h200.json")]) == 0
    out, err = capsys.readouterr()
    assert "skipped" in err and "fsdp2_h200_diag.json" in err and "diagnostic" in err
    assert "`fsdp2_h200.json`" in out and "diag" not in out
    assert not (tmp_path / "fsdp2_h200_diag_loss.png").exists()


@pytest.mark.parametrize("content, match", [
    ({"hello": 1}, "not a results file of qlora-nb bench.*hello"),
    ([1, 2], "not a results file \\(a JSON list"),
    ({"partial": True, "finished_runs": ["parity_1"], "missing_runs": ["parity_2"]}, "partial FSDP2"),
])
def test_unknown_json_is_a_clear_error(tmp_path, capsys, content, match):
    path = tmp_path / "other.json"
    path.write_text(json.dumps(content))
    assert lab_report([str(path)]) == 2
    err = capsys.readouterr().err
    assert "other.json" in err
    assert re.search(match, err), err

"""`qlora-nb train`'s first step: it says it compiles and for how long, and no speed it reports holds it.

A session's first step compiles; its tokens/s says nothing of the training's speed. One short
real run (tiny model, CPU, ``aot_eager``: a compile without code generation) checks the lines a
user sees; the rate and the summary are also checked on their own, for runs of every length.
"""

import json
import time

from word_data import write_words

from qlora_nb_utils import cli
from qlora_nb_utils.training.finetuning import Run
from qlora_nb_utils.training.first_step import Ticker, median_tokens_per_s


def _rows(rates, session=0):
    return [{"session": session, "tokens_per_s": r} for r in rates]


def test_tokens_per_s_never_holds_a_compiling_step():
    assert median_tokens_per_s(_rows([1.0])) is None  # only the compiling step ran
    assert median_tokens_per_s(_rows([1.0, 100.0])) == 100.0
    assert median_tokens_per_s(_rows([1.0, 90.0, 110.0])) == 100.0
    assert median_tokens_per_s(_rows([1.0, 5.0, 5.0, 100.0, 100.0, 100.0])) == 100.0  # settled steps only
    # a resumed session compiles again: its first step is left out too
    assert median_tokens_per_s(_rows([1.0, 100.0]) + _rows([2.0, 100.0], session=1)) == 100.0


class _Said:
    def __init__(self):
        self.lines = []

    def __call__(self, line):
        self.lines.append(line)


def _summary(tokens_per_s, tmp_path):
    said = _Said()
    run = Run.__new__(Run)
    run.log, run.out = said, tmp_path
    metrics = {"losses": [3.0, 2.0], "eval_losses": [{"step": 0, "loss": 3.1}, {"step": 2, "loss": 2.9}],
               "tokens_per_s": tokens_per_s, "steps_done": 2, "wall_s": 30.0, "compile_s": 12.5,
               "first_step_s": 14.0, "graph_breaks": 0, "compilations": {"compilations": 1},
               "sample": {"prompt": "p", "before": "b", "after": "a", "expected": "e"}}
    run.summary(metrics)
    return said.lines


def test_the_summary_states_the_compile_apart_from_the_speed(tmp_path):
    done, speed = _summary(1234.0, tmp_path)[:2]
    assert "compiling 12.5 s" in done and "the first step 14.0 s" in done
    assert "1234 real tokens/s" in speed and "compiling first step left out" in speed
    speed = _summary(None, tmp_path)[1]
    assert "not measured" in speed and "tokens/s" in speed


def test_the_ticker_says_how_long_until_stopped():
    said = _Said()
    ticker = Ticker(said, "compiling: {:.2f} s", every=0.02)
    time.sleep(0.15)
    ticker.stop()
    time.sleep(0.05)
    n = len(said.lines)
    time.sleep(0.1)
    assert n >= 2 and len(said.lines) == n  # it ticked, then stopped
    assert said.lines[0].startswith("compiling: ")


def test_a_short_run_says_it_compiles_and_reports_its_rate_without_that_step(tmp_path, capsys, monkeypatch):
    from qlora_nb_utils.training import finetuning

    checks = []
    own_check = finetuning.check_options
    monkeypatch.setattr(finetuning, "check_options", lambda **kw: checks.append(1) or own_check(**kw))
    data = write_words(tmp_path / "words.jsonl", 40)
    out = tmp_path / "run"
    code = cli.main(["train", "--model", "tiny", "--device", "cpu", "--dtype", "float32", "--steps", "2",
                     "--batch-size", "2", "--seq-len", "48", "--eval-every", "0", "--eval-size", "4",
                     "--save-every", "0", "--backend", "aot_eager", "--no-progress", "--data", str(data),
                     "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    before, _, after = text.partition("==> the first step compiles")
    assert after and "==> first step: " in after and "of which compiling" in after
    m = json.loads((out / "metrics.json").read_text())
    assert m["optimize"]["choices"]["scope"] == "regional"  # 2 steps on a CPU: one layer's graph
    first, second = m["history"]
    assert m["first_step_s"] == round(first["step_ms"] / 1e3, 3)
    assert m["tokens_per_s"] == second["tokens_per_s"] != first["tokens_per_s"]
    assert m["time_to_first_step_s"] is None or m["time_to_first_step_s"] >= m["first_step_s"]
    assert "(median, the compiling first step left out)" in text
    phases, parts = m["start_phases_s"], m["start_overlap_s"]
    assert set(phases) == {"data_and_load_s", "optimize_s"} and set(parts) == {"data_s", "load_s"}
    assert phases["data_and_load_s"] + 0.01 >= max(parts.values())  # side by side: the wall covers each
    assert "its batches built meanwhile" in before and "training batches of 2" in before
    assert len(checks) == 1  # the CLI checks the options before the allocator is set; finetune() takes them

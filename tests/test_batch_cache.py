"""A run's finished batches kept on disk (``data.batch_cache``), through ``build_finetune_batches``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from word_data import write_words

from qlora_nb_utils import models
from qlora_nb_utils.data import batch_cache
from qlora_nb_utils.training import finetune_batches


@pytest.fixture()
def folder(tmp_path, monkeypatch) -> Path:
    """A private batch cache for the test."""
    where = tmp_path / "batches"
    monkeypatch.setattr(batch_cache, "default_dir", lambda: where)
    return where


@pytest.fixture(scope="module")
def tok():
    return models.load_tokenizer("tiny")


def _build(tok, data, **kw):
    lines: list[str] = []
    out = finetune_batches.build_finetune_batches(tok, data=data, batch_size=2, seq_len=kw.pop("seq_len", 48),
                                                  eval_size=4, log=lines.append, **kw)
    return out, lines


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def _counting_builds(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = finetune_batches._build
    monkeypatch.setattr(finetune_batches, "_build", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("packing", [True, False])
def test_an_unchanged_start_reads_the_same_batches_back(tmp_path, folder, tok, monkeypatch, packing):
    data = write_words(tmp_path / "words.jsonl", 40)
    builds = _counting_builds(monkeypatch)
    (train, held, example), said = _build(tok, data, packing=packing)
    assert builds == [1] and len(list(folder.glob("*.pt"))) == 1
    (train2, held2, example2), said2 = _build(tok, data, packing=packing)
    assert builds == [1]  # read back, not built
    assert _same(train, train2) and _same(held, held2) and example == example2
    assert ("document_ids" in train2[0]) is packing
    # the same lines as the build said, then one saying where the batches came from
    assert said2[:-1] == said and said2[-1].startswith(f"==> batches read back from {folder}")


def test_a_changed_file_or_option_builds_again(tmp_path, folder, tok, monkeypatch):
    data = write_words(tmp_path / "words.jsonl", 40)
    builds = _counting_builds(monkeypatch)
    _build(tok, data)
    _build(tok, data, seed=1)  # another order
    _build(tok, data, seq_len=64)
    assert len(builds) == 3
    with open(data, "a") as fh:  # one example more: the file's size and time change
        fh.write(Path(data).read_text().splitlines()[0] + "\n")
    (train, _, _), said = _build(tok, data)
    assert len(builds) == 4 and not said[-1].startswith("==> batches read back")
    assert len(list(folder.glob("*.pt"))) == 4


def test_an_unreadable_entry_is_built_again_and_replaced(tmp_path, folder, tok, monkeypatch):
    data = write_words(tmp_path / "words.jsonl", 40)
    (train, _, _), _ = _build(tok, data)
    [entry] = folder.glob("*.pt")
    entry.write_bytes(entry.read_bytes()[:100])  # a disk filled while it was written
    builds = _counting_builds(monkeypatch)
    (again, _, _), _ = _build(tok, data)
    assert builds == [1] and _same(train, again)
    (third, _, _), said = _build(tok, data)
    assert builds == [1] and said[-1].startswith("==> batches read back")  # the entry was written anew


def test_batches_over_the_size_limit_are_not_kept(tmp_path, folder, tok, monkeypatch):
    data = write_words(tmp_path / "words.jsonl", 40)
    (train, held, _), _ = _build(tok, data, cache=False)
    size = batch_cache.tensor_bytes([train, held])
    assert size == sum(t.numel() * t.element_size() for b in train + held for t in b.values())
    monkeypatch.setattr(batch_cache, "MAX_ENTRY_BYTES", size - 1)
    builds = _counting_builds(monkeypatch)
    _build(tok, data)
    _build(tok, data)
    assert builds == [1, 1] and not list(folder.glob("*.pt"))
    monkeypatch.setattr(batch_cache, "MAX_ENTRY_BYTES", size)
    _build(tok, data)
    assert len(list(folder.glob("*.pt"))) == 1


def test_cache_false_keeps_nothing(tmp_path, folder, tok, monkeypatch):
    data = write_words(tmp_path / "words.jsonl", 40)
    builds = _counting_builds(monkeypatch)
    _build(tok, data, cache=False)
    _build(tok, data, cache=False)
    assert builds == [1, 1] and not folder.exists()


def test_a_missing_data_file_is_the_builders_error(tmp_path, folder, tok):
    with pytest.raises(FileNotFoundError):
        _build(tok, tmp_path / "absent.jsonl")
    assert not folder.exists()


def test_a_read_back_start_imports_neither_datasets_nor_pandas(tmp_path):
    """What the cache spares a start: loading the examples, which imports datasets and pandas."""
    data = write_words(tmp_path / "words.jsonl", 40)
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from qlora_nb_utils import models
        from qlora_nb_utils.data import batch_cache
        from qlora_nb_utils.training.finetune_batches import build_finetune_batches
        batch_cache.default_dir = lambda: Path({str(tmp_path / 'batches')!r})
        tok = models.load_tokenizer("tiny")
        before = sorted(m for m in ("datasets", "pandas") if m in sys.modules)
        build_finetune_batches(tok, data={str(data)!r}, batch_size=2, seq_len=48, eval_size=4, log=lambda m: None)
        print(before, sorted(m for m in ("datasets", "pandas") if m in sys.modules))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    first, second = (r.stdout.strip().splitlines()[-1] for r in runs)
    assert first == "[] ['datasets', 'pandas']"  # built: the examples loaded through datasets
    assert second == "[] []"  # read back: neither imported


@pytest.mark.parametrize("tokenized", ["kept", "not kept"])
def test_only_the_rows_own_warnings_become_notes(folder, tok, tmp_path, monkeypatch, tokenized):
    """catch_warnings is process-wide: what another thread warns during the build (the model load
    beside it) is neither logged as a note nor kept with the batches; the rows' own warnings (examples
    dropped) are notes, said again on a read-back, whether the token cache had the rows or not."""
    import threading
    import warnings

    if tokenized == "not kept":  # a token cache of its own: the rows are tokenized here
        monkeypatch.setenv("QLORA_NB_CACHE", str(tmp_path / "cache"))

    stop = threading.Event()

    def loading():  # another thread, warning all along
        while not stop.is_set():
            warnings.warn_explicit("a load warning", FutureWarning, "elsewhere.py", 7)
            stop.wait(0.001)

    kw = dict(data=None, batch_size=4, seq_len=128, eval_size=8)  # the shipped data: prompts that fill 128 tokens
    said: list[str] = []
    other = threading.Thread(target=loading)
    with pytest.warns(FutureWarning, match="a load warning"):
        other.start()
        try:
            finetune_batches.build_finetune_batches(tok, log=said.append, **kw)
        finally:
            stop.set()
            other.join()
    notes = [line for line in said if line.startswith("note:")]
    assert all("dropped" in n and "--seq-len 128" in n for n in notes), said
    assert any("of 4000 examples" in n for n in notes) and any("of 8 examples" in n for n in notes), said
    again: list[str] = []
    finetune_batches.build_finetune_batches(tok, log=again.append, **kw)
    assert again[:-1] == said and again[-1].startswith("==> batches read back")

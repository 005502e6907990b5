"""The training data: JSONL files or saved datasets in, validated examples out (:mod:`.tokenizing` makes token rows).

Each line (or row) is one of three layouts: ``prompt``/``response`` (the shipped
``data/kjv_continue_*.jsonl``, built by ``data/build_kjv.py``), ``prompt``/``completion``
(TRL's convention), or ``messages``, a list of ``{"role": "system"|"user"|"assistant",
"content": str}`` whose last message is the assistant turn that is learned. A source is a JSONL
file or a ``Dataset``/``DatasetDict.save_to_disk`` folder. It is validated before ``datasets``
or a model sees it (``validate_source``), so bad data fails with its file and line instead of
deep inside pyarrow, and before a run spends minutes loading a model.

Design: rows keep their own columns (a file mixing layouts gets the union, absent fields null)
and :func:`format_example` recognises each row's layout, so no rewriting pass is needed, extra
columns survive, and ``tokenize_examples`` (which only calls :func:`format_example`) works
on every layout. :func:`format_example` renders each example with the model's chat template.

Importing this module is cheap: ``datasets`` (no torch) and ``pyarrow`` are imported by the
functions that need them; tokenizers are passed in.
"""

from __future__ import annotations

import importlib.resources
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._paths import package_parent

if TYPE_CHECKING:
    import datasets

SPLITS = ("train", "validation")
FILE_TEMPLATE = "kjv_continue_{split}.jsonl"
PADDING_POLICIES = ("longest", "multiple", "fixed")
IGNORE_INDEX = -100
REQUIRED_FIELDS = ("prompt", "response")
OPTIONAL_STR_FIELDS = ("id", "source")
CHAT_ROLES = ("system", "user", "assistant")
#: the splits of a saved DatasetDict that :func:`load_splits` holds out, first found wins
HELDOUT_SPLITS = ("validation", "test")
_LAYOUT_HINT = "a record has prompt/response, prompt/completion or messages"


class DataFormatError(ValueError):
    """Data that is not one valid example per JSONL line (or per row of a saved dataset)."""


def default_data_path(split: str = "train") -> Path:
    """Return the path of the shipped data file for ``split``.

    The repository's ``data/`` folder next to the package wins (editable installs, a clone);
    otherwise the copy installed as ``qlora_nb_utils.shipped_data`` (``pip install git+URL``).

    Args:
        split: ``"train"`` or ``"validation"``.

    Returns:
        Path of ``kjv_continue_<split>.jsonl``.

    Raises:
        ValueError: unknown split.
        FileNotFoundError: neither location holds the file.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    name = FILE_TEMPLATE.format(split=split)
    repo_copy = package_parent() / "data" / name
    if repo_copy.is_file():
        return repo_copy
    try:
        installed = Path(str(importlib.resources.files("qlora_nb_utils.shipped_data") / name))
    except ModuleNotFoundError:
        installed = None
    if installed is not None and installed.is_file():
        return installed
    raise FileNotFoundError(
        f"shipped data file {name} not found in {repo_copy.parent} "
        "nor in the installed package qlora_nb_utils.shipped_data"
    )


def _layout(record: dict) -> str:
    """The row's layout: ``"messages"``, ``"completion"`` or ``"response"`` (null = absent)."""
    if record.get("messages") is not None:
        return "messages"
    if record.get("completion") is not None and record.get("response") is None:
        return "completion"
    return "response"


def _check_messages(messages: Any) -> str | None:
    """Return what is wrong with a chat's ``messages``, or None."""
    if not isinstance(messages, list):
        return f"field 'messages' must be a list, got {type(messages).__name__}"
    if len(messages) < 2:
        return f"field 'messages' needs a prompt and the assistant's answer, got {len(messages)} message(s)"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{i}] must be an object, got {type(message).__name__}"
        for key in ("role", "content"):
            if message.get(key) is None:
                return f"messages[{i}] has no {key!r}"
            if not isinstance(message[key], str):
                return f"messages[{i}] {key!r} must be a string, got {type(message[key]).__name__}"
        if message["role"] not in CHAT_ROLES:
            return f"messages[{i}] has unknown role {message['role']!r}; valid roles: {', '.join(CHAT_ROLES)}"
        if not message["content"].strip():
            return f"messages[{i}] ({message['role']}) has empty content"
    if messages[-1]["role"] != "assistant":
        return f"the last message must be the assistant's (it is learned), got role {messages[-1]['role']!r}"
    return None


def _check_record(record: Any) -> str | None:
    """Return what is wrong with one parsed line, or None if it is a valid example."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    plain = [k for k in ("prompt", "response", "completion") if record.get(k) is not None]
    if record.get("messages") is not None and plain:
        return f"field 'messages' cannot be combined with {plain[0]!r}; {_LAYOUT_HINT}"
    if "response" in plain and "completion" in plain:
        return "fields 'response' and 'completion' are both given; use one"
    layout = _layout(record)
    if layout == "messages" and (problem := _check_messages(record["messages"])):
        return problem
    for key in () if layout == "messages" else ("prompt", layout):
        if key not in record:
            return f"missing field {key!r} ({_LAYOUT_HINT})"
        if not isinstance(record[key], str):
            return f"field {key!r} must be a string, got {type(record[key]).__name__}"
        if not record[key].strip():
            return f"field {key!r} is empty"
    for key in OPTIONAL_STR_FIELDS:
        if key in record and not isinstance(record[key], str):
            return f"field {key!r} must be a string, got {type(record[key]).__name__}"
    return None


#: At most this many bad lines (or rows) are listed in one error; the rest are counted.
MAX_REPORTED_PROBLEMS = 20


class _Problems:
    """Every bad line of one pass: the first :data:`MAX_REPORTED_PROBLEMS` listed, all counted."""

    def __init__(self, where: str, unit: str) -> None:
        self.where, self.unit, self.listed, self.count = where, unit, [], 0

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.listed) < MAX_REPORTED_PROBLEMS:
            self.listed.append(message)

    def raise_if_any(self, total: int) -> None:
        if not self.count:
            return
        more = self.count - len(self.listed)
        tail = f"\n  ... and {more} more" if more else ""
        raise DataFormatError(f"{self.where}: {self.count} bad {self.unit}{'s' if self.count > 1 else ''} of {total}:\n  "
                              + "\n  ".join(self.listed) + tail)


def _json_problem(err: json.JSONDecodeError) -> str:
    """The parser's whole message with its column (``JSONDecodeError.msg`` alone has neither)."""
    return f"invalid JSON: {err.msg} at column {err.colno} (char {err.pos})"


def _scan_file(path: Path) -> tuple[int, bool]:
    """Validate a JSONL file; return its example count and whether its lines differ in shape.

    Every line is checked in one pass; the error lists each bad one as ``file:line: problem``.
    """
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    count, lines, shapes = 0, 0, set()
    problems = _Problems(str(path), "line")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            lines += 1
            try:
                record = json.loads(line.rstrip("\r\n"))  # a column on this line, not past its end
            except json.JSONDecodeError as e:
                problems.add(f"{path}:{lineno}: {_json_problem(e)}")
                continue
            if problem := _check_record(record):
                problems.add(f"{path}:{lineno}: {problem}")
                continue
            count += 1
            shapes.add((frozenset(record), frozenset(k for m in record.get("messages") or () for k in m)))
    problems.raise_if_any(lines)
    if count == 0:
        raise DataFormatError(f"{path}: no examples in file")
    return count, len(shapes) > 1


def validate_file(path: str | Path) -> int:
    """Check a JSONL data file line by line (each any one layout); blank lines are skipped.

    Args:
        path: the file to check.

    Returns:
        The number of examples in the file.

    Raises:
        FileNotFoundError: the file does not exist.
        DataFormatError: a line is not a JSON object of one layout with non-empty strings
            (a bad ``messages``: not a list, fewer than 2, a message without role/content,
            an unknown role, empty content, a last message not the assistant's), has a
            non-string ``id``/``source``, or the file holds no example. The message lists every
            bad line (the first :data:`MAX_REPORTED_PROBLEMS`, and how many more) as
            ``file:line: problem``; for invalid JSON, the parser's message with its column.
    """
    return _scan_file(Path(path))[0]


def _dict_splits(path: Path) -> list[str] | None:
    """The split names of a saved DatasetDict folder, None for a saved Dataset; else DataFormatError."""
    if (path / "dataset_dict.json").is_file():
        try:
            return list(json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"])
        except (ValueError, KeyError, TypeError) as err:
            raise DataFormatError(f"{path}/dataset_dict.json: unreadable ({err!r})") from None
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return None
    raise DataFormatError(f"{path}: not a saved dataset (no dataset_dict.json, nor state.json and "
                          "dataset_info.json, as save_to_disk writes)")


def _check_rows(ds: datasets.Dataset, where: str) -> None:
    """Check every row of a loaded dataset as :func:`validate_file` checks a line."""
    cols = [c for c in ("messages", "prompt", "response", "completion", *OPTIONAL_STR_FIELDS) if c in ds.column_names]
    if "messages" not in cols and "prompt" not in cols:
        raise DataFormatError(f"{where}: columns {ds.column_names}; {_LAYOUT_HINT}")
    if len(ds) == 0:
        raise DataFormatError(f"{where}: no examples")
    row = 0
    problems = _Problems(where, "row")
    for batch in ds.select_columns(cols).iter(batch_size=1024):
        for values in zip(*(batch[c] for c in cols)):
            if problem := _check_record({c: v for c, v in zip(cols, values) if v is not None}):
                problems.add(f"row {row} (0-based): {problem}")
            row += 1
    problems.raise_if_any(row)


def _load_saved(path: Path, split: str) -> datasets.Dataset:
    """One split of a ``save_to_disk`` folder (a Dataset folder has only one), rows checked."""
    splits = _dict_splits(path)
    if splits is not None and split not in splits:
        raise DataFormatError(f"{path}: saved DatasetDict has no split {split!r}; it has {', '.join(splits)}")
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as err:  # whatever a broken folder raises, name the folder
        raise DataFormatError(f"{path}: cannot load the saved dataset ({err})") from err
    ds = loaded if splits is None else loaded[split]
    _check_rows(ds, str(path) if splits is None else f"{path} (split {split!r})")
    return ds


def _heldout_split(path: Path) -> str | None:
    """The held-out split of a saved DatasetDict folder (see ``HELDOUT_SPLITS``), else None."""
    return next((s for s in HELDOUT_SPLITS if s in (_dict_splits(path) or ())), None)


def validate_source(path: str | Path | None = None) -> int:
    """Check a JSONL file or a ``save_to_disk`` folder, cheaply (no torch) and before a model loads.

    A file is checked by :func:`validate_file`; a folder's rows as lines are. A DatasetDict
    needs a ``"train"`` split; its held-out split (``"validation"``, else ``"test"``) is checked too.

    ``path=None`` checks the shipped training file. Returns the number of training examples
    (a DatasetDict's ``"train"`` split). Raises FileNotFoundError when nothing is at ``path``;
    DataFormatError for a bad line or row, a folder that is not a saved dataset (named in the
    message), a DatasetDict without ``"train"``, or data with no prompt or messages column.
    """
    if path is None:
        return validate_file(default_data_path("train"))
    path = Path(path)
    if path.is_file():
        return validate_file(path)
    if not path.is_dir():
        raise FileNotFoundError(f"data not found: {path}")
    count = len(_load_saved(path, "train"))
    if heldout := _heldout_split(path):
        _load_saved(path, heldout)
    return count


def _check_limit(value: Any, name: str = "limit") -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}")


def load_examples(
    path: str | Path | None = None, split: str = "train", limit: int | None = None, *,
    cache_dir: str | Path | None = None,
) -> datasets.Dataset:
    """Validate and load examples from a JSONL file or a ``save_to_disk`` folder, rows as they are.

    Args:
        path: a JSONL file (any layout per line; ``id``, ``source`` optional) or a folder saved
            by ``Dataset``/``DatasetDict.save_to_disk``. Default: the shipped file of ``split``.
        split: which shipped file when ``path`` is None; which split of a saved DatasetDict
            (a saved Dataset has one; ``split`` is then ignored).
        limit: keep only the first ``limit`` examples (the shipped files are in random order,
            so this is a fair sample).
        cache_dir: where ``datasets`` keeps its Arrow cache for a JSONL file (default: its own
            default). Nothing is downloaded; loading works with ``HF_DATASETS_OFFLINE=1``.

    Returns:
        The examples, one row per line (or row of the split).

    Raises:
        FileNotFoundError: the file does not exist.
        DataFormatError: malformed data (see :func:`validate_source`); no such saved split.
        ValueError: ``limit`` is not a positive integer.
    """
    _check_limit(limit)
    path = Path(path) if path is not None else default_data_path(split)
    if path.is_dir():
        ds = _load_saved(path, split)
    else:
        _, mixed = _scan_file(path)
        import datasets

        features = None
        if mixed:  # datasets infers the columns from the first 10 MB; take them from the whole file
            from pyarrow import json as pa_json

            features = datasets.Features.from_arrow_schema(pa_json.read_json(str(path)).schema)
        ds = datasets.load_dataset("json", data_files=str(path), split="train", features=features,
                                   cache_dir=None if cache_dir is None else str(cache_dir))
    if limit is not None and limit < len(ds):
        ds = ds.select(range(limit))
    return ds


def as_rows(ds: Any) -> list:
    """The rows of ``ds`` as plain Python values: a ``datasets.Dataset`` without a format converted in
    one call (``to_list``) instead of row by row (iterating one formats each row on its own, most of
    a cold start's pass over its data), anything else as iterating it gives."""
    if hasattr(ds, "to_list") and getattr(ds, "format", {}).get("type") is None:
        return ds.to_list()
    return list(ds)


def load_splits(path: str | Path | None = None, *, eval_fraction: float = 0.05, max_eval: int | None = 64,
                seed: int = 0, limit: int | None = None) -> tuple[datasets.Dataset, datasets.Dataset]:
    """The training examples and the held-out examples of a source.

    - ``path=None``: the shipped training and validation files.
    - a saved DatasetDict with a ``"validation"`` (else ``"test"``) split: ``"train"`` and that.
    - otherwise (a JSONL file, a saved Dataset, else a DatasetDict's ``"train"``):
      ``max(1, min(max_eval, round(eval_fraction * n)))`` of the ``n`` examples, drawn by
      ``seed``, are held out (never all: at most ``n - 1``); both parts keep the source's order.

    Args:
        path: a JSONL file or a ``save_to_disk`` folder (see :func:`load_examples`).
        eval_fraction: the share held out when the source has no held-out split, in (0, 1).
        max_eval: the most held-out examples; it also caps a given held-out split (its first
            ``max_eval`` rows), so evaluation stays cheap. None: no cap.
        seed: which examples a seeded split holds out.
        limit: keep only the first ``limit`` training examples (after the split).

    Returns ``(train, heldout)``, two ``datasets.Dataset``. Raises what :func:`load_examples`
    raises, DataFormatError when fewer than 2 examples must be split, ValueError for a bad
    ``eval_fraction``, ``max_eval`` or ``limit``.
    """
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
    _check_limit(max_eval, "max_eval")
    _check_limit(limit)
    named = _heldout_split(Path(path)) if path is not None and Path(path).is_dir() else None
    if path is None or named:
        train = load_examples(path, split="train")
        heldout = load_examples(path, split=named or "validation")
    else:
        data = load_examples(path)
        n = len(data)
        if n < 2:
            raise DataFormatError(f"{path}: {n} example; holding some out for evaluation needs at least 2")
        k = min(n - 1, max(1, min(max_eval or n, round(eval_fraction * n))))
        held = set(random.Random(seed).sample(range(n), k))
        heldout = data.select(sorted(held))
        train = data.select([i for i in range(n) if i not in held])
    if max_eval is not None and len(heldout) > max_eval:
        heldout = heldout.select(range(max_eval))
    if limit is not None and limit < len(train):
        train = train.select(range(limit))
    return train, heldout


def format_example(example: dict, tokenizer: Any, chat_template: bool = True) -> tuple[str, str]:
    """Render one example as ``(prompt_text, completion_text)``; their concatenation is the
    full training text, and only the completion is learned by default.

    With ``chat_template=True`` and a tokenizer that has one, the prompt is the conversation
    before the learned turn with the assistant's turn opened (``add_generation_prompt=True``):
    one user turn for a ``prompt``, every message but the last for a chat (earlier assistant
    turns are not learned). The completion is the rest of the full rendering (the template's
    turn end included, trailing whitespace dropped). Without a template: a plain ``### Prompt``
    / ``### Response`` layout, or for a chat one ``### System``/``### User``/``### Assistant``
    section per message, then an open ``### Assistant`` section.

    Args:
        example: a row in any layout (see the module docstring); null fields count as absent.
        tokenizer: a Hugging Face tokenizer.
        chat_template: use the tokenizer's chat template when it has one.

    Returns:
        ``(prompt_text, completion_text)``.

    Raises:
        ValueError: the rendered conversation does not start with the rendered prompt (a chat
            template that rewrites earlier turns), so prompt tokens cannot be masked.
    """
    layout = _layout(example)
    messages = ([{"role": m["role"], "content": m["content"]} for m in example["messages"]] if layout == "messages"
                else [{"role": "user", "content": example["prompt"]}, {"role": "assistant", "content": example[layout]}])
    if not (chat_template and getattr(tokenizer, "chat_template", None)):
        if layout != "messages":
            return f"### Prompt\n{example['prompt']}\n\n### Response\n", example[layout]
        head = "".join(f"### {m['role'].capitalize()}\n{m['content']}\n\n" for m in messages[:-1])
        return head + "### Assistant\n", messages[-1]["content"]
    head = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    if not full.startswith(head):
        raise ValueError("chat template output does not extend the prompt rendering; "
                         "use chat_template=False")
    return head, full[len(head):].rstrip()

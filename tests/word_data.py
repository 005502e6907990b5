"""A small prompt/response JSONL of Greek letter names for the train, export and generate tests.

Each prompt names two letters and its response the next one or two, so a few steps of a tiny
model already change what it says; every row fits in 48 tokens with the chat template.
"""

import json
from pathlib import Path

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def write_words(path: Path, rows: int) -> Path:
    """Write ``rows`` examples to ``path``; return it."""
    examples = [{"prompt": f"Continue: {WORDS[i % 13]} {WORDS[i % 13 + 1]}",
                 "response": " ".join(WORDS[i % 13 + 2:i % 13 + 2 + 1 + i % 2])} for i in range(rows)]
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path

"""``lab/RESULTS.md`` and the README's headline table, both generated from ``lab/results/index.csv``.

Why it exists: a number written by hand goes stale with the next run. Every figure on these
pages is a row of the index (source file, configuration, metric), printed with the device and
date of the run that wrote it; ``python -m lab.index`` rewrites both pages and
``tests/lab/test_index.py`` fails when a committed page differs from what the index gives.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from lab.paths import LAB, RESULTS, ROOT

RESULTS_MD = LAB / "RESULTS.md"
README = ROOT / "README.md"
START, END = "<!-- headline:start (python -m lab.index) -->", "<!-- headline:end -->"
NB_START, NB_END = "<!-- notebooks:start (python -m lab.index) -->", "<!-- notebooks:end -->"
#: the repository on GitHub and the branch, named here once: the README's Colab badges are made from
#: them, and the notebooks' install cell installs the same repository at the same branch by default
#: (tests/lab/test_index.py and tests/test_packaging.py check)
REPOSITORY = "qlora-compile/qlora-compile"
BRANCH = "main"

#: the README's headline: (what it shows, source file under lab/results, configuration, metric, format)
HEADLINE = (
    ("fast path vs HF eager, step time (Llama-3.2-1B shapes, 4 x 512)", "step/fast_path_h200.json",
     "calls/4x512", "speedup", "{:.2f}x"),
    ("vs Unsloth, step time (1B shapes, 4 x 512)", "compute/peers_compute_h100.json",
     "vs_unsloth/1b-4x512 ours b4 s512", "speedup", "{:.2f}x"),
    ("vs Unsloth, step time (8B shapes, 8 x 1024)", "compute/peers_compute_h100.json",
     "vs_unsloth/8b-8x1024 ours b8 s1024", "speedup", "{:.2f}x"),
    ("vs Unsloth, peak memory (8B shapes, 8 x 1024)", "compute/peers_compute_h100.json",
     "vs_unsloth/8b-8x1024 ours b8 s1024", "mem_ratio", "{:.2f}x"),
    ("8B shapes, FSDP2 on 2 GPUs: tokens/s over 1 GPU (8 x 2048 per GPU, LM head split by vocabulary)",
     "fsdp/fsdp2_sharded_h200.json", "vocab_parallel_head", "scaling", "{:.2f}x"),
    ("Llama-70B shapes, all 80 layers, 2 GPUs each capped at 22 GiB, every weight on its GPU (pipeline, 1F1B, "
     "8-bit AdamW): tokens/s", "fsdp/pipeline_h200.json", "big_model", "tokens_per_s", "{:,.0f}"),
    ("longest 8B QLoRA sequence on a 24 GB card (memory capped at 22 GiB): ours",
     "long_context/long_context_h200.json", "budgets/24 GB card, cap 22 GiB", "ours_max_seq_len", "{:,.0f}"),
    ("longest 8B QLoRA sequence on a 24 GB card (memory capped at 22 GiB): Unsloth",
     "long_context/long_context_h200.json", "budgets/24 GB card, cap 22 GiB", "unsloth_max_seq_len", "{:,.0f}"),
    ("8B shapes, 4 x 2048, empty compile caches: launch to the end of step 60, Unsloth's time over ours",
     "compile_time/cold_start_h200.json", "comparisons/llama-3.1-8b-shape 4 x 2048 cold, call 2026-11-29T06:07:16+00:00",
     "unsloth_wall_60_ratio", "{:.2f}x"),
    ("the same job: HF eager's time over ours",
     "compile_time/cold_start_h200.json", "comparisons/llama-3.1-8b-shape 4 x 2048 cold, call 2026-11-29T06:07:16+00:00",
     "hf_eager_wall_60_ratio", "{:.2f}x"),
)

#: the columns of a file's table on RESULTS.md, in this order, when the file has them
MAIN_METRICS = ("median_step_ms", "real_tokens_per_s", "tokens_per_s", "peak_mem_gib", "compile_s", "speedup",
                "mem_ratio", "mfu", "max_abs_loss_diff", "compilations", "graph_breaks")
MAX_TABLE_ROWS = 20


def _find(rows: list[dict], source: str, configuration: str, metric: str) -> dict:
    for row in rows:
        if row["source"] == f"lab/results/{source}" and row["configuration"] == configuration \
                and row["metric"] == metric:
            return row
    raise KeyError(f"no row {source} | {configuration} | {metric} in lab/results/index.csv")


def lower_bound(source: str, configuration: str, metric: str, results: Path = RESULTS) -> bool:
    """Whether a longest length (``*_max_seq_len``) is only a lower bound: its file says beside it that the
    search did not find the edge (``*_edge_found`` false: the longest try that trained, not the longest that
    would). The index holds numbers only, so this one word is read from the results file itself."""
    import json

    if not metric.endswith("_max_seq_len"):
        return False
    node = json.loads((results / source).read_text())
    for part in configuration.split("/"):
        if isinstance(node, list):
            node = next((x for x in node if isinstance(x, dict) and x.get("label") == part), None)
        elif isinstance(node, dict):
            node = node.get(part)
        if node is None:
            return False
    return isinstance(node, dict) and node.get(metric[: -len("max_seq_len")] + "edge_found") is False


def headline_table(rows: list[dict]) -> str:
    lines = ["| what | value | device | date | results row (file, configuration, metric) |", "|---|---|---|---|---|"]
    for what, source, configuration, metric, fmt in HEADLINE:
        row = _find(rows, source, configuration, metric)
        value = ("≥ " if lower_bound(source, configuration, metric) else "") + fmt.format(float(row["value"]))
        lines.append(f"| {what} | {value} | {row['device']} | {row['date']} | "
                     f"`{source}`, `{configuration}`, `{metric}` |")
    return "\n".join(lines) + "\n"


BADGE_SVG = "https://colab.research.google.com/assets/colab-badge.svg"


def colab_url(name: str) -> str:
    """The "Open in Colab" address of ``notebooks/<name>`` in :data:`REPOSITORY`."""
    return f"https://colab.research.google.com/github/{REPOSITORY}/blob/{BRANCH}/notebooks/{name}"


def notebook_with_badge(text: str, name: str) -> str:
    """A notebook's JSON text with its "Open in Colab" badge under the title of its first cell
    (replaced where one is there already), written as Jupyter writes it (indent 1)."""
    import json

    nb = json.loads(text)
    source = [line for line in nb["cells"][0]["source"] if BADGE_SVG not in line]
    badge = f"[![Open in Colab]({BADGE_SVG})]({colab_url(name)})\n"
    if len(source) > 1 and source[1] == "\n" and len(source) > 2 and source[2] == "\n":
        source.pop(2)  # the blank line that followed a removed badge
    nb["cells"][0]["source"] = source[:1] + ["\n", badge] + source[1:]
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def notebook_list(folder: Path = ROOT / "notebooks") -> str:
    """One line per notebook: an "Open in Colab" badge and the notebook's own title."""
    import json

    lines = []
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(path.read_text())
        first = nb["cells"][0]["source"]
        title = "".join(first).split("\n")[0].lstrip("# ").strip()
        title = title.split(" · ", 1)[1] if " · " in title else title  # "NN · Title": the number is in the name
        stamp = nb["metadata"].get("qlora_nb_run")  # the run whose outputs the notebook shows
        if stamp:
            device = f"{stamp['gpus']} x {stamp['device']}" if stamp.get("gpus", 1) > 1 else stamp["device"]
            shown = f" (outputs: {device}, `{stamp['profile']}` profile)"
        else:
            shown = " (no GPU outputs yet)"
        lines.append(f"- [![Open in Colab]({BADGE_SVG})]({colab_url(path.name)}) "
                     f"[`{path.name}`](notebooks/{path.name}): {title}{shown}")
    return "\n".join(lines) + "\n"


def _replace_block(text: str, start: str, end: str, body: str) -> str:
    if start not in text or end not in text:
        raise ValueError(f"README.md has no markers {start} ... {end}")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}{end}{tail}"


def readme_with_headline(readme: str, rows: list[dict]) -> str:
    """``readme`` with its headline table and its notebook list made anew."""
    return _replace_block(_replace_block(readme, START, END, headline_table(rows)), NB_START, NB_END, notebook_list())


def _cell(value: str) -> str:
    number = float(value)
    return f"{number:.4g}" if abs(number) >= 1e-3 or number == 0 else f"{number:.2e}"


def _file_section(source: str, rows: list[dict]) -> list[str]:
    first = rows[0]
    meta = ", ".join(x for x in (first["device"], first["date"], first["versions"],
                                 first["commit"] and f"code at {first['commit']}") if x)
    out = [f"#### `{Path(source).name}`", "", f"{meta}; {len(rows)} rows.", ""]
    metrics = [m for m in MAIN_METRICS if any(r["metric"] == m for r in rows)]
    if not metrics:
        return out + ["(no step-time, memory or parity metric: see the index)", ""]
    table: dict[str, dict[str, str]] = defaultdict(dict)
    for r in rows:
        if r["metric"] in metrics:
            table[r["configuration"] or "(file)"].setdefault(r["metric"], _cell(r["value"]))
    configs = list(table)
    out += ["| configuration | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    for config in configs[:MAX_TABLE_ROWS]:
        out.append(f"| {config} | " + " | ".join(table[config].get(m, "") for m in metrics) + " |")
    if len(configs) > MAX_TABLE_ROWS:
        out.append(f"| ... {len(configs) - MAX_TABLE_ROWS} more configurations in the index | " + " | " * len(metrics))
    return out + [""]


def results_md(rows: list[dict]) -> str:
    """The lab's record: per topic, each results file's run (device, date, versions) and main numbers."""
    by_topic: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_topic[r["topic"]][r["source"]].append(r)
    out = ["# Results", "",
           "Generated by `python -m lab.index` from `lab/results/index.csv`, the one table every results file",
           "under `lab/results/<topic>/` feeds (a row per measured number: source file, device, date, commit,",
           "versions, configuration, metric, value). Each file also records the command that wrote it, as it",
           "was run: the GPU scripts have since been grouped by topic, so a recorded `lab/gpu/<script>` is now",
           "`lab/gpu/<topic>/<script>` (`lab/README.md` lists the topics).",
           "Do not edit by hand: `tests/lab/test_index.py` regenerates this page and compares.", "",
           "## Headline", "", headline_table(rows)]
    for topic in sorted(by_topic):
        out += [f"## {topic}", ""]
        plots = sorted((LAB / "results" / topic).glob("*.png"))
        out += [f"![{p.stem}](results/{topic}/{p.name})" for p in plots] + ([""] if plots else [])
        for source in sorted(by_topic[topic]):
            out += _file_section(source, by_topic[topic][source])
    return "\n".join(out).rstrip() + "\n"

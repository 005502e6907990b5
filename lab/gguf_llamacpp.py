"""``python -m lab.gguf_llamacpp``: the GGUF files ``qlora-nb export --gguf`` writes, loaded by llama.cpp itself.

Why it exists: the test suite reads the files back with transformers' GGUF loader; this runs them in
llama.cpp (through ``llama-cpp-python``, as ``bash setup.sh --with-llama-cpp`` builds it: portable, not
for the CPU it builds on), the runtime users take them to, and compares with the Hugging Face model the
file was written from:

- the token ids llama.cpp's own tokenizer gives each held-out text against the Hugging Face
  tokenizer's (the merges and pre-tokenizer travelled);
- the next-token logits at every position of those ids (f16: same top-1 and the largest
  difference against the logits' range; q8_0 likewise);
- the held-out perplexity of f16 and q8_0 against the checkpoint's;
- the chat template llama.cpp reads from the file.

Models: SmolLM2-135M's real weights (``smollm2-135m``, Llama architecture, tied embeddings) and small
random Qwen2 and Qwen3 models (SmolLM2's tokenizer). Writes ``lab/results/export/gguf_llamacpp_cpu.json``, with
llama.cpp's own account of the CPU features its build uses (``llama_print_system_info``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import math
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "lab" / "results" / "export" / "gguf_llamacpp_cpu.json"


def _held_out(n: int, max_tokens: int) -> list[str]:
    lines = (ROOT / "data" / "kjv_continue_validation.jsonl").read_text().splitlines()[:n]
    return [json.loads(line)["prompt"][: max_tokens * 3] for line in lines]


def _random_checkpoint(folder: Path, model_type: str) -> Path:
    import torch
    import transformers

    from qlora_nb_utils import models

    cls = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[model_type]
    config = getattr(transformers, cls)(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                        max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    models.load_tokenizer("tiny").save_pretrained(folder)
    return folder


def _ppl(logits: np.ndarray, ids: list[int]) -> float:
    x = logits[:-1].astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return math.exp(-float(np.mean(logp[np.arange(len(ids) - 1), ids[1:]])))


def compare(folder: Path, work: Path, texts: list[str], label: str) -> dict[str, Any]:
    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qlora_nb_utils.training.gguf_export import write_gguf

    tok = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = [tok(t, add_special_tokens=False)["input_ids"][:96] for t in texts]
    ref = []
    with torch.no_grad():
        for row in ids:
            ref.append(hf(torch.tensor([row])).logits[0].numpy())
    out: dict[str, Any] = {"model": label, "texts": len(texts), "tokens": sum(map(len, ids)),
                           "hf_ppl": float(np.mean([_ppl(r, i) for r, i in zip(ref, ids)]))}
    for qtype in ("f16", "q8_0"):
        path = write_gguf(folder, work / f"{label}-{qtype}.gguf", qtype=qtype, log=lambda _: None)
        llm = Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
        same_ids = all(llm.tokenize(t.encode(), add_bos=False, special=False) == row for t, row in zip(texts, ids))
        top1, diffs, ppls = [], [], []
        for row, r in zip(ids, ref):
            llm.reset()
            llm.eval(row)
            got = np.asarray(llm.scores[: len(row)], dtype=np.float32)
            top1.append(float((got.argmax(-1) == r.argmax(-1)).mean()))
            diffs.append(float(np.abs(got - r).max() / (r.max() - r.min())))
            ppls.append(_ppl(got, row))
        out[qtype] = {"file_mib": round(path.stat().st_size / 2**20, 2), "same_token_ids": same_ids,
                      "top1_agreement": float(np.mean(top1)), "max_abs_logit_diff_over_range": max(diffs),
                      "ppl": float(np.mean(ppls)),
                      "chat_template_in_file": llm.metadata.get("tokenizer.chat_template") == tok.chat_template,
                      "architecture": llm.metadata.get("general.architecture")}
        del llm
    out["q8_0_ppl_vs_f16"] = out["q8_0"]["ppl"] / out["f16"]["ppl"] - 1
    out["f16_ppl_vs_hf"] = out["f16"]["ppl"] / out["hf_ppl"] - 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.gguf_llamacpp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=8)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    from qlora_nb_utils import models

    texts = _held_out(args.texts, 96)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows.append(compare(Path(models.materialize("smollm2-135m")), work, texts, "smollm2-135m"))
        for kind in ("qwen2", "qwen3"):
            rows.append(compare(_random_checkpoint(work / kind, kind), work, texts, f"{kind}-random-2l"))
    import llama_cpp

    versions = {"python": platform.python_version()}
    for name in ("llama-cpp-python", "gguf", "torch", "transformers", "qlora-nb-utils"):
        versions[name.replace("-", "_")] = md.version(name)
    record = {"device": "cpu", "versions": versions,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")[:10],
              "command": "python -m lab.gguf_llamacpp " + " ".join(sys.argv[1:] if argv is None else argv),
              "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode().strip(),
              "runs": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Unsloth's side of lab/gpu/step/profile_8b.py: the same batches, profiled the same way, in its own process.

Why apart: Unsloth patches transformers and peft on import, so it is imported first, in a
process of its own (``lab.peers.unsloth`` does the same for the peers); the
model is built exactly as that peer builds it (``FastLanguageModel.from_pretrained(load_in_4bit=True,
dtype=bfloat16)``, ``get_peft_model`` on the seven projections, ``use_gradient_checkpointing="unsloth"``
with checkpointing), trained by a plain AdamW loop, and measured by
:func:`lab.profile.profile_training`. Inside the same exclusive window it also
times Unsloth's ``fast_dequantize`` on the microbench's weight (``profile_8b.py``'s ``nf4_weight``).

    python3 lab/gpu/step/profile_unsloth.py SPEC.json PART.json [--grad-ckpt]
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_8b import (  # noqa: E402
    BATCH,
    LORA_ALPHA,
    LORA_R,
    LR,
    PROFILED,
    SEED,
    SEQ,
    TIMED,
    WARMUP,
    dequant_row,
    gpu_lock,
    mark,
    marked_step,
    nf4_weight,
    write_part,
)


def main(argv=None) -> int:
    import json

    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    out, grad_ckpt = argv[1], "--grad-ckpt" in argv
    part = {"library": "unsloth", "grad_ckpt": grad_ckpt}
    mark(part, "start")
    try:
        from lab.peers.unsloth import TARGET_MODULES, import_unsloth, load_batches, package_versions

        FastLanguageModel = import_unsloth()  # before transformers, as the peer does
        import torch

        from lab.profile import profile_training

        batches, b, s = load_batches(spec["batches"])
        assert (b, s) == (BATCH, SEQ), (b, s)
        mark(part, "imported")
        with gpu_lock(spec["lock"], shared=True):
            mark(part, "load_start")
            torch.manual_seed(SEED)
            model, _ = FastLanguageModel.from_pretrained(model_name=spec["model_dir"], max_seq_length=SEQ,
                                                         dtype=torch.bfloat16, load_in_4bit=True)
            model = FastLanguageModel.get_peft_model(
                model, r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=TARGET_MODULES, lora_dropout=0,
                bias="none", use_gradient_checkpointing="unsloth" if grad_ckpt else False, random_state=SEED)
            mark(part, "loaded")
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        adam = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
        part["versions"] = package_versions()

        step = marked_step(model, adam)

        with gpu_lock(spec["lock"], shared=False):
            mark(part, "measure_start")
            res = profile_training(step, batches, warmup=WARMUP, timed=TIMED, profiled=PROFILED, lora_r=LORA_R,
                                   vocab=spec["vocab"],
                                   on_stage=lambda st, r: write_part(out, {**part, **r, "stage": st}))
            part.update(res)
            write_part(out, part)
            if not grad_ckpt:
                part["fast_dequantize"] = _bench_fast_dequantize()
            mark(part, "measure_end")
    except BaseException as exc:  # recorded: the driver tabulates a failed run
        part["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        part["traceback_tail"] = traceback.format_exc()[-3000:]
    part["phases"]["end"] = time.time()
    write_part(out, part)
    return 0


def _bench_fast_dequantize() -> list[dict]:
    from bitsandbytes.functional import dequantize_4bit
    from unsloth.kernels.utils import fast_dequantize

    packed, st = nf4_weight()
    ref = dequantize_4bit(packed, st)
    n = st.shape[0] * st.shape[1]
    rows = []
    for name, kw in (("unsloth fast_dequantize", {}), ("unsloth fast_dequantize (global buffer)",
                                                        {"use_global_buffer": True})):
        try:
            rows.append(dequant_row(name, lambda kw=kw: fast_dequantize(packed, st, **kw), ref, n,
                                    "Unsloth's NF4 path as its LoRA kernels call it"))
        except Exception as exc:  # recorded per row
            rows.append({"name": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
    return rows


if __name__ == "__main__":
    sys.exit(main())

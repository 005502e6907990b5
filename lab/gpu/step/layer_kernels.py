"""Per-layer kernel A/B at the 8B shape: which Inductor options and recipe choices make a decoder
layer's norm and activation kernels cheaper (issue 20).

Why: at 8B, 8 x 1024 the profile (lab/results/step/profile_8b_h100_regional_inplace.json) puts ours'
norm/RoPE/activation kernels at 48 ms a step against Unsloth's 34, and RMSNorm's backward
reductions alone at 14 ms against Unsloth's 4.4, while the matmuls are even. Every decoder layer
runs the same kernels, so the four-layer 8B shape (``llama-3.1-8b-shape-4l``) shows them after a
few seconds of compile per variant, where the 32-layer model costs a minute to load per process.

One process for ours: variants in turn, each from the same LoRA weights and a fresh AdamW, with
``torch._dynamo.reset()`` between them: ``optimize(scope="regional", mode="default")`` with the
variant's options, Inductor config patches held over its whole run, warm-up, timed steps, a
profiled window grouped by :mod:`lab.profile`, and the generated source of the
slowest Triton kernels (from the Inductor cache). Unsloth runs beside it in its own process
(``profile_unsloth.py`` on the same model folder and batches); a file lock keeps every measured
window apart from the other process's work. Results are rewritten after each variant, so a
timeout keeps what finished.

    python3 lab/gpu/step/layer_kernels.py OUT_DIR [--variants a,b,...] [--deadline S]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_8b import BATCH, LORA_ALPHA, LORA_R, LR, SEED, SEQ, gpu_lock, marked_step, write_part  # noqa: E402

MODEL = "llama-3.1-8b-shape-4l"
WARMUP, TIMED, PROFILED = 3, 10, 3
def _unfused_route(min_rows):
    return lambda layer, x: None  # no layer takes the fused NF4 LoRA linear


def _eager_math(compiled):
    from qlora_nb_utils.ops.losses import _ce_math

    return _ce_math  # the loss's softmax arithmetic eager, as before compiled_math


#: name: (optimize() keywords, Inductor config patches held over the variant's run, and
#: (module, attribute, value) patches held over it). ``grad_ckpt`` among the keywords checkpoints every layer.
VARIANTS = {
    "default": ({}, {}, ()),
    "lora_unfused": ({}, {}, (("qlora_nb_utils.compile.patches.nf4_dequant", "make_lora_route", _unfused_route),)),
    "eager_loss_math": ({}, {}, (("qlora_nb_utils.ops.losses", "_math", _eager_math),)),
    "ckpt": ({"grad_ckpt": True}, {}, ()),
    "ckpt_lora_unfused": ({"grad_ckpt": True}, {},
                          (("qlora_nb_utils.compile.patches.nf4_dequant", "make_lora_route", _unfused_route),)),
    "no_eager_numerics": ({"eager_numerics": False}, {}, ()),
    "coord_descent": ({}, {"coordinate_descent_tuning": True}, ()),
    "coord_descent_no_eager_numerics": ({"eager_numerics": False}, {"coordinate_descent_tuning": True}, ()),
    "multi_kernel": ({}, {"triton.multi_kernel": 1}, ()),
    "no_recompute": ({"recompute": False}, {}, ()),
    "max_autotune_no_cudagraphs": ({"mode": "max-autotune-no-cudagraphs"}, {}, ()),
}
#: Time a variant is expected to need (s): one is not started with less left.
NEEDS = {"max_autotune_no_cudagraphs": 150}


@contextlib.contextmanager
def attributes(patches):
    """Set ``(module, attribute, value)`` for the block, then put the old values back."""
    import importlib

    old = []
    try:
        for module, name, value in patches:
            mod = importlib.import_module(module)
            old.append((mod, name, getattr(mod, name)))
            setattr(mod, name, value)
        yield
    finally:
        for mod, name, value in reversed(old):
            setattr(mod, name, value)


def kernel_sources(names: list[str], since: float) -> dict[str, str]:
    """The generated Triton source of each kernel name, from Inductor's cache files written since ``since``."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    found: dict[str, str] = {}
    files = [p for p in Path(cache_dir()).rglob("*.py") if p.stat().st_mtime >= since - 1]
    for name in names:
        for p in files:
            text = p.read_text(errors="replace")
            at = text.find(f"def {name}(")
            if at < 0:
                continue
            start = text.rfind("@triton", 0, at)
            start = start if start >= 0 and at - start < 3000 else at
            end = text.find("\n''', device_str", at)
            found[name] = text[start:end if end > 0 else at + 6000][:8000]
            break
    return found


def run_variant(model, batches, lora_state, name: str, kw: dict, patches: dict, attrs: tuple, vocab: int,
                lock: str) -> dict:
    import torch
    import torch._inductor.config as inductor_config

    from lab.profile import profile_training
    from qlora_nb_utils.compile.fast_path import optimize

    res: dict = {"optimize_kwargs": kw, "inductor_config": patches,
                 "attributes": [f"{m}.{a}" for m, a, _ in attrs]}
    since = time.time()
    model.load_state_dict(lora_state, strict=False)
    torch._dynamo.reset()
    with contextlib.ExitStack() as held:
        held.enter_context(attributes(attrs))  # over optimize() and every step
        opt = optimize(model, batches=batches, scope="regional", **{"mode": "default", "grad_ckpt": False, **kw})
        held.callback(opt.undo)
        res["optimize"] = opt.description
        params = [p for p in model.parameters() if p.requires_grad]
        adam = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
        step = marked_step(opt.forward, adam)
        with inductor_config.patch(patches):
            first = {k: v.cuda() for k, v in batches[0].items()}
            with gpu_lock(lock, shared=True):
                t0 = time.perf_counter()
                step(first)
                torch.cuda.synchronize()
                res["compile_s"] = time.perf_counter() - t0
            with gpu_lock(lock, shared=False):
                res.update(profile_training(step, batches, warmup=WARMUP - 1, timed=TIMED, profiled=PROFILED,
                                            memory=False, lora_r=LORA_R, vocab=vocab, top=30))
        res["compilations"] = opt.counter.to_dict().get("compilations")
    triton = [k["name"] for k in res.get("top_kernels", []) if k["name"].startswith("triton_")]
    res["sources"] = kernel_sources(triton, since)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--deadline", type=float, default=540)
    ap.add_argument("--no-unsloth", action="store_true")
    a = ap.parse_args(argv)
    t_start = time.time()
    import torch
    from transformers import AutoConfig

    from qlora_nb_utils import env, models
    from qlora_nb_utils.bench.main_job import make_bench_batches

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="layer_kernels_"))
    gpu = next((t.lower() for t in ("H100", "H200", "A100") if t in torch.cuda.get_device_name()), "gpu")
    path, src_path = out / f"layer_kernels_{gpu}.json", out / "layer_kernels_sources.json"
    res = {"device": env.device_info("cuda"), "versions": env.versions(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": os.environ.get("QLORA_NB_LAYER_CMD", " ".join(sys.argv)), "model": MODEL,
           "shape": {"batch_size": BATCH, "seq_len": SEQ}, "lora": {"r": LORA_R, "alpha": LORA_ALPHA},
           "steps": {"warmup": WARMUP, "timed": TIMED, "profiled": PROFILED}, "variants": {}}
    sources: dict = {}

    def log(msg):
        print(f"[{time.time() - t_start:6.1f} s] {msg}", flush=True)

    def save():
        write_part(path, res)
        write_part(src_path, sources)

    model_dir = models.materialize(MODEL)
    tok = models.load_tokenizer(MODEL)
    batches, pad = make_bench_batches(tok, batch_size=BATCH, seq_len=SEQ, steps=16, padding="fixed", seed=SEED)
    torch.save(batches, work / "batches.pt")
    vocab = int(AutoConfig.from_pretrained(model_dir).vocab_size)
    res["padding"] = pad
    lock = str(work / "gpu.lock")
    unsloth = None
    if not a.no_unsloth:
        spec = {"batches": str(work / "batches.pt"), "lock": lock, "vocab": vocab, "model_dir": str(model_dir)}
        (work / "spec.json").write_text(json.dumps(spec))
        here = str(Path(__file__).resolve().parent / "profile_unsloth.py")
        from lab.peers.process import _child_env

        unsloth = subprocess.Popen([sys.executable, here, str(work / "spec.json"), str(work / "unsloth.json")],
                                   stdout=open(out / "unsloth_log.txt", "w"), stderr=subprocess.STDOUT,
                                   env=_child_env("unsloth", work / "inductor_unsloth"))
    log(f"built {model_dir}; batches ready")
    with gpu_lock(lock, shared=True):
        model, _ = models.load_model(MODEL, quant="nf4", lora=True, lora_r=LORA_R, lora_alpha=LORA_ALPHA,
                                     dtype="bfloat16", device="cuda", prepare_kbit=True, seed=SEED)
    lora_state = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    log("ours loaded")
    for name in [v for v in a.variants.split(",") if v]:
        kw, patches, attrs = VARIANTS[name]
        left = t_start + a.deadline - time.time()
        if left < NEEDS.get(name, 60):
            res["variants"][name] = {"skipped": f"{left:.0f} s left"}
            continue
        log(f"variant {name}")
        try:
            r = run_variant(model, batches, lora_state, name, kw, patches, attrs, vocab, lock)
            sources[name] = r.pop("sources")
        except Exception as exc:  # recorded: the table shows a failed variant
            import traceback

            r = {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback_tail": traceback.format_exc()[-3000:]}
        res["variants"][name] = r
        log(f"  {name}: {r.get('median_step_ms')} ms, compile {r.get('compile_s')}, {r.get('error', '')[:200]}")
        save()
    if unsloth is not None:
        try:
            unsloth.wait(timeout=max(t_start + a.deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            unsloth.kill()
        p = work / "unsloth.json"
        res["unsloth"] = json.loads(p.read_text()) if p.exists() else {"error": "no result"}
    save()
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Gemma-2's capped, windowed attention under optimize() on a GPU: the loss and LoRA gradients of the model's
own eager forward, through flex attention with the cap in its score modification.

Wrote: lab/results/attention/model_attention_<gpu>.json
Rerun: python lab/gpu/attention/model_attention_check.py --out $OUT/model_attention.json [--flex] [--window N]
  [--kinds padded,packed] [--scopes whole,regional]   (one GPU, repository root;
  --device cpu is the dry run: there optimize() takes the eager attention, flex attention has no CPU backward)

Why: on a CPU the tests can only run the flex path forward (``tests/test_model_attention.py``); the
gradients of the path a GPU takes are checked here. The model is a two-layer Gemma-2 with its
attention scores capped at 5, query/key projections scaled by 6 (so that the cap bites: the
uncapped loss and gradients are recorded beside) and a sliding window of 64 on every other layer,
shorter than the rows (so that the window bites too). fp32 with TF32 off, so that the comparison
is of the attention, not of rounding. For padded and packed batches, in whole and regional scope
(Inductor), each case records the choice and reason, the loss and the largest relative LoRA
gradient difference against the same model's forward with ``attn_implementation="eager"``, the
graph breaks and the compilations over three steps of two lengths (padded) or layouts (packed).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time

import torch

CAP, WINDOW, SCALE = 5.0, 64, 6.0


def _model(device: torch.device, window: int = WINDOW):
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                          attn_logit_softcapping=CAP, sliding_window=window, max_position_embeddings=1024,
                          pad_token_id=0, use_cache=False)
    model = Gemma2ForCausalLM(config).to(device)
    model.set_attn_implementation("sdpa")  # transformers' default: the attention optimize() must not keep
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(SCALE)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(device))
    return model.train()


def _padded(seq: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (2, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -seq // 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _packed(seq: int, seed: int) -> dict:
    from qlora_nb_utils.data import packing

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, WINDOW, (40,), generator=g).tolist()  # documents within the window
    docs = [{"input_ids": (ids := torch.randint(3, 512, (n,), generator=g).tolist()), "labels": ids} for n in lengths]
    return packing.pack_examples(docs, seq, rows_per_batch=2, pad_id=0)[0][0]


def _loss_grads(model, forward, batch):
    model.zero_grad(set_to_none=True)
    loss = forward(**batch).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _own(model, batch, device, capped: bool = True):
    """The model's eager forward (a packed batch as transformers takes it: restarting position ids)."""
    base = model.get_base_model()
    layers = [m for m in base.modules() if hasattr(m, "attn_logit_softcapping")]
    base.set_attn_implementation("eager")
    if not capped:
        for m in layers:
            m.attn_logit_softcapping = None
    try:
        plain = {k: v.to(device) for k, v in batch.items() if k != "document_ids"}
        return _loss_grads(model, lambda **b: model(**b, use_cache=False), plain)
    finally:
        for m in layers:
            m.attn_logit_softcapping = CAP
        base.set_attn_implementation("sdpa")


def _rel(got, ref) -> float:
    return max(float((got[1][n] - g).abs().max() / g.abs().max().clamp(min=1e-30)) for n, g in ref[1].items())


def _case(kind: str, scope: str, device: torch.device, backend: str, window: int = WINDOW) -> dict:
    from qlora_nb_utils import optimize
    from qlora_nb_utils.training.hf_trainer import count_graph_breaks

    make = _padded if kind == "padded" else _packed
    batches = [make(256, 2), make(384 if kind == "padded" else 256, 3), make(256, 4)]
    model = _model(device, window)
    own = [_own(model, b, device) for b in batches]
    uncapped = _own(model, batches[0], device, capped=False)
    torch._dynamo.reset()
    start = time.perf_counter()
    with count_graph_breaks() as breaks:
        opt = optimize(model, batches=batches, scope=scope, backend=backend)
        try:
            got = [_loss_grads(model, opt.forward, b) for b in batches]
            choice = "doc_attention" if kind == "packed" else "attention"
            rec = {"kind": kind, "scope": scope, "choice": opt.choices[choice], "reason": opt.reasons[choice],
                   "losses": [g[0] for g in got], "eager_losses": [o[0] for o in own],
                   "max_abs_loss_diff": max(abs(g[0] - o[0]) for g, o in zip(got, own)),
                   "max_rel_grad_diff": max(_rel(g, o) for g, o in zip(got, own)),
                   "uncapped_loss_diff": abs(uncapped[0] - own[0][0]), "uncapped_rel_grad_diff": _rel(uncapped, own[0]),
                   "compilations": opt.counter.compilations, "recompilations": opt.counter.recompilations,
                   "description": opt.description}
        finally:
            opt.undo()
    rec["graph_breaks"], rec["graph_break_reasons"] = breaks.total, breaks.by_reason
    rec["wall_s"] = round(time.perf_counter() - start, 1)
    rec["ok"] = rec["max_abs_loss_diff"] <= 1e-4 and rec["max_rel_grad_diff"] <= 1e-4 and rec["graph_breaks"] == 0
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--scopes", default="whole,regional")
    p.add_argument("--kinds", default="padded,packed")
    p.add_argument("--window", type=int, default=WINDOW,
                   help="the sliding window of every other layer (longer than the rows: a window that never bites)")
    p.add_argument("--flex", action="store_true",
                   help="let optimize() train the capped scores with flex attention (off in the package until checked)")
    args = p.parse_args(argv)
    from qlora_nb_utils import env
    from qlora_nb_utils.models import attention_scores

    attention_scores.FLEX_TRAINS_SCORES = args.flex

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    cases = []
    for kind in args.kinds.split(","):
        for scope in args.scopes.split(","):
            try:
                rec = _case(kind, scope, device, args.backend, args.window)
            except Exception as exc:  # record and go on: one case's failure is a finding, not the end of the call
                rec = {"kind": kind, "scope": scope, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
            print({k: v for k, v in rec.items() if k != "description"}, flush=True)
            cases.append(rec)
    out = {"kind": "model_attention", "what": __doc__.split("\n")[0], "cap": CAP, "window": args.window,
           "flex_trains_scores": args.flex,
           "qk_scale": SCALE, "dtype": "float32 (TF32 off)", "backend": args.backend, "cases": cases,
           "all_ok": all(c["ok"] for c in cases), "device": env.device_info(device), "versions": env.versions(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": "python lab/gpu/attention/model_attention_check.py " + " ".join(sys.argv[1:])}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print({"all_ok": out["all_ok"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())

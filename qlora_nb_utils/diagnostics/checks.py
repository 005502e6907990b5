"""Diagnose one named configuration, and judge the report against the project's targets.

`diagnostics` knows how to count breaks and compilations for any model and batch; this
module knows *which* model and batches a user means when they say "QLoRA on tiny with
gradient checkpointing over lengths 64, 80, 96", builds them from the shipped data exactly
as a training run would, and turns the report into a list of problems. The CLI's
`diagnose --strict` and the tests use the same `problems()` so that "clean" means one thing.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any, Sequence

import torch

from .. import diagnostics, env, models
from ..data import make_length_batcher

__all__ = ["FLEX_BLOCK_MASKS", "diagnose", "problems", "make_length_batcher"]

#: Where a flex_attention model's BlockMask comes from in `diagnose` (see its docstring).
FLEX_BLOCK_MASKS = ("graph", "precomputed")


def diagnose(
    model: str = "tiny",
    *,
    quant: str = "nf4",
    lora: bool = True,
    grad_ckpt: bool = False,
    seq_lens: Sequence[int] = (64,),
    batch_size: int = 2,
    device: str = "auto",
    dtype: str = "auto",
    seed: int = 0,
    prepare: bool = True,
    scope: str = "whole",
    compile_kwargs: dict | None = None,
    attn: str = "sdpa",
    flex_block_mask: str = "graph",
    fast: bool = False,
) -> dict[str, Any]:
    """Load a configuration and report its graph breaks and compilations.

    Args:
        model: a model name (see `models.MODEL_NAMES`), an HF id or a path.
        quant: "nf4" or "none".
        lora: add LoRA adapters (all linear layers).
        grad_ckpt: enable gradient checkpointing the way users do
            (`prepare_model_for_kbit_training(..., use_gradient_checkpointing=True)` for nf4,
            `gradient_checkpointing_enable()` otherwise).
        seq_lens: lengths the compiled model is run on, in order; compilations are counted.
        batch_size: examples per batch.
        device: "auto", "cpu" or "cuda".
        dtype: "auto" (bf16 on SM80+, fp16 on older GPUs, fp32 on a CPU) or a dtype name.
        seed: seeds LoRA init and the examples drawn.
        prepare: apply `compile.prepare_for_compile` (the package's patches and checkpointing
            policy) first; False reports what upstream does on its own.
        scope: "whole" or "regional" (with `prepare`): what the run over `seq_lens` compiles.
        compile_kwargs: `backend`, `mode`, `dynamic` for the run over `seq_lens`.
        attn: the attention implementation (`models.ATTN_CHOICES`; `flex_attention` trains
            only on CUDA: torch has no CPU backward for it).
        flex_block_mask: with `attn="flex_attention"`, "graph" leaves the mask to the model
            (built in the compiled graph); "precomputed" passes every batch the causal
            `BlockMask` built outside the graph (`attention.causal_block_mask`; the batches
            are right-padded, so no padding mask is needed).
        fast: go through :func:`qlora_nb_utils.optimize` (the user's fast path: lengths padded
            to a multiple of 8, dynamic from the first call when several are given, the chunked
            loss, causal-only SDPA) instead of ``prepare_for_compile`` alone; needs ``prepare``,
            ``scope="whole"`` and ``attn="sdpa"``.

    Returns:
        The `diagnostics.diagnose_model` keys plus the configuration, patches applied,
        device, versions and date.
    """
    from ..env import resolve_device_dtype

    if flex_block_mask not in FLEX_BLOCK_MASKS:
        raise ValueError(f"flex_block_mask must be one of {FLEX_BLOCK_MASKS}, got {flex_block_mask!r}")
    if flex_block_mask == "precomputed" and attn != "flex_attention":
        raise ValueError(f"flex_block_mask='precomputed' needs attn='flex_attention', got attn={attn!r}")
    if fast and (not prepare or scope != "whole" or attn != "sdpa"):
        raise ValueError("fast=True is the optimize() path: it needs prepare=True, scope='whole' and attn='sdpa' "
                         f"(got prepare={prepare}, scope={scope!r}, attn={attn!r})")
    dev, torch_dtype = resolve_device_dtype(device, dtype)
    net, tok = models.load_model(
        model, quant=quant, lora=lora, dtype=torch_dtype, device=dev, seed=seed,
        gradient_checkpointing=grad_ckpt, prepare_kbit=grad_ckpt and quant == "nf4", attn_implementation=attn,
    )
    net.train()
    make_batch = make_length_batcher(tok, batch_size, seed=seed)

    def to_dev(b: dict) -> dict:
        b = {k: v.to(dev) for k, v in b.items()}
        if flex_block_mask == "precomputed":  # the causal BlockMask in place of the 2-D padding mask
            from ..ops.attention import with_causal_block_mask

            b = with_causal_block_mask(dict)(**b)
        return b
    if fast:
        report = _diagnose_fast(net, lambda n: to_dev(make_batch(n)), list(seq_lens), grad_ckpt,
                                dict(compile_kwargs or {}))
    elif prepare:
        report = _diagnose_prepared(net, lambda n: to_dev(make_batch(n)), list(seq_lens), scope, grad_ckpt,
                                    dict(compile_kwargs or {}))
    else:
        report = diagnostics.diagnose_model(
            net, to_dev(make_batch(seq_lens[0])), compile_kwargs=compile_kwargs,
            seq_lens=list(seq_lens), make_batch=lambda n: to_dev(make_batch(n)),
        )
        report["patches"] = []
    report.update(
        lengths=list(seq_lens),  # the name the diagnose checks read; seq_lens is kept for older readers
        model=model, quant=quant, lora=lora, grad_ckpt=grad_ckpt, batch_size=batch_size, prepared=prepare, attn=attn,
        flex_block_mask=flex_block_mask if attn == "flex_attention" else None,
        scope=scope, fast=fast, dtype=str(torch_dtype).replace("torch.", ""), device=env.device_info(dev),
        versions=env.versions(), date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )
    return report


def _describe(err: BaseException) -> str:
    """``Type: first line``, naming the backend's own exception when Dynamo wrapped it."""
    first = lambda e: (str(e).strip().splitlines() or [""])[0]  # noqa: E731
    inner = getattr(err, "inner_exception", None) or err.__cause__
    text = f"{type(err).__name__}: {first(err)}"
    return text + (f" {type(inner).__name__}: {first(inner)}" if inner is not None and inner is not err else "")


def _check_and_run(net, loss_fn, first: dict, forward, items, *, reset_after_checks: bool) -> dict[str, Any]:
    """Breaks and the fullgraph verdict of ``loss_fn`` on ``first``, then each ``(length, batch)`` of
    ``items`` through ``forward`` with a backward; a compiler failure is recorded, not raised."""
    breaks = diagnostics.graph_breaks(loss_fn, **first)
    full = diagnostics.check_fullgraph(loss_fn, **first)
    if reset_after_checks:
        torch.compiler.reset()
    run_error, failed_at = None, None
    for n, batch in items:
        try:
            forward(**batch).loss.backward()
        except Exception as err:  # a compiler failure is a finding of the run, reported, not a crash
            run_error, failed_at = _describe(err), n
            break
        finally:
            net.zero_grad(set_to_none=True)
    return {"graph_breaks": breaks.graph_break_count, "break_reasons": breaks.break_reasons, "fullgraph_ok": full.ok,
            "fullgraph_error": full.error, "run_error": run_error, "run_failed_at_len": failed_at}


def _diagnose_prepared(net, make_batch, seq_lens, scope, grad_ckpt, kwargs) -> dict[str, Any]:
    from ..compile import prepare_for_compile

    prepared = prepare_for_compile(
        net, scope=scope, grad_ckpt=True if grad_ckpt else None, fullgraph=False,
        backend=kwargs.pop("backend", "inductor"), mode=kwargs.pop("mode", None), dynamic=kwargs.pop("dynamic", None),
    )
    try:
        found = _check_and_run(net, lambda **b: net(**b).loss, make_batch(seq_lens[0]), prepared.forward,
                               ((n, make_batch(n)) for n in seq_lens), reset_after_checks=False)
        counts = prepared.counter.to_dict()
    finally:
        prepared.undo()
        torch.compiler.reset()
    counts.pop("backend_s", None)
    return {**found, "seq_lens": seq_lens, "patches": prepared.patches, **counts}


def _diagnose_fast(net, make_batch, seq_lens, grad_ckpt, kwargs) -> dict[str, Any]:
    from ..compile.fast_path import optimize

    batches = [make_batch(n) for n in seq_lens]
    opt = optimize(net, batches=batches, grad_ckpt=bool(grad_ckpt), backend=kwargs.pop("backend", "inductor"),
                   mode=kwargs.pop("mode", None) or "auto", dynamic=kwargs.pop("dynamic", "auto"))
    try:
        found = _check_and_run(net, lambda **b: opt.eager_prepared(**b).loss, opt.prepare(**batches[0]), opt.forward,
                               zip(seq_lens, batches), reset_after_checks=True)
        counts = opt.counter.to_dict()
    finally:
        opt.undo()
        torch.compiler.reset()
    counts.pop("backend_s", None)
    return {**found, "seq_lens": seq_lens, "patches": opt.fast.prepared.patches, "optimize": opt.description,
            **counts}


def problems(report: dict[str, Any], max_compilations: int = 2) -> list[str]:
    """What in a diagnose report misses the targets (empty list: clean).

    Args:
        report: a `diagnose` / `diagnostics.diagnose_model` dict.
        max_compilations: the most compilations a run over the lengths may take.

    Returns:
        One sentence per problem.
    """
    found = []
    if report.get("graph_breaks"):
        found.append(f"{report['graph_breaks']} graph break(s)")
    if not report.get("fullgraph_ok"):
        first = (report.get("fullgraph_error") or "unknown error").splitlines()[0]
        found.append(f"fullgraph=True compile failed: {first}")
    if report.get("run_error"):
        found.append(f"the run over the lengths failed at length {report.get('run_failed_at_len')}: "
                     f"{report['run_error']}")
    compilations = report.get("compilations")
    if compilations is not None and compilations > max_compilations:
        found.append(f"{compilations} compilations over {len(report.get('seq_lens') or [])} lengths (max {max_compilations})")
    return found

"""Model FLOPs of a (Q)LoRA training step, a measured matmul rate, and MFU.

Why it exists: "tokens/s" compares runs of one shape; MFU (model FLOPs utilisation) says how
far a run is from what the GPU can do. It needs two numbers, both stated rather than assumed:

* **FLOPs per step, counted from the model config** (:func:`train_step_flops`). Only matmuls
  count (norms, activations, softmax and the loss are a rounding error at these sizes), each
  ``(T x k) @ (k x n)`` product as ``2*T*k*n``, where ``T = batch * seq_len`` (padding included:
  the GPU computes it). Per decoder layer the linear layers are q, k, v, o, gate, up, down
  (shapes from ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
  ``intermediate_size``), and the LM head ``hidden -> vocab`` once. Attention scores and the
  weighted sum are ``2*b*s*s*(heads*head_dim)`` each, so ``4*b*s^2*d`` per layer forward,
  **not halved for the causal mask** by default (``causal_halved=True`` halves it): that is
  what the SDPA kernels' flop formulas in ``torch.utils.flop_counter`` count, and PaLM/nanoGPT
  MFU count the same way. The backward is traced through which tensors require grad:

  - a *trainable* weight costs 2x its forward (input gradient + weight gradient);
  - a *frozen* base weight (LoRA/QLoRA) costs 1x (the input gradient only), and 0 where its
    input does not require grad: the q/k/v projections of layer 0 read the embeddings, which
    require grad only when something forces them to (``embed_requires_grad``, e.g. the hook
    ``prepare_model_for_kbit_training`` adds with checkpointing);
  - a LoRA pair ``A (k->r), B (r->n)`` costs ``2*T*r*(k+n)`` forward, and backward the two
    weight gradients ``2*T*r*(k+n)``, B's input gradient ``2*T*r*n`` and A's input gradient
    ``2*T*k*r`` when its input requires grad;
  - attention's backward is 2x its forward (four batched matmuls) once its inputs require grad.

  Recomputation (gradient checkpointing) is *not* counted: these are model FLOPs, the work the
  step needs, not the work a given implementation does (that would be hardware FLOPs). The
  same figure therefore serves every peer of a comparison, and MFU ranks them like step time.
  ``tests/test_flops.py`` checks the count against a hand count and against
  ``FlopCounterMode`` over a real forward + backward.

* **The GPU's matmul rate, measured** (:func:`measure_matmul_tflops`): an ``n x n`` matmul in
  the run's dtype, timed with CUDA events after warm-up (on a CPU with ``perf_counter`` and a
  small ``n``). A datasheet peak is a promise; the measured rate is what this card, clock and
  driver give, so MFU against it is an honest upper bound of 1.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterable

import torch

__all__ = ["LINEARS", "StepFlops", "linear_shapes", "train_step_flops", "measure_matmul_tflops", "mfu"]

#: The projections of a Llama decoder layer, in execution order.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step (one micro-batch), split by part.

    Attributes:
        forward: forward-pass FLOPs.
        backward: backward-pass FLOPs.
        parts: part name -> ``(forward, backward)``; parts are ``base`` (frozen or trainable
            base linears), ``lora``, ``attention``, ``lm_head``.
        tokens: ``batch * seq_len``.
    """

    forward: int
    backward: int
    parts: dict
    tokens: int

    @property
    def total(self) -> int:
        """Forward + backward."""
        return self.forward + self.backward

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"forward": self.forward, "backward": self.backward, "total": self.total,
                "tokens": self.tokens, "parts": {k: list(v) for k, v in self.parts.items()}}


def _get(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def linear_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """``name -> (in_features, out_features)`` of each projection of one decoder layer.

    Args:
        config: a ``LlamaConfig`` (or a dict with the same keys).
    """
    d = int(_get(config, "hidden_size"))
    heads = int(_get(config, "num_attention_heads"))
    kv = int(_get(config, "num_key_value_heads") or heads)
    hd = int(_get(config, "head_dim") or d // heads)
    inter = int(_get(config, "intermediate_size"))
    return {"q_proj": (d, heads * hd), "k_proj": (d, kv * hd), "v_proj": (d, kv * hd),
            "o_proj": (heads * hd, d), "gate_proj": (d, inter), "up_proj": (d, inter),
            "down_proj": (inter, d)}


def _linear(t: int, k: int, n: int, *, rg_in: bool, trainable: bool, lora_r: int):
    """(forward, backward, lora_forward, lora_backward, output requires grad) of one linear."""
    fwd = 2 * t * k * n
    bwd = (fwd if rg_in else 0) + (fwd if trainable else 0)
    l_fwd = l_bwd = 0
    if lora_r:
        l_fwd = 2 * t * lora_r * (k + n)
        l_bwd = 2 * t * lora_r * (k + n) + 2 * t * lora_r * n + (2 * t * k * lora_r if rg_in else 0)
    return fwd, bwd, l_fwd, l_bwd, rg_in or trainable or bool(lora_r)


def train_step_flops(
    config: Any,
    batch_size: int,
    seq_len: int,
    *,
    lora_r: int = 16,
    lora_targets: Iterable[str] = LINEARS,
    trainable_base: bool = False,
    embed_requires_grad: bool = False,
    causal_halved: bool = False,
) -> StepFlops:
    """Count the matmul FLOPs of one forward + backward of a Llama-style causal LM.

    Args:
        config: the model's config (``LlamaConfig`` or a dict).
        batch_size: sequences per step.
        seq_len: tokens per sequence (padded length).
        lora_r: LoRA rank; 0 for no adapters.
        lora_targets: which projections carry adapters (``LINEARS`` = "all-linear" in PEFT,
            which leaves the LM head alone).
        trainable_base: the base weights train too (full fine-tuning); False for (Q)LoRA.
        embed_requires_grad: the embedding output requires grad (the
            ``enable_input_require_grads`` hook), so layer 0's q/k/v compute input gradients.
        causal_halved: count half the attention FLOPs (a kernel that skips masked blocks).

    Returns:
        A :class:`StepFlops`.

    Raises:
        ValueError: non-positive sizes, a negative rank, or unknown target names.
    """
    if batch_size < 1 or seq_len < 1 or lora_r < 0:
        raise ValueError(f"batch_size and seq_len must be >= 1 and lora_r >= 0; got "
                         f"{batch_size}, {seq_len}, {lora_r}")
    targets = set(lora_targets)
    if targets - set(LINEARS):
        raise ValueError(f"unknown lora_targets {sorted(targets - set(LINEARS))}; valid: {list(LINEARS)}")
    t = batch_size * seq_len
    shapes = linear_shapes(config)
    layers = int(_get(config, "num_hidden_layers"))
    d_attn = shapes["q_proj"][1]
    attn_fwd = 4 * batch_size * seq_len * seq_len * d_attn // (2 if causal_halved else 1)
    parts = {"base": [0, 0], "lora": [0, 0], "attention": [0, 0], "lm_head": [0, 0]}
    rg = embed_requires_grad  # does the residual stream require grad at this point?

    def run(name: str, rg_in: bool) -> bool:
        k, n = shapes[name]
        f, b, lf, lb, rg_out = _linear(t, k, n, rg_in=rg_in, trainable=trainable_base,
                                       lora_r=lora_r if name in targets else 0)
        parts["base"][0] += f
        parts["base"][1] += b
        parts["lora"][0] += lf
        parts["lora"][1] += lb
        return rg_out

    for _ in range(layers):
        qkv = [run(name, rg) for name in ("q_proj", "k_proj", "v_proj")]
        attn_rg = any(qkv)
        parts["attention"][0] += attn_fwd
        parts["attention"][1] += 2 * attn_fwd if attn_rg else 0
        o_rg = run("o_proj", attn_rg)
        rg = rg or o_rg
        mlp = [run(name, rg) for name in ("gate_proj", "up_proj")]
        down_rg = run("down_proj", any(mlp))
        rg = rg or down_rg
    vocab = int(_get(config, "vocab_size"))
    head = 2 * t * shapes["o_proj"][1] * vocab
    parts["lm_head"] = [head, (head if rg else 0) + (head if trainable_base else 0)]
    fwd = sum(p[0] for p in parts.values())
    bwd = sum(p[1] for p in parts.values())
    return StepFlops(forward=fwd, backward=bwd, parts={k: tuple(v) for k, v in parts.items()}, tokens=t)


def measure_matmul_tflops(device: Any = "cuda", dtype: Any = torch.bfloat16, n: int | None = None,
                          iters: int = 20, warmup: int = 5) -> float:
    """The measured dense matmul rate of ``device`` in ``dtype``, in TFLOP/s.

    An ``n x n @ n x n`` product (``2*n^3`` FLOPs) is run ``warmup`` times, then ``iters``
    times between two CUDA events (on a CPU, between two ``perf_counter`` reads); the median
    of three such rounds is returned.

    Args:
        device: a torch device or name.
        dtype: the matmul dtype (a ``torch.dtype`` or its name, e.g. ``"bfloat16"``).
        n: matrix size; default 8192 on CUDA, 512 on a CPU.
        iters: timed matmuls per round.
        warmup: untimed matmuls first (clocks up, kernels chosen).

    Returns:
        TFLOP/s (1e12 FLOP/s).

    Raises:
        ValueError: ``n``, ``iters`` < 1.
    """
    device = torch.device(device)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    n = n or (8192 if device.type == "cuda" else 512)
    if n < 1 or iters < 1:
        raise ValueError(f"n and iters must be >= 1, got {n}, {iters}")
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(warmup):
        a @ b
    rates = []
    for _ in range(3):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                a @ b
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                a @ b
            seconds = time.perf_counter() - t0
        rates.append(2 * n**3 * iters / seconds / 1e12)
    del a, b
    return sorted(rates)[1]


def mfu(flops_per_step: float, step_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: ``flops_per_step / step_s / peak_flops``.

    Args:
        flops_per_step: model FLOPs of one step (e.g. ``train_step_flops(...).total``).
        step_s: seconds per step (the median steady-state step).
        peak_flops: the device's rate in FLOP/s (``measure_matmul_tflops(...) * 1e12``).

    Raises:
        ValueError: a non-positive argument.
    """
    if flops_per_step <= 0 or step_s <= 0 or peak_flops <= 0:
        raise ValueError(f"mfu needs positive numbers, got {flops_per_step}, {step_s}, {peak_flops}")
    return flops_per_step / step_s / peak_flops

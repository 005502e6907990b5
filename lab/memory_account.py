"""What one training step's memory peak is made of, and how far it is from the least a step must hold.

Why: "the longest sequence under 24 GB" is decided by one number, the step's peak. To know what
to shrink next, the peak must be split into its parts: what lives between steps (the frozen NF4
weights, the adapter, the optimizer state), and what the step adds on top at its highest point
(the layer being computed, the checkpointed layers' inputs, the offload prefetch buffers, the loss
piece). The product's recorder (``qlora_nb_utils.diagnostics.memprof``) replays the allocator's
own record of the step and names the line behind each allocation alive at the peak; this module
sums those lines into the parts above and sets them against a floor.

The floor is stated, not measured: what lives between steps, plus four hidden-state tensors of
the whole sequence (a layer's input and output, and their gradients in the backward), which
every layer-by-layer schedule holds at once. Everything over it is working set that a finer
schedule (smaller tiles, pieces of attention) could in principle trade for time.
"""

from __future__ import annotations

from typing import Any

_GIB = 2**30

#: what an allocation is for, from the innermost frame of its stack that names one of these words
COMPONENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("offload buffers", ("offload.py",)),
    ("loss", ("losses.py", "lm_head.py", "loss_rows")),
    ("MLP", ("tiled_mlp", "mlp", "act_fn", "gate_proj", "down_proj")),
    ("attention", ("sdpa", "attention", "rotary", "flash", "flex")),
    ("embedding", ("embedding",)),
    ("optimizer", ("optim/", "clip_grad")),
)
#: when in the step, from any frame of the stack (first match wins)
PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("recompute in the backward", ("unpack_hook", "recompute_fn")),
    ("backward", ("backward",)),
)
_INTERNAL = ("torch/", "_inductor/", "_dynamo/", "_functorch/", "autograd/", "modules/module.py", "nn/functional.py",
             "contextlib.py", "functools.py")
OTHER = "other"


def part_of(stack: list[str] | str) -> str:
    """``"<what>, <when>"`` for an allocation's stack (innermost first, ``file:line:function`` each).

    *What* is the first :data:`COMPONENTS` entry named by the innermost frame that names one, else
    the innermost frame outside torch and Inductor's modules; *when* is a :data:`PHASES` entry named
    anywhere in the stack, else the forward.
    """
    frames = [stack] if isinstance(stack, str) else list(stack)
    low = [f.lower() for f in frames]
    what = next((name for f in low for name, words in COMPONENTS if any(w in f for w in words)), None)
    if what is None:
        plain = [f for f in frames if not any(i in f for i in _INTERNAL) and not f.split("/")[-1].startswith("c")]
        what = plain[0].rsplit(":", 2)[0] + ":" + plain[0].rsplit(":", 1)[-1] if plain else OTHER
    when = next((name for name, words in PHASES if any(w in f for f in low for w in words)), "forward")
    return f"{what}, {when}"


def held_between_steps(model) -> dict[str, float]:
    """GiB of the frozen parameters and of the adapter (trainable) parameters, as the model holds them."""
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    adapter = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"frozen_params_gib": frozen / _GIB, "adapter_params_gib": adapter / _GIB}


def account(at_peak: dict[str, Any], *, before_gib: float, peak_gib: float, params: dict[str, float],
            seq_len: int, hidden_size: int, dtype_bytes: int = 2,
            at_peak_completed: dict[str, Any] | None = None) -> dict[str, Any]:
    """The peak as parts, from ``memprof.live_at_peak`` of the step and what was allocated before it.

    Args:
        at_peak: ``live_at_peak(snapshot, top=<all>, depth=<deep>, free_on="free_requested")`` of a
            recording that spans one whole step: every block alive at the peak with its stack (the
            allocator's ``allocated`` figures end a block when its tensor dies, so this replay
            matches ``max_memory_allocated``).
        before_gib: ``torch.cuda.memory_allocated()`` when the recording started (between steps).
        peak_gib: the allocator's peak over the step (``max_memory_allocated``).
        params: :func:`held_between_steps` of the model.
        seq_len, hidden_size, dtype_bytes: the floor's four hidden-state tensors.
        at_peak_completed: the same replay ending blocks when they are back in the pool
            (``free_on="free_completed"``): its higher peak is memory whose free waits for another
            stream, which counts against reserved memory and so against a cap.

    Returns:
        ``parts`` (name -> GiB, largest first: what the step added at its peak), the between-steps
        parts, ``floor_gib`` with its definition, ``over_floor_gib``, ``unattributed_gib`` (the
        allocator's peak less what the replay explains: about 0 when the recording is whole),
        ``deferred_free_gib`` and the largest sites.

    Raises:
        ValueError: a negative or inconsistent input (a recording that did not span the step).
    """
    if before_gib < 0 or peak_gib <= 0 or seq_len <= 0 or hidden_size <= 0:
        raise ValueError(f"need before_gib >= 0 and positive peak, seq_len, hidden_size; got "
                         f"{before_gib}, {peak_gib}, {seq_len}, {hidden_size}")
    frozen, adapter = params["frozen_params_gib"], params["adapter_params_gib"]
    if frozen + adapter > before_gib + 1e-6:
        raise ValueError(f"the parameters ({frozen + adapter:.3f} GiB) exceed what was allocated before the step "
                         f"({before_gib:.3f} GiB): the recording did not start between steps")
    parts: dict[str, float] = {}
    for block in at_peak["largest"]:
        name = part_of(block["stack"] or block["site"])
        parts[name] = parts.get(name, 0.0) + block["mib"] / 1024
    if abs(sum(parts.values()) - at_peak["live_gib"]) > 1e-3:
        raise ValueError("at_peak lists fewer blocks than are alive at its peak: call live_at_peak with a top "
                         "above its block count")
    # frees of tensors older than the recording (last step's leftovers) lower the level: what the
    # step added at its highest point is peak_delta, of which live_gib is attributed to sites
    freed_older = at_peak["live_gib"] - at_peak["peak_delta_gib"]
    between = {"frozen weights (NF4 words, their scales, bf16 embedding and head)": frozen,
               "adapter parameters": adapter,
               "optimizer state and the rest held between steps": before_gib - frozen - adapter}
    hidden = 4 * seq_len * hidden_size * dtype_bytes / _GIB
    floor = before_gib + hidden
    return {
        "peak_gib": peak_gib,
        "held_between_steps_gib": before_gib,
        "between_steps": between,
        "added_at_peak_gib": at_peak["peak_delta_gib"],
        "parts": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
        "freed_older_gib": freed_older,
        "unattributed_gib": peak_gib - before_gib - at_peak["peak_delta_gib"],
        "floor_gib": floor,
        "floor_is": "held between steps + 4 hidden-state tensors of the sequence (a layer's input and output and "
                    f"their gradients: 4 x {seq_len} x {hidden_size} x {dtype_bytes} bytes = {hidden:.3f} GiB)",
        "over_floor_gib": peak_gib - floor,
        "deferred_free_gib": (at_peak_completed["peak_delta_gib"] - at_peak["peak_delta_gib"]
                              if at_peak_completed else None),
        "largest_sites": at_peak["by_site"][:12],
        "largest": [{**b, "part": part_of(b["stack"] or b["site"]), "stack": b["stack"][:24]}
                    for b in at_peak["largest"][:40]],
    }

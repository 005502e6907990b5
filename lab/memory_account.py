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

#: the parts of a peak, each with the words in an allocation's stack that put it there; checked in
#: this order over the whole stack (a piece of the MLP allocated while recomputing a layer in the
#: backward is an MLP piece), the first that matches wins
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("offload buffers (layer inputs brought back or sent to the CPU)", ("offload",)),
    ("MLP pieces (tiled)", ("tiled_mlp",)),
    ("loss (labelled rows, vocabulary pieces)", ("losses.py", "lm_head", "loss_rows")),
    ("adapter gradients and optimizer update", ("optim/", "clip_grad", "lora_update.py:apply")),
    ("recompute of a checkpointed layer (backward)", ("recompute_fn", "unpack_hook", "_recompute")),
    ("a layer's backward", ("backward",)),
    ("forward (the layers being computed, the embedding)", ("forward",)),
)
OTHER = "other"


def part_of(stack: list[str] | str) -> str:
    """The part of the peak an allocation belongs to (:data:`PARTS`), from its stack (or one site)."""
    low = (" | ".join(stack) if isinstance(stack, list) else stack).lower()
    return next((name for name, words in PARTS if any(w in low for w in words)), OTHER)


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
        "largest": [{**b, "stack": b["stack"][:10]} for b in at_peak["largest"][:8]],
    }

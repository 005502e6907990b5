"""Is a compiled run's loss "the same" as eager's? Judged against the floor, never a fixed number.

Why it exists: bf16 training is not bit-reproducible across kernels. Two eager runs of the very
same examples drift apart once anything changes the order of a sum, and a compiled run fuses
and reorders by design. So a fixed tolerance is either too tight (it fails correct runs) or
too loose (it hides a bug). The floor is measured instead: the eager run again on the same
batches with the rows of every batch in another order (:func:`permute_rows`). The examples and
the loss are the same in exact arithmetic; only the order of the sums over tokens, in the loss
and in every weight gradient, changes. Its per-step difference from the eager run is what a
correct run can differ by. A compiled run passes (:func:`judge`) when its difference from eager
stays within ``max_factor`` (1.5) x the floor's largest at every step and its mean is at most
``mean_factor`` (1.5) x the floor's mean.

Why a margin on the largest difference too: a correct compiled run is one more draw of the same
noise, and the largest of its steps' differences exceeds the largest of the floor's two runs
about one time in three (of three draws of a maximum, each is the largest equally often). In
fp32 on a CPU that is what the main job met: every difference, the floor's and the compiled
runs', was a few units in the last place of a loss near 4 (2.4e-7 each), the floor's largest
4 of them, a compiled run's 5 at one step. A real error is of another size: a loss computed with
another ``exp`` (``torch.logsumexp`` against ``F.cross_entropy``'s ``log_softmax``) was 70 of
them; a left-out soft cap, a loss many times the model's.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

__all__ = ["MAX_FACTOR", "MEAN_FACTOR", "permute_rows", "loss_diffs", "judge", "limits", "verdict_text"]

#: the most any step's difference may be, in the floor's largest (:func:`judge`'s ``max_factor``)
MAX_FACTOR = 1.5
#: the most the mean difference may be, in the floor's mean (:func:`judge`'s ``mean_factor``)
MEAN_FACTOR = 1.5


def permute_rows(batches: Sequence[dict], seed: int = 1) -> list[dict]:
    """The same batches with the rows of each in a seeded order that is never the identity.

    Tensors whose first dimension is the batch are permuted together; other values pass.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for batch in batches:
        n = int(batch["input_ids"].shape[0])
        order = torch.randperm(n, generator=gen)
        if n > 1 and torch.equal(order, torch.arange(n)):
            order = order.roll(1)
        out.append({k: (v[order] if torch.is_tensor(v) and v.dim() and v.shape[0] == n else v)
                    for k, v in batch.items()})
    return out


def loss_diffs(reference: Sequence[float], other: Sequence[float]) -> list[float]:
    """Per-step ``|other - reference|``.

    Raises:
        ValueError: the runs have different lengths.
    """
    if len(reference) != len(other):
        raise ValueError(f"runs of different lengths: {len(reference)} and {len(other)} steps")
    return [abs(float(a) - float(b)) for a, b in zip(reference, other)]


def judge(eager: Sequence[float], floor_run: Sequence[float] | Sequence[Sequence[float]], run: Sequence[float],
          mean_factor: float = MEAN_FACTOR, max_factor: float = MAX_FACTOR) -> dict[str, Any]:
    """The floor, the run's difference, and the verdict, per the module docstring.

    Args:
        eager: the eager run's per-step losses.
        floor_run: the eager run again with the rows permuted (:func:`permute_rows`), or several
            such runs (other seeds): the floor at each step is then the largest of their
            differences, the range that one summation order alone does not show.
        run: the run under test (compiled), same batches, same start.
        mean_factor: the most the run's mean difference may be, in floor means.
        max_factor: the most any step's difference may be, in the floor's largest (module docstring).

    Returns:
        ``floor_max_abs_loss_diff``, ``floor_mean_abs_loss_diff``, ``max_abs_loss_diff``,
        ``mean_abs_loss_diff``, ``steps_over_floor`` (the steps whose difference exceeds
        ``max_factor`` x the floor's max), ``within_floor`` (bool) and the per-step lists
        ``floor_diffs``, ``diffs``.
    """
    runs = [floor_run] if floor_run and not isinstance(floor_run[0], (list, tuple)) else list(floor_run)
    floor = [max(step) for step in zip(*(loss_diffs(eager, r) for r in runs))]
    diffs = loss_diffs(eager, run)
    floor_max, floor_mean = max(floor), sum(floor) / len(floor)
    run_max, run_mean = max(diffs), sum(diffs) / len(diffs)
    over = [i for i, d in enumerate(diffs) if d > max_factor * floor_max]
    return {
        "floor_max_abs_loss_diff": floor_max, "floor_mean_abs_loss_diff": floor_mean,
        "max_abs_loss_diff": run_max, "mean_abs_loss_diff": run_mean, "steps_over_floor": over,
        "within_floor": not over and run_mean <= mean_factor * floor_mean,
        "mean_factor": mean_factor, "max_factor": max_factor, "floor_runs": len(runs), "floor_diffs": floor, "diffs": diffs,
    }


def limits(verdict: Mapping[str, Any]) -> tuple[float, float]:
    """``(max_limit, mean_limit)`` of a :func:`judge` result: the largest difference any step may have
    (``max_factor`` x the floor's largest) and the most the mean difference may be (``mean_factor`` x
    the floor's mean). A result written before the factors were recorded was judged with the defaults."""
    return (verdict.get("max_factor", MAX_FACTOR) * verdict["floor_max_abs_loss_diff"],
            verdict.get("mean_factor", MEAN_FACTOR) * verdict["floor_mean_abs_loss_diff"])


def verdict_text(verdict: Mapping[str, Any]) -> str:
    """The verdict of a :func:`judge` result in words, with both limits it was judged by.

    Why: "within the floor" alone reads as "under the floor's largest difference", which is not
    the rule; a reader comparing a figure's lines with the verdict needs the limits themselves.
    """
    max_limit, mean_limit = limits(verdict)
    max_factor, mean_factor = verdict.get("max_factor", MAX_FACTOR), verdict.get("mean_factor", MEAN_FACTOR)
    run_max, run_mean = verdict["max_abs_loss_diff"], verdict["mean_abs_loss_diff"]
    over = list(verdict.get("steps_over_floor", []))
    steps = f" at step{'s' if len(over) > 1 else ''} {', '.join(map(str, over))}" if over else ""
    largest = (f"largest |diff| {run_max:.2g} {'>' if over else '<='} limit {max_limit:.2g} "
               f"({max_factor:g} x the floor's largest {verdict['floor_max_abs_loss_diff']:.2g}){steps}")
    mean = (f"mean {run_mean:.2g} {'<=' if run_mean <= mean_limit else '>'} limit {mean_limit:.2g} "
            f"({mean_factor:g} x the floor's mean {verdict['floor_mean_abs_loss_diff']:.2g})")
    return f"{'within' if verdict['within_floor'] else 'OUTSIDE'} the floor: {largest}; {mean}"

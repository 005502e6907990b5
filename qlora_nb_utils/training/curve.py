"""The loss-curve PNG a fine-tune leaves next to its metrics.

Why here and not in ``report``: the product (``training``) may not import the lab, and one
small figure does not justify a dependency on it. The figure is drawn on a matplotlib
``Figure`` with the Agg canvas directly, without ``pyplot``: it never changes the process's
backend, so a notebook's inline plots are left as they were, and it works on a headless machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

__all__ = ["plot_loss_curve"]


def plot_loss_curve(losses: Sequence[float], eval_losses: Sequence[dict], path: str | Path,
                    title: str = "") -> Path:
    """Draw the train loss per step and the held-out loss points; save as PNG.

    Args:
        losses: the train loss of each step (step ``i`` is the ``i + 1``-th optimizer step).
        eval_losses: ``{"step": steps_done, "loss": value}`` entries.
        path: the PNG to write.
        title: the figure title.

    Returns:
        ``path``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(range(1, len(losses) + 1), losses, lw=1.2, label="train loss (per step)")
    if eval_losses:
        ax.plot([e["step"] for e in eval_losses], [e["loss"] for e in eval_losses], "o-", ms=5,
                label="held-out loss (per token)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path

"""The lab's presentation: plots and Markdown tables read from results files.

- ``plots``: matplotlib figures from step histories and results files (``plot_loss_curves``,
  ``plot_step_time``, ``plot_memory``, ``load_results``).
- ``markdown``: the one table-header helper every Markdown table uses.
- ``peers``: the peers file as a Markdown table and PNG plots.
- ``fsdp``: the FSDP2 results file as a Markdown table and a loss plot.
- ``packing``: the packing benchmark's file as tables per model and data, the issue's two
  targets, and a plot of real tokens/s against peak memory.
- ``peers_compute``: issue 20's ours-against-Unsloth file as a Markdown table, and the trade-off
  plot (step time against peak memory at 8B, 8 x 1024) with the offload files' points.

Everything here takes dicts and DataFrames and writes text or PNGs; it imports nothing of the
product, so a results file can be reported on a machine with no GPU.
"""

from qlora_nb_utils._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "plot_loss_curves": "plots",
    "load_results": "plots",
    "table_header": "markdown",
})

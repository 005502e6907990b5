"""The lab: everything that measures the product, beside it and never inside it.

- ``peers/``: ours against HF eager, plain compile, TRL, torchao NF4 and Unsloth, one process per
  library (``python -m lab.peers``); ``peers.compute`` and ``peers.packed`` are the compute-bound
  and packing benchmarks.
- ``profile``, ``idle``, ``kernel_shapes``: where a step's time and memory go.
- ``optim_bench``, ``parity_split``, ``lengths``: the optimizer step, the split of the eager/compiled
  difference, and the long-tail length draws the packing benchmark uses.
- ``report/``: readers of every results file (``python -m lab.report FILE...``).
- ``results/<topic>/``: what GPU and CPU runs wrote; ``results/index.csv`` is the one table they
  all feed and ``RESULTS.md`` is generated from it (``python -m lab.index``).
- ``gpu/<topic>/``: the scripts that ran on the GPU machines, by the results topic they write,
  all started by ``gpu/gpu_env.sh``. ``README.md`` says how to add a measurement.

The lab imports the product (``qlora_nb_utils``); the product never imports the lab, and the
wheel ships none of it. It runs from a checkout: ``python -m lab...`` from the repository root.
"""

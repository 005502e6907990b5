"""``python -m qlora_nb_utils.bench.peers --spec SPEC.json --out RUN.json``: one peer, one process."""

import sys

from .runner import _child_main

sys.exit(_child_main())

"""``python -m qlora_nb_utils.bench.peers --spec SPEC.json --out RUN.json``: one peer, one process."""

import sys

from .run import _child_main

sys.exit(_child_main())

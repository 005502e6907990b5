"""``python -m lab.peers --spec SPEC.json --out RUN.json``: one peer, one process."""

import sys

from lab.peers.runner import _child_main

sys.exit(_child_main())

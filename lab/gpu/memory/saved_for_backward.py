"""What a compiled layer's backward takes from its forward, read from Inductor's generated code.

Why: a memory account names the blocks live at a step's peak, not why they are alive. A tensor the
backward module receives as an argument was saved by the forward (AOTAutograd's partitioner chose
to keep it, not recompute it), so it lives from the layer's recompute to its backward whatever
checkpointing the model asked for. Reading the backward's ``assert_size_stride`` lines for its
arguments (everything but parameters and the incoming gradients) gives that list by shape.

Use: python lab/gpu/memory/saved_for_backward.py CODE_TGZ DEST_JSON [TRY_JSON ...] [--command CMD]
CODE_TGZ holds the generated modules (``code/*.py``, the one with the layer's backward is found by
its ``tangents_1`` argument); each TRY_JSON is a ``lab.long_context try`` record of the same call
or of related calls, copied into DEST_JSON's ``tries`` as written (nothing typed in).
"""
from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import math
import re
import tarfile
import tempfile
from pathlib import Path


def saved_inputs(code: str) -> dict:
    """The backward module's saved arguments (``call``'s unpacked args less ``primals_*`` and
    ``tangents_*``), grouped by shape, with their bf16 GiB (the layer's activations are bf16)."""
    call = code[code.index("    def call(self, args):"):]
    names = re.search(r"^\s+(.*?) = args$", call, re.M).group(1).replace(" ", "").split(",")
    saved = [n for n in names if not n.startswith(("primals_", "tangents_"))]
    shapes = dict(re.findall(r"assert_size_stride\((\w+), \(([\d, ]*)\)", call))
    by_shape: dict = collections.defaultdict(list)
    for name in saved:
        by_shape[shapes.get(name, "?").replace(" ", "")].append(name)
    out = {}
    for shape, group in sorted(by_shape.items(), key=lambda kv: -len(kv[1])):
        numel = math.prod(int(x) for x in shape.split(",") if x)
        out[shape] = {"count": len(group), "gib_bf16": len(group) * numel * 2 / 2**30, "names": group}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("code_tgz")
    ap.add_argument("dest")
    ap.add_argument("tries", nargs="*")
    ap.add_argument("--command", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(args.code_tgz) as tar:
            tar.extractall(tmp, filter="data")
        modules = sorted(Path(tmp).rglob("*.py"))
        backward = [p for p in modules if re.search(r"tangents_1(, |\s*=\s*args)", p.read_text())]
        if not backward:
            raise SystemExit(f"no backward module (an argument named tangents_1) among {len(modules)} files")
        text = backward[0].read_text()
        record = {
            "backward_module": backward[0].name,
            "saved_by_shape": saved_inputs(text),
            "dequantize_kernels_in_backward": len(re.findall(r"_nf4_dequant_kernel_\d+\.run\(", text)),
        }
    tries = [json.loads(Path(t).read_text()) for t in args.tries]
    record["tries"] = tries
    ref = next((t for t in tries if t.get("device")), {})
    record |= {"device": ref.get("device"), "versions": ref.get("versions"), "command": args.command,
               "date": dt.datetime.now(dt.timezone.utc).isoformat()}
    Path(args.dest).write_text(json.dumps(record, indent=1, default=str) + "\n")
    for shape, row in record["saved_by_shape"].items():
        print(shape, row["count"], f"{row['gib_bf16']:.2f} GiB")


if __name__ == "__main__":
    main()

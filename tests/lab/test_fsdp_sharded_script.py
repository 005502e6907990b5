"""``lab/gpu/fsdp/gpu_fsdp_sharded.sh`` rehearsed on a CPU (``DRY=1``: tiny model, gloo, 2 steps).

Everything the 2-GPU call will run, except the GPU: the corruption probe, the parity runs with
the floor run and ``--check-bytes``, the scaling pair, the 70B builder's run on a tiny shape, and
the assembly of ``fsdp2_sharded_<gpu>.json`` with every field the issue names. One repeat of the
scaling pair instead of three keeps it near a minute on a 2-core CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_sharded_gpu_script_runs_dry_on_a_cpu_and_writes_every_field(tmp_path):
    env = {**os.environ, "DRY": "1", "PY": sys.executable, "OUT": str(tmp_path), "REPEATS": "1"}
    result = subprocess.run(["bash", "lab/gpu/fsdp/gpu_fsdp_sharded.sh"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rec = json.loads((tmp_path / "fsdp2_sharded_cpu.json").read_text())
    assert rec["missing_runs"] == [], (rec["missing_runs"], (tmp_path / "errors.txt").read_text()
                                       if (tmp_path / "errors.txt").exists() else "")
    assert rec["nf4"] == "shard" and rec["world_size"] == 2
    assert rec["bytes_equal_after_allgather"] is True and rec["bytes_check"]["method"] == "every byte"
    assert len(rec["scaling_runs"]) == 1 and rec["scaling"] > 0
    assert rec["max_abs_loss_diff"] is not None and rec["floor_max"] is not None
    assert set(rec["peak_mem_gib_per_gpu"]) == {"1", "2"} and all(rec["peak_mem_gib_per_gpu"].values())
    big = rec["big_model"]
    assert big["shape"] == "llama-tiny" and big["layers_run"] == 2 and big["extrapolated"] is True
    assert big["peak_mem_gib_per_gpu"] > 0 and big["tokens_per_s"] > 0
    probe = rec["corruption_probe"]  # on a CPU nothing changes: the CUDA kernel is what the GPU call tests
    assert probe["foreach_copy"]["bfloat16"]["foreach_copy"]["changed"] == 0
    assert probe["fsdp2"]["bfloat16"]["changed"] == 0 and probe["foreach_copy"]["bfloat16"]["nan_words"] == 254
    for key in ("device", "versions", "date", "command"):
        assert rec[key], key
    assert (tmp_path / "fsdp_sharded_logs.tgz").is_file()

"""The multi-node commands of ``docs/fsdp2.md``, run: two "nodes" on one machine.

Each layout is launched as users launch it on two machines: the same ``torchrun --nnodes 2
--nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT`` command once per node with
its ``--node-rank``, here both on localhost over gloo with the tiny model for 2 steps. What is
checked is what a second machine changes: the rendezvous forms one world of 2 from two launches,
the ranks train together, and node 0 writes the run's summary and adapter. The pipeline layout's
rehearsal is ``tests/test_pipeline.py``'s 1F1B run, launched with :func:`two_nodes`: the same
launch also checks its losses, gradients and adapter against one process (one launch, not two).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["--model", "tiny", "--steps", "2", "--global-batch-size", "2", "--seq-len", "64",
          "--device", "cpu", "--dtype", "float32", "--backend", "eager"]
#: Each layout's options for the rehearsal (a layout added to the launcher adds its line here).
LAYOUT_ARGS = {
    "fsdp": [],
    "context": ["--micro-batch-size", "1"],
}
#: Layouts rehearsed as two nodes by their own test module (with that module's checks of the run).
REHEARSED_ELSEWHERE = {"pipeline": "tests/test_pipeline.py"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(layout: str, out: Path, argv: list[str], timeout: int = 240) -> list[subprocess.CompletedProcess]:
    """Launch ``layout`` as node 0 and node 1 of a 2-node job (one process each) on this machine;
    ``argv``: the layout's command line (``--out`` included)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    from torch.distributed import TCPStore

    port = _free_port()
    # The rendezvous store lives in this process, as on a cluster where it outlives every node: with
    # both nodes on one machine, either could host it, and the one that exits first would take it
    # away from the other's closing of the rendezvous (a failed exit after a finished job).
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 (kept alive)
    endpoint = f"127.0.0.1:{port}"
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
               "--rdzv-conf", "is_host=false",
               "--rdzv-id", f"rehearsal-{layout}", "-m", "qlora_nb_utils.distributed.launch", "--layout", layout,
               *argv]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    done = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return done


@pytest.mark.parametrize("layout", sorted(LAYOUT_ARGS))
def test_each_layout_trains_as_two_nodes_over_a_c10d_rendezvous(tmp_path, layout):
    out = tmp_path / layout
    results = two_nodes(layout, out, [*COMMON, *LAYOUT_ARGS[layout], "--out", str(out)])
    for node, r in enumerate(results):
        assert r.returncode == 0, f"node {node}:\n{r.stdout[-2000:]}\n{r.stderr[-5000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == "gloo"
    assert len(summary["losses"]) == 2 and all(loss > 0 for loss in summary["losses"])
    assert summary["graph_breaks"]["total"] == 0
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_every_layout_of_the_launcher_is_rehearsed_as_two_nodes():
    import qlora_nb_utils.distributed.launch as launch

    assert set(LAYOUT_ARGS) | set(REHEARSED_ELSEWHERE) == set(launch.LAYOUTS)
    for module in REHEARSED_ELSEWHERE.values():
        assert "two_nodes" in (ROOT / module).read_text()


def test_the_context_layout_without_its_module_exits_2_with_a_clear_message(monkeypatch, capsys):
    import qlora_nb_utils.distributed.launch as launch

    monkeypatch.setattr(launch, "context_module", lambda: None)
    assert launch.main(["--layout", "context", "--out", "x"]) == 2
    assert "context_parallel" in capsys.readouterr().err


def test_an_unknown_layout_is_refused():
    import qlora_nb_utils.distributed.launch as launch

    with pytest.raises(SystemExit) as err:
        launch.main(["--layout", "tensor", "--out", "x"])
    assert err.value.code == 2

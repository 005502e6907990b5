"""Sharded NF4 over 2 gloo ranks: the all-gathered packed bytes equal the unsharded ones, bit for bit.

Each storage dtype we support (uint8, bf16, and the float32 of ``sharded_nf4_precision``) is
sharded ``Shard(0)`` by FSDP2, including weights whose packed rows do not split evenly over 2
ranks, and whose bytes were seeded with words that read as bf16 NaNs (the words CUDA rewrote on
2 H200s). The CUDA copy cannot run here, so one more case swaps FSDP2's CPU copy-in kernel, for
the test only, for one that does what CUDA's same-dtype ``_foreach_copy_`` does (through float):
it must corrupt the bf16-policy plan (proving the test can fail, with the NaN-words signature)
and leave our plan exact. Two processes spawned once for the whole module (~20 s).
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

STORAGES = ("uint8", "bfloat16", "float32")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _odd_model(storage: torch.dtype):
    """Three Linear4bit whose packed rows are odd for this storage (uneven Shard(0) over 2)."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    itemsize = torch.empty((), dtype=storage).element_size()
    layers = torch.nn.ModuleList()
    for out_f in (3, 5, 7):
        in_f = 2 * itemsize * 19  # rows = out*in/(2*itemsize) = 19*out: odd
        lin = bnb.nn.Linear4bit(in_f, out_f, bias=False, compute_dtype=torch.float32, quant_type="nf4",
                                quant_storage=storage)
        lin.weight = bnb.nn.Params4bit(torch.randn(out_f, in_f) * 0.05, requires_grad=False, quant_type="nf4",
                                       quant_storage=storage)
        layers.append(lin.to("cpu"))
    return layers


def _seed_nan_words(modules) -> None:
    """Write bf16 NaN patterns (0x7f98, 0xffb9, 0x7f81) into the packed bytes (any byte is two valid codes)."""
    for m in modules:
        b = m.weight.data.view(torch.uint8).reshape(-1)
        for i, word in enumerate((0x7F98, 0xFFB9, 0x7F81)):
            b[2 * i], b[2 * i + 1] = word & 0xFF, word >> 8


class _CudaLikeCopyIn:
    """Swap FSDP2's CPU ``all_gather_copy_in`` for one that copies 16-bit floats through float
    (CUDA's same-dtype ``_foreach_copy_``); records the buffer dtypes; undone in ``__exit__``."""

    def __enter__(self):
        self.dtypes = []
        self.lib = torch.library.Library("fsdp", "IMPL")

        def copy_in(inputs, output, split_sizes, numel, rank):
            self.dtypes.append(output.dtype)
            buf = output.narrow(0, numel * rank, numel)
            with torch.no_grad():
                for dst, src in zip(torch.split(buf, split_sizes), inputs):
                    dst.copy_(src.float() if src.dtype in (torch.bfloat16, torch.float16) else src)
            return buf, output

        self.lib.impl("all_gather_copy_in", copy_in, "CPU", allow_override=True)
        return self

    def __exit__(self, *exc):
        self.lib._destroy()


def _shard_odd(storage: torch.dtype, mp_policy, cuda_like: bool) -> dict:
    from torch.distributed.fsdp import fully_shard

    from qlora_nb_utils.distributed.packed_words import compare_packed, snapshot_packed

    model = _odd_model(storage)
    _seed_nan_words(model)
    x = torch.randn(2, model[0].in_features)
    with torch.no_grad():
        expected = [m(x) for m in model]
    snap = snapshot_packed(model)
    states = [m.weight.quant_state for m in model]
    for m in model:
        fully_shard(m, mp_policy=mp_policy)
    local_rows = [m.weight.to_local().shape[0] for m in model]
    if cuda_like:
        with _CudaLikeCopyIn() as hook:
            for m in model:
                m.unshard()
        dtypes = sorted({str(d) for d in hook.dtypes})
    else:
        for m in model:
            m.unshard()
        dtypes = []
    record = compare_packed(model, snap)
    same_out = True
    for m, y, state in zip(model, expected, states):
        with torch.no_grad():  # the all-gathered bytes, dequantized with the unsharded quant state
            w = _dequant(m.weight.detach().contiguous(), state)
            same_out &= bool(torch.allclose(torch.nn.functional.linear(x, w), y, rtol=1e-5, atol=1e-6))
        m.reshard()
    return {**record, "local_rows": local_rows, "allgather_dtypes": dtypes, "same_output": same_out}


def _dequant(packed: torch.Tensor, state) -> torch.Tensor:
    import bitsandbytes.functional as bf

    return bf.dequantize_4bit(packed, state).to(torch.float32)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch.distributed as dist

    from qlora_nb_utils.distributed.fsdp import apply_fsdp2
    from qlora_nb_utils.distributed.packed_words import sharded_nf4_precision
    from qlora_nb_utils.distributed.setup import init_distributed, load_qlora, mixed_precision

    init_distributed("cpu")
    res: dict = {}
    for name in STORAGES:
        storage = getattr(torch, name)
        plan, _ = sharded_nf4_precision(torch.bfloat16, name)
        res[f"odd_{name}"] = _shard_odd(storage, plan, cuda_like=False)
        res[f"odd_{name}_cuda_like"] = _shard_odd(storage, plan, cuda_like=True)
        model, _ = load_qlora("tiny", dtype="float32", device="cpu", quant_storage=storage)
        sharded = apply_fsdp2(model, mp_policy=plan, nf4="shard", verify="exact")
        res[f"tiny_{name}"] = sharded.bytes_check
        model, _ = load_qlora("tiny", dtype="float32", device="cpu", quant_storage=storage)
        with _CudaLikeCopyIn() as hook:
            sharded = apply_fsdp2(model, mp_policy=plan, nf4="shard", verify="exact")
        res[f"tiny_{name}_cuda_like"] = {**sharded.bytes_check, "allgather_dtypes": sorted({str(d) for d in hook.dtypes})}
    # the plan that broke on 2 H200s: bf16 policy + bf16 storage, through the CUDA-like copy
    res["odd_bf16_policy_cuda_like"] = _shard_odd(torch.bfloat16, mixed_precision("bfloat16"), cuda_like=True)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("nf4_bytes")
    mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("storage", STORAGES)
def test_allgathered_nf4_bytes_equal_the_unsharded_bytes(results, storage):
    for rank in results:
        tiny = rank[f"tiny_{storage}"]
        assert tiny["method"] == "every byte" and tiny["equal"], tiny
        assert tiny["weights"] == 14 and tiny["bytes"] > 0 and tiny["changed_bytes"] == 0
        odd = rank[f"odd_{storage}"]
        assert odd["equal"] and odd["same_output"], odd
        assert odd["nan_words"] >= 9  # the seeded bf16-NaN words went through the round trip


def test_the_uneven_shards_really_are_uneven(results):
    r0, r1 = results[0]["odd_bfloat16"]["local_rows"], results[1]["odd_bfloat16"]["local_rows"]
    assert [a + b for a, b in zip(r0, r1)] == [19 * 3, 19 * 5, 19 * 7]
    assert all(a == b + 1 for a, b in zip(r0, r1))


def test_a_cuda_like_float_copy_corrupts_the_bf16_policy_plan_only_on_nan_words(results):
    for rank in results:
        bad = rank["odd_bf16_policy_cuda_like"]
        assert bad["allgather_dtypes"] == ["torch.bfloat16"]
        assert not bad["equal"] and not bad["same_output"]
        assert bad["samples"] and all(s.split("->")[0] in ("7f98", "ffb9", "7f81") for s in bad["samples"])


@pytest.mark.parametrize("storage", STORAGES)
def test_our_plan_survives_the_cuda_like_copy(results, storage):
    for rank in results:
        tiny = rank[f"tiny_{storage}_cuda_like"]  # decoder layers: packed words + fp32 LoRA per unit
        assert tiny["equal"] and tiny["changed_bytes"] == 0, tiny
        assert not set(tiny["allgather_dtypes"]) & {"torch.bfloat16", "torch.float16"}


def test_a_unit_of_bf16_packed_words_alone_is_what_the_plan_check_refuses(results):
    """bf16 storage in a unit with nothing else all-gathers as bf16 even without a cast: the
    CUDA-like copy corrupts it, and ``unsafe_units`` (apply_fsdp2's check off the CPU) flags it."""
    from qlora_nb_utils.distributed.packed_words import unsafe_units

    for rank in results:
        for name in STORAGES:
            odd = rank[f"odd_{name}_cuda_like"]
            assert odd["equal"] == (name != "bfloat16"), (name, odd)
            assert odd["allgather_dtypes"] == [f"torch.{name}"]
    layers = _odd_model(torch.bfloat16)
    assert unsafe_units(layers, list(layers), None) == {"0": "bfloat16", "1": "bfloat16", "2": "bfloat16"}
    assert unsafe_units(_odd_model(torch.float32), [], None) == {}


def test_the_plan_check_predicts_the_allgather_dtype():
    from qlora_nb_utils.distributed.packed_words import allgather_dtype

    bf16, f32, u8 = torch.bfloat16, torch.float32, torch.uint8
    assert allgather_dtype([bf16, f32], bf16) == bf16  # the plan that broke: LoRA cast to bf16
    assert allgather_dtype([f32, f32], None) == f32  # ours: float32 storage, no cast
    assert allgather_dtype([bf16, f32], None) == u8  # bf16 storage + fp32 LoRA: bytes
    assert allgather_dtype([u8, f32], bf16) == u8

"""Where does a 2-GPU FSDP2 QLoRA forward differ from the 1-GPU one? (a GPU diagnostic)

    torchrun --nproc-per-node N tools/fsdp_diag.py MODEL OUT.json

Each rank loads the model (NF4 in bf16 storage, as tools/gpu_fsdp.sh runs it) and, on the
first global batch of 2 packed rows of 2048 tokens:
  1. plain per-row losses, no FSDP (each rank computes both rows: rank-independent reference)
  2. keeps a copy of every packed NF4 weight, shards with apply_fsdp2, unshards, and counts
     the 16-bit words that differ from the copy (all-gather integrity) and quant states
     attached / missing
  3. per-row losses of the sharded model, eager, then with every decoder layer compiled
Rank 0 writes everything to OUT.json.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from qlora_nb_utils.distributed import fsdp, fsdp_train


def row_losses(model, batch, rows, device):
    out = {}
    for r in rows:
        micro = {k: v[r:r + 1].to(device) for k, v in batch.items()}
        n = max(1, fsdp_train._target_count(micro))
        loss = fsdp_train._loss_sum(model, micro) / n
        loss.backward()
        out[r] = float(loss.detach())
    for p in model.parameters():
        p.grad = None
    return out


def check(folder) -> int:
    """Exit status 0 when the replicate run is equal to the unsharded model (per row, 1e-3)."""
    status = 1
    for mode in ("shard", "replicate"):
        try:
            two = json.load(open(f"{folder}/diag_2_{mode}.json"))
        except OSError:
            print(mode, "did not finish")
            continue
        good = all(r["integrity"]["bad_words"] == 0 for r in two)
        for r in two:
            for row, v in r["fsdp_eager"].items():
                d = abs(v - r["plain"][row])
                print(f"{mode}: rank {r['rank']} row {row}: FSDP eager {v:.6f} vs plain {r['plain'][row]:.6f} ({d:.2e})")
                good = good and d < 1e-3
        print(mode, "bit-exact and equal" if good else "DIFFERS", two[0]["integrity"])
        if mode == "replicate" and good:
            status = 0
    return status


def main():
    if sys.argv[1] == "--check":
        sys.exit(check(sys.argv[2]))
    name, path = sys.argv[1], sys.argv[2]
    info = fsdp.init_distributed(os.environ.get("DIAG_DEVICE", "cuda"))
    args = fsdp_train.build_parser().parse_args(
        ["--model", name, "--seq-len", "2048", "--pack", "--steps", "1", "--global-batch-size", "2",
         "--out", "/tmp/diag"])
    t0 = time.perf_counter()
    model, tok = fsdp.load_qlora(name, dtype=torch.bfloat16 if info.device.type == "cuda" else torch.float32, device=info.device,
                                 quant_storage=torch.bfloat16 if info.device.type == "cuda" else torch.float32, seed=0)
    batch = fsdp_train.make_global_batches(tok, args)[0]
    res = {"rank": info.rank, "world_size": info.world_size, "load_s": time.perf_counter() - t0}
    res["plain"] = row_losses(model, batch, [0, 1], info.device)
    ref = {n: p.detach().clone() for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}
    nf4 = os.environ.get("DIAG_NF4", "shard")
    sharded = fsdp.apply_fsdp2(model, mp_policy=fsdp.mixed_precision(torch.bfloat16 if info.device.type == "cuda" else None),
                               nf4=nf4, verify=False)
    mods = fsdp._fsdp_modules(model)
    for m in mods:
        m.unshard()
    bad_words, bad_params, missing_qs, checked, samples = 0, [], 0, 0, []
    for m in fsdp._linear4bit_modules(model):
        w = m.weight
        full = getattr(w, "_local_tensor", w)
        key = _prefix_of(model, m) + ".weight"
        if key not in ref or ref[key].shape != full.shape:
            bad_params.append(f"{key}: not comparable")
            continue
        checked += 1
        neq = full.view(torch.int16) != ref[key].view(torch.int16)
        diff = int(neq.sum())
        if diff and len(samples) < 12:
            idx = neq.flatten().nonzero()[:4].flatten()
            a = ref[key].view(torch.int16).flatten()[idx].tolist()
            b = full.view(torch.int16).flatten()[idx].tolist()
            samples += [f"{x & 0xFFFF:04x}->{y & 0xFFFF:04x}" for x, y in zip(a, b)]
        if diff:
            bad_words += diff
            bad_params.append(key)
        if getattr(w, "quant_state", None) is None:
            missing_qs += 1
    for m in mods:
        m.reshard()
    res["integrity"] = {"checked": checked, "total_nf4": len(ref), "bad_words": bad_words,
                        "bad_params": bad_params[:10], "missing_quant_state": missing_qs, "samples": samples, "nf4": nf4}
    del ref
    mine = [0, 1] if info.world_size == 1 else [info.rank]
    res["fsdp_eager"] = row_losses(model, batch, mine, info.device)
    res["fsdp_eager_again"] = row_losses(model, batch, mine, info.device)
    from qlora_nb_utils.compile import prepare_for_compile
    prepare_for_compile(model, grad_ckpt=None, scope="regional", backend="inductor", fullgraph=True)
    res["fsdp_compiled"] = row_losses(model, batch, mine, info.device)
    res["fsdp_compiled_again"] = row_losses(model, batch, mine, info.device)
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, res)
    if info.rank == 0:
        json.dump(gathered, open(path, "w"), indent=1)
        for g in gathered:
            print(json.dumps(g))
    dist.destroy_process_group()


_PREFIX = {}


def _prefix_of(model, module):
    if not _PREFIX:
        for n, m in model.named_modules():
            _PREFIX[id(m)] = n
    return _PREFIX[id(module)]


if __name__ == "__main__":
    main()

"""lab.profile: kernel grouping rules, the memory breakdown and a CPU run end to end."""

from __future__ import annotations

import json

import pytest
import torch

from lab import profile as P


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    torch.compiler.reset()


@pytest.mark.parametrize("name, context, shapes, group, rule", [
    ("void multi_tensor_apply_kernel<TensorListMetadata<4>, LerpFunctor>", ["aten::_foreach_lerp_",
     "Optimizer.step#AdamW.step"], None, "optimizer", "context: Optimizer.step"),
    ("void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>", ["bitsandbytes::dequantize_4bit"], None,
     "nf4_dequantize", "name/context: dequant"),
    ("_nf4_dequant_kernel", [], None, "nf4_dequantize", "name/context: dequant"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", ["aten::_flash_attention_forward"],
     None, "attention", "name/context: attention kernel"),
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT", ["aten::mm", "CompiledFunction"], [[8192, 4096], [4096, 16]],
     "lora_matmul", "shapes: a dimension is the rank 16"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", ["aten::mm"], [[8192, 4096], [4096, 14336]], "base_matmul",
     "shapes: no rank dimension"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", ["aten::mm"], [[2048, 4096], [4096, 128256]], "base_matmul",
     "shapes: lm_head"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_TNN", [], None, "matmul_unattributed", "GEMM with no launching op's shapes"),
    ("_lora_h_kernel", [], None, "lora_matmul", "name: _lora_"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3", ["triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3"],
     None, "norm_rope_act", "norm"),
    ("triton_red_fused__to_copy_add_div_mul_pow_sum_7", [], None, "norm_rope_act", "norm"),
    ("triton_poi_fused_add_cat_mul_neg_slice_4", [], None, "norm_rope_act", "rope"),
    ("triton_poi_fused_mul_silu_5", [], None, "norm_rope_act", "activation"),
    ("_fg_kernel", [], None, "norm_rope_act", "activation"),
    ("_rms_layernorm_backward", ["autograd::engine::evaluate_function: Fast_RMS_LayernormBackward"], None,
     "norm_rope_act", "norm"),
    ("triton_red_fused__to_copy_logsumexp_1", [], None, "loss", "name/context: cross-entropy"),
    ("triton_poi_fused__to_copy_exp_sub_9", [], None, "loss", "name/context: cross-entropy"),
    ("_fl_forward_kernel", [], None, "loss", "name/context: cross-entropy"),
    ("triton_poi_fused__to_copy_add_mul_2", [], None, "other",
     "Inductor-fused elementwise (casts, residual adds, LoRA scaling, copies)"),
    ("Memcpy HtoD (Pageable -> Device)", [], None, "other", "copy/memset"),
    ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", ["aten::add_"], None,
     "other", "unmatched"),
])
def test_classify_kernel_rules(name, context, shapes, group, rule):
    assert P.classify_kernel(name, context, shapes, lora_r=16, vocab=128256) == (group, rule)


def test_group_kernels_totals_and_shares():
    recs = [
        {"name": "sm90_xmma_gemm", "us": 3000.0, "context": ["aten::mm"], "shapes": [[8, 64], [64, 128]],
         "phase": "forward"},
        {"name": "sm90_xmma_gemm", "us": 1000.0, "context": ["aten::mm"], "shapes": [[8, 64], [64, 16]],
         "phase": "backward"},
        {"name": "kDequantizeBlockwise", "us": 500.0, "context": [], "shapes": None, "phase": "unknown"},
        {"name": "weird_kernel", "us": 500.0, "context": [], "shapes": None, "phase": "unknown"},
    ]
    out = P.group_kernels(recs, steps=2, lora_r=16)
    assert set(out["groups"]) == set(P.GROUPS)
    assert out["total_ms"] == pytest.approx(2.5)  # 5000 us over 2 steps
    g = out["groups"]
    assert g["base_matmul"]["ms"] == pytest.approx(1.5) and g["base_matmul"]["share"] == pytest.approx(0.6)
    assert g["lora_matmul"]["by_phase"] == {"backward": pytest.approx(0.5)}
    assert g["other"]["ms"] == pytest.approx(0.25) and g["attention"]["ms"] == 0.0
    assert sum(x["ms"] for x in g.values()) == pytest.approx(out["total_ms"])
    top = P.top_kernels(recs, 2, steps=2, lora_r=16)
    assert top[0]["name"] == "sm90_xmma_gemm" and top[0]["ms"] == pytest.approx(2.0) and top[0]["calls"] == 1
    assert top[0]["groups"] == {"base_matmul": pytest.approx(1.5), "lora_matmul": pytest.approx(0.5)}


def _event(action, addr, size, name="f", filename="x.py"):
    return {"action": action, "addr": addr, "size": size, "frames": [{"filename": filename, "line": 1, "name": name}]}


def test_memory_breakdown_categories_and_peak_phase():
    m = P._MARKER_BYTES
    mk = lambda phase, addr: [_event("alloc", addr, m[phase], P._MARKER_FN),  # noqa: E731
                              _event("free_completed", addr, m[phase], P._MARKER_FN)]
    mib = 2**20
    trace = (mk("step_start", 1)
             + [_event("alloc", 10, 100 * mib, "forward", "model.py"),            # saved activation
                _event("alloc", 11, 50 * mib, "_dequantize_4bit_impl", "bitsandbytes/ops.py"),
                _event("alloc", 12, 2 * 128256 * 512, "g", "inductor_fwd.py"),  # vocab rows: logits
                _event("alloc", 13, 30 * mib, "tmp", "model.py"),
                _event("free_completed", 13, 30 * mib, "tmp", "model.py")]
             + mk("forward_end", 2)
             + [_event("alloc", 20, 70 * mib, "grad", "autograd.py")]
             + [_event("free_completed", 20, 70 * mib), _event("free_completed", 10, 100 * mib)]
             + mk("backward_end", 3) + mk("optimizer_end", 4))
    snap = {"device_traces": [trace], "segments": []}
    out = P.memory_breakdown(snap, vocab=128256, resident_before_step=2**30)
    cats = out["categories"]
    assert out["peak_phase"] == "backward"
    assert cats["saved_activations"] == pytest.approx(100 / 1024, abs=1e-3)
    assert cats["dequantized_weights"] == pytest.approx(50 / 1024, abs=1e-3)
    assert cats["backward_buffers"] == pytest.approx(70 / 1024, abs=1e-3)
    assert cats["logits"] > 0 and cats["cudagraph_pool"] == 0
    assert out["markers_found"] == list(P.PHASES) and out["resident_before_step_gib"] == 1.0
    assert [r["category"] for r in out["largest"]][:2] == ["logits", "saved_activations"]
    assert out["by_site"][0] == {"gib": pytest.approx(125.25 / 1024, abs=1e-3), "category": "logits",
                                 "site": "inductor_fwd.py:1:g"}


def test_memory_breakdown_reads_the_innermost_frame():
    """A compiled graph runs inside its module's frames (losses.py here): only the innermost one counts;
    bitsandbytes' dequantize-then-matmul op returns an activation, not a dequantized weight."""
    mib = 2**20
    frames = lambda *fs: [{"filename": f, "line": 1, "name": n} for f, n in fs]  # noqa: E731
    trace = [{"action": "alloc", "addr": 1, "size": 64 * mib,
              "frames": frames(("/tmp/ind/3i/c3ii.py", "call"), ("qlora_nb_utils/ops/losses.py", "forward"))},
             {"action": "alloc", "addr": 2, "size": 224 * mib,
              "frames": frames(("bitsandbytes/backends/cuda/ops.py", "_dequant_linear_fallback"))},
             {"action": "alloc", "addr": 3, "size": 112 * mib,
              "frames": frames(("bitsandbytes/backends/cuda/ops.py", "_dequantize_4bit_impl"))}]
    cats = P.memory_breakdown({"device_traces": [trace], "segments": []}, vocab=128256)["categories"]
    assert cats["logits"] == 0 and cats["dequantized_weights"] == pytest.approx(112 / 1024, abs=1e-3)
    assert cats["saved_activations"] == pytest.approx(288 / 1024, abs=1e-3)  # no markers: all one forward
    with pytest.raises(ValueError):
        P.memory_breakdown({"device_traces": []})
    with pytest.raises(ValueError):
        P.phase_marker("middle")


class _TinyLoRA(torch.nn.Module):
    def __init__(self, d=64, r=16, vocab=96):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.base = torch.nn.Linear(d, d, bias=False).requires_grad_(False)
        self.a = torch.nn.Linear(d, r, bias=False)
        self.b = torch.nn.Linear(r, d, bias=False)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        h = torch.nn.functional.silu(self.base(h) + self.b(self.a(h)))
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_profile_training_cpu_end_to_end():
    model = _TinyLoRA()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step(batch):
        P.phase_marker("step_start")
        loss = model(**batch)
        P.phase_marker("forward_end")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    batches = [{"input_ids": torch.randint(0, 96, (4, 32)), "labels": torch.randint(0, 96, (4, 32))}
               for _ in range(3)]
    stages = []
    out = P.profile_training(step, batches, warmup=1, timed=2, profiled=2, device="cpu", lora_r=16, vocab=96,
                             on_stage=lambda s, r: stages.append(s))
    assert stages == ["timed", "profiled"] and "memory" not in out
    assert len(out["step_ms"]) == 2 and len(out["losses"]) == 1 + 2 + 3
    k = out["kernels"]
    assert k["total_ms"] > 0 and set(k["groups"]) == set(P.GROUPS)
    assert k["groups"]["lora_matmul"]["ms"] > 0 and k["groups"]["base_matmul"]["ms"] > 0
    assert k["groups"]["optimizer"]["ms"] > 0 and k["groups"]["loss"]["ms"] > 0
    assert k["groups"]["lora_matmul"]["by_phase"].get("backward", 0) > 0
    assert k["lm_head_ms"] > 0
    assert len(out["top_kernels"]) <= 15
    json.dumps(out)  # the whole result is JSON as it is


def test_idle_gaps_counts_what_no_kernel_covers_inside_each_step():
    windows = [(0.0, 1000.0), (2000.0, 3000.0)]
    kernels = [  # step 1: lead 100, kernels 100-400 and 300-500 overlap (busy 400), gap 500-800, tail 100
        (100.0, 400.0, "k1", "aten::mm"), (300.0, 500.0, "k2", "aten::add"), (800.0, 900.0, "k3", "aten::mul"),
        # step 2: one kernel 2000-2990 (tail 10); a kernel outside every window is ignored
        (2000.0, 2990.0, "k4", "aten::mm"), (1500.0, 1600.0, "k5", "aten::mm")]
    out = P.idle_gaps(kernels, windows, min_us=20.0)
    assert out["steps"] == 2 and out["window_ms"] == 1.0  # per step
    assert out["busy_ms"] == round((500 + 990) / 2 / 1e3, 3) and out["idle_ms"] == round((500 + 10) / 2 / 1e3, 3)
    assert out["lead_ms"] == 0.05 and out["tail_ms"] == round((100 + 10) / 2 / 1e3, 3)
    assert out["gaps"] == 0  # one gap in two steps: 0 per step (integer division)
    assert out["top"] == [{"us": 300.0, "after": "k2", "before": "k3", "launched_by": "aten::mul"}]
    assert P.idle_gaps([], [(0.0, 50.0)])["idle_ms"] == 0.05  # a step with no kernel is all idle


def test_base_matmul_time_is_split_by_shape_and_phase():
    from lab.kernel_shapes import by_shape

    recs = [
        {"name": "gemm_a", "us": 3000.0, "context": ["aten::mm"], "shapes": [[8, 64], [64, 128]], "phase": "forward"},
        {"name": "gemm_b", "us": 1000.0, "context": ["aten::mm"], "shapes": [[8, 64], [64, 128]], "phase": "forward"},
        {"name": "gemm_a", "us": 2000.0, "context": ["aten::mm"], "shapes": [[8, 128], [128, 64]], "phase": "backward"},
        {"name": "gemm_a", "us": 900.0, "context": ["aten::mm"], "shapes": [[8, 64], [64, 16]], "phase": "forward"},
        {"name": "gemm_c", "us": 100.0, "context": [], "shapes": None, "phase": "unknown"},
    ]

    def group(r):
        return P.classify_kernel(r["name"], r.get("context") or (), r.get("shapes"), lora_r=16)[0]

    rows = by_shape(recs, group, steps=2)
    assert rows == [  # the rank-16 matmul is LoRA's, the one without shapes is not a base matmul
        {"shapes": "8x64 64x128", "phase": "forward", "ms": 2.0, "calls": 1, "kernels": ["gemm_a", "gemm_b"]},
        {"shapes": "8x128 128x64", "phase": "backward", "ms": 1.0, "calls": 0, "kernels": ["gemm_a"]},
    ]
    assert by_shape(recs, group, "lora_matmul", steps=1)[0]["shapes"] == "8x64 64x16"
    assert by_shape(recs, group, "matmul_unattributed")[0]["shapes"] == "?"

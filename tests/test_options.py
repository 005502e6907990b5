"""compile.options: optimize()'s options object, its decision table, and the line count of optimize().

The descriptions in ``optimize_descriptions.json`` were recorded from ``optimize()`` before its
choices were split into small functions: each case here must still read exactly as recorded.
"""

import ast
import inspect
import json
from pathlib import Path

import pytest
import torch

from qlora_nb_utils import data as qdata
from qlora_nb_utils import models, optimize

DESCRIPTIONS = json.loads((Path(__file__).parent / "optimize_descriptions.json").read_text())


def _docs(seed, lengths, vocab=2000):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": (ids := torch.randint(3, vocab, (n,), generator=g).tolist()), "labels": ids}
            for n in lengths]


@pytest.fixture(scope="module")
def cases():
    """A tiny NF4 model and the keyword arguments of each recorded case (bf16 last: it casts the weights)."""
    from qlora_nb_utils.data import packing

    model, tok = models.load_model("tiny", quant="nf4", dtype="float32", device="cpu")
    fixed = qdata.build_batches(tok, batch_size=2, steps=3, max_len=64, padding="fixed")
    varied = qdata.build_batches(tok, batch_size=2, steps=6, max_len=256, padding="longest")
    packed = [packing.pack_examples(_docs(s, [20, 30, 10]), 64, rows_per_batch=2, pad_id=0)[0][0] for s in (1, 2)]
    kwargs = {
        "default": dict(batches=fixed),
        "no_batches": dict(),
        "varied_eager": dict(batches=varied, backend="eager", grad_ckpt=True),
        "memory": dict(batches=fixed, max_memory_gib=0.5988, backend="eager"),
        "memory_fit": dict(batches=fixed, max_memory_gib=100.0, backend="eager"),
        "regional": dict(batches=fixed, scope="regional", loss_rows=True, ce_min_rows=0, autocast=False),
        "packed": dict(batches=packed, backend="aot_eager"),
        "own_loss": dict(batches=fixed, ce_chunks=0, mode="default", dynamic=True, recompute=False,
                         warm_cache=False, lora_addmm=False, nf4_dequant=False, memory_budget=0.5, pad_multiple=1),
        "knobs": dict(batches=varied, lora_addmm="ungrouped", eager_numerics=True, offload=False,
                      attention="mask", ckpt_layers=1, grad_ckpt=True),
        "nf4_true": dict(batches=fixed, nf4_dequant=True, backend="eager"),
        "bf16": dict(batches=fixed, dtype=torch.bfloat16),
    }
    assert list(kwargs) == list(DESCRIPTIONS)
    return model, kwargs


def test_descriptions_read_as_recorded(cases):
    model, kwargs = cases
    seen = {}
    for name, kw in kwargs.items():
        opt = optimize(model, **kw)
        try:
            seen[name] = opt.description
        finally:
            opt.undo()
    for name, want in DESCRIPTIONS.items():
        assert seen[name] == want, name


def test_the_plan_decides_every_choice_before_the_model_changes(cases):
    """``plan.decide`` names every choice the description lists, in its order, before the model
    changes; applying only fills in what it counts, and a choice the plan did not decide is refused."""
    from qlora_nb_utils.compile.options import OptimizeOptions
    from qlora_nb_utils.compile.plan import decide
    from qlora_nb_utils.compile.recipe import can_cache_functions, can_recompute_elementwise

    model, kwargs = cases
    for name in ("default", "packed", "own_loss", "memory"):
        kw = dict(kwargs[name])
        batches = kw.pop("batches", None)
        plan = decide(model, OptimizeOptions(**kw), batches, recompute_available=can_recompute_elementwise(),
                      cache_available=can_cache_functions())
        opt = optimize(model, batches=batches, **kw)
        try:
            assert list(plan.choices) == list(opt.choices) and list(plan.reasons) == list(opt.reasons), name
        finally:
            opt.undo()
    with pytest.raises(KeyError, match="'turbo' was not decided by the plan"):
        plan.applied("turbo", 1)


def test_the_choices_table_reads_as_the_description(cases):
    """``choices_table()`` holds the description's choices, values and reasons row by row, and its text
    keeps every line within the width asked for, each reason whole once its wrapping is undone."""
    from qlora_nb_utils.compile.optimized import format_choices

    model, kwargs = cases
    opt = optimize(model, **kwargs["memory"])
    try:
        rows = opt.choices_table()
        assert "optimize: " + "; ".join(f"{c}={v} ({why})" for c, v, why in rows) == opt.description
        assert [c for c, _, _ in rows] == [c for c in opt.choices if c in opt.reasons]
        text = opt.choices_text(width=90)
    finally:
        opt.undo()
    lines = text.splitlines()
    assert lines[0].split() == ["choice", "value", "why"] and set(lines[1]) <= {"-", " "}
    assert all(len(line) <= 90 for line in lines)
    why_at = lines[0].index("why")
    for name, value, why in rows:  # each row starts with its choice and value; its reason continues below
        start = next(i for i, line in enumerate(lines) if line.split()[:1] == [name] and line[why_at:] in why)
        parts = [lines[start][why_at:]]
        for line in lines[start + 1:]:
            if line[:why_at].strip():
                break
            parts.append(line[why_at:])
        assert " ".join(parts) == why and lines[start][:why_at].split() == [name, *value.split()]
    assert format_choices([], width=50).splitlines()[0].split() == ["choice", "value", "why"]


def test_an_options_object_or_dict_reads_as_its_keywords(cases):
    """``optimize(model, options)`` with the object, or a dict, chooses as the same keywords do."""
    from qlora_nb_utils.compile.options import OptimizeOptions

    model, kwargs = cases
    kw = dict(kwargs["memory_fit"])
    batches = kw.pop("batches")
    optimize(model, batches=batches, **kw).undo()  # a case before may have cast the weights: cast them back
    reference = optimize(model, batches=batches, **kw)  # the keywords
    want = reference.description
    reference.undo()
    for options, extra in ((OptimizeOptions(**kw), {}), (kw, {}), ({"backend": "eager"}, {"max_memory_gib": 100.0})):
        opt = optimize(model, options, batches=batches, **extra)
        try:
            assert opt.description == want
            assert opt.options == OptimizeOptions(**kw)
        finally:
            opt.undo()
    with pytest.raises(TypeError, match=r"unknown optimize\(\) option\(s\) \['turbo'\]; valid: \['grad_ckpt'"):
        optimize(model, batches=batches, turbo=True)


# ----------------------------------------------------------------------------- the options object
DEFAULTS = {  # optimize()'s keyword defaults before the options object
    "grad_ckpt": "auto", "max_memory_gib": None, "mode": "auto", "attention": "auto", "ckpt_layers": None,
    "dtype": None, "backend": "inductor", "ce_chunks": 4, "cast": True, "autocast": "auto", "pad_multiple": 8,
    "dynamic": "auto", "memory_budget": None, "eager_numerics": "auto", "scope": "auto", "doc_attention": "auto",
    "offload": "auto", "loss_rows": "auto", "recompute": "auto", "lora_addmm": "auto", "nf4_dequant": "auto",
    "warm_cache": "auto", "ce_min_rows": "auto", "lora_min_rows": "auto", "tile_mlp": "auto", "sdpa_kernel": "auto", "keep_attention": "auto",
    "steps": None, "compile_cache": "auto", "autotune": "auto", "step_graph": "auto",
}


def test_the_defaults_are_optimizes():
    from qlora_nb_utils.compile.options import OptimizeOptions

    assert OptimizeOptions().to_dict() == DEFAULTS
    assert OptimizeOptions.names() == list(DEFAULTS)


@pytest.mark.parametrize("options, message", [
    ({"mode": "turbo"}, r"mode must be one of \['auto', 'default'"),
    ({"grad_ckpt": "sometimes"}, "grad_ckpt must be one of"),
    ({"attention": "flash"}, "attention must be one of"),
    ({"scope": "layer"}, "scope must be one of"),
    ({"doc_attention": "dense"}, "doc_attention must be one of"),
    ({"lora_addmm": "wide"}, "lora_addmm must be one of"),
    ({"offload": "yes"}, "offload must be one of"),
    ({"pad_multiple": 0}, "pad_multiple must be an integer >= 1, got 0"),
    ({"pad_multiple": True}, "pad_multiple must be an integer >= 1"),
    ({"max_memory_gib": -1}, "max_memory_gib must be None or a number > 0"),
    ({"ckpt_layers": -1}, "ckpt_layers must be None or an integer >= 0"),
    ({"ckpt_layers": 1, "grad_ckpt": False}, "needs grad_ckpt=True or 'auto'"),
    ({"offload": True, "grad_ckpt": False}, "offload=True keeps checkpointed layers' inputs in CPU memory"),
    ({"mode": "reduce-overhead", "backend": "eager"}, "is an Inductor option"),
    ({"ce_min_rows": -1}, "ce_min_rows must be 'auto' or an integer"),
    ({"ce_min_rows": True}, "ce_min_rows must be 'auto' or an integer"),
    ({"ce_chunks": -2}, "ce_chunks must be an integer >= 0"),
    ({"ce_chunks": 0, "loss_rows": True}, "loss_rows=True needs the chunked loss"),
    ({"dtype": "float77"}, "dtype must be None, a torch dtype or its name"),
    ({"memory_budget": 2.0}, r"memory_budget must be None or a number in \[0, 1\]"),
    ({"autotune": "sometimes"}, r"autotune must be one of \['auto', True, False\]"),
    ({"autotune": False, "mode": "max-autotune"}, "autotune=False contradicts mode 'max-autotune'"),
    ({"autotune": False, "mode": "max-autotune-no-cudagraphs"}, "autotune=False contradicts mode"),
    ({"autotune": True, "backend": "eager"}, "autotune is an Inductor option"),
])
def test_a_bad_value_is_refused_with_what_is_valid(options, message):
    from qlora_nb_utils.compile.options import OptimizeOptions

    with pytest.raises(ValueError, match=message):
        OptimizeOptions(**options)
    with pytest.raises(ValueError, match=message):
        OptimizeOptions.from_dict(options)


def test_every_bad_value_is_reported_at_once():
    from qlora_nb_utils.compile.options import OptimizeOptions

    with pytest.raises(ValueError) as err:
        OptimizeOptions(mode="turbo", scope="layer", pad_multiple=0)
    lines = str(err.value).splitlines()
    assert lines[0] == "3 bad optimize() options:"
    assert [line.split(" must")[0] for line in lines[1:]] == ["- mode", "- scope", "- pad_multiple"]


def test_from_dict_names_unknown_keys_and_the_valid_ones():
    from qlora_nb_utils.compile.options import OptimizeOptions

    with pytest.raises(TypeError) as err:
        OptimizeOptions.from_dict({"mode": "auto", "turbo": 1, "ckpt": 2})
    message = str(err.value)
    assert "['ckpt', 'turbo']" in message and "valid: ['grad_ckpt', 'max_memory_gib'" in message
    with pytest.raises(TypeError, match="must be a mapping"):
        OptimizeOptions.from_dict([("mode", "auto")])


def test_to_dict_round_trips_and_is_plain():
    from qlora_nb_utils.compile.options import OptimizeOptions

    opts = OptimizeOptions(dtype=torch.bfloat16, max_memory_gib=9.5, scope="regional", lora_addmm="narrow",
                           ckpt_layers=3, grad_ckpt=True, ce_min_rows=0)
    plain = opts.to_dict()
    assert plain["dtype"] == "bfloat16" and json.loads(json.dumps(plain)) == plain
    assert OptimizeOptions.from_dict(plain) == opts and OptimizeOptions(**plain).dtype is torch.bfloat16
    assert OptimizeOptions.from_dict({"dtype": "torch.float16"}).dtype is torch.float16


def test_build_puts_keywords_over_the_options():
    from qlora_nb_utils.compile.options import OptimizeOptions

    base = OptimizeOptions(scope="regional")
    assert OptimizeOptions.build(base) is base
    assert OptimizeOptions.build(base, backend="eager") == OptimizeOptions(scope="regional", backend="eager")
    assert OptimizeOptions.build({"scope": "regional"}, scope="whole") == OptimizeOptions(scope="whole")
    assert OptimizeOptions.build(None, mode="default") == OptimizeOptions(mode="default")
    with pytest.raises(ValueError, match="scope must be one of"):  # a keyword is validated with the rest
        OptimizeOptions.build(base, scope="layer")


def test_recipe_options_check_and_hand_prepare_for_compile_its_share():
    from qlora_nb_utils.compile.options import RecipeOptions

    opts = RecipeOptions(dtype=torch.float32, grad_ckpt=True, scope="regional", offload=True, dynamic=True)
    assert opts.compile_options() == {"grad_ckpt": True, "mode": None, "backend": "inductor",
                                      "eager_numerics": False, "one_config": False, "scope": "regional",
                                      "dynamic": True}
    with pytest.raises(ValueError, match="offload needs grad_ckpt=True and scope='regional'"):
        RecipeOptions(dtype=torch.float32, offload=True)
    with pytest.raises(ValueError, match="ckpt_layers picks which layers"):
        RecipeOptions(dtype=torch.float32, ckpt_layers=1)
    with pytest.raises(TypeError):
        RecipeOptions()  # no dtype


# ----------------------------------------------------------------------------- the decision table
def test_the_mode_rule():
    from qlora_nb_utils.compile.launch_choices import MAX_CUDAGRAPH_SHAPES, choose_mode

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    few, many = [(2, 64)], [(2, 8 * n) for n in range(1, MAX_CUDAGRAPH_SHAPES + 2)]
    assert choose_mode("auto", "inductor", "whole", cuda, few) == ("reduce-overhead", "1 batch shape(s): CUDA graphs")
    assert choose_mode("auto", "inductor", "whole", cuda, many).value is None
    assert choose_mode("auto", "inductor", "whole", cuda, None).why == "shapes not shown: no CUDA graphs"
    assert choose_mode("auto", "inductor", "regional", cuda, few).why == "regional scope: no CUDA graphs"
    assert choose_mode("auto", "eager", "whole", cuda, few) == (None, "backend 'eager'")
    assert choose_mode("auto", "inductor", "whole", cpu, few) == (None, "no CUDA graphs on cpu")
    assert choose_mode("default", "inductor", "whole", cuda, few) == (None, "asked for")
    assert choose_mode("max-autotune", "inductor", "whole", cpu, few) == ("max-autotune", "asked for")


def test_the_autotune_rule():
    """No autotuning unless asked: a max-autotune mode is asking, any other Inductor plan compiles each
    kernel in one configuration; the reason says when this torch cannot hold reductions to one."""
    from qlora_nb_utils.compile.launch_choices import choose_autotune

    auto = choose_autotune("auto", None, "inductor", True)
    assert auto.value is False and auto.why.startswith("each Inductor kernel compiled in one configuration")
    assert "cannot filter" not in auto.why
    assert "reductions keep their candidates" in choose_autotune("auto", "reduce-overhead", "inductor", False).why
    for mode in ("max-autotune", "max-autotune-no-cudagraphs"):
        assert choose_autotune("auto", mode, "inductor", True) == (
            True, f"mode {mode!r} benchmarks kernel variants on the first step")
    assert choose_autotune(True, None, "inductor", True).value is True
    assert choose_autotune(False, "reduce-overhead", "inductor", True) == (False, "asked for")
    assert choose_autotune("auto", None, "aot_eager", True) == (False, "backend 'aot_eager': no Inductor kernels")


def test_the_plan_compiles_one_configuration_unless_autotuning(cases):
    """The recipe is handed ``one_config`` exactly when Inductor compiles and autotuning is not asked."""
    from qlora_nb_utils.compile.options import OptimizeOptions
    from qlora_nb_utils.compile.plan import decide
    from qlora_nb_utils.compile.recipe import can_cache_functions, can_recompute_elementwise

    model, kwargs = cases
    seen = {}
    for knobs in ({}, {"autotune": True}, {"mode": "max-autotune"}, {"backend": "aot_eager"}):
        plan = decide(model, OptimizeOptions(**knobs), kwargs["default"]["batches"],
                      recompute_available=can_recompute_elementwise(), cache_available=can_cache_functions())
        seen[tuple(knobs.items())] = (plan.choices["autotune"], plan.recipe_options().one_config)
    assert seen == {(): (False, True), (("autotune", True),): (True, False),
                    (("mode", "max-autotune"),): (True, False), (("backend", "aot_eager"),): (False, False)}


def test_the_numerics_rules():
    from qlora_nb_utils.compile import choices as c

    assert c.choose_dynamic("auto", [(2, 64), (2, 128)]) == (True, "2 lengths: dynamic from the first call")
    assert c.choose_dynamic("auto", [(2, 64), (4, 64)]) == (False, "one length: static")
    assert c.choose_dynamic(True, None) == (True, "asked for")
    assert c.choose_autocast("auto", torch.bfloat16) == (True, "LoRA matmuls in the compute dtype")
    assert c.choose_autocast(False, torch.bfloat16) == (False, "asked for")
    assert c.choose_autocast("auto", torch.float32) == (False, "float32: nothing to autocast")
    assert c.choose_eager_numerics("auto", torch.float16, "eager") == (False, "backend 'eager'")
    assert c.choose_eager_numerics("auto", torch.bfloat16, "inductor").value is True
    assert c.choose_dtype(None, torch.float32) == (torch.float32, "the model's compute dtype")
    assert c.choose_dtype(torch.bfloat16, torch.float32) == (torch.bfloat16, "asked for")
    from qlora_nb_utils.compile.plan import chunk_rows

    assert chunk_rows(4, "regional", "auto") == 512 and chunk_rows(4, "whole", "auto") == 0
    assert c.choose_loss(0, True, 0).why == "the chunked loss would not compute this model's loss (see head)"
    assert c.choose_recompute("auto", False) == ("torch's default", "this torch's partitioner has no such setting")
    with pytest.raises(ValueError, match="recompute=True"):
        c.choose_recompute(True, False)
    with pytest.raises(ValueError, match="warm_cache=True"):
        c.choose_warm_cache(True, "inductor", False)


# ----------------------------------------------------------------------------- the shape of the code
def test_the_body_of_optimize_spans_at_most_80_lines():
    """Measured as the ``FunctionDef``'s ``end_lineno`` minus the line after its docstring."""
    import qlora_nb_utils

    source = Path(inspect.getsourcefile(qlora_nb_utils.optimize)).read_text()
    node = next(n for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.FunctionDef) and n.name == qlora_nb_utils.optimize.__name__)
    doc = node.body[0]
    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)
    assert node.end_lineno - (doc.end_lineno + 1) <= 80


def _imports(path: Path, package: str) -> set[str]:
    """The modules of ``package`` that the file imports, at any depth of the file (TYPE_CHECKING included)."""
    module = package + "." + ".".join(path.with_suffix("").relative_to(COMPILE).parts)
    module = module.removesuffix(".__init__")
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            parent = base[:len(base) - node.level + 1] if node.level else []
            target = ".".join(parent + ([node.module] if node.module else []))
            found |= {target} | {f"{target}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {t for t in found if t.startswith(package + ".") or t == package}


COMPILE = Path(__file__).resolve().parent.parent / "qlora_nb_utils" / "compile"


def test_the_compile_package_has_no_import_cycle():
    package = "qlora_nb_utils.compile"
    files = {p: package + "." + ".".join(p.with_suffix("").relative_to(COMPILE).parts) for p in COMPILE.rglob("*.py")}
    modules = {m.removesuffix(".__init__") for m in files.values()}
    graph = {m.removesuffix(".__init__"): {t for t in _imports(p, package) if t in modules} - {m.removesuffix(".__init__")}
             for p, m in files.items()}
    # package __init__ files only re-export lazily; an edge to a package is an edge to its __init__
    assert "qlora_nb_utils.compile.optimized" in graph["qlora_nb_utils.compile.fast_path"]
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError(" -> ".join(path[path.index(nxt):] + [nxt]) if nxt in path else nxt)
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])


def test_the_models_compute_dtype_is_what_its_frozen_weights_are_on_any_device():
    """A model built from a config in memory names no dtype: its weights say what it computes in, not
    the device's default (an fp32 model on a GPU is not cast to bf16 unless asked)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from qlora_nb_utils.compile.plan import compute_dtype

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=2, target_modules="all-linear"))
    assert getattr(model.config, "dtype", None) in (None, torch.float32)
    assert compute_dtype(model, torch.device("cuda")) == torch.float32
    model.get_base_model().to(torch.bfloat16)
    for name, p in model.named_parameters():  # LoRA kept as fp32 master weights, the base in bf16
        if "lora_" in name:
            p.data = p.data.float()
    assert compute_dtype(model, torch.device("cuda")) == torch.bfloat16
    for p in model.parameters():
        p.requires_grad_(True)  # nothing frozen: the config, else the device's default
    assert compute_dtype(model, torch.device("cpu")) == torch.float32

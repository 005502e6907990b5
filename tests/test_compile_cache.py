"""compile.compile_cache and the scope choice: what optimize() keeps for the next run, and what it compiles.

The artifacts are torch's own (``torch.compiler.save_cache_artifacts``): a real round trip is
made with a one-kernel function (seconds on a CPU); the rest checks the choices, the file's key
and when it is written, without compiling a model.
"""

import pytest
import torch

from qlora_nb_utils import optimize
from qlora_nb_utils.compile import choices
from qlora_nb_utils.compile import compile_cache as cc
from qlora_nb_utils.compile.choices import choose_scope
from qlora_nb_utils.compile.options import OptimizeOptions
from qlora_nb_utils.compile.prepare import regional_pays_until


def test_auto_scope_weighs_the_job():
    """Regional wherever the whole graph gets no CUDA graphs; on a GPU with them, by the steps."""
    until = regional_pays_until(16)
    assert until > 100  # a GPU job of a few hundred steps never repays a whole-model compile
    assert choose_scope("auto", steps=60, device_type="cpu", layers=30).value == "regional"
    assert choose_scope("auto", steps=10**6, device_type="cpu", layers=30).value == "regional"
    assert choose_scope("auto", steps=60, device_type="cuda", layers=16, cuda_graphs=False).value == "regional"
    assert choose_scope("auto", steps=until - 1, device_type="cuda", layers=16, cuda_graphs=True).value == "regional"
    assert choose_scope("auto", steps=until + 1, device_type="cuda", layers=16, cuda_graphs=True).value == "whole"
    # the job not told: one graph, as before; one layer: nothing to share
    assert choose_scope("auto", steps=None, device_type="cpu", layers=30).value == "whole"
    assert choose_scope("auto", steps=60, device_type="cpu", layers=1).value == "whole"
    for asked in ("whole", "regional"):
        assert choose_scope(asked, steps=60, device_type="cpu", layers=30).value == asked
    why = choose_scope("auto", steps=60, device_type="cuda", layers=16, cuda_graphs=True).why
    assert "60 steps" in why and str(until) in why


def test_optimize_takes_the_steps_and_says_why(tiny):
    from qlora_nb_utils import data as qdata

    model, tok = tiny
    batches = qdata.build_batches(tok, batch_size=2, steps=2, max_len=64, padding="fixed")
    for steps, scope in ((None, "whole"), (5, "regional")):
        opt = optimize(model, batches=batches, backend="eager", steps=steps)
        try:
            assert opt.choices["scope"] == scope
            assert f"scope={scope} (" in opt.description
        finally:
            opt.undo()
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="steps must be"):
            OptimizeOptions(steps=bad)


def test_the_cache_choice(tmp_path):
    assert choices.choose_compile_cache("auto", "inductor", "cuda").value == cc.default_folder()
    assert choices.choose_compile_cache("auto", "inductor", "cpu").value is False  # this machine's cache serves
    assert choices.choose_compile_cache(True, "inductor", "cpu").value == cc.default_folder()
    assert choices.choose_compile_cache(str(tmp_path), "inductor", "cpu").value == tmp_path
    assert choices.choose_compile_cache(False, "inductor", "cuda") == (False, "asked for")
    assert choices.choose_compile_cache("auto", "eager", "cuda").value is False
    with pytest.raises(ValueError, match="leaves no compiled artifacts"):  # refused with the options, before the model
        OptimizeOptions(compile_cache=True, backend="aot_eager")
    with pytest.raises(ValueError, match="compile_cache must be"):
        OptimizeOptions(compile_cache="")


def test_the_key_is_the_model_shape_device_torch_and_choices(tiny):
    model, _ = tiny
    cpu = torch.device("cpu")
    key = cc.cache_key(model, cpu, {"scope": "regional", "mode": None})
    assert key == cc.cache_key(model, cpu, {"mode": None, "scope": "regional"})  # order does not matter
    assert key != cc.cache_key(model, cpu, {"scope": "whole", "mode": None})
    assert key.startswith("llama-2l-") and torch.__version__.replace("+", "_") in key and key.endswith(".bin")
    config = next(m.config for m in model.modules() if hasattr(getattr(m, "config", None), "hidden_size"))
    width = config.hidden_size
    try:
        config.hidden_size = width * 2  # another shape: another file
        assert cc.cache_key(model, cpu, {"scope": "regional", "mode": None}) != key
    finally:
        config.hidden_size = width


def test_artifacts_round_trip_through_torchs_own_cache(tmp_path):
    """What a compile stored is written atomically, read back by the next run, and a damaged file
    only costs a compile."""
    torch.compiler.reset()
    fn = torch.compile(lambda x: torch.sin(x) * 3 + 1, backend="inductor", fullgraph=True)
    fn(torch.randn(16))
    path = tmp_path / "sub" / "run.bin"
    saver = cc.CompileCache(path)
    assert saver.save() and path.is_file() and saver.saved_bytes == path.stat().st_size
    assert not list(path.parent.glob("*.tmp"))
    assert not cc.CompileCache(path).save()  # the same bytes: left as they are
    reader = cc.CompileCache(path)
    said = reader.load()
    assert reader.loaded_bytes == path.stat().st_size and "loaded from" in said
    broken = tmp_path / "broken.bin"
    broken.write_bytes(b"not torch's")
    said = cc.CompileCache(broken).load()
    assert "compiled anew" in said
    assert "none yet" in cc.CompileCache(tmp_path / "missing.bin").load()


def test_saved_once_after_the_first_step_or_at_undo():
    saved = []

    class Fake:
        def save(self):
            saved.append(True)
            return True

    forward, finish = cc.save_after_first_step(lambda **b: b["x"] + 1, Fake())
    finish()
    assert saved == []  # nothing ran: nothing compiled to keep
    assert forward(x=1) == 2 and saved == []  # the first step's backward is still to compile
    assert forward(x=2) == 3 and saved == [True]
    forward(x=3)
    finish()
    assert saved == [True]
    one_step, finish = cc.save_after_first_step(lambda **b: 0, Fake())
    one_step()
    finish()
    assert saved == [True, True]


def test_optimize_loads_before_and_keeps_after(tiny, tmp_path, monkeypatch):
    """optimize(compile_cache=folder) reads the key's file before anything compiles, says so, and
    writes it after the first step (torch's save and load are stood in for: nothing compiles here)."""
    from qlora_nb_utils import data as qdata

    calls = []
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: calls.append("save") or (b"blob", None))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda blob: calls.append(("load", blob)) or object())
    monkeypatch.setattr(choices, "choose_compile_cache", lambda asked, backend, device: choices.Choice(tmp_path, "asked for"))
    model, tok = tiny
    batches = qdata.build_batches(tok, batch_size=2, steps=2, max_len=64, padding="fixed")
    opt = optimize(model, batches=batches, backend="eager", steps=2)
    try:
        assert opt.choices["compile_cache"] == "kept" and "none yet" in opt.reasons["compile_cache"]
        for batch in batches:
            opt.forward(**batch).loss.backward()
    finally:
        opt.undo()
    assert calls == ["save"]
    (path,) = tmp_path.glob("*.bin")
    assert path.read_bytes() == b"blob"
    opt = optimize(model, batches=batches, backend="eager", steps=2)
    opt.undo()  # never stepped: nothing saved
    assert opt.choices["compile_cache"] == "loaded" and calls == ["save", ("load", b"blob")]

"""``qlora-nb generate``: talk to a trained run, as it was trained, with nothing exported first.

Why it exists: the question after a fine-tune is "what does it say now?", and the run's own
samples are one held-out prompt. Decisions, and why:

* **The model is the run's as trained**: its base loaded in NF4 (in the device's compute dtype:
  bf16 on a recent GPU, fp32 on a CPU) with the adapter on top, unmerged: the model the held-out
  loss measured. ``merged=True`` loads an exported folder (:mod:`.export`) instead, with plain
  ``from_pretrained``, so that an export can be checked against the run.
* **The prompt is rendered as training rendered prompts** (:func:`qlora_nb_utils.data.format_example`):
  one user turn through the tokenizer's chat template, the assistant's turn opened, when it has
  one; the package's ``### Prompt`` layout otherwise. ``chat_template=False`` continues the text
  as typed.
* **Greedy by default**: the same prompt gives the same answer, so two runs can be compared.
* **Streamed** (``transformers.TextStreamer``): text appears as it is generated.
* **Bad input fails first**: a missing folder, a folder without an adapter, a base model that is
  not on this machine (:mod:`.run_folder`) fail before any model loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["check_source", "load_trained", "stream_completion", "render_prompt"]


def check_source(path: str | Path, *, merged: bool = False) -> Any:
    """Check what ``generate`` will load, loading nothing: a run (``TrainedRun``) or an exported folder (``Path``).

    Raises:
        ValueError: no such folder; a run without adapter or metrics or whose base cannot be
            found; with ``merged``, a folder that is not a full model (or is an adapter).
    """
    from .run_folder import read_run

    if not merged:
        return read_run(path)
    from ..models.registry import check_model_source

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder (expected one written by `qlora-nb export`)")
    if (folder / "adapter_config.json").is_file():
        raise ValueError(f"{folder} holds a PEFT adapter, not a merged model: drop --merged and pass the run folder")
    if (folder / "adapter").is_dir() and not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is a training run, not an exported model: drop --merged, or export it first")
    check_model_source(str(folder))
    return folder


def load_trained(path: str | Path, *, merged: bool = False, device: str = "auto") -> tuple[Any, Any]:
    """``(model, tokenizer)`` ready to generate: the run's NF4 base + adapter, or an exported folder.

    On a CPU the NF4 layers keep the layout and kernels training used
    (:mod:`~qlora_nb_utils.compile.patches.bnb_cpu_packing`): bitsandbytes' CPU inference repack
    rounds the block scales to bf16 on CPUs with AVX512-BF16, so the model would compute otherwise
    than it trained, and its export (exact in fp32) would no longer match it.

    Raises:
        ValueError: as :func:`check_source`, before anything loads.
    """
    from .. import env

    source = check_source(path, merged=merged)
    dev, dtype = env.resolve_device_dtype(device, "auto")
    if merged:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(dev)
        tok = AutoTokenizer.from_pretrained(source)
    else:
        from .. import models

        base, tok = models.load_model(source.model, quant="nf4", lora=False, dtype=dtype, device=dev)
        from peft import PeftModel  # after load_model, which imports bitsandbytes first (env.import_bitsandbytes)

        model = PeftModel.from_pretrained(base, source.adapter)
        if dev.type == "cpu":
            from ..compile.patches import bnb_cpu_packing

            bnb_cpu_packing.apply(model)  # kept for the model's life: it computes as it trained
    model.eval()
    model.config.use_cache = True
    return model, tok


def render_prompt(tok: Any, prompt: str, *, chat_template: bool = True) -> tuple[str, bool]:
    """``(text, add_special_tokens)``: the prompt as training rendered one, or as typed."""
    from ..data import format_example

    if not chat_template:
        return prompt, True
    text, _ = format_example({"prompt": prompt, "response": ""}, tok)
    return text, not getattr(tok, "chat_template", None)  # a template writes its own special tokens


def stream_completion(model: Any, tok: Any, prompt: str, *, max_new_tokens: int = 64, chat_template: bool = True,
                      temperature: float = 0.0, stream: bool = True) -> str:
    """Generate a completion of ``prompt``, printing it to stdout as it comes; return it.

    Args:
        temperature: 0 (the default) is greedy decoding; above 0, sampling at that temperature.
        stream: print the text as it is generated (``TextStreamer``).
    """
    import torch
    from transformers import TextStreamer

    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    text, special = render_prompt(tok, prompt, chat_template=chat_template)
    device = next(model.parameters()).device
    enc = tok(text, return_tensors="pt", add_special_tokens=special).to(device)
    streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True) if stream else None
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, use_cache=True, streamer=streamer,
                             pad_token_id=tok.pad_token_id, **sampling)
    return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)

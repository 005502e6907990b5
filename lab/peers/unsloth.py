"""The Unsloth peer of the benchmark: the same batches, trained by Unsloth, in a process of its own.

Unsloth patches transformers, peft and trl when it is imported, so it must be imported before
any of them, and its patches must not leak into the process that measures our own code. The
benchmark therefore runs it as a subprocess (`lab.peers` calls this module with the
CLI below) and reads back one JSON file. The GPU machine has no network and its own package set:
Unsloth and the few packages it needs beyond that machine travel as one archive made by
`lab/gpu/peers/unsloth_bundle.sh` and sit first on PYTHONPATH (see docs/unsloth_peer.md).

Nothing here imports transformers: the package's ``__init__`` imports nothing heavy either, so
``python -m lab.peers.unsloth`` reaches `import unsloth` with transformers unloaded.

The training loop is deliberately plain (no Trainer): AdamW over the trainable parameters at a
constant learning rate, weight decay 0, the gradient norm clipped to 1.0 as
:func:`qlora_nb_utils.training.train` clips ours and the HF peer's (and TRL's Trainer every
TRL peer's; ``--max-grad-norm 0`` for none), one synchronised `perf_counter` pair around
each step (host-to-device copy of the batch excluded). Tokens per second count the real (non-pad)
tokens of each step's batch as written to the batches file,
:func:`qlora_nb_utils.data.packing.real_tokens` (the one count every peer uses). With
``--packed`` the batches are packed (:func:`qlora_nb_utils.data.packing.pack_examples`) and each
is trained the way Unsloth's own padding-free path trains (``unsloth.utils.packing``, what its
``SFTTrainer`` patch feeds the model): all documents flattened into one row, position ids
restarting per document, ``packed_seq_lengths``, no attention mask
(:func:`lab.peers.packed_batches.flatten_packed`). Any failure after the arguments are parsed
is written to the JSON file as ``{"name": "unsloth", "error": ...}`` and the exit status is 0, so
the caller can put a failed peer in its table without parsing stderr; bad arguments exit 2.

    python -m lab.peers.unsloth --model-dir DIR --batches FILE.pt --steps N \
        --warmup W --lr LR --seed S --lora-r 16 --lora-alpha 32 --out RUN.json [--grad-ckpt] \
        [--packed --name unsloth-packed]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

NAME = "unsloth"
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BATCH_KEYS = ("input_ids", "attention_mask", "labels")
PACKED_KEYS = ("input_ids", "labels", "position_ids", "document_ids")
VERSION_PACKAGES = ("unsloth", "unsloth_zoo", "trl", "transformers", "peft", "bitsandbytes", "torch")

# Set before unsloth is imported: no hub, no statistics ping, no silent CPU fallback.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "UNSLOTH_DISABLE_STATISTICS": "1",
    "UNSLOTH_DISABLE_CPU_FALLBACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # Unsloth writes generated modules to ./unsloth_compiled_cache by default: keep the repo clean.
    "UNSLOTH_COMPILE_LOCATION": os.path.join(tempfile.gettempdir(), "qlora_nb_unsloth_compiled_cache"),
}

NOTES = (
    "tokens_per_s = real_tokens_per_s = median over the steps after warm-up of real (non-pad) tokens / step time, "
    "real tokens counted by qlora_nb_utils.data.packing.real_tokens on each step's batch as written (the same "
    "count as every peer; before this change this peer counted batch_size * seq_len, padding included); "
    "plain loop: torch.optim.AdamW(trainable params, constant lr, weight_decay=0), gradient norm clipped with "
    "torch.nn.utils.clip_grad_norm_ (--max-grad-norm, 1.0 as training.train clips ours; no sync before the "
    "step's end); "
    "each step timed with torch.cuda.synchronize + perf_counter, batch copy to GPU excluded; "
    "median over steps after the warm-up steps; peak_mem_gib = torch.cuda.max_memory_allocated "
    "reset after loading; FastLanguageModel.from_pretrained(load_in_4bit=True, dtype=bfloat16), "
    "get_peft_model(lora_dropout=0, bias='none')"
)


# ---------------------------------------------------------------- arguments


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The CLI that `lab.peers` calls."""
    p = argparse.ArgumentParser(
        prog="python -m lab.peers.unsloth",
        description="Train the benchmark's batches with Unsloth (QLoRA) and write one RUN.json.",
    )
    p.add_argument("--model-dir", required=True, type=Path, help="local HF checkpoint folder (config.json inside)")
    p.add_argument("--batches", required=True, type=Path, help="torch.save'd list of dicts: input_ids, attention_mask, labels")
    p.add_argument("--steps", required=True, type=_positive_int, help="training steps (batches are cycled)")
    p.add_argument("--warmup", required=True, type=_int, help="steps left out of the median")
    p.add_argument("--lr", required=True, type=_positive_float)
    p.add_argument("--seed", required=True, type=_int)
    p.add_argument("--lora-r", type=_positive_int, default=16)
    p.add_argument("--lora-alpha", type=_positive_float, default=32.0)
    p.add_argument("--out", required=True, type=Path, help="RUN.json to write")
    p.add_argument("--grad-ckpt", action="store_true", help='use_gradient_checkpointing="unsloth"')
    p.add_argument("--max-grad-norm", type=lambda t: 0.0 if t in ("0", "0.0") else _positive_float(t), default=1.0,
                   help="clip the gradient norm to this, as training.train does for ours (0: no clipping)")
    p.add_argument("--packed", action="store_true",
                   help="packed batches (document_ids): trained through Unsloth's padding-free path")
    p.add_argument("--name", default=NAME, help="the run's name in RUN.json")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the arguments; exits 2 with a clear message on bad input.

    Raises:
        SystemExit: (status 2) from argparse when an argument is missing or invalid.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.model_dir.is_dir():
        parser.error(f"--model-dir {args.model_dir} is not a directory")
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"--model-dir {args.model_dir} has no config.json: not a Hugging Face checkpoint")
    if not args.batches.is_file():
        parser.error(f"--batches {args.batches} does not exist")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be >= 0 and < --steps ({args.steps}), got {args.warmup}")
    if args.out.exists() and args.out.is_dir():
        parser.error(f"--out {args.out} is a directory; give a file name such as RUN.json")
    return args


# ---------------------------------------------------------------- pure helpers (tested on CPU)


def load_batches(path: str | os.PathLike, packed: bool = False) -> tuple[list[dict[str, Any]], int, int]:
    """Read the batch file and check that every batch has one shape.

    Args:
        path: a file written by ``torch.save`` holding a non-empty list of dicts with
            ``input_ids``, ``attention_mask`` and ``labels`` (padded) or ``input_ids``,
            ``labels``, ``position_ids`` and ``document_ids`` (``packed``): 2-D int64 CPU
            tensors of equal shape.
        packed: the batches are packed.

    Returns:
        ``(batches, batch_size, seq_len)``.

    Raises:
        ValueError: the file holds anything else, or shapes differ between batches.
    """
    import torch

    keys = PACKED_KEYS if packed else BATCH_KEYS
    batches = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(batches, (list, tuple)) or not batches:
        raise ValueError(f"{path}: expected a non-empty list of batch dicts, got {type(batches).__name__}")
    shape = None
    for i, batch in enumerate(batches):
        if not isinstance(batch, dict):
            raise ValueError(f"{path}: batch {i} is a {type(batch).__name__}, not a dict")
        missing = [k for k in keys if k not in batch]
        if missing:
            raise ValueError(f"{path}: batch {i} lacks {missing}" + ("" if packed else " (packed batches need --packed)"
                                                                    if "document_ids" in batch else ""))
        for key in keys:
            t = batch[key]
            if not torch.is_tensor(t) or t.dim() != 2 or t.dtype != torch.int64:
                got = f"{t.dtype} {tuple(t.shape)}" if torch.is_tensor(t) else type(t).__name__
                raise ValueError(f"{path}: batch {i} {key} must be a 2-D int64 tensor, got {got}")
            if shape is None:
                shape = tuple(t.shape)
            elif tuple(t.shape) != shape:
                raise ValueError(
                    f"{path}: batch {i} {key} has shape {tuple(t.shape)}, expected {shape}: "
                    "the peer needs fixed-length padding (one shape for all batches)"
                )
    return list(batches), shape[0], shape[1]


def step_summary(step_ms: Sequence[float], warmup: int, tokens: Sequence[int]) -> dict[str, float]:
    """Median step time after warm-up, and real tokens/s: the median of ``tokens[i] / step i's time``.

    The same statistic as :func:`lab.peers.results.summarize_run`, over the
    real tokens of each step (:func:`qlora_nb_utils.data.packing.real_tokens`).

    Raises:
        ValueError: no step is left after the warm-up steps, or the lists differ in length.
    """
    if len(step_ms) != len(tokens):
        raise ValueError(f"{len(step_ms)} step times but {len(tokens)} token counts")
    steady = list(zip(step_ms, tokens))[warmup:]
    if not steady:
        raise ValueError(f"no timed step left: {len(step_ms)} steps, warmup {warmup}")
    median = float(statistics.median(ms for ms, _ in steady))
    tps = float(statistics.median(t / (ms / 1000.0) for ms, t in steady))
    return {"median_step_ms": median, "tokens_per_s": tps, "real_tokens_per_s": tps}


def package_versions(names: Sequence[str] = VERSION_PACKAGES) -> dict[str, str | None]:
    """Versions as imported (``__version__`` of a loaded module first, then the metadata found first)."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in names:
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None) if module is not None else None
        if version is None:
            try:
                version = metadata.version(name.replace("_", "-"))
            except metadata.PackageNotFoundError:
                version = None
        out[name] = str(version) if version is not None else None
    return out


def error_record(exc: BaseException, tail_chars: int = 4000, name: str = NAME) -> dict[str, Any]:
    """The JSON written when the run fails: name, ``"<type>: <message>"`` and the traceback's tail."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "name": name,
        "error": f"{type(exc).__name__}: {exc}",
        "traceback_tail": tb[-tail_chars:],
        "versions": package_versions(),
    }


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    tmp.replace(path)


# ---------------------------------------------------------------- the run (needs unsloth and CUDA)


def set_offline_env(environ=os.environ) -> None:
    """Hub off and Unsloth quiet; values already set by the caller are kept."""
    for key, value in OFFLINE_ENV.items():
        environ.setdefault(key, value)


def import_unsloth():
    """Import unsloth first, before transformers/peft/trl, and return `FastLanguageModel`.

    Raises:
        RuntimeError: no CUDA device, or transformers was already imported (the patches would
            not take).
    """
    set_offline_env()
    if "transformers" in sys.modules:
        raise RuntimeError("transformers was imported before unsloth; run this module in a fresh process")
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: the Unsloth peer runs on an NVIDIA GPU only")
    import unsloth  # noqa: F401  (must precede transformers)
    from unsloth import FastLanguageModel

    return FastLanguageModel


def train_unsloth(args: argparse.Namespace, FastLanguageModel, batches, batch_size: int, seq_len: int) -> dict[str, Any]:
    """Load, add LoRA, train `args.steps` steps; return the RUN.json record."""
    import torch

    from lab.peers.packed_batches import flatten_packed
    from qlora_nb_utils.data.packing import real_tokens

    torch.manual_seed(args.seed)
    t_load = time.perf_counter()
    model, _tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(args.model_dir),
        max_seq_length=batch_size * seq_len if args.packed else seq_len,
        dtype=torch.bfloat16,
        load_in_4bit=True,
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        target_modules=TARGET_MODULES,
        lora_dropout=0,
        bias="none",
        use_gradient_checkpointing="unsloth" if args.grad_ckpt else False,
        random_state=args.seed,
    )
    load_s = time.perf_counter() - t_load
    how = "padded batches as written"
    if args.packed:
        from unsloth.utils import packing as unsloth_packing

        unsloth_packing.mark_allow_overlength(model)  # what its SFTTrainer patch does before packed training
        how = ("padding-free: each packed batch flattened into one row (tail padding dropped), "
               "position_ids restarting per document, packed_seq_lengths, no attention_mask "
               "(Unsloth's own padding-free input; unsloth.utils.packing)")
    model.train()
    device = next(p.device for p in model.parameters() if p.requires_grad)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)

    torch.cuda.reset_peak_memory_stats(device)
    losses, step_ms, tokens = [], [], []
    for step in range(args.steps):
        written = batches[step % len(batches)]
        tokens.append(real_tokens(written))
        batch = flatten_packed(written) if args.packed else written
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        if args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        step_ms.append((time.perf_counter() - t0) * 1000.0)
        if step == 0:  # the clock a launch-to-first-step time is read against (lab/gpu/compile_time)
            first_step_end_unix = time.time()
        losses.append(float(loss.detach()))
        if not losses[-1] == losses[-1]:
            raise FloatingPointError(f"loss is NaN at step {step}")

    summary = step_summary(step_ms, args.warmup, tokens)
    return {
        "name": args.name,
        "packed": bool(args.packed),
        "batch_size": batch_size,
        "seq_len": seq_len,
        "steps": args.steps,
        "warmup": args.warmup,
        **summary,
        "mfu": None,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "compile_s": None,
        "load_s": load_s,
        "losses": losses,
        "step_ms": step_ms,
        "first_step_end_unix": first_step_end_unix,
        "trainable_params": sum(p.numel() for p in params),
        "grad_ckpt": bool(args.grad_ckpt),
        "max_grad_norm": args.max_grad_norm or None,
        "lora_r": args.lora_r,
        "lora_alpha": args.lora_alpha,
        "lr": args.lr,
        "seed": args.seed,
        "device": torch.cuda.get_device_name(device),
        "versions": package_versions(),
        "command": " ".join([sys.executable, "-m", __spec__.name if __spec__ else __name__, *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "real_tokens": tokens,
        "notes": f"{how}; {NOTES}",
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the peer; 0 also when the run failed (the error is in the JSON), 2 for bad arguments."""
    args = parse_args(argv)
    try:
        batches, batch_size, seq_len = load_batches(args.batches, packed=args.packed)
        FastLanguageModel = import_unsloth()
        record = train_unsloth(args, FastLanguageModel, batches, batch_size, seq_len)
    except (Exception, SystemExit) as exc:  # recorded, not raised: the caller tabulates failed peers
        record = error_record(exc, name=args.name)
        print(f"unsloth peer failed: {record['error']}", file=sys.stderr)
    write_json(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``qlora-nb train``: fine-tune a model on your data through the fast path, and keep the result.

Why it exists: everything else in the package measures; this is what a user runs to get an
adapter. It is the measured recipe end to end: the model loaded as QLoRA (NF4 base, LoRA on
every linear layer), compiled by :func:`qlora_nb_utils.compile.optimize` (which says what it
chose), trained by the package's own loop (:func:`~qlora_nb_utils.training.loop.train`), judged
on held-out examples (:func:`~qlora_nb_utils.training.evaluation.evaluate`), and saved as a PEFT
adapter that ``PeftModel.from_pretrained`` loads. What a run leaves in ``out``: ``adapter/``,
``checkpoint/`` (resumable, :mod:`.checkpoint`), ``metrics.json`` and ``loss_curve.png``; a run
stopped by a signal writes them too, marked ``"interrupted": true``, so that what was trained can
be read, plotted, exported and talked to before (or without) a ``--resume``.

Decisions, and why:

* **Bad input fails first**: :func:`~.finetune_options.check_options` (:mod:`.finetune_options`)
  runs before any model loads.
* **The batches** (:mod:`.finetune_batches`): padded to buckets of a quarter of ``seq_len``
  (at most 4 shapes), packed where padding would be more than
  :data:`~.finetune_batches.PACK_WHEN_PADDING_OVER`, in an order fixed by the seed so that a
  resumed run sees what the uninterrupted one saw.
* **LR**: linear warm-up, then constant; a resume with a larger ``steps`` simply goes on.
* **Defaults fit a laptop CPU**: SmolLM2-135M (real weights, so the losses mean something),
  batch 4 x 128 tokens, 60 steps, held-out loss every 20 steps on 32 examples: a few minutes on
  two CPU cores (a cold compile cache adds the compile, a warm one spares most of it), long enough
  for the held-out loss to fall visibly.

The run is :class:`Run`, one object that :func:`finetune` drives, in this module with it so that
a run reads in one place. Why a class: the run's state (model, the ``optimize`` result,
optimizer, scheduler, history, the RNG state of the last step boundary) is needed by the step
callback, the checkpoint, the interrupt path and the metrics alike; holding it in one place keeps
each stage a short method and :func:`finetune` a short sequence of them.

Order of a run: Inductor's compile workers started (:mod:`~qlora_nb_utils.compile.workers`) ->
the batches (tokenizer only, in a thread) beside the model load, neither waiting for the other ->
``optimize`` -> optional parity check
(undone) -> fresh optimizer and scheduler, or the checkpoint's -> the loop, with
:meth:`Run.on_step` evaluating, checkpointing and honouring a stop at each step boundary -> the
"before" sample and the held-out loss at step 0, on the adapter's starting weights put back for
the while (they evaluate the model before any update, so they need not delay the first step)
-> the "after" sample. Samples and evaluations run eagerly on the very weights and attention
path the compiled step trains.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import shlex
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from .. import env
from ..compile.workers import start_compile_workers
from ..data.packing import real_tokens
from .checkpoint import (
    CHECKPOINT,
    FinetuneInterrupted,
    StopSignals,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .evaluation import complete, evaluate
from .finetune_batches import PACK_WHEN_PADDING_OVER, build_finetune_batches
from .finetune_options import DEFAULTS, OUTPUTS, check_options, run_meta
from .first_step import Ticker, median_tokens_per_s, since_launch

# DEFAULTS, OUTPUTS, PACK_WHEN_PADDING_OVER, check_options, build_finetune_batches and run_meta are
# defined in .finetune_options and .finetune_batches, and imported from here too (the CLI, the tests)
__all__ = ["DEFAULTS", "OUTPUTS", "PACK_WHEN_PADDING_OVER", "check_options", "build_finetune_batches", "finetune",
           "run_meta", "Run"]

_ROW_KEYS = ("step", "loss", "tokens", "tokens_per_s", "step_ms", "lr", "grad_norm")
# .loop (pandas) is imported by the stages that train, so that importing this module to check the
# options first (the CLI) costs no more than the checkpoint module's torch


def _clear(out: Path) -> None:
    for name in OUTPUTS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _resume_command(command: str | None, out: Path) -> str:
    if not command:
        return f"finetune(..., out={str(out)!r}, resume=True)"
    words = [w for w in shlex.split(command) if w != "--overwrite"]
    return shlex.join(words + ([] if "--resume" in words else ["--resume"]))


def finetune(*, out: str | Path = "runs/train", resume: bool = False, overwrite: bool = False, progress: bool = True,
             log: Callable[[str], None] = print, command: str | None = None, checked: dict[str, Any] | None = None,
             **options: Any) -> dict[str, Any]:
    """Fine-tune a model with QLoRA through the fast path; write adapter, checkpoint and metrics.

    Args:
        out: the output folder (module docstring); refused when it holds a run, unless
            ``resume`` or ``overwrite``.
        resume: continue the run in ``out`` from its checkpoint (same options; ``steps`` may grow).
        overwrite: delete the run in ``out`` first.
        progress: show a tqdm bar (loss, tokens/s, time left).
        log: where status lines go.
        command: the command line, recorded in the metrics and used for the resume hint.
        checked: what :func:`check_options` returned for these very arguments, by a caller that
            checked them first (the CLI, before it sets up the allocator): not checked again.
        **options: any of :data:`DEFAULTS`: ``model`` (a name of ``models.MODEL_NAMES`` or a
            folder), ``data`` (None: the shipped data; a JSONL file or a ``save_to_disk``
            folder), ``steps``, ``batch_size``, ``seq_len``, ``lr``, ``warmup_steps``,
            ``lora_r``, ``lora_alpha``, ``eval_every`` / ``save_every`` (0: only at the end),
            ``eval_size``, ``mode``, ``backend``, ``max_memory_gib``, ``grad_ckpt``, ``packing``
            (``"auto"``: packed where padding would waste more than a quarter; True, False),
            (``"auto"``, True, False), ``device``, ``dtype``, ``seed``, ``check_parity`` (K > 0:
            K steps eager, eager on rows permuted two ways and compiled first, judged, then undone).

    Returns:
        The metrics, as written to ``out/metrics.json``.

    Raises:
        ValueError, FileNotFoundError: bad input, before any model loads (:func:`check_options`).
        FinetuneInterrupted: SIGINT or SIGTERM; the checkpoint was written first (``exit_code``), and,
            once a step is done, ``metrics.json`` (``"interrupted": true``) and ``loss_curve.png``.
    """
    started = time.perf_counter()
    opts = checked if checked is not None else check_options(out=out, resume=resume, overwrite=overwrite, **options)
    out = opts["out"]
    if overwrite:
        _clear(out)
    out.mkdir(parents=True, exist_ok=True)
    with StopSignals() as stop:
        run = Run(opts, stop=stop, progress=progress, log=log)
        stopped = None
        try:
            run.prepare()
            run.train()
        except KeyboardInterrupt:
            stopped = _interrupted(run, stop, command)
        except torch.OutOfMemoryError as err:  # the plan's estimate, for the hint the command prints
            err.plan_estimate_gib = run.plan_estimate_gib()
            raise
        finally:
            run.release()  # opt.undo(), and the graph-break count closed
            run.name_the_base()
        if stopped is not None:
            if run.has_trained():  # what was trained keeps its record, marked as stopped
                with contextlib.suppress(KeyboardInterrupt):  # a second signal: stop without them
                    metrics = run.metrics(command=command, wall_s=time.perf_counter() - started, stopped=stopped)
                    run.write(metrics)
                    log(f"wrote {out / 'metrics.json'} and {out / 'loss_curve.png'} (interrupted after "
                        f"{run.steps_done} steps)")
            raise stopped
        metrics = run.metrics(command=command, wall_s=time.perf_counter() - started)
        run.write(metrics)
        run.summary(metrics)
    return metrics


def _interrupted(run: Any, stop: StopSignals, command: str | None) -> FinetuneInterrupted:
    import signal

    signum = stop.signum or signal.SIGINT
    saved = run.save_on_interrupt() if stop.at_boundary else None
    folder = latest_checkpoint(run.out)
    name = signal.Signals(signum).name
    if folder is None:
        message = f"{name}: stopped after {run.steps_done} step(s), before any checkpoint; nothing to resume"
    else:
        step = json.loads((folder / "history.json").read_text())["steps_done"]
        message = (f"{name}: stopped after {run.steps_done}/{run.opts['steps']} steps; "
                   f"checkpoint{' saved' if saved else ''} in {folder} (step {step})\n"
                   f"resume with: {_resume_command(command, run.out)}")
    run.log(message)
    return FinetuneInterrupted(signum, folder, run.steps_done, message)


def utc_now() -> str:
    """The date as the metrics record it."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _show(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value).replace("torch.", "")


class Run:
    """One fine-tune's state and stages (see the module docstring); built by ``finetune``."""

    def __init__(self, opts: dict[str, Any], *, stop: StopSignals, progress: bool, log: Callable[[str], None]):
        self.opts, self.stop, self.progress, self.log = opts, stop, progress, log
        self.out: Path = opts["out"]
        self.opt = None
        self.breaks = None
        self._breaks_cm = None
        resumed = opts.get("resume_history")
        self.start_step = self.steps_done = resumed["steps_done"] if resumed else 0
        self.saved_step = self.start_step if resumed else -1
        self.parity: dict | None = None
        self._bnb_layout = None

    # ------------------------------------------------------------------ stages
    def _build_batches(self, tok: Any) -> float:
        """The run's training and held-out batches (in a thread beside the model load); its seconds."""
        clock = time.perf_counter()
        o = self.opts
        self.train_batches, self.eval_batches, self.example = build_finetune_batches(
            tok, data=o["data"], batch_size=o["batch_size"], seq_len=o["seq_len"], seed=o["seed"],
            eval_size=o["eval_size"], log=self.log, packing=o["packing"])
        self.packed = "document_ids" in self.train_batches[0]
        slots = sum(b["input_ids"].numel() for b in self.train_batches)
        self.pad_fraction = 1 - sum(real_tokens(b) for b in self.train_batches) / slots
        self.log(f"==> {len(self.train_batches)} training batches of {o['batch_size']} (one epoch, <= {o['seq_len']} "
                 f"tokens), {len(self.eval_batches)} held-out batches")
        return round(time.perf_counter() - clock, 3)

    def prepare(self) -> None:
        """Batches, model, ``optimize``, the "before" sample, parity, optimizer/scheduler, start state."""
        from .. import models
        from ..compile import optimize
        from .hf_trainer import count_graph_breaks
        from .loop import load_trainable_state, trainable_state, warmup_schedule

        o = self.opts
        self.device, self.dtype = env.resolve_device_dtype(o["device"], o["dtype"])
        start_compile_workers(self.device, o["backend"])  # they come up while the data and model load
        note = env.bytecode_note()  # an image without torch's bytecode pays seconds of imports at every start
        if note:
            self.log(note)
        clock = time.perf_counter()
        tok = models.load_tokenizer(o["model"])
        self.log(f"==> loading {o['model']} (NF4 + LoRA r={o['lora_r']}, {_show(self.dtype)}) on {self.device}, "
                 "its batches built meanwhile")
        with ThreadPoolExecutor(1, thread_name_prefix="qlora-nb-batches") as pool:
            batches = pool.submit(self._build_batches, tok)  # tokenizers and packing, beside the load
            try:
                self.model, self.tok = models.load_model(
                    o["model"], quant="nf4", lora=True, lora_r=o["lora_r"], lora_alpha=o["lora_alpha"],
                    dtype=self.dtype, device=self.device, prepare_kbit=True, seed=o["seed"])
            except BaseException:
                batches.cancel()
                raise
            load_s = round(time.perf_counter() - clock, 3)
            data_s = batches.result()  # a data error surfaces here, as it would have before the load
        self.meta = run_meta(o)  # after the load: a named model's config.json exists now
        self.loaded_from = self.model.get_base_model().name_or_path  # what PEFT writes as the base
        self.loaded_attention = self.model.get_base_model().config._attn_implementation
        if self.device.type == "cpu":  # else an eval pass repacks NF4 weights and breaks gradients
            from ..compile.patches import bnb_cpu_packing

            self._bnb_layout = bnb_cpu_packing.apply(self.model)
        # where the start goes (metrics): data and load side by side, so their wall time is one phase
        self.phases = {"data_and_load_s": round(time.perf_counter() - clock, 3)}
        self.start_overlap_s = {"data_s": data_s, "load_s": load_s}
        clock = time.perf_counter()
        self._breaks_cm = count_graph_breaks()
        self.breaks = self._breaks_cm.__enter__()
        self.opt = optimize(self.model, o["optimize_options"], batches=self.train_batches,
                            steps=o["steps"] - self.start_step)  # the steps this process runs: the compile's job
        self.phases["optimize_s"] = round(time.perf_counter() - clock, 3)
        self.log("==> optimize() chose:\n" + self.opt.choices_text())
        self.autocast = self.opt.choices["dtype"] if self.opt.choices["autocast"] else None
        history = o.get("resume_history")
        self.sample = self._sample_texts()
        self.sample["before"] = None if history is None else history.get("sample_before")
        # the adapter's start, in host memory: the device keeps nothing extra through the loop
        self._initial = ({n: t.cpu() for n, t in trainable_state(self.model).items()} if history is None else None)
        if o["check_parity"]:
            self.parity = self._parity(o["check_parity"])
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=o["lr"], weight_decay=0.0)
        self.scheduler = warmup_schedule(self.optimizer, o["warmup_steps"])
        if history is None:
            self.history = {"steps_done": 0, "sessions": 1, "rows": [], "eval_losses": [],
                            "sample_before": self.sample["before"]}
        else:
            state, self.history = load_checkpoint(self.out)
            load_trainable_state(self.model, state["trainable"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.resume_rng = state["rng"]
            self.history["sessions"] += 1
        self.session = self.history["sessions"] - 1

    def plan_estimate_gib(self) -> float | None:
        """The peak ``optimize()`` estimated for its plan, as its description states it (None: none stated)."""
        import re

        opt = getattr(self, "opt", None)
        said = re.search(r"the plan's estimated peak: ([\d.]+) GiB", opt.reasons.get("ckpt_layers", "")) if opt else None
        return float(said.group(1)) if said else None

    def train(self) -> None:
        """The loop from the start step to ``steps``, then the "after" sample."""
        from .loop import TrainConfig, train

        o = self.opts
        cfg = TrainConfig(steps=o["steps"], lr=o["lr"], warmup_steps=o["warmup_steps"], seed=o["seed"],
                          progress=self.progress, adapter_dir=self.out / "adapter")
        if self.start_step:
            set_rng_state(self.resume_rng, self.device)
            self.log(f"==> resuming at step {self.start_step + 1} of {o['steps']} from {self.out / CHECKPOINT}")
        else:
            torch.manual_seed(o["seed"])  # train() seeds too: the RNG of boundary 0 is this one
        self.boundary_rng = rng_state(self.device)
        self._say(self._compiling_note())
        self._ticker = Ticker(self._say, "    still on the first step (compiling): {:.0f} s")
        try:
            train(self.model, self.train_batches, cfg, forward=self.opt.forward, label="train",
                  optimizer=self.optimizer, scheduler=self.scheduler, start_step=self.start_step, on_step=self.on_step)
        finally:
            self._ticker.stop()
        self.stop.immediate = True  # nothing left to save: a signal now stops at once
        self._at_start_checks()
        self.sample["after"] = self._complete()

    def _at_start_checks(self) -> None:
        """The "before" sample and the held-out loss at step 0, on the adapter as it started.

        Why after the loop: both are evaluations of the model before any update, and a user waits
        for them before the first step when they run first; run here, on the adapter's starting
        weights put back for the while (then the trained ones again), they give the same text and
        loss without delaying the first step. The starting weights are the ones kept at the start,
        or, in a resumed run that has lost them, LoRA's own start: every ``lora_B`` zero, which
        makes each adapted layer its base layer whatever ``lora_A`` holds.
        """
        from .loop import load_trainable_state, trainable_state

        need_sample = self.sample.get("before") is None
        need_loss = not any(e["step"] == 0 for e in self.history["eval_losses"])
        if not (need_sample or need_loss):
            return
        start = getattr(self, "_initial", None)
        trained = trainable_state(self.model)
        if start is None:
            if not all("lora_A" in n or "lora_B" in n for n in trained):
                return  # other trainable weights: their start is not known here
            start = {n: torch.zeros_like(t) if "lora_B" in n else t for n, t in trained.items()}
        load_trainable_state(self.model, start)
        self.log("==> the adapter as it started, evaluated now (run after the steps, so that the first step "
                 "waits for none of it):")
        try:
            if need_sample:
                self.sample["before"] = self.history["sample_before"] = self._complete()
                self.log(f"==> before training, the held-out prompt continued as: {self.sample['before']!r}")
            if need_loss:
                self._evaluate(0)
                self.history["eval_losses"].sort(key=lambda e: e["step"])
        finally:
            load_trainable_state(self.model, trained)

    def on_step(self, step: int, row: dict) -> None:
        """At each step boundary: record, evaluate and checkpoint when due, then honour a stop."""
        self.stop.immediate = False
        if step == self.start_step:  # this process's first step: the one that compiled
            self._ticker.stop()
            self.first_step = {"first_step_s": round(row["step_ms"] / 1e3, 3), "first_step_end_unix": time.time(),
                               "time_to_first_step_s": since_launch(), "start_phases_s": self.phases,
                               "start_overlap_s": self.start_overlap_s}
            c = self.opt.counter
            self._say(f"==> first step: {row['step_ms'] / 1e3:.1f} s, of which compiling {c.compile_s:.1f} s "
                      f"({c.compilations} compilation(s)); the steps after it reuse what was compiled")
        self.steps_done = step + 1
        self.peak_mem_gib = max(getattr(self, "peak_mem_gib", 0.0), row["step_peak_mem_gib"])
        self.boundary_rng = rng_state(self.device)
        self.history["rows"].append({**{k: row[k] for k in _ROW_KEYS}, "session": self.session})
        self.history["steps_done"] = self.steps_done
        o, n = self.opts, self.steps_done
        last = n == o["steps"]
        if last or (o["eval_every"] and n % o["eval_every"] == 0):
            self._evaluate(n)
        if last or (o["save_every"] and n % o["save_every"] == 0):
            self.save()
        self.stop.check()

    def save(self) -> Path:
        """Checkpoint the last step boundary (atomic; :func:`.checkpoint.save_checkpoint`)."""
        from .loop import trainable_state

        folder = save_checkpoint(self.out, trainable=trainable_state(self.model), optimizer=self.optimizer,
                                 scheduler=self.scheduler, rng=self.boundary_rng, history=self.history, meta=self.meta)
        self.saved_step = self.steps_done
        return folder

    def save_on_interrupt(self) -> bool:
        """Save the boundary a stop was raised at, unless it is saved already; True if saved."""
        if self.saved_step == self.steps_done or self.steps_done == self.start_step:
            return False
        self.save()
        return True

    def release(self) -> None:
        """``opt.undo()`` and close the graph-break count (safe when ``prepare`` failed half-way)."""
        try:
            if self.opt is not None:
                self.opt.undo()
        finally:
            if self._bnb_layout is not None:
                self._bnb_layout.undo()
            if self._breaks_cm is not None:
                self._breaks_cm.__exit__(None, None, None)
                self._breaks_cm = None

    def name_the_base(self) -> None:
        """The saved adapter names its base as the run does, not by the folder it was read from.

        ``from_pretrained`` records where the weights were read (for a named model, this
        machine's cache folder), and PEFT writes that into ``adapter_config.json`` and the model
        card. The run's name (a name of ``models.MODEL_NAMES``, a hub id, or a folder's absolute
        path) is what another machine loads the base by. The files are rewritten after PEFT saved
        them: set on the model, the name would send PEFT's save to the hub to look for its config.
        """
        folder, loaded_from = self.out / "adapter", getattr(self, "loaded_from", None)
        config_file = folder / "adapter_config.json"
        if not loaded_from or not config_file.is_file():
            return
        name = self.meta["model"]
        config = json.loads(config_file.read_text())
        if config.get("base_model_name_or_path") == loaded_from:
            config["base_model_name_or_path"] = name
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        card = folder / "README.md"
        if card.is_file():
            card.write_text(card.read_text().replace(loaded_from, name))

    # ------------------------------------------------------------------ helpers
    def _say(self, message: str) -> None:
        if self.progress:
            from tqdm.auto import tqdm

            tqdm.write(message)
        else:
            self.log(message)

    def _compiling_note(self) -> str:
        """What the first step will do, said before it starts (it is the long one)."""
        choices = self.opt.choices
        if self.opt.options.backend == "eager":
            return "==> training (backend eager: nothing compiles)"
        what = ("one decoder layer's graph, reused by every layer" if choices["scope"] == "regional"
                else "the whole model as one graph")
        cached = " from an earlier run's compiled graphs" if choices.get("compile_cache") == "loaded" else ""
        return f"==> the first step compiles {what}{cached}; the steps after it reuse it"

    def _as_loaded(self) -> Any:
        """The model's own attention for padded batches and generation (packing switched it)."""
        from ..ops.doc_attention import DOC_MASK_KERNELS, use_document_attention

        if not self.packed or self.loaded_attention not in DOC_MASK_KERNELS:
            return contextlib.nullcontext()
        return use_document_attention(self.model, self.loaded_attention)  # undone on exit

    def _evaluate(self, step: int) -> float:
        with self._as_loaded():
            loss = evaluate(self.opt.module, self.eval_batches, autocast_dtype=self.autocast)
        self.history["eval_losses"].append({"step": step, "loss": loss})
        self._say(f"step {step}: held-out loss {loss:.4f}")
        return loss

    def _sample_texts(self) -> dict[str, Any]:
        from ..data import format_example

        ex = self.example
        if ex.get("messages"):
            shown = ex["messages"][-2]["content"]
            expected = ex["messages"][-1]["content"]
        else:
            shown, expected = ex["prompt"], ex.get("response") or ex.get("completion")
        self._rendered = format_example(ex, self.tok)[0]
        return {"prompt": shown, "expected": expected}

    def _complete(self) -> str:
        plain = not getattr(self.tok, "chat_template", None)
        with self._as_loaded():
            return complete(self.model, self.tok, self._rendered, max_new_tokens=32, autocast_dtype=self.autocast,
                            add_special_tokens=plain)

    def _parity(self, k: int) -> dict[str, Any]:
        """K steps eager, eager on rows permuted two ways, and compiled, from the same start; then undone."""
        from .loop import TrainConfig, load_trainable_state, train, trainable_state
        from .parity import judge, permute_rows, verdict_text

        o = self.opts
        start = trainable_state(self.model)
        eager = self.opt.eager  # the recipe uncompiled: same padding, autocast and loss
        batches = [self.train_batches[i % len(self.train_batches)] for i in range(k)]
        cfg = TrainConfig(steps=k, lr=o["lr"], warmup_steps=o["warmup_steps"], seed=o["seed"], progress=False,
                          interrupt_dir=Path(tempfile.gettempdir()) / "qlora_nb_parity_interrupted")
        runs = {}
        # the floor in two seeded row orders (the larger difference at each step), as qlora-nb bench judges
        orders = [(f"eager_permuted{j}", eager, permute_rows(batches, seed=o["seed"] + j)) for j in (1, 2)]
        for label, forward, data in (("eager", eager, batches), *orders, ("compiled", self.opt.forward, batches)):
            load_trainable_state(self.model, start)
            runs[label] = [float(x) for x in train(self.model, data, cfg, forward=forward, label=label)["loss"]]
        load_trainable_state(self.model, start)
        verdict = judge(runs["eager"], [runs["eager_permuted1"], runs["eager_permuted2"]], runs["compiled"])
        self.log(f"==> parity over {k} steps, |compiled - eager|: {verdict_text(verdict)}")
        return {"steps": k, **verdict, "losses": runs}

    # ------------------------------------------------------------------ results
    def has_trained(self) -> bool:
        """Whether there are steps to report (this session's or a resumed checkpoint's)."""
        return self.steps_done > 0 and self.opt is not None and hasattr(self, "history")

    def write(self, metrics: dict[str, Any]) -> None:
        """``metrics.json`` and ``loss_curve.png``."""
        (self.out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str) + "\n")
        self.plot(metrics)

    def metrics(self, *, command: str | None, wall_s: float,
                stopped: FinetuneInterrupted | None = None) -> dict[str, Any]:
        """The metrics dict that ``metrics.json`` holds (``stopped``: the run was interrupted)."""
        o, rows = self.opts, self.history["rows"]
        counter = self.opt.counter.to_dict()
        metrics = {
            "model": o["model"], "data": None if o["data"] is None else str(o["data"]), "out": str(self.out),
            "options": {k: _show(o[k]) for k in DEFAULTS}, "meta": self.meta,
            "steps_done": self.steps_done, "resumed_from": self.start_step or None,
            "losses": [r["loss"] for r in rows], "eval_losses": self.history["eval_losses"],
            "final_eval_loss": self.history["eval_losses"][-1]["loss"] if self.history["eval_losses"] else None,
            "tokens_per_s": median_tokens_per_s(rows),
            **getattr(self, "first_step", {}), "peak_mem_gib": getattr(self, "peak_mem_gib", None),
            "packing": self.packed, "pad_fraction": self.pad_fraction,
            "graph_breaks": self.breaks.total, "break_reasons": self.breaks.by_reason,
            "compilations": counter, "compile_s": counter["compile_s"],
            "optimize": {"description": self.opt.description,
                         "choices": {k: _show(v) for k, v in self.opt.choices.items()}},
            "device": env.device_info(self.device), "versions": env.versions(),
            "command": command or "finetune()", "date": utc_now(), "wall_s": round(wall_s, 2),
            "sample": self.sample, "history": rows,
            "adapter": str(self.out / "adapter"), "checkpoint": str(self.out / CHECKPOINT),
            "interrupted": stopped is not None,
        }
        if stopped is not None:
            import signal

            metrics["stopped_by"] = signal.Signals(stopped.signum).name
            metrics["resume_checkpoint"] = None if stopped.checkpoint is None else str(stopped.checkpoint)
        if self.parity is not None:
            metrics["parity"] = self.parity
        return metrics

    def plot(self, metrics: dict[str, Any]) -> Path:
        """``loss_curve.png`` next to the metrics."""
        from .curve import plot_loss_curve

        stopped = " (interrupted)" if metrics.get("interrupted") else ""
        title = (f"{metrics['model']}: QLoRA fine-tune, {metrics['steps_done']} steps{stopped} "
                 f"({metrics['device']['name']})")
        return plot_loss_curve(metrics["losses"], metrics["eval_losses"], self.out / "loss_curve.png", title)

    def summary(self, metrics: dict[str, Any]) -> None:
        """A few lines for the terminal: losses, speed, compilations, the samples, the files."""
        losses, ev, k = metrics["losses"], metrics["eval_losses"], min(5, len(metrics["losses"]))
        first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        tps = metrics["tokens_per_s"]
        first_step = f", the first step {metrics['first_step_s']:.1f} s" if "first_step_s" in metrics else ""
        steps = lambda n: f"{n} step" + ("" if n == 1 else "s")  # noqa: E731
        self.log(f"==> done: {steps(metrics['steps_done'])} in {metrics['wall_s']:.0f} s (compiling "
                 f"{metrics['compile_s']:.1f} s{first_step}); train loss {first:.3f} -> {last:.3f} (mean of "
                 f"{steps(k)}), held-out loss {ev[0]['loss']:.3f} (step {ev[0]['step']}) -> {ev[-1]['loss']:.3f} "
                 f"(step {ev[-1]['step']})")
        speed = ("real tokens/s: not measured (only the compiling first step ran; run more steps)" if tps is None
                 else f"{tps:.0f} real tokens/s (median, the compiling first step left out)")
        self.log(f"    {speed}, graph breaks {metrics['graph_breaks']}, "
                 f"compilations {metrics['compilations']['compilations']}")
        s = metrics["sample"]
        self.log(f"prompt:   {s['prompt']!r}\nbefore:   {s['before']!r}\nafter:    {s['after']!r}\n"
                 f"expected: {s['expected']!r}")
        self.log(f"wrote {self.out / 'adapter'}/ (PEFT adapter), {self.out / CHECKPOINT}/, "
                 f"{self.out / 'metrics.json'}, {self.out / 'loss_curve.png'}")

"""What :func:`~qlora_nb_utils.compile.fast_path.optimize` hands back: the step, its choices, its undo.

Why this module exists: ``optimize()`` decides; the object it returns is what a user and every
training path in the package hold for the whole run (``forward`` each step, ``eager`` for parity,
``install`` for a Trainer, ``undo`` at the end). Kept apart so that each reads on its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..reversible import PatchHandle, set_attribute
from .choices import show
from .hf_forward import trainer_forward
from .recipe import FastPrepared
from .step_inputs import StepInputs, prepare_batch, with_masks

__all__ = ["Optimized", "format_choices"]


def format_choices(rows: list[tuple[str, str, str]], width: int = 100) -> str:
    """Rows ``(choice, value, why)`` as a plain-text table: a header, then each row with its reason
    wrapped under the ``why`` column so that no line passes ``width`` (a column is never narrower
    than 20 characters)."""
    import textwrap

    heads = ("choice", "value", "why")
    name_w = max(len(heads[0]), *(len(r[0]) for r in rows)) if rows else len(heads[0])
    value_w = max(len(heads[1]), *(len(r[1]) for r in rows)) if rows else len(heads[1])
    value_w = min(value_w, 40)
    why_w = max(20, width - name_w - value_w - 4)
    lines = [f"{heads[0]:<{name_w}}  {heads[1]:<{value_w}}  {heads[2]}",
             f"{'-' * name_w}  {'-' * value_w}  {'-' * min(why_w, 40)}"]
    for name, value, why in rows:
        wrapped = textwrap.wrap(why, why_w, break_on_hyphens=False) or [""]
        lines.append(f"{name:<{name_w}}  {value:<{value_w}}  {wrapped[0]}")
        lines += [f"{'':<{name_w}}  {'':<{value_w}}  {more}" for more in wrapped[1:]]
    return "\n".join(lines)


@dataclasses.dataclass
class Optimized:
    """What :func:`optimize` hands back.

    Attributes:
        forward: What to train with: ``forward(**batch).loss`` (moves the batch to the
            model's device, pads, marks lengths dynamic, runs the compiled recipe). Where the plan
            chose ``step_graph``, it carries :meth:`prepare_step` as ``forward.prepare_step``, and
            ``train(..., forward=opt.forward)`` captures each step as a CUDA graph.
        module: The module that was compiled (the model wrapped in the chunked loss, or the
            model itself); graph-break checks look at it.
        counter: The :class:`~qlora_nb_utils.compile.CompileCounter` of every compilation.
        choices: Each choice made, by name (``mode``, ``attention``, ``ckpt_layers``, ...).
        reasons: Why, one short phrase per choice.
        fast: The :class:`~qlora_nb_utils.compile.recipe.FastPrepared` underneath.
        options: The :class:`~qlora_nb_utils.compile.options.OptimizeOptions` it was made with.
        inputs: The :class:`~qlora_nb_utils.compile.step_inputs.StepInputs` the step was built
            from (padding, labelled rows, masks, the model's device, the recipe's options): the
            same object :meth:`prepare` and :meth:`eager` prepare a batch by.
    """

    forward: Callable[..., Any]
    module: torch.nn.Module
    counter: Any
    choices: dict[str, Any]
    reasons: dict[str, str]
    fast: FastPrepared
    options: Any = None
    inputs: StepInputs = dataclasses.field(default_factory=StepInputs)
    _extra: list[PatchHandle] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.choices.get("step_graph"):  # the loop that trains with this forward captures its step
            self.forward.prepare_step = self.prepare_step

    def __call__(self, **batch: Any) -> Any:
        return self.forward(**batch)

    def eager(self, **batch: Any) -> Any:
        """The same recipe uncompiled (padding, the document mask, autocast, the chunked loss): parity's reference.

        In regional scope the decoder layers themselves are compiled, so the recipe runs under the
        ``force_eager`` stance, which makes them run as plain code and compile nothing (a reference
        that went through the compiled layers would judge them by themselves, and its first call
        would compile them). Not where layers are checkpointed: their recompute runs in the
        backward, after this returns, and a checkpoint must recompute what its forward ran, so
        there the reference takes the compiled layers."""
        if str(self.choices.get("ckpt_layers", "0")).split("/")[0] not in ("0", "None"):
            return self.eager_prepared(**self.prepare(**batch))
        with torch.compiler.set_stance("force_eager"):
            return self.eager_prepared(**self.prepare(**batch))

    def prepare(self, **batch: Any) -> dict:
        """``batch`` as the recipe takes it: on the model's device, padded, with its labelled rows
        (read from the labels' values).

        What :meth:`forward` and :meth:`eager` do before the recipe, outside any graph, by
        :attr:`inputs` (:meth:`~.step_inputs.StepInputs.uncompiled`: no mark only a compiled graph
        reads). A tool that traces the recipe (graph-break counts) traces :meth:`eager_prepared` on this.
        """
        return prepare_batch(batch, self.inputs.uncompiled())

    def prepare_step(self, **batch: Any) -> dict:
        """``batch`` as :attr:`forward` prepares it (the compiled step's marks included), done ahead:
        :attr:`forward` then finds it prepared and runs only the recipe, which reads no value of
        the batch on the host. What a step captured as a CUDA graph runs outside the graph
        (``train()`` finds it on :attr:`forward` where the plan chose ``step_graph``)."""
        return prepare_batch(batch, self.inputs)

    def eager_prepared(self, **batch: Any) -> Any:
        """The recipe uncompiled on a batch from :meth:`prepare` (traceable: no data-dependent step)."""
        module = with_masks(self.module, self.inputs.uncompiled())
        if self.choices["autocast"]:
            with torch.autocast(self.choices["device"], dtype=self.choices["dtype"]):
                return module(**batch)
        return module(**batch)

    @property
    def description(self) -> str:
        """One line: every choice and its reason."""
        parts = [f"{name}={show(value)} ({self.reasons[name]})" for name, value in self.choices.items()
                 if name in self.reasons]
        return "optimize: " + "; ".join(parts)

    def choices_table(self) -> list[tuple[str, str, str]]:
        """Every choice as a row ``(choice, value, why)``, in the description's order: the same
        text as :attr:`description`, for a reader who scans a column instead of one long line."""
        return [(name, show(value), self.reasons[name]) for name, value in self.choices.items() if name in self.reasons]

    def choices_text(self, width: int = 100) -> str:
        """:meth:`choices_table` as plain text: one row per choice, the reason wrapped under its
        column to ``width`` characters (a terminal's, a log's)."""
        return format_choices(self.choices_table(), width)

    def install(self, model: torch.nn.Module) -> None:
        """Make ``model(**batch)`` run the optimized step (how a ``Trainer``/``SFTTrainer`` trains with it).

        The model's ``forward`` is replaced on the instance (undone by :meth:`undo`) by one that
        takes a Trainer's arguments (:func:`~qlora_nb_utils.compile.hf_forward.trainer_forward`:
        ``num_items_in_batch``, TRL's ``fused_lm_head``); calls without labels still reach the
        model's own forward. :func:`qlora_nb_utils.training.hf_trainer.optimized_trainer` does
        this for a built trainer.

        Raises:
            ValueError: the loss is the model's own (``ce_chunks=0``): the compiled module is then
                the model itself, whose forward this would replace.
        """
        if not self.choices["loss"].startswith("chunked"):
            raise ValueError("install() needs the chunked loss (ce_chunks > 0): with the model's own loss the "
                             "compiled module is the model, whose forward install() replaces")
        handle = PatchHandle("optimize.install", {"model": type(model).__name__})
        set_attribute(handle, model, "forward", trainer_forward(self, model.forward))
        self._extra.append(handle)

    def undo(self) -> None:
        """Revert every change but the weights' cast (newest first); safe to call twice."""
        while self._extra:
            self._extra.pop().undo()
        self.fast.undo()

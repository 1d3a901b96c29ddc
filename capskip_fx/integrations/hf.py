"""Hugging Face ``Trainer``: the run summary in the training logs (``capskip/kept_pct``, ``capskip/rows_pct``,
``capskip/steps_selected``, ``capskip/steps_dense_masked``, ``capskip/steps_dense``, ``capskip/fallbacks``).

    model.compile(backend="capskip")                       # in place: Trainer sees the model's own class
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    add_callback(trainer)
"""
from __future__ import annotations

import warnings
from typing import Optional

from transformers import TrainerCallback

from ..api import mark_compiled_batches, set_loss_type, summary

WRAPPED = ("capskip_fx: trainer.model is a torch.compile wrapper (OptimizedModule): Trainer.save_model() writes "
           "'_orig_mod.*' keys that from_pretrained() silently loads as random weights, and evaluate() finds no "
           "labels (no eval_loss). Compile in place instead: model.compile(backend=\"capskip\"); "
           "Trainer(model=model, ...)")


def _warn_if_wrapped(model) -> None:
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(model, OptimizedModule):
        warnings.warn(WRAPPED, stacklevel=3)


def _training_log(logs: dict) -> bool:
    """A training step's log (``loss``) or the end of training (``train_loss``); not an evaluation's
    (``eval_loss``, its metrics dict: the one ``trainer.evaluate()`` returns)."""
    return ("loss" in logs or "train_loss" in logs) and not any(k.startswith("eval_") for k in logs)


class CapskipCallback(TrainerCallback):
    """Adds ``capskip_fx.summary(model).as_dict()`` (a fixed key set) to each training log.  Loggers run as
    callbacks in list order: :func:`add_callback` puts this one first so that every reporter sees the
    fields; appended after them it still reaches ``trainer.state.log_history``."""

    def __init__(self, model=None):
        self.model = model

    def on_init_end(self, args, state, control, model=None, **kwargs):
        target = self.model if self.model is not None else model
        _warn_if_wrapped(target)
        set_loss_type(target)
        mark_compiled_batches(target)  # its step 0 selects (no static first batch)

    def on_log(self, args, state, control, logs: Optional[dict] = None, model=None, **kwargs):
        target = self.model if self.model is not None else model
        if logs is None or target is None or not _training_log(logs):
            return
        try:
            fields = summary(target, logged=True).as_dict()
        except TypeError:  # not compiled with capskip (yet): nothing to add
            return
        last = state.log_history[-1] if state.log_history else None
        logs.update(fields)
        if last is not None and last is not logs and all(last.get(k) == v for k, v in logs.items() if k not in fields):
            last.update(fields)  # Trainer appended this log to the history before calling the callbacks


def add_callback(trainer, model=None) -> CapskipCallback:
    """Install :class:`CapskipCallback` ahead of the trainer's reporters; returns it.  Warns when
    ``trainer.model`` is a ``torch.compile`` wrapper (its saved keys reload as random weights); sets an
    unrecognised ``loss_type`` to the loss transformers would use (:func:`set_loss_type`)."""
    _warn_if_wrapped(trainer.model)
    set_loss_type(model if model is not None else trainer.model)
    mark_compiled_batches(model if model is not None else trainer.model)  # its step 0 selects
    cb = CapskipCallback(model)
    trainer.callback_handler.callbacks.insert(0, cb)
    return cb

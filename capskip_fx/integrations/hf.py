"""Hugging Face ``Trainer``: the run summary in every log (``capskip/kept_pct``, ``capskip/rows_pct``,
steps by mode).

    trainer = Trainer(model=model, args=args, train_dataset=ds)   # model compiled with backend="capskip"
    add_callback(trainer)
"""
from __future__ import annotations

from typing import Optional

from transformers import TrainerCallback

from ..api import summary


class CapskipCallback(TrainerCallback):
    """Adds ``capskip_fx.summary(model).as_dict()`` to the logs of each logging step.  Loggers run as
    callbacks in list order: :func:`add_callback` puts this one first so that every reporter sees the
    fields; appended after them it still reaches ``trainer.state.log_history``."""

    def __init__(self, model=None):
        self.model = model

    def on_log(self, args, state, control, logs: Optional[dict] = None, model=None, **kwargs):
        target = self.model if self.model is not None else model
        if logs is None or target is None:
            return
        try:
            fields = summary(target).as_dict()
        except TypeError:  # not compiled with capskip (yet): nothing to add
            return
        logs.update(fields)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(fields)


def add_callback(trainer, model=None) -> CapskipCallback:
    """Install :class:`CapskipCallback` ahead of the trainer's reporters; returns it."""
    cb = CapskipCallback(model)
    trainer.callback_handler.callbacks.insert(0, cb)
    return cb

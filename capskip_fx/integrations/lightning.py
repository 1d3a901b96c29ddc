"""Lightning: the run summary logged with the LightningModule's own logger, the same fixed key set as the
Hugging Face callback (``capskip/kept_pct``, ``rows_pct``, ``steps_selected``, ``steps_dense_masked``,
``steps_dense``, ``fallbacks``).

    self.net.compile(backend="capskip")                  # in the LightningModule: in place, keys stay net.*
    trainer = L.Trainer(callbacks=[CapskipCallback()])
"""
from __future__ import annotations

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback

from ..api import mark_compiled_batches, summary


class CapskipCallback(Callback):
    """Logs ``capskip_fx.summary(...).as_dict()`` at each training batch end (``on_step``; training only),
    for the module passed in or, by default, the LightningModule itself (its compiled submodules are found
    through their parameters)."""

    def __init__(self, model=None):
        self.model = model

    def on_train_start(self, trainer, pl_module) -> None:
        # the modules compiled in place in the LightningModule trace a dynamic batch from step 0 (it selects)
        mark_compiled_batches(self.model if self.model is not None else pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not trainer.loggers:  # Trainer(logger=False): nothing to log to (Lightning would warn every call)
            return
        try:
            fields = summary(self.model if self.model is not None else pl_module, logged=True).as_dict()
        except TypeError:  # not compiled with capskip (yet)
            return
        pl_module.log_dict({k: float(v) for k, v in fields.items()}, on_step=True, on_epoch=False, prog_bar=False,
                           logger=True)

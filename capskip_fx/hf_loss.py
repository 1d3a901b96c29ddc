"""Hugging Face models whose loss lookup breaks the compiled graph (GPT-2's ``GPT2LMHeadModel``).

A ``loss_type`` transformers does not recognise makes ``model.loss_function`` log a warning and fall back to
``ForCausalLM``; Dynamo breaks the graph at that log call, so the loss lands in a graph of its own, one with
no classifier head.  Imports transformers only for a model that has a ``loss_type`` once it is loaded: the
library calls this for any model (``capskip_fx.compile``, a warning's text; ``integrations.hf`` through the API).
"""
from __future__ import annotations

import sys
from typing import Any, Optional

FIX = 'model.loss_type = "ForCausalLM"'


def _lookup_breaks(model: Any) -> Optional[Any]:
    """The model (unwrapped from torch.compile / DDP) whose loss lookup goes through that warning, else None."""
    if model is None or "transformers" not in sys.modules:
        return None
    inner = getattr(model, "_orig_mod", model)
    inner = getattr(inner, "module", inner)
    if not hasattr(inner, "loss_type") or "_loss_function" in vars(inner):
        return None
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:
        return None
    return None if inner.loss_type in LOSS_MAPPING else inner


def set_loss_type(model: Any) -> bool:
    """Give a model whose ``loss_type`` transformers does not recognise (GPT-2's ``GPT2LMHeadModel``) the
    loss it falls back to anyway, ``"ForCausalLM"``: the same loss, in the same graph as the logits.  True
    if it was set."""
    inner = _lookup_breaks(model)
    if inner is None:
        return False
    inner.loss_type = "ForCausalLM"
    return True


def loss_lookup_warning(model: Any) -> Optional[str]:
    """What a graph with no head means for such a model (the loss's graph after the break), with the fix;
    None for any other model."""
    inner = _lookup_breaks(model)
    if inner is None:
        return None
    return (f"{type(inner).__name__}'s loss lookup (loss_type={inner.loss_type!r}, not one transformers "
            f"recognises: it logs a warning, then uses ForCausalLM) breaks the compiled graph before the loss. "
            f"Rows are still selected: the graph that returns the logits runs the rule; the loss's own graph "
            f"has no head and runs its small backward dense (see report()). To keep the loss in one graph, "
            f"set {FIX} before the first step (the loss transformers uses anyway; capskip_fx.compile and "
            f"integrations.hf.add_callback set it)")

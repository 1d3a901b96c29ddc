"""Token-shaped logits (s, T, C) (a causal LM, token classification) from one Linear applied per token,
optionally times a number: a row is a sequence.

``h`` is the (s, T, d) value the Linear's (s*T, d) input is a view of (``Head.tokens`` holds that input);
the rules read per-sequence quantities (rules/base.py ``head_gram``)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import fx

from .base import Head, HeadForm, Logits, sequence_source


def _match(c: Logits) -> bool:
    return c.val.dim() == 3


def _obligations(c: Logits) -> Optional[str]:
    if c.unsupported is not None:
        return c.unsupported
    if c.terms is not None and any(c.cosines):
        return "token-shaped logits (N, T, C) of a cosine head (its Gram is followed for (N, C) only)"
    if c.terms is None or len(c.terms) != 1:
        return ("token-shaped logits (N, T, C) not produced by one Linear per token"
                + (" (a sum of Linear heads)" if c.terms else ""))
    hv = c.terms[0].h.meta.get("val")
    if not isinstance(hv, torch.Tensor) or hv.dim() != 2:
        return "token-shaped logits from a Linear whose input is not (N*T, d)"
    if sequence_source(c.terms[0].h, c.z) is None:
        return "token-shaped logits from a Linear whose input is not a view of (N, T, d)"
    return None


def _features(graph: fx.Graph, c: Logits) -> Head:
    t = c.terms[0]
    return Head(z=c.z, g=c.g, h=sequence_source(t.h, c.z), bias=t.bias, output_index=c.idx, tokens=t.h,
                form=TOKEN_LOGITS.name)


TOKEN_LOGITS = HeadForm("token_logits", "(N, T, C) logits from one Linear per token (a row is a sequence): `h` "
                        "its (N, T, d) input", _match, _obligations, _features)

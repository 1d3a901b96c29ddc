"""One Linear, ``addmm(bias, h, W^T)``, ``mm(h, W^T)`` or ``mm + bias``, and the same times a number.

The rule's Gram is ``K = (D D^T) * (H H^T [+ 1 if bias])`` of the Linear's (N, d) input ``h``: the
same rows as the logits (a head over reshaped rows, e.g. multiple choice, is no head).  A uniform
scale cancels in CAPSkip's relative bound, so the scaled form has the same features."""
from __future__ import annotations

from typing import Optional

import torch
from torch import fx

from .base import Head, HeadForm, Logits, producer, same_size

aten = torch.ops.aten


def _one_linear(c: Logits) -> bool:
    return (c.val.dim() == 2 and c.per_row is None and c.terms is not None and len(c.terms) == 1
            and not any(c.cosines))


def _scaled(c: Logits) -> bool:
    return producer(c.z).target in (aten.mul.Tensor, aten.div.Tensor)


def _obligations(c: Logits) -> Optional[str]:
    hv = c.terms[0].h.meta.get("val")
    if not isinstance(hv, torch.Tensor) or hv.dim() != 2:
        return "head input is not 2-D"
    if not same_size(hv.shape[0], c.val.shape[0]):
        return (f"the head's input has {hv.shape[0]} rows, the logits {c.val.shape[0]} "
                "(a Linear over reshaped rows, e.g. multiple choice)")
    return None


def _features(name: str):
    def features(graph: fx.Graph, c: Logits) -> Head:
        t = c.terms[0]
        return Head(z=c.z, g=c.g, h=t.h, bias=t.bias, output_index=c.idx, form=name)
    return features


LINEAR = HeadForm("linear", "one Linear (`addmm`, `mm`, `mm + b`): `h` its (N, d) input",
                  lambda c: _one_linear(c) and not _scaled(c), _obligations, _features("linear"))
SCALED_LINEAR = HeadForm("scaled_linear", "a Linear times (or over) a number: as `linear` (a uniform scale "
                         "cancels in the relative bound)", lambda c: _one_linear(c) and _scaled(c), _obligations,
                         _features("scaled_linear"))

"""``L[arange(N), j]``: per-token logits ``L`` (N, T, C) from one Linear, read at one token ``j`` per row (a
decoder classifier's last token).

Only the chosen tokens reach the loss, so the Gram is a Linear's on their inputs: ``h`` is a new node
``H[arange(N), j]`` of the (N, T, d) value ``H`` the Linear's (N*T, d) input is a view of."""
from __future__ import annotations

from typing import Optional

import torch
from torch import fx

from .base import Head, HeadForm, Logits, sequence_source

aten = torch.ops.aten


def _match(c: Logits) -> bool:
    return c.val.dim() == 2 and c.per_row is not None and c.terms is not None and not any(c.cosines)


def _obligations(c: Logits) -> Optional[str]:
    if len(c.terms) > 1:
        return "L[arange(N), j] of a sum of Linear heads"
    if sequence_source(c.terms[0].h, c.per_row[0]) is None:
        return "L[arange(N), j] of a Linear whose input is not (N, T, d)"
    return None


def _features(graph: fx.Graph, c: Logits) -> Head:
    """The head input of the chosen tokens, ``H[arange(N), j]``, as a new node before the logits."""
    _, r, j = c.per_row
    t = c.terms[0]
    n = sequence_source(t.h, c.per_row[0])
    with graph.inserting_before(c.z):
        h = graph.call_function(aten.index.Tensor, (n, [r, j]))
    with n.meta["val"].fake_mode:
        h.meta["val"] = aten.index.Tensor(n.meta["val"], [r.meta["val"], j.meta["val"]])
    return Head(z=c.z, g=c.g, h=h, bias=t.bias, output_index=c.idx, rows=(r, j), form=ARANGE_INDEXED.name)


ARANGE_INDEXED = HeadForm("arange_indexed", "`L[arange(N), j]`, `L` (N, T, C) from one Linear: `h` a new node "
                          "`H[arange(N), j]` of its (N, T, d) input", _match, _obligations, _features)

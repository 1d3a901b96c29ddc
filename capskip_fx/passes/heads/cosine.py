"""A cosine head ``s * mm(x, normalize(W).T)``: ``W`` a (C, d) parameter normalised over its rows
(``weights.cosine_weight``: ``div(W, [expand]([clamp_min](row norms)))``, as ``F.normalize`` traces), ``x``
any (N, d) input of the logits' rows, normalised or not, ``s`` a number, no bias, one head of (N, C) logits.

The Gram is not the rank-one form, so ``h`` is a new (N, 1, d + 2C) node of its features ``[x, Q, s^2 a]``
(``Head.cosine``; rules/base.py ``cosine_gram``), and the head's mm reads ``x`` back from it (saved)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from .base import Head, HeadForm, Logits, fake_node, same_size
from .weights import CosineWeight

aten = torch.ops.aten


def _match(c: Logits) -> bool:
    return c.val.dim() == 2 and c.terms is not None and any(c.cosines)


def _obligations(c: Logits) -> Optional[str]:
    if len(c.terms) > 1 or c.per_row is not None:
        return ("a cosine head " + ("in a sum of heads" if len(c.terms) > 1 else "read at L[arange(N), j]")
                + " (its Gram is followed for one cosine head of (N, C) logits only)")
    x, nv = c.terms[0].h, c.cosines[0].norm.meta["val"]
    xv = x.meta.get("val")
    if not (isinstance(xv, torch.Tensor) and xv.dim() == 2 and same_size(xv.shape[0], c.val.shape[0])
            and same_size(nv.shape[0], c.val.shape[1]) and isinstance(nv.shape[0], int)):
        return "a cosine head whose input is not (N, d) of the logits' rows"
    return None


def _features(graph: fx.Graph, c: Logits) -> Head:
    sc, x, _, lin = c.terms[0]
    h = _cosine_features(graph, lin, sc, c.cosines[0])
    return Head(z=c.z, g=c.g, h=h, bias=False, output_index=c.idx, cosine=x, form=COSINE.name)


def _cosine_features(graph: fx.Graph, lin: fx.Node, scale: float, cos: CosineWeight) -> fx.Node:
    """The (N, 1, d + 2C) Gram features of the cosine head ``z = scale * mm(x, normalize(W).T)`` (``lin`` the
    mm): ``[x, Q, scale^2 a]`` with ``a_c = 1 / n_c^2`` (``n_c = clamp_min(|W_c|, eps)``) on every row and
    ``Q_ic = z_ic m_c / n_c`` (``m_c = |W_c| > eps``: where the clamp holds, ``normalize`` has no projection
    term).  Row i's gradient of ``W_c`` is ``delta_ic (scale x_i - m_c z_ic W^_c) / n_c``, so
    ``<G_i, G_j> = sum_c delta_ic delta_jc (scale^2 a_c x_i . x_j - Q_ic Q_jc)`` (rules/base.py cosine_gram).

    The head's mm then reads ``x`` back as a slice of the features (the same values, bit for bit), so the
    forward needs them and the partitioner saves them for the selection; ``Q`` takes its own
    ``mm(x, normalize(W).T)`` (the head's would depend on the features).  Inserted before the head's mm."""
    x, w, c = lin.args[0], lin.args[1], cos.norm.meta["val"].shape[0]
    d = x.meta["val"].shape[1]

    def node(target, *args, **kwargs):
        return fake_node(graph, target, args, lin, kwargs)

    n = node(aten.clamp_min.default, cos.norm, cos.eps) if cos.eps is not None else cos.norm
    inv = node(aten.reciprocal.default, n)
    r = node(aten.mul.Tensor, inv, node(aten.gt.Scalar, cos.norm, cos.eps)) if cos.eps is not None else inv
    r = node(aten.view.default, node(aten.mul.Tensor, r, scale) if scale != 1.0 else r, [1, c])
    q = node(aten.mul.Tensor, node(aten.mm.default, x, w), r)
    a = node(aten.view.default, node(aten.mul.Tensor, node(aten.mul.Tensor, inv, inv), scale * scale), [1, c])
    a = node(aten.expand.default, a, [node(aten.sym_size.int, x, 0), c])
    # at least float32 (autocast: a bf16 Q and a would lose the Gram to cancellation); the mm reads x back
    # cast to its own dtype, exact (a 16-bit float round-trips through float32)
    xdt = x.meta["val"].dtype
    dt = torch.promote_types(xdt, torch.float32)
    parts = [node(aten.unsqueeze.default, t if t.meta["val"].dtype == dt else node(aten._to_copy.default, t, dtype=dt), 1)
             for t in (x, q, a)]
    h = node(aten.cat.default, parts, 2)
    # saved for the selection, never recomputed in the backward (a selected-row backward reads saved values only)
    h.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    x_back = node(aten.squeeze.dim, node(aten.slice.Tensor, h, 2, 0, d), 1)
    lin.replace_input_with(x, x_back if dt == xdt else node(aten._to_copy.default, x_back, dtype=xdt))
    return h


COSINE = HeadForm("cosine", "`s * mm(x, normalize(W).T)`, one head, no bias: `h` the (N, 1, d + 2C) features "
                  "`[x, Q, s^2 a]`", _match, _obligations, _features)

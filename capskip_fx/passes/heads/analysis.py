"""A logits output read once for every head form (``analyse``): z (or ``L`` when ``z = L[arange(N), j]``) as a
sum of scaled Linear heads, and each head's weight (a parameter or ``normalize(W)`` of one).

The refusals made here hold for every form: a head weight that is computed (weight norm, ``W * 2``), a
cosine head with a bias, logits scaled by a tensor (a learnable temperature)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import fx

from ...symbolic import expr_of
from ..row_index import is_batch_arange
from .base import Logits, Term, constant, producer
from .weights import cosine_weight, is_parameter, weight_of

aten = torch.ops.aten


class _Unsupported(Exception):
    """A head form whose CAPSkip Gram we can't follow exactly (the message says why)."""


def analyse(idx: int, z: fx.Node, g: Optional[fx.Node]) -> Optional[Logits]:
    """The output's analysis, or None if it is not a differentiable (N, C) or floating (N, T, C) tensor."""
    val = z.meta.get("val")
    if g is None or not isinstance(val, torch.Tensor):
        return None
    if val.dim() == 3 and val.dtype.is_floating_point:
        per_row = None
    elif val.dim() == 2:
        per_row = _per_row(z)
    else:
        return None
    try:
        terms, unsupported = _terms(per_row[0] if per_row else z), None
    except _Unsupported as e:
        terms, unsupported = None, str(e)
    terms = None if terms is None else tuple(Term(*t) for t in terms)
    cosines = () if terms is None else tuple(
        None if is_parameter(weight_of(t.linear)) else cosine_weight(weight_of(t.linear)) for t in terms)
    return Logits(idx, z, g, val, per_row, terms, cosines, unsupported)


def _match_linear(z: fx.Node) -> Optional[tuple[fx.Node, bool]]:
    p = producer(z)
    if p.op != "call_function":
        return None
    if p.target == aten.addmm.default:
        return p.args[1], True
    if p.target == aten.mm.default:
        return p.args[0], False
    if p.target in (aten.add.Tensor,):  # mm + bias
        for a, b in ((p.args[0], p.args[1]), (p.args[1], p.args[0])):
            if isinstance(a, fx.Node) and producer(a).op == "call_function" and producer(a).target == aten.mm.default:
                return producer(a).args[0], True
    return None


def _scalar_tensor(c) -> bool:
    return isinstance(c, fx.Node) and isinstance(c.meta.get("val"), torch.Tensor) and c.meta["val"].dim() == 0


def _terms(z: fx.Node) -> Optional[list]:
    """z as a sum of scaled Linear heads: [(scale, h, bias, the Linear's mm/addmm node)]; None if z is not one.

    Per-example gradient of head k's (W_k, b_k): ``c_k delta (x) [h_k; 1]``, so the Gram over all
    heads' parameters is ``(D D^T) * sum_k c_k^2 (H_k H_k^T + 1)``.
    """
    p = producer(z)
    if p.op != "call_function":
        return None
    if p.target in (aten.addmm.default, aten.mm.default):
        w = weight_of(p)
        if not is_parameter(w):
            if cosine_weight(w) is None:
                raise _Unsupported(f"the head's weight {w.name} is computed, not a parameter nor normalize(W) of one "
                                   "over its rows (a cosine head); e.g. weight norm or W * 2: CAPSkip's Gram would "
                                   "bound the computed weight's gradient, not the parameters'")
            if p.target is aten.addmm.default:
                raise _Unsupported(f"a cosine head with a bias ({p.name}): its Gram is not followed")
        m = _match_linear(p)
        return [(1.0, m[0], m[1], p)]
    if p.target in (aten.mul.Tensor, aten.div.Tensor):
        a, c = p.args[0], p.args[1]
        if p.target is aten.mul.Tensor and (constant(a) is not None or _scalar_tensor(a)) and isinstance(c, fx.Node) \
                and not _scalar_tensor(c):  # the scale first (2 * z): the other operand may be the head
            a, c = c, a
        if not isinstance(a, fx.Node):
            return None
        k = constant(c)
        if _scalar_tensor(c):
            inner = _terms(a)
            if inner is not None:
                raise _Unsupported(f"the head's logits are scaled by a tensor ({c.name}; a learnable temperature or "
                                   "logit scale): its own gradient is not of the head's rank-one form, so CAPSkip's "
                                   "Gram can't follow it (fold a fixed scale in as a number)")
        if k is None or not isinstance(a, fx.Node) or k == 0:
            return None
        inner = _terms(a)
        k = k if p.target is aten.mul.Tensor else 1.0 / k
        return None if inner is None else [(sc * k, h, b, lin) for sc, h, b, lin in inner]
    if p.target in (aten.add.Tensor, aten.sub.Tensor) and len(p.args) == 2 and all(isinstance(a, fx.Node) for a in p.args):
        alpha = constant(p.kwargs.get("alpha", 1)) or 0.0
        sign = -alpha if p.target is aten.sub.Tensor else alpha
        left, right = _terms(p.args[0]), _terms(p.args[1])
        if left is not None and right is not None:
            return left + [(sc * sign, h, b, lin) for sc, h, b, lin in right]
        m = _match_linear(p)  # mm + bias
        if m is not None:
            mm = next(producer(a) for a in p.args if producer(a).target == aten.mm.default)
            if not is_parameter(mm.args[1]):
                raise _Unsupported(f"the head's weight {mm.args[1].name} is computed, not a parameter"
                                   + (" (a cosine head with a bias: its Gram is not followed)"
                                      if cosine_weight(mm.args[1]) else ""))
            return [(1.0, m[0], m[1], mm)]
    return None


def _per_row(z: fx.Node) -> Optional[tuple[fx.Node, fx.Node, fx.Node]]:
    """z = L[arange(N), j] with L (N, T, C) and j (N,) (a decoder classifier's last token): (L, arange, j)."""
    p = producer(z)
    if p.op != "call_function" or p.target != aten.index.Tensor or len(p.args[1]) != 2:
        return None
    L, (r, j) = p.args[0], p.args[1]
    lv, zv = L.meta.get("val"), z.meta.get("val")
    if not (isinstance(r, fx.Node) and isinstance(j, fx.Node) and isinstance(lv, torch.Tensor) and lv.dim() == 3):
        return None
    sym = expr_of(zv.shape[0])
    jv = j.meta.get("val")
    if not (is_batch_arange(r, sym) and isinstance(jv, torch.Tensor) and jv.dim() == 1 and expr_of(jv.shape[0]) == sym
            and expr_of(lv.shape[0]) == sym):
        return None
    return L, r, j

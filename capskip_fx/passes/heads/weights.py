"""A head's weight operand: a parameter (through transposes and casts), or ``normalize(W).T`` of one (a
cosine head).  Any other weight is computed, and the rule's Gram would bound its gradient, not the
parameters'."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx

from .base import constant

aten = torch.ops.aten

# a Linear's weight operand reaches its parameter through these (transposes, casts under autocast)
_WEIGHT_PATH = {aten.permute.default, aten.t.default, aten.transpose.int, aten._to_copy.default, aten.alias.default,
                aten.view.default, aten.clone.default, aten.detach.default, torch.ops.prims.convert_element_type.default}


def is_parameter(w: fx.Node) -> bool:
    while w.op == "call_function" and w.target in _WEIGHT_PATH:
        w = w.args[0]
    return w.op in ("placeholder", "get_attr")


def weight_of(p: fx.Node) -> Optional[fx.Node]:
    """The weight operand of a Linear's addmm / mm."""
    return p.args[2] if p.target == aten.addmm.default else p.args[1] if p.target == aten.mm.default else None


_CASTS = {aten._to_copy.default, aten.alias.default, aten.clone.default, aten.detach.default,
          torch.ops.prims.convert_element_type.default}
_TRANSPOSES = {aten.t.default, aten.permute.default, aten.transpose.int}


def _swaps_2d(n: fx.Node) -> bool:
    """``n`` transposes a 2-D value (t, permute [1, 0], transpose 0 1)."""
    v = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
    if not isinstance(v, torch.Tensor) or v.dim() != 2:
        return False
    if n.target is aten.permute.default:
        return [d % 2 for d in n.args[1]] == [1, 0]
    if n.target is aten.transpose.int:
        return {n.args[1] % 2, n.args[2] % 2} == {0, 1}
    return True


def _strip_casts(n):
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _CASTS:
        n = n.args[0]
    return n


def _call(n, target) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is target


def _row_norm_of(n: fx.Node) -> Optional[fx.Node]:
    """The 2-D value (casts stripped) whose row norms, kept as a (C, 1) column, ``n`` is:
    ``linalg_vector_norm(W, 2, [1], keepdim=True)`` or its decompositions ``pow(sum(pow(W, 2), [1], True), 0.5)``
    and ``sqrt(sum(W * W, [1], True))``; else None."""
    if _call(n, aten.linalg_vector_norm.default):
        args = list(n.args) + [None] * (4 - len(n.args))
        order = args[1] if args[1] is not None else n.kwargs.get("ord", 2)
        dim = args[2] if args[2] is not None else n.kwargs.get("dim")
        keep = args[3] if args[3] is not None else n.kwargs.get("keepdim", False)
        return _strip_casts(n.args[0]) if (order == 2 and keep and _row_dim(dim) and "dtype" not in n.kwargs) else None
    if _call(n, aten.pow.Tensor_Scalar) and n.args[1] == 0.5:
        s = n.args[0]
    elif _call(n, aten.sqrt.default):
        s = n.args[0]
    else:
        return None
    if not (_call(s, aten.sum.dim_IntList) and _row_dim(s.args[1]) and (s.args[2] if len(s.args) > 2 else
                                                                       s.kwargs.get("keepdim", False))):
        return None
    sq = s.args[0]
    if _call(sq, aten.pow.Tensor_Scalar) and sq.args[1] == 2:
        return _strip_casts(sq.args[0])
    if _call(sq, aten.mul.Tensor) and sq.args[0] is sq.args[1]:
        return _strip_casts(sq.args[0])
    return None


def _row_dim(dim) -> bool:
    """``dim`` names only dim 1 (-1) of a 2-D value."""
    return isinstance(dim, (list, tuple)) and len(dim) == 1 and isinstance(dim[0], int) and dim[0] % 2 == 1


@dataclass
class CosineWeight:
    """``normalize(W)`` of a (C, d) parameter over its rows: ``W / clamp_min(|W_c|, eps)``."""

    norm: fx.Node  # (C, 1) row norms |W_c| (before the clamp)
    eps: Optional[float]  # the clamp's minimum (None: no clamp)


def cosine_weight(w: fx.Node) -> Optional[CosineWeight]:
    """The mm's weight operand is ``normalize(W).T`` of a parameter ``W`` (C, d), normalised over dim 1: one
    transpose (and casts) above ``div(W, [expand]([clamp_min](row_norms(W))))`` (``_row_norm_of``)."""
    flips = 0
    while w.op == "call_function" and (w.target in _CASTS or w.target in _TRANSPOSES):
        if w.target in _TRANSPOSES:
            if not _swaps_2d(w):
                return None
            flips += 1
        w = w.args[0]
    if flips != 1 or w.op != "call_function" or w.target is not aten.div.Tensor or not isinstance(w.args[1], fx.Node):
        return None
    num, den = w.args
    if den.op == "call_function" and den.target is aten.expand.default:
        den = den.args[0]
    eps = None
    if den.op == "call_function" and den.target is aten.clamp_min.default:
        eps = constant(den.args[1])
        if eps is None:
            return None
        den = den.args[0]
    base = _strip_casts(num)
    wv = num.meta.get("val") if isinstance(num, fx.Node) else None
    if not (isinstance(base, fx.Node) and base.op in ("placeholder", "get_attr") and isinstance(wv, torch.Tensor)
            and wv.dim() == 2 and isinstance(den, fx.Node) and _row_norm_of(den) is base):
        return None
    return CosineWeight(den, eps)

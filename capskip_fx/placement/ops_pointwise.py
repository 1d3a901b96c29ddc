"""Rules of the ops that act element by element (pointwise ops, and the activation backwards torch does
not tag pointwise) and of the factories (constant or i.i.d. rows; ``arange(N)``, a row index).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import sympy
import torch
from torch import fx

from ..symbolic import expr_of, same_size, shape_exprs, symbol_dims
from .lattice import FREE, Layout, aligned
from .registry import rule
from .tables import ACTIVATION_BACKWARD_OPS, ARANGE_OPS, FACTORY_OPS, NEW_OPS, POINTWISE_EXTRA, packet_of
from .walk import Result, Walk, ndim_of


@rule(POINTWISE_EXTRA, ACTIVATION_BACKWARD_OPS, tags=(torch.Tag.pointwise,), fitting=True)
def pointwise(w: Walk, n: fx.Node) -> Result:
    ins = w.tensor_inputs(n)
    bad = w.first_unknown(ins)
    if bad is not None:
        return w.per_output(n, lambda v: bad)
    if w.uses_batch_size(n, list(n.args) + list(n.kwargs.values())):
        return w.per_output(n, lambda v: None, "(uses the batch size as a value)")
    batch = [(a, l) for a, l in ins if l.kind == "batch"]
    if not batch:
        return w.generic(n)
    val = n.meta["val"]
    nd = (val if isinstance(val, torch.Tensor) else val[0]).dim()
    items = [(a, aligned(l, ndim_of(a), nd)) for a, l in batch]
    lay = w.agree(n, items, "combines")
    fits = all(l.fits for _, l in batch)
    return w.per_output(n, lambda v: w.track(lay, v, fits=fits))



@rule(FACTORY_OPS, fitting=True)
def factory(w: Walk, n: fx.Node) -> Result:
    """A value of constant or i.i.d. random rows (also ``expand``/``repeat`` of a free value)."""
    direct = [a for a in n.args if not isinstance(a, (list, tuple))] + list(n.kwargs.values())
    if w.uses_batch_size(n, direct):  # full([N, D], N)
        return w.per_output(n, lambda v: None, "(uses the batch size as a value)")
    shape_only = n.args[0] if packet_of(n) in NEW_OPS else None  # new_zeros(x, size): x gives dtype/device
    if any(l.kind != "free" for a, l in w.tensor_inputs(n) if a is not shape_only):
        return w.generic(n)
    r = w.per_output(n, w.from_shape, "(batch symbol in several dims)")
    return replace(r, fits=True) if isinstance(r, Layout) and r.kind == "batch" else r


@rule(ARANGE_OPS, row_index=True)
def _arange(w: Walk, n: fx.Node) -> Result:
    """``arange(N)`` (start 0, step 1, length the batch symbol): a row index; otherwise a factory."""
    if packet_of(n) == "prims::iota":
        length, start, step = n.args[0], n.kwargs.get("start", 0), n.kwargs.get("step", 1)
    else:
        pos = [a for a in n.args if not isinstance(a, (torch.dtype, torch.device))]
        start, length, step = (0, pos[0], 1) if len(pos) == 1 else (pos[0], pos[1], pos[2] if len(pos) > 2 else 1)
        start, step = n.kwargs.get("start", start), n.kwargs.get("step", step)
    length, start, step = (a.meta.get("val") if isinstance(a, fx.Node) else a for a in (length, start, step))
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() == 1 and same_size(expr_of(val.shape[0]), w.sym) \
            and _is_int(length, None, w.sym) and _is_int(start, 0) and _is_int(step, 1):
        return Layout("batch", 0, index=True)
    return w.per_output(n, lambda v: FREE if not symbol_dims(shape_exprs(v), w.sym) else None,
                        "(creates a batch-sized value)")


def _is_int(v: Any, k: Optional[int], expr: Optional[sympy.Expr] = None) -> bool:
    """``v`` is the integer ``k`` (or the expression ``expr``), structurally."""
    return isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool) \
        and same_size(expr_of(v), expr if expr is not None else sympy.Integer(k))


"""Rules of the ops that move, reshape, slice, pad or concatenate values: the batch dim is followed into
the output's shape, and cut only into whole slabs.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import sympy
import torch
from torch import fx

from ..symbolic import ONE, ZERO, exact_quotient, expr_of, same_size, shape_exprs
from .lattice import Layout, reshape_layout
from .registry import rule
from .tables import AS_STRIDED_OPS, CAT_OPS, MOVE_OPS, PAD_OPS, RESHAPE_OPS, SLICE_OPS, STACK_OPS, packet_of
from .walk import Result, Walk, arg_of, located, ndim_of, norm_dims, op_name
from .ops_pointwise import factory
from .ops_reductions import dim_op


@rule(MOVE_OPS, fitting=True)
def _move(w: Walk, n: fx.Node) -> Result:
    x = w.of(n.args[0]) if n.args else None
    if x is None:
        return w.generic(n) if w.tensor_inputs(n) else factory(w, n)
    if x.kind == "unknown":
        return w.per_output(n, lambda v: x)
    if any(l.kind != "free" for a, l in w.tensor_inputs(n) if a is not n.args[0]):
        return w.generic(n)
    if x.kind == "free":  # expand of a free value to the batch size: rows are copies
        return factory(w, n)
    return w.per_output(n, lambda v: w.track(x, v, fits=x.fits), "(moved or resized the batch dim)")


@rule(RESHAPE_OPS)
def _reshape(w: Walk, n: fx.Node) -> Result:
    x = w.of(n.args[0])
    if x is None or x.kind != "batch":
        return _move(w, n) if x is not None and x.kind == "free" else w.generic(n)
    in_shape = shape_exprs(n.args[0].meta["val"])
    def one(v):
        r = reshape_layout(x, in_shape, shape_exprs(v), w.sym)
        if r is not None and r.outer != 1 and not x.why:  # remember where it became token-major
            r = replace(r, why=f"{op_name(n)} merged dims left of the batch{located(n)}", origin=n)
        return r if r is None or r.outer != 1 else Layout("batch", r.dim, r.outer, r.inner)
    return w.per_output(n, one, "(split the batch dim)")


@rule(AS_STRIDED_OPS)
def _as_strided(w: Walk, n: fx.Node) -> Result:
    """as_strided of a contiguous tensor with contiguous strides and no offset is a reshape."""
    x = w.of(n.args[0])
    if x is None or x.kind != "batch":
        return w.generic(n)
    src, out = n.args[0].meta["val"], n.meta["val"]
    offset = n.args[3] if len(n.args) > 3 else n.kwargs.get("storage_offset")
    if (_contiguous(shape_exprs(src), [expr_of(st) for st in src.stride()])
            and _contiguous(shape_exprs(out), [expr_of(st) for st in out.stride()])
            and (offset is None or offset == 0) and expr_of(src.storage_offset()) == 0):
        return _reshape(w, n)
    return w.generic(n)


def _contiguous(shape: list, strides: list) -> bool:
    expect = ONE
    for size, st in zip(reversed(shape), reversed(strides)):
        if size != 1 and not same_size(st, expect):
            return False
        expect = expect * size
    return True


def _slab(w: Walk, x: Layout, start: Any, length: sympy.Expr) -> Optional[Layout]:
    """The part [start, start + length) of ``x``'s batch dim, if it is whole slabs of s*inner."""
    unit = w.sym * x.inner
    if isinstance(start, fx.Node):
        start = expr_of(start.meta["val"])
    elif not isinstance(start, sympy.Expr):  # a split's pieces: their starts are sums of sizes already
        start = expr_of(start or 0)
    if start is None:
        return None
    if start != 0 and (start.is_Number and start < 0 or exact_quotient(start, unit, w.sym) is None):
        return None
    outer = exact_quotient(length, unit, w.sym)
    return replace(x, kind="batch", outer=outer) if outer is not None else None


@rule(SLICE_OPS)
def _slice(w: Walk, n: fx.Node) -> Result:
    """slice/narrow/split/chunk/unbind/select.  Along the batch dim only whole slabs of s*inner are
    kept (a no-op when outer == 1; a piece of a ``cat`` along the batch otherwise)."""
    idx, default = SLICE_OPS[packet_of(n)]
    x = w.of(n.args[0])
    dl = norm_dims(arg_of(n, idx, default=default), ndim_of(n.args[0]))
    if x is None or x.kind != "batch" or (dl is not None and x.dim not in dl):
        return dim_op(w, n, dl, "slices the batch dim")
    val, name = n.meta["val"], str(n.target)
    outs = list(val) if isinstance(val, (list, tuple)) else [val]
    if any(not isinstance(v, torch.Tensor) or v.dim() != ndim_of(n.args[0]) for v in outs):
        raise w.mixing(n, "selects one row of the batch dim")  # select / unbind: the dim is gone
    if "slice" in name and (n.args[4] if len(n.args) > 4 else n.kwargs.get("step", 1)) != 1:
        raise w.mixing(n, "slices the batch dim with a step")
    if "slice" in name or "narrow" in name:
        starts = [n.args[2] if len(n.args) > 2 else n.kwargs.get("start")]
    else:  # split-like: the pieces are consecutive
        starts, acc = [], ZERO
        for v in outs:
            starts.append(acc)
            acc = acc + expr_of(v.shape[x.dim])
    lays = [_slab(w, x, st, expr_of(v.shape[x.dim])) for st, v in zip(starts, outs)]
    if any(l is None for l in lays):
        raise w.mixing(n, "slices or splits the batch dim")
    return lays if isinstance(val, (list, tuple)) else lays[0]


@rule(PAD_OPS)
def _pad(w: Walk, n: fx.Node) -> Result:
    """constant_pad_nd(x, pad): pairs of pads from the last dim; padding the batch dim = mixing."""
    x = w.of(n.args[0])
    if x is None or x.kind != "batch":
        return w.generic(n)
    pad, nd = list(n.args[1]), ndim_of(n.args[0])
    padded = {nd - 1 - i // 2 for i, p in enumerate(pad) if not (isinstance(p, int) and p == 0)}
    if x.dim in padded:
        raise w.mixing(n, "pads the batch dim")
    return w.per_output(n, lambda v: w.track(x, v))


@rule(CAT_OPS, STACK_OPS, fitting=True)
def _cat(w: Walk, n: fx.Node) -> Result:
    """cat/stack.  Along other dims the batch inputs agree; along the batch dim, inputs of one
    ``inner`` stack up as slabs: the result is token-major with the outers summed."""
    ins = [(a, w.of(a)) for a in n.args[0] if isinstance(a, fx.Node) and w.of(a) is not None]
    bad = w.first_unknown(ins)
    if bad is not None:
        return w.per_output(n, lambda v: bad)
    batch = [(a, l) for a, l in ins if l.kind == "batch"]
    if not batch:
        return w.generic(n)
    nd = n.meta["val"].dim()
    dim = int(arg_of(n, 1, default=0)) % max(nd, 1)
    if packet_of(n) not in STACK_OPS and any(l.dim == dim for _, l in batch):
        nonempty = [a for a, _ in ins if ndim_of(a) != 1 or expr_of(a.meta["val"].shape[0]) != 0]  # legacy 1-D empties
        if len(batch) != len(nonempty) or any(l.dim != dim or l.inner != batch[0][1].inner for _, l in batch):
            raise w.mixing(n, "concatenates along the batch dim values that are not batch slabs alike")
        outer = ZERO
        for _, l in batch:
            outer = outer + l.outer
        first = batch[0][1]
        lay = replace(first, dim=dim, outer=outer) if first.why else replace(
            first, dim=dim, outer=outer, why=f"{op_name(n)} along the batch dim{located(n)}", origin=n)
        return w.per_output(n, lambda v: w.track(lay, v))
    lay = w.agree(n, batch, "concatenates")
    fits = all(l.fits for _, l in batch)
    return w.per_output(n, lambda v: w.track(lay, v, fits=fits))

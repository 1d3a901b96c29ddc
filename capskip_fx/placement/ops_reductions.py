"""Rules of the ops along one dim: reductions, scans, sorts, softmax.  Over the batch dim they mix rows
(in the backward, a plain sum of the cotangent's rows is a parameter gradient: Walk.summed).
"""
from __future__ import annotations


import torch
from torch import fx

from .registry import rule
from .tables import ALONG_OPS, REDUCE_OPS, SUM_OPS, packet_of
from .walk import Result, Walk, arg_of, ndim_of, norm_dims
from .ops_pointwise import pointwise


def dim_op(w: Walk, n: fx.Node, dims, what: str) -> Result:
    """An op along ``dims`` of its first input (None = all dims): row mixing if the batch dim is one."""
    x = w.of(n.args[0])
    if x is None or x.kind == "free":
        return w.generic(n)
    if x.kind == "unknown":
        return w.per_output(n, lambda v: x)
    dl = norm_dims(dims, ndim_of(n.args[0]))
    if dl is None or x.dim in dl:
        if packet_of(n) in SUM_OPS:
            return w.summed(n, [n.args[0]], what)
        raise w.mixing(n, what)
    if any(l.kind != "free" for a, l in w.tensor_inputs(n) if a is not n.args[0]):
        return w.generic(n)
    return w.per_output(n, lambda v: w.track(x, v))


@rule(REDUCE_OPS)
def _reduce(w: Walk, n: fx.Node) -> Result:
    if torch.Tag.pointwise in getattr(n.target, "tags", ()):
        return pointwise(w, n)  # max.other, min.other
    if len(n.args) > 1 and isinstance(n.args[1], fx.Node):
        return w.generic(n)
    return dim_op(w, n, arg_of(n, REDUCE_OPS[packet_of(n)]), "reduces over the batch dim, e.g. BatchNorm in train mode "
                   "(per-example instead: LayerNorm, GroupNorm, or the BatchNorm in eval mode)")


@rule(ALONG_OPS)
def _along(w: Walk, n: fx.Node) -> Result:
    idx, default = ALONG_OPS[packet_of(n)]
    return dim_op(w, n, arg_of(n, idx, default=default),
                   "mixes rows along the batch dim (sorts, shifts, flips or accumulates over it)")

"""Rules of the matmuls: the batch of either operand lands on one output dim; contracting it mixes rows
(in the backward, a contraction of the cotangent's rows is a weight gradient: Walk.summed).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from torch import fx

from .lattice import FREE, Layout, aligned
from .registry import rule
from .tables import ADD_MATMUL_OPS, MATMUL_OPS
from .walk import Result, Walk, ndim_of


def _matmul_out(w: Walk, n: fx.Node, a: fx.Node, b: fx.Node) -> Optional[Layout]:
    """Layout of a @ b (both batch -> they must land on one output dim with one layout)."""
    la, lb = w.of(a), w.of(b)
    nda, ndb, nd = ndim_of(a), ndim_of(b), n.meta["val"].dim()
    lands, contracted = [], []
    for arg, lay, ndi, is_a in ((a, la, nda, True), (b, lb, ndb, False)):
        if lay is None or lay.kind != "batch":
            continue
        if (lay.dim == ndi - 1) if is_a else (ndi == 1 or lay.dim == ndi - 2):
            contracted.append((arg, lay))
            continue
        if is_a:
            d = nd - (1 if ndb == 1 else 2) if lay.dim == ndi - 2 else lay.dim + nd - ndi
        else:
            d = nd - 1 if lay.dim == ndi - 1 else lay.dim + nd - ndi
        lands.append((arg, replace(lay, kind="batch", dim=d)))
    if contracted:
        # a weight gradient: row b of one operand meets row b of the other, summed (backward only)
        if len(contracted) == 2 and not lands and (
                (contracted[0][1].outer, contracted[0][1].inner) == (contracted[1][1].outer, contracted[1][1].inner)
                or any(l.fits for _, l in contracted)):
            return w.summed(n, [c for c, _ in contracted], f"contracts over the batch dim ({contracted[0][0].name}: "
                                                          f"{contracted[0][1]})")
        raise w.mixing(n, f"contracts over the batch dim ({contracted[0][0].name}: {contracted[0][1]})")
    if len(lands) == 2 and lands[0][1] != lands[1][1]:
        raise w.mixing(n, f"pairs rows of the batch ({a.name}: {la}, {b.name}: {lb}): an (N, N) product such as "
                          "a Gram matrix h @ h.T")
    return lands[0][1] if lands else FREE


@rule(MATMUL_OPS)
def _matmul(w: Walk, n: fx.Node) -> Result:
    ins = w.tensor_inputs(n)
    bad = w.first_unknown(ins)
    if bad is not None:
        return w.per_output(n, lambda v: bad)
    if len(n.args) < 2 or not all(isinstance(x, fx.Node) for x in n.args[:2]):
        return w.generic(n)
    return _tracked(w, n, _matmul_out(w, n, n.args[0], n.args[1]))


@rule(ADD_MATMUL_OPS)
def _add_matmul(w: Walk, n: fx.Node) -> Result:
    """addmm(bias, a, b) = bias + a @ b (bias broadcast)."""
    ins = w.tensor_inputs(n)
    bad = w.first_unknown(ins)
    if bad is not None:
        return w.per_output(n, lambda v: bad)
    lay = _matmul_out(w, n, n.args[1], n.args[2])
    if not isinstance(lay, Layout) or lay.kind == "sum":
        raise w.mixing(n, "adds a sum over the rows to a bias")
    bias = w.of(n.args[0])
    nd = n.meta["val"].dim()
    if bias is not None and bias.kind == "batch":
        items = [(n.args[0], aligned(bias, ndim_of(n.args[0]), nd))]
        if lay.kind == "batch":
            items.append((n.args[1], lay))
        lay = w.agree(n, items, "adds")
    return _tracked(w, n, lay)


def _tracked(w: Walk, n: fx.Node, lay: Layout) -> Result:
    return w.per_output(n, lambda v: lay if lay.kind in ("free", "sum") else w.track(lay, v))

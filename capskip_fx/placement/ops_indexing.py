"""Rules of indexing, gathers and scatters: along the batch dim they mix rows, except reading row b by the
row index (``x[arange(N), j]``); in the backward, rows placed by their data (an embedding's, a scatter_add's)
are summed.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import fx

from ..records import RefusalKind
from .lattice import Layout, aligned
from .registry import rule
from .tables import (EMBEDDING_OPS, GATHER_OPS, INDEX_OPS, INDEX_PUT_OPS, INDEX_SELECT_OPS, INDEX_UPDATE_OPS,
                     MASKED_INDEX_OPS, MASKED_INDEX_PUT_OPS, SCATTER_OPS, SCATTER_SLICE_OPS, aten, packet_of, packets)
from .walk import Refuse, Result, Walk, arg_of, located, ndim_of, norm_dims, op_name
from .ops_reductions import dim_op


@rule(INDEX_SELECT_OPS)
def _index_select(w: Walk, n: fx.Node) -> Result:
    return dim_op(w, n, arg_of(n, 1), "selects rows along the batch dim")


@rule(INDEX_OPS, EMBEDDING_OPS)
def _index(w: Walk, n: fx.Node, mask: Optional[fx.Node] = None) -> Result:
    """x[indices] (advanced indexing) and embedding(weight, indices)."""
    if packet_of(n) in EMBEDDING_OPS:
        x, indices = n.args[0], [n.args[1]]
    elif mask is not None:
        x, indices = n.args[0], n.args[2]
    else:
        x, indices = n.args[0], n.args[1]
    xl = w.of(x)
    il = [(i, w.of(t)) for i, t in enumerate(indices) if isinstance(t, fx.Node) and w.of(t) is not None]
    if xl is not None and xl.kind == "batch" and packet_of(n) not in EMBEDDING_OPS and any(i == xl.dim for i, _ in il):
        at = indices[xl.dim]
        if mask is None and xl.outer == 1 and xl.inner == 1 and w.is_index(at):
            # x[arange(N)[:, None], j] (HF's padding mask) and x[arange(N), j] with j per row (a decoder
            # classifier's last token): row b reads row b of x only, at positions of its own
            nd = max(ndim_of(t) for t in indices if isinstance(t, fx.Node))
            lay = aligned(w.of(at), ndim_of(at), nd)
            if all(l.kind == "free" or (_per_row_index(w, indices[i], l, nd, lay)) for i, l in il if i != xl.dim):
                return w.per_output(n, lambda v: w.track(lay, v), "(indexed by the row index)")
        raise w.mixing(n, "indexes along the batch dim (a permutation, roll or gather of rows)")
    ins = w.tensor_inputs(n)
    bad = w.first_unknown(ins)
    if bad is not None:
        return w.per_output(n, lambda v: bad)
    ib = [(indices[i], l) for i, l in il if l.kind == "batch"]
    if mask is not None and w.of(mask) is not None and w.of(mask).kind != "free":
        return w.generic(n)
    if xl is not None and xl.kind == "batch":
        if ib:
            return w.generic(n)
        return w.per_output(n, lambda v: w.track(xl, v))
    if not ib:
        return w.generic(n)
    nd = max(ndim_of(a) for a, _ in ib)  # index tensors broadcast together (aligned from the right)
    lay = w.agree(n, [(a, aligned(l, ndim_of(a), nd)) for a, l in ib], "indexes with")
    return w.per_output(n, lambda v: w.track(lay, v))


def _per_row_index(w: Walk, t: fx.Node, lay: Layout, nd: int, row: Layout) -> bool:
    """``t`` indexes a non-batch dim of x with row b's own positions: batch-major, inner 1, broadcast to the
    row index's dim, and not computed from the row index (the backward may recompute that at k rows)."""
    return (lay.kind == "batch" and lay.outer == 1 and lay.inner == 1 and aligned(lay, ndim_of(t), nd) == row
            and w.from_index(t) is None)


@rule(MASKED_INDEX_OPS)
def _masked_index(w: Walk, n: fx.Node) -> Result:
    return _index(w, n, mask=n.args[1])


@rule(INDEX_PUT_OPS, MASKED_INDEX_PUT_OPS)
def _index_put(w: Walk, n: fx.Node) -> Result:
    x = w.of(n.args[0])
    masked = packet_of(n) in MASKED_INDEX_PUT_OPS
    indices = n.args[2] if masked else n.args[1]
    if w.sums:
        r = _index_put_backward(w, n, x, list(indices), n.args[3] if masked else n.args[2])
        if r is not None:
            return r
    if x is not None and x.kind == "batch" and len(indices) > x.dim and indices[x.dim] is not None:
        raise w.mixing(n, "writes rows along the batch dim")
    rest = [l for a, l in w.tensor_inputs(n) if a is not n.args[0]]
    if x is None or x.kind != "batch" or any(l.kind != "free" for l in rest):
        return w.generic(n)
    return w.per_output(n, lambda v: w.track(x, v))


def _index_put_backward(w: Walk, n: fx.Node, x: Optional[Layout], indices: list, values: Any) -> Optional[Result]:
    """The backward's index_put (None: the forward's rule decides).  A row index among the indices of a value
    that does not carry the batch (a parameter per batch position, ``table[arange(N)]``) puts the kept rows'
    gradients at their positions among the rows run, not at their rows: refused.  Into a batch value, a row
    index in its batch dim with the other indices of the row's own (``x[arange(N), j]``) writes row b into
    row b.  Into a free value with data indices (an embedding's), the rows' values are summed."""
    pos = [i for i, t in enumerate(indices) if isinstance(t, fx.Node) and w.from_index(t) is not None]
    vl = w.of(values) if isinstance(values, fx.Node) else None
    if x is not None and x.kind == "free" and pos:
        raise Refuse(f"the row index indexes {n.args[0].name}, which does not carry the batch "
                     f"({op_name(n)}{located(n)}): "
                      "row b's gradient goes to its position among the rows the backward runs, not to row b "
                      "(a parameter indexed by arange(N)?)", RefusalKind.ROW_INDEX_VALUE, n)
    if x is not None and x.kind == "batch" and x.outer == 1 and x.inner == 1 and len(indices) > x.dim \
            and w.is_index(indices[x.dim]) and vl is not None and vl.kind == "batch":
        at = indices[x.dim]
        nd = max(ndim_of(t) for t in indices if isinstance(t, fx.Node))
        lay = aligned(w.of(at), ndim_of(at), nd)
        others = [(i, w.of(t)) for i, t in enumerate(indices) if i != x.dim and isinstance(t, fx.Node)]
        if all(l is not None and (l.kind == "free" or _per_row_index(w, indices[i], l, nd, lay)) for i, l in others):
            return w.per_output(n, lambda v: w.track(x, v))
        return None
    accumulate = bool(n.args[-1]) if packet_of(n) not in MASKED_INDEX_PUT_OPS else True
    if x is not None and x.kind == "free" and accumulate and vl is not None and vl.kind == "batch":
        ib = [(t, w.of(t)) for t in indices if isinstance(t, fx.Node) and w.of(t) is not None and w.of(t).kind == "batch"]
        if ib and all(l == ib[0][1] and l.dim == vl.dim and (l.outer, l.inner) == (vl.outer, vl.inner) for _, l in ib):
            return w.summed(n, [values], "accumulates rows into a tensor without the batch")
    return None


@rule(GATHER_OPS)
def _gather(w: Walk, n: fx.Node) -> Result:
    x, idx = w.of(n.args[0]), w.of(n.args[2])
    dim = int(n.args[1]) % max(ndim_of(n.args[0]), 1)
    if x is not None and x.kind == "batch" and x.dim == dim:
        raise w.mixing(n, "gathers along the batch dim")
    if x is None or idx is None or "unknown" in (x.kind, idx.kind) or idx.kind != "batch":
        return w.generic(n)
    if x.kind == "batch" and x != idx:
        return w.generic(n)
    return w.per_output(n, lambda v: w.track(idx, v))


@rule(SCATTER_OPS, INDEX_UPDATE_OPS)
def _scatter(w: Walk, n: fx.Node) -> Result:
    """scatter(x, dim, index, src) / index_add(x, dim, index, source): along the batch = mixing.

    Otherwise the index and src of a scatter must carry x's layout (a free index touches the first
    rows only: position-dependent), and an index_add's 1-D index must be free.
    """
    x = w.of(n.args[0])
    dim = int(n.args[1]) % max(ndim_of(n.args[0]), 1)
    if x is not None and x.kind == "batch" and x.dim == dim:
        raise w.mixing(n, "scatters along the batch dim")
    if w.sums and x is not None and x.kind == "free":
        return _scatter_free(w, n, dim)
    if x is None or x.kind != "batch":
        return w.generic(n)
    index_like = packet_of(n) in INDEX_UPDATE_OPS
    for a, l in w.tensor_inputs(n):
        if a is n.args[0]:
            continue
        ok = l.kind == "free" if index_like and a is n.args[2] else (l == x or (l.kind == "free" and ndim_of(a) == 0))
        if not ok:
            return w.generic(n)
    return w.per_output(n, lambda v: w.track(x, v))


def _scatter_free(w: Walk, n: fx.Node, dim: int) -> Result:
    """Backward: scatter/index_add into a tensor without the batch (a gathered parameter's gradient).  Along
    the index's batch dim, data indices place the rows' values: summed (scatter_add, index_add).  Along another
    dim, row b of the source lands in row b of the target, a position: at the rows run, the kept rows' values
    land at their positions among them (``torch.gather(param, 1, idx)``'s backward): refused."""
    index_like = packet_of(n) in INDEX_UPDATE_OPS
    idx, src = n.args[2], n.args[3]
    il, sl = w.of(idx), w.of(src)
    if il is None or sl is None or il.kind != "batch" or sl.kind != "batch":
        return w.generic(n)
    if not index_like and il.dim != dim:
        raise Refuse(f"scatters row b of {src.name} into row b of {n.args[0].name}, which does not carry the batch "
                      f"({op_name(n)}{located(n)}): at the rows the backward runs, a kept row's values land at its "
                      "position among them, not at its row (torch.gather of a parameter by a per-row index?)",
                      RefusalKind.ROW_INDEX_VALUE, n)
    reduce = n.args[4] if len(n.args) > 4 else n.kwargs.get("reduce", "sum")
    adds = packet_of(n) in packets(aten, "scatter_add index_add") or (
        packet_of(n) == "aten::scatter_reduce" and reduce == "sum")
    if adds and sl.dim == dim and (il.outer, il.inner) == (sl.outer, sl.inner) and (not index_like or il.dim == 0):
        return w.summed(n, [src], "scatters rows into a tensor without the batch")
    raise w.mixing(n, "scatters rows into a tensor without the batch other than by adding them")


@rule(SCATTER_SLICE_OPS)
def _slice_scatter(w: Walk, n: fx.Node) -> Result:
    idx, default = SCATTER_SLICE_OPS[packet_of(n)]
    x, src = w.of(n.args[0]), w.of(n.args[1])
    dl = norm_dims(arg_of(n, idx, default=default), ndim_of(n.args[0]))
    if x is not None and x.kind == "batch" and (dl is None or x.dim in dl):
        if not (src is not None and src == x):  # writing the whole batch dim is a no-op for rows
            raise w.mixing(n, "writes a slice of the batch dim")
    if x is None or src is None or x.kind != "batch" or src.kind == "unknown" or (
            src.kind == "batch" and (src.outer, src.inner) != (x.outer, x.inner)):
        return w.generic(n)
    return w.per_output(n, lambda v: w.track(x, v))

"""Rules of the per-sample ops (convolutions, pools, group norm, attention, layer norm): row-wise when every
batch input holds the batch in one leading dim; BatchNorm in train mode mixes rows.
"""
from __future__ import annotations


from torch import fx

from ..symbolic import shape_exprs, symbol_dims
from .lattice import FREE, SUM, aligned
from .registry import rule
from .tables import ATTENTION_OPS, BATCH_NORM_OPS, LAYER_NORM_OPS, PER_SAMPLE_OPS
from .walk import Result, Walk, ndim_of


@rule(PER_SAMPLE_OPS)
def per_sample(w: Walk, n: fx.Node) -> Result:
    ins = w.tensor_inputs(n)
    batch = [(a, l) for a, l in ins if l.kind == "batch"]
    bad = w.first_unknown(ins)
    if bad is not None:
        return w.per_output(n, lambda v: bad)
    if not batch:
        return w.generic(n)
    if any(l.dim != 0 for _, l in batch):
        return w.per_output(n, lambda v: None, "(batch not in dim 0)")
    lay = w.agree(n, batch, "combines")
    summed = w.sums and any(a in w.carry for a, _ in batch)
    return w.per_output(n, lambda v: (SUM if summed else FREE) if not symbol_dims(shape_exprs(v), w.sym)
                        else w.track(lay, v))


@rule(ATTENTION_OPS)
def _attention(w: Walk, n: fx.Node) -> Result:
    """sdpa: per sample when q, k, v (and a mask) agree on a leading batch dim; per query row when only
    q carries the batch in its L dim; attending over the batch (k/v's S dim) or contracting it is mixing."""
    ins = w.tensor_inputs(n)
    bad = w.first_unknown(ins)
    if bad is not None:
        return w.per_output(n, lambda v: bad)
    q, k, v = (w.of(a) for a in n.args[:3])
    nd = ndim_of(n.args[0])
    if any(l is not None and l.kind == "batch" and l.dim == ndim_of(a) - 1 for a, l in zip(n.args[:3], (q, k, v))):
        raise w.mixing(n, "contracts over the batch dim (the batch is the attention's feature dim)")
    if any(l is not None and l.kind == "batch" and l.dim == ndim_of(a) - 2 for a, l in zip(n.args[1:3], (k, v))):
        raise w.mixing(n, "attends over the batch dim (the batch is the keys' sequence dim)")
    batch = [(a, aligned(l, ndim_of(a), nd)) for a, l in ins if l.kind == "batch"]
    if not batch:
        return w.generic(n)
    lay = w.agree(n, batch, "combines")  # a mask carrying the batch must agree as well
    return w.per_output(n, lambda t: FREE if not symbol_dims(shape_exprs(t), w.sym) else w.track(lay, t))


@rule(LAYER_NORM_OPS)
def _layer_norm(w: Walk, n: fx.Node) -> Result:
    x = w.of(n.args[0])
    if x is None or x.kind != "batch" or any(l.kind != "free" for a, l in w.tensor_inputs(n) if a is not n.args[0]):
        return w.generic(n)
    normalized = n.args[1]
    if x.dim >= ndim_of(n.args[0]) - len(normalized):
        raise w.mixing(n, "normalises over the batch dim")
    return w.per_output(n, lambda v: w.track(x, v))


@rule(BATCH_NORM_OPS)
def _batch_norm(w: Walk, n: fx.Node) -> Result:
    training = next((a for a in n.args if isinstance(a, bool)), n.kwargs.get("training", False))
    name = str(n.target)
    if "no_training" in name or "no_update" in name:
        training = False
    elif "with_update" in name:
        training = True
    x = w.of(n.args[0])
    if training and x is not None and x.kind == "batch":
        raise w.mixing(n, "is BatchNorm in train mode: it normalises with statistics over the batch")
    return per_sample(w, n)

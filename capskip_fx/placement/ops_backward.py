"""Rules of the backward-only ops (passes/validate.py proves the backward that runs): per-sample backwards,
layer norm's, softmax's, attention's and embedding's; weight gradients are sums over the rows run.
"""
from __future__ import annotations

from dataclasses import replace

from torch import fx

from ..symbolic import shape_exprs, symbol_dims
from .lattice import FREE, SUM, aligned
from .registry import rule
from .tables import (ATTENTION_BACKWARD_OPS, EMBEDDING_BACKWARD_OPS, LAYER_NORM_BACKWARD_OPS, PER_SAMPLE_BACKWARD_OPS,
                     SOFTMAX_BACKWARD_OPS, packet_of)
from .walk import Result, Walk, ndim_of
from .ops_per_sample import per_sample


@rule(PER_SAMPLE_BACKWARD_OPS)
def _batch_norm_backward(w: Walk, n: fx.Node) -> Result:
    train = n.args[7] if len(n.args) > 7 else n.kwargs.get("train", False)
    x = w.of(n.args[1])
    if packet_of(n) == "aten::native_batch_norm_backward" and train and x is not None and x.kind == "batch":
        raise w.mixing(n, "is BatchNorm's train-mode backward (statistics over the batch)")
    return per_sample(w, n)


@rule(LAYER_NORM_BACKWARD_OPS)
def _layer_norm_backward(w: Walk, n: fx.Node) -> Result:
    """native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, mask) ->
    (grad_input, grad_weight, grad_bias): per row over the normalised dims; the weight's gradients sum the rows."""
    early, batch = w.batch_operands(n)
    if early is not None:
        return early
    nd = ndim_of(n.args[1])
    lay = w.agree(n, [(a, aligned(l, ndim_of(a), nd)) for a, l in batch], "combines")
    if lay.dim >= nd - len(n.args[2]):
        raise w.mixing(n, "normalises over the batch dim")
    summed = any(a in w.carry for a, _ in batch)
    return w.per_output(n, lambda v: (SUM if summed else None) if not symbol_dims(shape_exprs(v), w.sym)
                        else w.track(lay, v), "(a weight gradient without the cotangent)")


@rule(SOFTMAX_BACKWARD_OPS)
def _softmax_backward(w: Walk, n: fx.Node) -> Result:
    """_softmax_backward_data(grad, output, dim, dtype): per row unless ``dim`` is the batch dim."""
    early, batch = w.batch_operands(n)
    if early is not None:
        return early
    lay = w.agree(n, batch, "combines")
    if int(n.args[2]) % max(ndim_of(n.args[0]), 1) == lay.dim:
        raise w.mixing(n, "is a softmax's backward over the batch dim")
    return w.per_output(n, lambda v: w.track(lay, v))


@rule(ATTENTION_BACKWARD_OPS)
def _attention_backward(w: Walk, n: fx.Node) -> Result:
    """The fused attention backwards (grad_out, q, k, v, out, logsumexp, ...): per sample when every batch input
    holds the batch in one leading dim (with dropout, _random refuses them first: the mask comes from a seed)."""
    early, batch = w.batch_operands(n)
    if early is not None:
        return early
    # every input shares the leading (batch, heads) dims of q (grad_out, q, k, v, out, a mask (B, H, L, S),
    # logsumexp (B, H, L)): the batch in one of them, the same for all, never in L, S or E
    if len({l.dim for _, l in batch}) != 1 or batch[0][1].dim >= ndim_of(n.args[1]) - 2:
        return w.per_output(n, lambda v: None, "(the batch is not a leading dim)")
    lay = w.agree(n, batch, "combines")
    return w.per_output(n, lambda t: FREE if not symbol_dims(shape_exprs(t), w.sym) else w.track(lay, t))


@rule(EMBEDDING_BACKWARD_OPS)
def _embedding_backward(w: Walk, n: fx.Node) -> Result:
    """embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq): the rows' gradients
    summed into the table by their indices (data, not positions); scaling by the batch's frequencies mixes rows."""
    g, idx = w.of(n.args[0]), w.of(n.args[1])
    scale = n.args[4] if len(n.args) > 4 else n.kwargs.get("scale_grad_by_freq", False)
    if g is None or idx is None or "unknown" in (g.kind, idx.kind) or g.kind != "batch":
        return w.generic(n)
    if scale:
        raise w.mixing(n, "scales by how often each index occurs in the batch")
    if idx.kind != "batch" or aligned(idx, ndim_of(n.args[1]), ndim_of(n.args[0]) - 1) != replace(g, why="") or g.dim == ndim_of(n.args[0]) - 1:
        return w.generic(n)
    return w.summed(n, [n.args[0]], "sums the rows' gradients into the table")

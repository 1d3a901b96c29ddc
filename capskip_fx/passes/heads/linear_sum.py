"""A sum of Linear heads with numeric weights, ``sum_k c_k (W_k h_k + b_k)`` (distillation's two heads, an
auxiliary head added to the main one).

Row i's gradient of head k's (W_k, b_k) is ``c_k delta_i (x) [h_k; 1]``, so the Gram over every head's
parameters is ``(D D^T) * sum_k c_k^2 (H_k H_k^T + 1)``: ``h`` is a new node
``[c_1 h_1, c_1, c_2 h_2, c_2, ...]`` (the constant columns for the heads with a bias), bias False.
Heads of one input are a uniform factor: ``h`` is that input.  Every ``h_k`` has the logits' rows."""
from __future__ import annotations

from typing import Optional

import torch
from torch import fx

from .base import Head, HeadForm, Logits, same_size

aten = torch.ops.aten


def _match(c: Logits) -> bool:
    return c.val.dim() == 2 and c.per_row is None and c.terms is not None and len(c.terms) > 1 and not any(c.cosines)


def _obligations(c: Logits) -> Optional[str]:
    if any(not same_size(t.h.meta["val"].shape[0], c.val.shape[0]) or t.h.meta["val"].dim() != 2 for t in c.terms):
        return "a sum of Linear heads over inputs not of the logits' rows"
    return None


def _features(graph: fx.Graph, c: Logits) -> Head:
    terms = list(c.terms)
    if len({(t.h, t.bias) for t in terms}) == 1:  # heads of one input: sum_k c_k^2 is a uniform factor
        return Head(z=c.z, g=c.g, h=terms[0].h, bias=terms[0].bias, output_index=c.idx, linear_in=terms[0].h,
                    form=SUM_OF_LINEARS.name)
    h = _gram_features(graph, terms, c.z)
    return Head(z=c.z, g=c.g, h=h, bias=False, output_index=c.idx, linear_in=terms[0].h, form=SUM_OF_LINEARS.name)


def _gram_features(graph: fx.Graph, terms: list, before: fx.Node) -> fx.Node:
    """One (N, sum d_k (+1)) input whose Gram is the heads' ``sum_k c_k^2 (H_k H_k^T + 1)``: the columns
    ``c_k h_k`` and, for a head with a bias, a constant column ``c_k``.

    With one |c_k| for all heads (a uniform factor cancels in the bound) the columns are plain copies,
    ``[h_1, 1, h_2, 1, ...]``, and each head's Linear reads its ``h_k`` back as a slice of them: the
    features are then needed by the forward, so the partitioner saves them for the selection (the same
    values, bit for bit).  Otherwise they are computed for the selection only."""
    fake = terms[0][1].meta["val"].fake_mode

    def node(target, *args, at=before):
        with graph.inserting_before(at):
            n = graph.call_function(target, args)
        vals = [[x.meta["val"] for x in a] if isinstance(a, list) else a.meta["val"] if isinstance(a, fx.Node) else a
                for a in args]
        with fake:
            n.meta["val"] = target(*vals)
        return n

    def column(h, c, at):  # (N, 1) of c: the bias's input
        v = h.meta["val"]
        with graph.inserting_before(at):
            size = graph.call_function(aten.sym_size.int, (h, 0))
            n = graph.call_function(aten.full.default, ([size, 1], c),
                                    {"dtype": v.dtype, "device": v.device, "pin_memory": False})
        size.meta["val"] = v.shape[0]
        with fake:
            n.meta["val"] = torch.full([v.shape[0], 1], c, dtype=v.dtype, device=v.device)
        return n

    order = {n: i for i, n in enumerate(graph.nodes)}
    uniform = len({abs(c) for c, *_ in terms}) == 1
    first_linear = min((lin for *_, lin in terms), key=order.__getitem__)

    def hoist(n: fx.Node, depth: int = 0) -> bool:
        """Move ``n`` (and what it needs) before the first head: pure ops of earlier values only."""
        if order[n] < order[first_linear]:
            return True
        if depth > 8 or n.op != "call_function" or n.is_impure() or n in {lin for *_, lin in terms}:
            return False
        if not all(hoist(a, depth + 1) for a in n.all_input_nodes):
            return False
        first_linear.prepend(n)
        order[n] = order[first_linear] - 0.5
        return True

    if uniform:  # an input taken after the first head ran (head(f[:, 0]) + head_dist(f[:, 1]))
        for _, h, *_ in terms:
            hoist(h)
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_input = max((h for _, h, *_ in terms), key=order.__getitem__)
    if uniform and order[last_input] < order[first_linear] and len({h for _, h, *_ in terms}) == len(terms):
        at = first_linear
        parts, spans, width = [], [], 0
        for _, h, bias, _ in terms:
            d = h.meta["val"].shape[1]
            parts.append(h)
            spans.append((width, width + d))
            width += d
            if bias:
                parts.append(column(h, 1.0, at))
                width += 1
        out = node(aten.cat.default, parts, 1, at=at)
        for (_, h, _, lin), (lo, hi) in zip(terms, spans):
            lin.replace_input_with(h, node(aten.slice.Tensor, out, 1, lo, hi, at=at))
        return out
    parts = []
    for c, h, bias, _ in terms:
        parts.append(node(aten.mul.Tensor, h, c))
        if bias:
            parts.append(column(h, c, before))
    return node(aten.cat.default, parts, 1)


SUM_OF_LINEARS = HeadForm("sum_of_linears", "`sum_k c_k (W_k h_k + b_k)`, numbers `c_k`: `h` the features "
                          "`[c_1 h_1, c_1, c_2 h_2, ...]` (heads of one input: that input)",
                          _match, _obligations, _features)

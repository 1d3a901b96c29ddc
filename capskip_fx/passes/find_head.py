"""Find the classifier head in the joint graph.

Invariants: the logits ``z`` are a user output of shape (s, C) (batch in dim 0) with a tangent
``g``; ``z`` is produced (through views only) by ``addmm(bias, h, W^T)`` or ``mm(h, W^T)`` and
``h`` is (s, d).  The logits output is found from AOT output descriptors when available (the
first plain user output that qualifies), else from the joint graph's output/tangent order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx

from .batch import Refused, tangent_nodes

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default,
          aten.clone.default, aten.squeeze.dim, aten.squeeze.dims}


@dataclass
class Head:
    z: fx.Node  # logits
    g: fx.Node  # logits' tangent placeholder
    h: fx.Node  # head input
    bias: bool
    output_index: int  # which user output holds the logits


def _outputs_and_tangents(graph: fx.Graph) -> list[tuple[int, fx.Node, Optional[fx.Node]]]:
    """[(user_output_index, output_node, tangent_node)] for the joint graph."""
    try:
        from torch._functorch._aot_autograd.descriptors import PlainAOTOutput
        from torch._functorch._aot_autograd.fx_utils import get_all_output_and_tangent_nodes

        pairs = get_all_output_and_tangent_nodes(graph)
        out = [(d.idx, o, t) for d, (o, t) in pairs.items() if isinstance(d, PlainAOTOutput)]
        if out:
            return sorted(out, key=lambda x: x[0])
    except Exception:  # older torch without descriptors: positional fallback below
        pass
    tangents = tangent_nodes(graph)
    outs = list(graph.find_nodes(op="output"))[0].args[0]
    outs = outs[0] if isinstance(outs, (tuple, list)) and outs and isinstance(outs[0], (tuple, list)) else outs
    return [(i, o, t) for i, (o, t) in enumerate(zip(outs, tangents)) if isinstance(o, fx.Node)]


def _producer(n: fx.Node) -> fx.Node:
    while n.op == "call_function" and n.target in _VIEWS:
        n = n.args[0]
    return n


def _match_linear(z: fx.Node) -> Optional[tuple[fx.Node, bool]]:
    p = _producer(z)
    if p.op != "call_function":
        return None
    if p.target == aten.addmm.default:
        return p.args[1], True
    if p.target == aten.mm.default:
        return p.args[0], False
    if p.target in (aten.add.Tensor,):  # mm + bias
        for a, b in ((p.args[0], p.args[1]), (p.args[1], p.args[0])):
            if isinstance(a, fx.Node) and _producer(a).op == "call_function" and _producer(a).target == aten.mm.default:
                return _producer(a).args[0], True
    return None


def find_head(graph: fx.Graph, logits_index: Optional[int] = None) -> Head:
    candidates = _outputs_and_tangents(graph)
    reasons = []
    for idx, z, g in candidates:
        if logits_index is not None and idx != logits_index:
            continue
        val = z.meta.get("val")
        if g is None or not isinstance(val, torch.Tensor) or val.dim() != 2:
            reasons.append(f"output {idx}: not a 2-D differentiable tensor")
            continue
        m = _match_linear(z)
        if m is None:
            reasons.append(f"output {idx}: not produced by a Linear (addmm/mm)")
            continue
        h, bias = m
        hv = h.meta.get("val")
        if not isinstance(hv, torch.Tensor) or hv.dim() != 2:
            reasons.append(f"output {idx}: head input is not 2-D")
            continue
        return Head(z=z, g=g, h=h, bias=bias, output_index=idx)
    raise Refused("no classifier head: the model output must be logits (N, C) from a final Linear"
                  + (f" ({'; '.join(reasons)})" if reasons else ""))

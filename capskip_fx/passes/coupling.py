"""Detect forward computations that mix examples (cross-example coupling).

Row-selected backward is exact only if example i's loss depends on example i's inputs alone.
Op names don't work (BatchNorm is already decomposed into var_mean/... in the joint graph), so
the test is structural: a forward node whose input carries the batch symbol and whose output
does not is a reduction over the batch; if its value reaches a batch-shaped forward node or a
forward output, examples are coupled (BatchNorm in train mode, in-batch statistics, batch-level
aux losses).  Backward nodes (reachable from a tangent) are ignored: weight gradients are
batch reductions by design.
"""
from __future__ import annotations

from typing import Optional

import sympy
import torch
from torch import fx

from .batch import has_symbol, is_tensor_value, tangent_nodes


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = tangent_nodes(graph)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.users)
    return seen


def find_coupling(graph: fx.Graph, sym: sympy.Symbol) -> Optional[str]:
    """A human-readable reason naming the first coupling node, or None."""
    bwd = _backward_nodes(graph)
    for n in graph.nodes:
        if n.op != "call_function" or n in bwd:
            continue
        val = n.meta.get("val")
        if not is_tensor_value(val) or has_symbol(val, sym):
            continue
        if not any(isinstance(a, fx.Node) and has_symbol(a.meta.get("val"), sym) for a in n.all_input_nodes):
            continue
        # a batch reduction: does it feed per-example values or the model's outputs?
        stack, seen = list(n.users), set()
        while stack:
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            # the joint graph's one output node is reachable from the tangents too: test it first
            if u.op != "output" and u in bwd:
                continue
            if u.op == "output" or has_symbol(u.meta.get("val"), sym):
                code = [ln.strip() for ln in n.meta.get("stack_trace", "").splitlines()
                        if ln.strip() and set(ln.strip()) - set("^~")]
                where = f" (at: {code[-1]})" if code else ""
                return (f"cross-example op in the forward: {n.name} ({n.target}) reduces over the batch "
                        f"and feeds {u.name}, e.g. BatchNorm in train mode{where}")
            stack.extend(u.users)
    return None

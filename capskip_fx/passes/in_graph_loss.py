"""Joint-graph pass: an in-graph loss, computed inside the model from the logits (Hugging Face's ``labels=``).

Invariants: the loss region is the forward nodes after the logits ``z`` that read only ``z``, the labels and
constants (nothing else that carries gradient), and reduce to the model's loss output; its backward up to
``dL/dz`` is then split off as a prefix (passes/selected_rows.py) whose labels, read back from the region's
own values, the rules may use.  Anything else: no in-graph loss (the logits' tangent is the backward's input).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx

from ..records import RefusalKind, Refused
from .find_head import Head

aten = torch.ops.aten


@dataclass
class InGraphLoss:
    """A loss computed inside the graph from the logits (Hugging Face models given ``labels``)."""

    nodes: frozenset  # the forward nodes after z that compute it (not analysed for row mixing)
    grad: fx.Node  # the backward node holding dL/dz, every path into the logits summed (token-shaped logits:
    # flattened to (s*T, C), as the head's mm's read it)


def find_in_graph_loss(graph: fx.Graph, head: Head, backward: set) -> Optional[InGraphLoss]:
    """The forward nodes computed from the logits, if they reduce over the batch into an output (a loss).

    Exact only if the loss reaches the model through ``z`` alone: every value the loss nodes read
    besides ``z`` and each other must come from non-floating inputs (labels, masks) or constants;
    otherwise Refused.  ``grad`` is the gradient into ``z`` (the first operand of the head's weight
    gradient ``mm(G.T, h)``), where the rows are selected instead of at the logits' tangent.
    """
    needs_grad = _inputs_with_grad(graph)
    region, stack = set(), [u for u in head.z.users if u not in backward and u.op != "output"]
    while stack:
        n = stack.pop()
        if n in region:
            continue
        region.add(n)
        stack.extend(u for u in n.users if u not in backward and u.op != "output")
    outputs = [n for n in region if any(u.op == "output" for u in n.users)]
    zdim = head.z.meta["val"].shape[0]
    if not any(_is_reduced(n, zdim) for n in outputs):
        return None
    # what the loss reads besides the logits, computed from labels and constants only (the count of
    # non-ignored labels, the gather index), belongs to it: its reductions over the batch carry no gradient
    stack = [a for n in region for a in n.all_input_nodes]
    while stack:
        a = stack.pop()
        if a in region or a is head.z or a.op != "call_function" or _differentiable(a, needs_grad):
            continue
        if all(u in region or u in backward for u in a.users):
            region.add(a)
            stack.extend(a.all_input_nodes)
    for n in region:
        for a in n.all_input_nodes:
            if a is not head.z and a not in region and _differentiable(a, needs_grad):
                raise Refused(f"the in-graph loss reads {a.name}, which depends on the model's float inputs or "
                              f"parameters other than through the logits: its gradient could not be selected "
                              f"(compute the loss outside the model)", RefusalKind.IN_GRAPH_LOSS, node=a)
    if head.linear_in is not None:
        raise Refused("an in-graph loss after a sum of Linear heads: the gradient into the logits has no node of "
                      "its own (compute the loss outside the model)", RefusalKind.IN_GRAPH_LOSS)
    if head.rows is not None:  # L[arange(N), j]: the gradient into z is what the backward puts back into L
        r, j = head.rows
        grad = next((u.args[2] for u in j.users if u in backward and u.target == aten.index_put.default
                     and list(u.args[1]) == [r, j]), None)
    else:
        grad = None
    lin = head.linear_in if head.linear_in is not None else head.tokens if head.tokens is not None else \
        head.cosine if head.cosine is not None else head.h
    grad = grad or next((u.args[0].args[0] for u in lin.users
                 if u in backward and u.target == aten.mm.default and u.args[1] is lin
                 and isinstance(u.args[0], fx.Node) and u.args[0].target in (aten.permute.default, aten.t.default)),
                None)
    # token-shaped logits: the gradient the head's mm's read is (s*T, C), the logits' gradient flattened
    want = tuple(head.z.meta["val"].shape) if head.tokens is None else \
        tuple(head.tokens.meta["val"].shape[:1]) + tuple(head.z.meta["val"].shape[-1:])
    if grad is None or tuple(grad.meta["val"].shape) != want:
        raise Refused("in-graph loss: the gradient into the logits was not found (a frozen head?)",
                      RefusalKind.IN_GRAPH_LOSS)
    region |= _label_values_of_loss_backward(grad, region, backward, head.z, needs_grad)
    return InGraphLoss(frozenset(region), grad)


def _label_values_of_loss_backward(grad: fx.Node, region: set, backward: set, z: fx.Node, needs_grad) -> set:
    """Forward values computed from labels and sizes only for the loss's backward (the nodes computing dL/dz),
    e.g. a decomposed cross-entropy's one-hot ``scatter`` of the labels: they belong to the loss (the prefix
    reads them, on all rows; never gathered).  Those with any other reader stay out."""
    loss_bwd, stack = set(), [grad]
    while stack:
        n = stack.pop()
        if n in loss_bwd or n not in backward:
            continue
        loss_bwd.add(n)
        stack.extend(n.all_input_nodes)
    found, stack = set(), [a for n in loss_bwd for a in n.all_input_nodes if a not in backward]
    while stack:
        a = stack.pop()
        if a in found or a in region or a is z or a.op != "call_function" or _differentiable(a, needs_grad):
            continue
        found.add(a)
        stack.extend(a.all_input_nodes)
    changed = True
    while changed:
        changed = False
        for a in list(found):
            if any(u not in region and u not in loss_bwd and u not in found for u in a.users):
                found.discard(a)
                changed = True
    return found


def _is_reduced(n: fx.Node, zdim) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and not any(s is zdim or (hasattr(s, "node") and hasattr(zdim, "node")
                                                                 and s.node.expr == zdim.node.expr) for s in v.shape)


def _inputs_with_grad(graph: fx.Graph) -> Optional[set]:
    """The joint graph's inputs that get a gradient (parameters, inputs requiring grad); None if this
    torch has no AOT descriptors."""
    try:
        from torch._functorch._aot_autograd.fx_utils import get_all_input_and_grad_nodes

        return {n for n, g in get_all_input_and_grad_nodes(graph).values() if g is not None}
    except Exception:
        return None


def _differentiable(n: fx.Node, needs_grad: Optional[set]) -> bool:
    """Does ``n`` depend on an input that gets a gradient?  (Without descriptors: any floating input,
    conservatively — e.g. Trainer's ``num_items_in_batch`` then counts too.)"""
    stack, seen = [n], set()
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        if m.op == "placeholder":
            v = m.meta.get("val")
            if needs_grad is not None:
                if m in needs_grad:
                    return True
            elif isinstance(v, torch.Tensor) and (v.dtype.is_floating_point or v.dtype.is_complex):
                return True
        stack.extend(m.all_input_nodes)
    return False

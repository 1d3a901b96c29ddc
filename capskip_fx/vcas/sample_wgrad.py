"""Backward-graph pass (VCAS SampleW): sample token rows in each Linear's weight-gradient matmul.

A Linear's weight gradient in the decomposed backward is ``mm(permute(G, [1, 0]), X)``: ``G``
(R, out) the output gradient (a gradient node), ``X`` (R, in) the saved input (not a gradient),
``R`` a batch row count (``a*s``).  Each such matmul inside the model's repeated blocks (below the
first cut, and of a block's module when the blocks are known: an input projection or embedding
below the blocks and the head stay exact, as in VCAS, ``vcas/model_processor.py`` 27-37) becomes
``capskip::sampled_wgrad(G, X, key, slot)``: rows kept with probability soft-top-k of ``||g_t|| ||x_t||`` and scaled by ``1/p`` (unbiased).
The bias gradient (a sum over rows) and the input gradient ``mm(G, W)`` are untouched (exact).

Invariants: only matmuls contracting over the batch rows are rewritten (attention's bmm contract
over tokens within a row: untouched); with ``nu = 1`` the op is the plain matmul (exact).
"""
from __future__ import annotations

from typing import Container, Optional

import sympy
import torch
from torch import Tensor, fx

from .. import ops
from ..symbolic import batch_dim_of
from .segment_backward import Flow

aten = torch.ops.aten


@torch.library.custom_op("capskip::sampled_wgrad", mutates_args=())
def sampled_wgrad(g: Tensor, x: Tensor, key: int, slot: int) -> Tensor:
    """VCAS SampleW: ``g.T @ x`` over sampled rows reweighted by 1/p (VcasBackward.wgrad, the runner ``key`` names)."""
    return ops.lookup(key).wgrad(g, x, slot)


@sampled_wgrad.register_fake
def _sampled_wgrad_fake(g: Tensor, x: Tensor, key: int, slot: int) -> Tensor:
    return g.new_empty(g.shape[1], x.shape[1])


def _rows_are_batch(v, sym) -> bool:
    bd = batch_dim_of(v, sym)
    return bd is not None and bd[0] == 0 and v.dim() == 2


def find_wgrad_matmuls(graph: fx.Graph, sym: sympy.Symbol, below: fx.Node,
                       inside: Optional[Container] = None) -> list[tuple[fx.Node, fx.Node, fx.Node]]:
    """(mm, G, X) for every weight-gradient matmul below the cut ``below`` (and in ``inside``, the
    matmuls of the model's repeated blocks, when given)."""
    flow = Flow.of(graph)
    grad = flow.grad
    found = []
    for mm in graph.find_nodes(op="call_function", target=aten.mm.default):
        if not flow.below(below, mm) or (inside is not None and mm not in inside):
            continue
        a, x = mm.args
        if not isinstance(a, fx.Node) or not isinstance(x, fx.Node):
            continue
        if a.target is aten.t.default or (a.target is aten.permute.default and list(a.args[1]) == [1, 0]):
            g = a.args[0]
        else:
            continue
        gv, xv = g.meta.get("val"), x.meta.get("val")
        if grad.get(g) and not grad.get(x) and _rows_are_batch(gv, sym) and _rows_are_batch(xv, sym) \
                and gv.shape[0] == xv.shape[0]:
            found.append((mm, g, x))
    return found


def sample_wgrad(gm: fx.GraphModule, sym: sympy.Symbol, key: int, below: fx.Node,
                 inside: Optional[Container] = None) -> int:
    """Rewrite the weight-gradient matmuls below the cut ``below`` (and in ``inside``) in place;
    returns how many (= slots)."""
    op = torch.ops.capskip.sampled_wgrad.default
    found = find_wgrad_matmuls(gm.graph, sym, below, inside)
    for slot, (mm, g, x) in enumerate(found):
        with gm.graph.inserting_before(mm):
            new = gm.graph.call_function(op, (g, x, key, slot))
        new.meta = dict(mm.meta)
        mm.replace_all_uses_with(new)
        gm.graph.erase_node(mm)
    if found:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return len(found)

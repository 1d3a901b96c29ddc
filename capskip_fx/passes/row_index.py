"""Joint-graph pass: the backward computes its own row index.

``x[arange(N), j]`` (a decoder classifier's last token) is differentiable in ``x``: its backward is
``index_put(zeros, [arange(N), j], g)``, which reads the forward's ``arange(N)``.  Saved and gathered
at the kept rows, that index would hold the rows' old numbers (up to N - 1) while the backward has k
rows.  This pass gives every backward reader of an ``arange`` of the batch a fresh
``arange(t.shape[0])`` of a batch-shaped tangent ``t``: the tangent is a backward input, so the
partitioner cannot save the new index, and at k gathered rows it numbers them 0..k-1, as the
gathered ``j`` and the other gathered values are.

Invariants: only nodes ``arange``/``iota`` of length exactly the batch symbol, start 0, step 1 are
rewritten; on all N rows the graph computes the same values as before.  A row index the backward
still reads afterwards (a view of one, for instance) is refused by the layout analysis.
"""
from __future__ import annotations

from typing import Optional

import sympy
import torch
from torch import fx

from ..placement import backward_nodes
from ..symbolic import expr_of, tangent_nodes

aten = torch.ops.aten
prims = torch.ops.prims
_ARANGES = (prims.iota.default, aten.arange.default, aten.arange.start, aten.arange.start_step)


def is_batch_arange(n: fx.Node, sym: sympy.Symbol) -> bool:
    """``n`` is ``arange(N)`` (or ``iota``): length the batch symbol, start 0, step 1."""
    if n.op != "call_function" or n.target not in _ARANGES:
        return False
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 1 or expr_of(val.shape[0]) != sym:
        return False
    if n.target is prims.iota.default:
        return n.kwargs.get("start", 0) == 0 and n.kwargs.get("step", 1) == 1
    if n.target is aten.arange.default:
        return True
    return n.args[0] == 0 and (len(n.args) < 3 or n.args[2] == 1)


def _length_arg(n: fx.Node) -> int:
    return 0 if n.target in (prims.iota.default, aten.arange.default) else 1


def recompute_row_indices(graph: fx.Graph, sym: sympy.Symbol) -> int:
    """Give the backward readers of ``arange(N)`` their own; returns how many reads were rewritten."""
    tangent: Optional[fx.Node] = next(
        (t for t in tangent_nodes(graph) if isinstance(t.meta.get("val"), torch.Tensor)
         and t.meta["val"].dim() >= 1 and expr_of(t.meta["val"].shape[0]) == sym), None)
    if tangent is None:
        return 0
    bwd = backward_nodes(graph)
    done = 0
    for r in [n for n in graph.nodes if n not in bwd and is_batch_arange(n, sym)]:
        for u in [u for u in r.users if u in bwd and u.op != "output"]:
            with graph.inserting_before(u):
                size = graph.call_function(aten.sym_size.int, (tangent, 0))
                args = list(r.args)
                args[_length_arg(r)] = size
                r2 = graph.call_function(r.target, tuple(args), dict(r.kwargs))
            size.meta["val"] = tangent.meta["val"].shape[0]
            r2.meta.update({k: v for k, v in r.meta.items() if k in ("val", "tensor_meta")})
            u.replace_input_with(r, r2)
            done += 1
    return done

"""What every head form shares: the ``Head`` found, the analysed logits output each form matches
(``Logits``), the registry entry (``HeadForm``) and the graph helpers the forms use."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
from torch import fx

from ...symbolic import shape_exprs, tangent_nodes

aten = torch.ops.aten
VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default,
                   aten.clone.default, aten.squeeze.dim, aten.squeeze.dims})


@dataclass
class Head:
    z: fx.Node  # logits
    g: fx.Node  # logits' tangent placeholder
    h: fx.Node  # head input
    bias: bool
    output_index: int  # which user output holds the logits
    rows: Optional[tuple] = None  # (arange(N), j): the logits are L[arange(N), j] of per-token logits L
    linear_in: Optional[fx.Node] = None  # a sum of heads: the first head's input (h holds the Gram features)
    tokens: Optional[fx.Node] = None  # token-shaped logits (s, T, C): the Linear's (s*T, d) input (h is (s, T, d))
    cosine: Optional[fx.Node] = None  # a cosine head: its mm's input x (h holds the Gram features)
    form: str = ""  # the registry entry that found it (HeadForm.name)


class Term(NamedTuple):
    """One Linear head in the logits: ``scale * (W h [+ b])``, ``linear`` its mm/addmm node."""

    scale: float
    h: fx.Node
    bias: bool
    linear: fx.Node


@dataclass(frozen=True)
class Logits:
    """One differentiable user output, analysed once; every form's match and obligations read this."""

    idx: int  # user output index
    z: fx.Node
    g: fx.Node  # its tangent
    val: torch.Tensor  # z's fake value: (N, C), or (N, T, C) floating
    per_row: Optional[tuple]  # (L, arange(N), j) when z = L[arange(N), j] (2-D z only)
    terms: Optional[tuple]  # z (or L) as a sum of scaled Linears (Term); None: not one
    cosines: tuple  # per term: its weights.CosineWeight, or None for a parameter weight
    unsupported: Optional[str]  # why the Linears can't be followed (a computed weight, a tensor scale)


@dataclass(frozen=True)
class HeadForm:
    """One head form: ``match`` says whether an output has this form (structure only; the forms' matches are
    disjoint), ``obligations`` what must hold for the rule's Gram to be exact (None, or why not, without the
    ``output i:`` prefix), ``features`` builds the Head, adding the Gram feature nodes to the graph if the
    Gram is not rank-one in the head input.  ``gram`` is the one line docs/design.md lists."""

    name: str
    gram: str
    match: Callable[[Logits], bool]
    obligations: Callable[[Logits], Optional[str]]
    features: Callable[[fx.Graph, Logits], Head]


def outputs_and_tangents(graph: fx.Graph) -> list[tuple[int, fx.Node, Optional[fx.Node]]]:
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


def producer(n: fx.Node) -> fx.Node:
    """``n`` with views (and clones) stripped."""
    while n.op == "call_function" and n.target in VIEWS:
        n = n.args[0]
    return n


def same_size(a, b) -> bool:
    """Sizes equal structurally (no guard: a SymInt is compared by its expression)."""
    ea = a.node.expr if isinstance(a, torch.SymInt) else a
    eb = b.node.expr if isinstance(b, torch.SymInt) else b
    return ea == eb


def fake_node(graph: fx.Graph, target, args: tuple, before: fx.Node, kwargs: Optional[dict] = None) -> fx.Node:
    """A new node before ``before``, its ``val`` computed under the graph's fake mode."""
    with graph.inserting_before(before):
        n = graph.call_function(target, args, kwargs or {})
    vals = [[x.meta["val"] if isinstance(x, fx.Node) else x for x in a] if isinstance(a, list)
            else a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    fake = next(v for v in (a.meta["val"] for a in n.all_input_nodes) if isinstance(v, torch.Tensor)).fake_mode
    with fake:
        n.meta["val"] = target(*vals, **(kwargs or {}))
    return n


def constant(c) -> Optional[float]:
    """``c`` as a float if it is a number (not a bool), else None."""
    return float(c) if isinstance(c, (int, float)) and not isinstance(c, bool) else None


def sequence_source(h2d: fx.Node, like: fx.Node) -> Optional[fx.Node]:
    """The (N, T, d) value a Linear's (N*T, d) input ``h2d`` is a view of, N and T those of ``like``; else None."""
    n, want = h2d, shape_exprs(like.meta["val"])[:2]
    while True:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() == 3 and shape_exprs(v)[:2] == want:
            return n
        if n.op != "call_function" or n.target not in VIEWS:
            return None
        n = n.args[0]

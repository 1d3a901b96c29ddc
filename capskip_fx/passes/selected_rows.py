"""Backward-graph pass: run the backward on the kept rows only, reusing the forward's activations.

Given the partitioned backward (symbolic batch ``s``) that contains ``w = capskip::select(h, z, g)``
(head graph) or ``w = capskip::shared(g)`` (body graph):
  1. the node's tensor inputs must be backward inputs (saved activations / tangents); the node
     is replaced by a new last input ``capskip_w``.  At run time (runtime/backward.py) the head
     graph's ``w`` is the rule's weight; a body graph's is the mask of rows whose incoming gradient
     is nonzero, computed from its own tangents (the head's kept rows are not reused).
  2. Every input is classified from its *example input* (real strides from the compiled
     forward, not node meta): no batch / SymInt expression of ``s`` / tensor with one batch dim
     of size ``a*s``.  Anything else is refused.  A saved activation's batch dim is then taken from
     the layout proof, never from its sizes alone: the dim it proved, batch-major with ``a`` inner
     rows, or token-major ``(outer, s, inner)`` with ``outer * inner == a`` (``(T*N, E)`` rows of a
     Linear over a ``(T, N, E)`` value, as ``nn.MultiheadAttention`` makes); the gather follows it.
  3. The rewritten graph is compiled ONCE (symbolic batch; passes/pipeline.py compiles it).  At run
     time the rule picks the rows, the kept rows are moved to the front, ``kb = bucket(k)`` rows
     are gathered (the pad rows are skipped rows with weight 0: exact), SymInt inputs are
     evaluated at ``kb``, and batch-shaped outputs (input gradients) are scattered back to N rows.
Invariants: outputs equal the dense-masked backward's (exact semantics, see insert_select.py);
the compiled graph must not specialise ``s`` (checked after compiling; refused otherwise);
k == N (and kb > gather_below*N) runs ungathered with w masking; k == 0 runs on ``min_rows``
zero-weight rows (zero gradients, not None).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import sympy
import torch
from torch import fx

from ..records import RefusalKind, Refused
from ..symbolic import Spec, batch_symbol_of, spec_of, stride_symbols
from .insert_select import SELECTION_OPS


@dataclass
class Prefix:
    """An in-graph loss: the backward nodes that compute dL/dz run first, as their own graph: on all rows,
    or on the kept rows when proven row-wise (passes/prefix_rows.py) and the rule reads no dL/dz."""

    gm: fx.GraphModule
    examples: list  # its example inputs
    args: tuple[int, ...]  # which backward inputs it takes
    keep: tuple[int, ...]  # which backward inputs the rest of the backward takes (then the prefix's outputs)
    specs: Optional[list] = None  # row-wise: its inputs' specs (how the kept rows are gathered); None: all rows
    whole_rows: Optional[str] = None  # why it runs on every row whatever the rule (not proven row-wise)
    # a recognised cross-entropy (passes/loss_grad.py): which backward inputs its dL/dz is derived from, in the
    # recipe's ``inputs`` order, and the recipe; then a rule that reads dL/dz also chooses before the prefix
    grad_args: Optional[tuple[int, ...]] = None
    grad: Any = None
    grad_why: Optional[str] = None  # why dL/dz is not derived (a rule that reads it runs the prefix on every row)


@dataclass
class BackwardPlan:
    """What the rewrite found; kept in the graph's compile record (``record.plan``)."""

    select_args: tuple[int, ...]  # input positions of h, z, g (head) or g (body)
    tangent_args: tuple[int, ...]  # input positions of the batch-shaped tangents
    specs: list[Spec]
    out_specs: list[Optional[Spec]]
    sym: sympy.Symbol
    prefix: Optional[Prefix] = None
    stride_syms: tuple = ()  # symbolic strides of saved views, contiguous in the gathered copies (symbolic.py)
    # batch inputs the rewritten graph never reads (the logits z, read only by the selection it replaced):
    # the runtime passes their first rows as a view instead of gathering them (a causal LM's (N, T, C) z)
    unread: tuple[int, ...] = ()

    @property
    def head(self) -> bool:
        return len(self.select_args) == 3

    @property
    def gathered_inputs(self) -> int:
        return sum(s.kind == "batch" for s in self.specs)


def plan_backward(gm: fx.GraphModule, example_inputs, layouts: dict) -> tuple[fx.GraphModule, BackwardPlan, Any, list]:
    """Rewrite ``gm`` in place (select -> input).  Returns the graph, its plan, the w example and the
    graph's example inputs (those of the rest of the backward when an in-graph loss split off a prefix).

    ``layouts`` (the joint pass's analysis, by forward value name) must prove every batch-shaped
    saved activation batch-major, in the dim and with the factor its sizes show."""
    sel = [n for n in gm.graph.nodes if n.target in SELECTION_OPS]
    if len(sel) != 1:
        raise Refused(f"expected one selection node in the backward, found {len(sel)}", RefusalKind.SELECTION)
    sel = sel[0]
    prefix = None
    if sel.args[-2].op != "placeholder":  # dL/dz computed in the backward: an in-graph loss
        graph = fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))  # split a copy: the caller's gm stays the exact fallback
        gm = fx.GraphModule(gm, graph)
        sel = next(n for n in gm.graph.nodes if n.target in SELECTION_OPS)
        grad_args, grad_why = _loss_inputs(gm, sel)
        prefix, example_inputs = _split_prefix(gm, list(example_inputs), sel.args[-2], sel)
        prefix = replace(prefix, grad_args=grad_args, grad_why=grad_why)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    pos = {n: i for i, n in enumerate(placeholders)}
    tensors = sel.args[:-1]  # (h, z, g) or (g,); the last arg is the state key
    if not all(a in pos for a in tensors):
        raise Refused("the selection's inputs are computed inside the backward (not saved activations), so the rows "
                      "cannot be chosen before it runs: the rule's weights mask every row instead (e.g. a head "
                      "inside torch.utils.checkpoint, whose input the backward recomputes: keep the head out of the "
                      "checkpoint; or heads summed with different weights, 0.7 * head(a) + 0.3 * head2(b): give "
                      "them one weight to select rows; docs/limits.md)", RefusalKind.SELECTION)
    sym = batch_symbol_of(example_inputs[pos[tensors[-1]]])
    strides = stride_symbols(example_inputs, sym)
    specs = [spec_of(v, sym, strides) for v in example_inputs]
    for a in tensors:
        if specs[pos[a]].kind != "batch" or specs[pos[a]].factor != 1 or specs[pos[a]].dim != 0:
            raise Refused(f"selection input {a.name} does not carry the batch in dim 0", RefusalKind.SELECTION)
    computed = {n.name for n in placeholders[len(placeholders) - len(prefix.gm.graph.output_node().args[0]):]} \
        if prefix is not None else set()
    for i, (node, spec) in enumerate(zip(placeholders, specs)):
        if spec.kind == "batch" and not node.name.startswith("tangents") and node.name not in computed:
            specs[i] = _proven(node.name, spec, layouts.get(node.name))
    out_vals = list(gm.graph.find_nodes(op="output"))[0].args[0]
    out_specs = []
    for o in out_vals:
        v = o.meta.get("val") if isinstance(o, fx.Node) else None
        out_specs.append(spec_of(v, sym, strides) if isinstance(v, torch.Tensor) else None)
        if out_specs[-1] is not None and out_specs[-1].kind == "static":
            out_specs[-1] = None
    w_val = sel.meta["val"]
    with gm.graph.inserting_after(placeholders[-1]):
        w = gm.graph.placeholder("capskip_w")
    w.meta["val"] = w_val
    sel.replace_all_uses_with(w)
    gm.graph.erase_node(sel)
    gm.graph.lint()
    gm.recompile()
    tangents = tuple(i for i, n in enumerate(placeholders)
                     if n.name.startswith("tangents") and specs[i].kind == "batch")
    unread = tuple(pos[a] for a in dict.fromkeys(tensors) if not a.users and specs[pos[a]].kind == "batch")
    plan = BackwardPlan(tuple(pos[a] for a in tensors), tangents, specs, out_specs, sym, prefix, tuple(strides),
                        unread)
    return gm, plan, w_val, example_inputs


def _loss_inputs(gm: fx.GraphModule, sel: fx.Node) -> tuple[Optional[tuple[int, ...]], Optional[str]]:
    """(the backward inputs a recognised cross-entropy's dL/dz is derived from, or None; why not).  Takes
    them off the selection node: the rest of the backward does not read them (the runtime reads them from
    the backward's own inputs)."""
    nodes = sel.kwargs.get("loss")
    if not nodes:
        return None, None
    sel.kwargs = {**sel.kwargs, "loss": []}
    pos = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    missing = [n.name for n in nodes if n not in pos]
    if missing:
        return None, f"the loss's inputs {missing} are computed in the backward, not passed to it"
    return tuple(pos[n] for n in nodes), None


def _split_prefix(gm: fx.GraphModule, example_inputs: list, g: fx.Node, sel: fx.Node) -> tuple[Prefix, list]:
    """Move the nodes computing ``g`` (dL/dz) into a prefix graph of their own; in ``gm`` their values
    used later become new inputs.  Exact: the prefix is an in-graph loss's backward, which touches the
    logits only (insert_select proved the loss reads nothing else that carries gradient)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inside, stack = set(), [g]
    while stack:
        n = stack.pop()
        if n in inside or n.op != "call_function":
            continue
        inside.add(n)
        stack.extend(n.all_input_nodes)
    ordered = [n for n in gm.graph.nodes if n in inside]
    exported = [g] + [n for n in ordered if n is not g and any(u not in inside for u in n.users)]
    pg = fx.Graph()
    env: dict = {}
    p_args = [i for i, p in enumerate(placeholders) if any(u in inside for u in p.users)]
    for i in p_args:
        env[placeholders[i]] = pg.placeholder(placeholders[i].name)
        env[placeholders[i]].meta = dict(placeholders[i].meta)
    for n in ordered:
        env[n] = pg.node_copy(n, lambda a: env[a])
    pg.output([env[n] for n in exported])
    prefix_gm = fx.GraphModule(gm, pg)
    # the rest: exported values become inputs; the prefix's nodes and the inputs only it read go
    new_inputs = []
    for n in exported:  # in export order (each after the last): the runtime passes the prefix's outputs so
        with gm.graph.inserting_after(new_inputs[-1] if new_inputs else placeholders[-1]):
            ph = gm.graph.placeholder(f"{n.name}_from_loss")
        ph.meta["val"] = n.meta["val"]
        new_inputs.append(ph)
    for n, ph in zip(exported, new_inputs):
        n.replace_all_uses_with(ph, delete_user_cb=lambda u: u not in inside)
    for n in reversed(ordered):
        gm.graph.erase_node(n)
    keep = [i for i, p in enumerate(placeholders) if p.users]
    for i, p in enumerate(placeholders):
        if not p.users:
            gm.graph.erase_node(p)
    gm.graph.lint()
    gm.recompile()
    prefix = Prefix(prefix_gm, [example_inputs[i] for i in p_args], tuple(p_args), tuple(keep))
    return prefix, [example_inputs[i] for i in keep] + [n.meta["val"] for n in exported]


def _proven(name: str, spec: Spec, layout) -> Spec:
    """The spec a saved activation is gathered along: the dim its sizes show, split as the dataflow
    proved it (``outer`` > 1: token-major).  Refused unless the proof and the sizes agree."""
    if layout is None:
        raise Refused(f"saved activation {name} has no proven batch layout (not a forward value of the joint graph)",
                      RefusalKind.UNPROVEN)
    outer, inner = (layout.outer, layout.inner) if layout.kind == "batch" else (None, None)
    if not (layout.kind == "batch" and layout.dim == spec.dim and outer.is_Integer and inner.is_Integer
            and spec.outer == 1 and int(outer) * int(inner) == spec.factor):
        raise Refused(f"saved activation {name}: its sizes suggest batch dim {spec.dim} x{spec.factor}, but the "
                      f"dataflow says {layout}{': ' + layout.why if layout.why else ''}", RefusalKind.UNPROVEN)
    return replace(spec, outer=int(outer), factor=int(inner))


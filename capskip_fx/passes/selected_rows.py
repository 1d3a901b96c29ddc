"""Backward-graph pass: run the backward on the kept rows only, reusing the forward's activations.

Given the partitioned backward (symbolic batch ``s``) that contains ``w = capskip::select(h, z, g)``
(head graph) or ``w = capskip::shared(g)`` (body graph):
  1. the node's tensor inputs must be backward inputs (saved activations / tangents); the node
     is replaced by a new last input ``capskip_w``.  At run time the head graph runs the rule
     and publishes its kept rows; body graphs (whose backward runs later) use them.
  2. Every input is classified from its *example input* (real strides from the compiled
     forward, not node meta): no batch / SymInt expression of ``s`` / tensor with one batch dim
     of size ``a*s`` (flattened batch-major when a > 1).  Anything else is refused.
  3. The rewritten graph is compiled ONCE (symbolic batch).  At run time the rule picks the rows,
     the kept rows are moved to the front, ``kb = bucket(k)`` rows are gathered (the pad rows are
     skipped rows with weight 0: exact), SymInt inputs are evaluated at ``kb``, and batch-shaped
     outputs (input gradients) are scattered back to N rows.
Invariants: outputs equal the dense-masked backward's (exact semantics, see insert_select.py);
the compiled graph must not specialise ``s`` (checked after compiling; refused otherwise);
k == N (and kb > gather_below*N) runs ungathered with w masking; k == 0 runs on ``min_rows`` zero-weight rows (zero gradients, not None).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import sympy
import torch
from torch import fx

from ..rows import Spec, spec_of
from .batch import Refused, batch_symbol_of
from .insert_select import SELECTION_OPS


@dataclass
class BackwardPlan:
    """What the rewrite found; kept in the backend's graph record."""

    select_args: tuple[int, ...]  # input positions of h, z, g (head) or g (body)
    tangent_args: tuple[int, ...]  # input positions of the batch-shaped tangents
    specs: list[Spec]
    out_specs: list[Optional[Spec]]
    sym: sympy.Symbol

    @property
    def head(self) -> bool:
        return len(self.select_args) == 3

    @property
    def gathered_inputs(self) -> int:
        return sum(s.kind == "batch" for s in self.specs)


def plan_backward(gm: fx.GraphModule, example_inputs, layouts: dict) -> tuple[fx.GraphModule, BackwardPlan, Any]:
    """Rewrite ``gm`` in place (select -> input).  Returns the graph, its plan and the w example.

    ``layouts`` (the joint pass's analysis, by forward value name) must prove every batch-shaped
    saved activation batch-major, in the dim and with the factor its sizes show."""
    sel = [n for n in gm.graph.nodes if n.target in SELECTION_OPS]
    if len(sel) != 1:
        raise Refused(f"expected one selection node in the backward, found {len(sel)}")
    sel = sel[0]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    pos = {n: i for i, n in enumerate(placeholders)}
    tensors = sel.args[:-1]  # (h, z, g) or (g,); the last arg is the state key
    if not all(a in pos for a in tensors):
        raise Refused("the selection's inputs are computed inside the backward (not saved activations)")
    sym = batch_symbol_of(example_inputs[pos[tensors[-1]]])
    specs = [spec_of(v, sym) for v in example_inputs]
    for a in tensors:
        if specs[pos[a]].kind != "batch" or specs[pos[a]].factor != 1 or specs[pos[a]].dim != 0:
            raise Refused(f"selection input {a.name} does not carry the batch in dim 0")
    for node, spec in zip(placeholders, specs):
        if spec.kind == "batch" and not node.name.startswith("tangents"):
            _check_proven(node.name, spec, layouts.get(node.name))
    out_vals = list(gm.graph.find_nodes(op="output"))[0].args[0]
    out_specs = []
    for o in out_vals:
        v = o.meta.get("val") if isinstance(o, fx.Node) else None
        out_specs.append(spec_of(v, sym) if isinstance(v, torch.Tensor) else None)
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
    plan = BackwardPlan(tuple(pos[a] for a in tensors), tangents, specs, out_specs, sym)
    return gm, plan, w_val


def _check_proven(name: str, spec: Spec, layout) -> None:
    """A saved activation is gathered along ``spec`` only where the dataflow proved that layout."""
    if layout is None:
        raise Refused(f"saved activation {name} has no proven batch layout (not a forward value of the joint graph)")
    if not (layout.kind == "batch" and layout.outer == 1 and layout.dim == spec.dim and layout.inner == spec.factor):
        raise Refused(f"saved activation {name}: its sizes suggest batch dim {spec.dim} x{spec.factor}, but the "
                      f"dataflow says {layout}{': ' + layout.why if layout.why else ''}")


def check_not_specialised(example_inputs, sym: sympy.Symbol) -> None:
    """Refuse if compiling fixed the batch symbol (the graph would be wrong at other sizes)."""
    fm = next((getattr(v, "fake_mode", None) for v in example_inputs if getattr(v, "fake_mode", None)), None)
    env = getattr(fm, "shape_env", None)
    if env is None:
        return
    rep = env.replacements.get(sym)
    if rep is not None and not rep.free_symbols:
        raise Refused(f"compiling the backward specialised the batch size to {rep}")

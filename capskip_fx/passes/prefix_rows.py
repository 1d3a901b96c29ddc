"""Backward-graph pass: prove an in-graph loss's backward (the prefix up to dL/dz) row-wise, so that it
may run on the kept rows only.

Given the prefix graph that passes/selected_rows.py split off (its inputs: saved forward values of the
loss, its tangents, SymInts of the batch symbol ``s``; its outputs: dL/dz and the values the rest of the
backward reads) and the rest's specs of those outputs:
  1. every input is classified from its example (symbolic.spec_of): a tensor with the batch in one dim
     of size ``a*s``, read batch-major (``a`` rows per example, as the rest gathers its inputs) / a SymInt
     of ``s`` / no batch;
  2. the layout analysis walks every node from those inputs (placement.analyze_rowwise) and must find no row
     mixing: no reduction over the batch (a token count the partitioner recomputed in the backward), no
     index, sort or shift along it, no value that lost its layout;
  3. every output is free, or batch-major in the dim and with the factor the rest reads it with.
Then row ``b`` of each output depends on row ``b`` of the batch inputs and on the free ones only, so the
prefix run on gathered rows returns the gathered rows of its outputs: the rest of the backward gets exactly
what the dense-masked backward's kept rows get.  Otherwise Refused, and the prefix runs on every row.

Used only for rules that read no dL/dz (``Rule.reads_gradient`` False: a fixed count, random rows): the
runtime then picks the rows first and runs the loss's backward on the kept ones (runtime/backward.py).
A rule that reads dL/dz needs the prefix on every row to choose.
"""
from __future__ import annotations

from typing import Optional

import sympy
from torch import fx

from ..placement import analyze_rowwise, spec_layout
from ..records import RefusalKind, Refused
from ..symbolic import Spec, spec_of


def prove_prefix_rows(gm: fx.GraphModule, examples: list, sym: sympy.Symbol,
                      out_specs: list[Optional[Spec]]) -> list[Spec]:
    """The prefix's input specs (what the runtime gathers them by) if it is row-wise; Refused otherwise.
    ``out_specs``: the rest's spec of each prefix output (None: not a batch tensor)."""
    specs = [spec_of(v, sym) for v in examples]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    seeds = {node.name: spec_layout(spec) for node, spec in zip(placeholders, specs) if spec.kind == "batch"}
    result = analyze_rowwise(gm.graph, sym, seeds)
    if result.refusal is not None:
        raise Refused(f"the in-graph loss's backward is not row-wise ({result.refusal})", RefusalKind.IN_GRAPH_LOSS,
                      node=result.node)
    outs = gm.graph.output_node().args[0]
    for o, spec in zip(outs, out_specs):
        lay = result.layouts.get(o.name) if isinstance(o, fx.Node) else None
        if spec is None or spec.kind != "batch":
            if lay is not None and lay.kind != "free":
                raise Refused(f"the in-graph loss's backward returns {o.name} ({lay}) where the rest reads no batch",
                              RefusalKind.IN_GRAPH_LOSS)
            continue
        want = spec_layout(spec)
        if lay != want:
            raise Refused(f"the in-graph loss's backward returns {o.name} as {lay}; the rest gathers it as {want}",
                          RefusalKind.IN_GRAPH_LOSS)
    return specs


"""Backward-graph pass: prove the backward that will run on gathered rows (translation validation).

The joint graph's proof (insert_select.prove_layout) covers the forward values.  What executes is the
partitioned backward after every rewrite: the selection node turned into the input ``capskip_w``, the
backward's row indices recomputed (row_index.py), an in-graph loss's prefix split off.  This pass walks
*that* graph with the same layout analysis (placement.analyze_backward), its inputs seeded with the layouts
the runtime gathers them by (the plan's specs: the forward proof's dim, outer and inner for a saved value,
batch-major for a tangent, the prefix's outputs and ``w``), and accepts it only if:

  1. no node mixes rows: every batch value's row b depends on row b of the batch inputs and on values
     without the batch only;
  2. every sum over the rows (a reduction or contraction over the batch, an index_put / scatter_add /
     embedding backward placing rows by their data) sums values computed from ``capskip_w``: the weighted
     cotangents, zero on the rows of weight 0, so the rows run add up to the dense-masked sum; and nothing
     combines a sum with per-row values or spreads it back over the rows;
  3. no row is placed by its position: the row index may index the batch dim of a batch value only
     (``x[arange(N), j]``'s backward), never a tensor without the batch (``table[arange(N)]``), and no scatter
     puts row b of its source into row b of a tensor without the batch (``torch.gather(param, 1, idx)``);
  4. no random numbers are drawn or replayed (a seed-and-offset dropout in a fused attention backward,
     Inductor's RNG, checkpoint's replay): at k gathered rows they would be rows 0..k-1's;
  5. every output is either batch-major in the dim and factor the runtime scatters it by, or carries no
     batch (free, or a sum over the rows: a parameter gradient).

Then the graph run on any subset of rows that holds every row of nonzero weight returns, on those rows and
in its sums, exactly what it returns on all N rows (dense-masked).  Otherwise Refused: the graph runs on all
rows (dense-masked, exact), with the reason, the op and the user's source line.  ``verify`` stays a second
line of defence; this proof holds without it.
"""
from __future__ import annotations

from torch import fx

from ..placement import Layout, analyze_backward, spec_layout
from ..records import RefusalKind, Refused, counters

W_INPUT = "capskip_w"  # the input selected_rows.py puts in place of the selection node


def prove_backward(gm: fx.GraphModule, plan) -> None:
    """Prove ``gm`` (the rewritten backward, its inputs as ``plan.specs`` describes them) row-wise; Refused
    otherwise."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    seeds: dict[str, Layout] = {}
    for node, spec in zip(placeholders, plan.specs):
        if spec.kind == "batch":
            seeds[node.name] = spec_layout(spec)
    if placeholders and placeholders[-1].name == W_INPUT:
        seeds[W_INPUT] = Layout("batch", 0)
    result = analyze_backward(gm.graph, plan.sym, seeds, frozenset({W_INPUT}))
    if result.refusal is not None:
        raise Refused(f"the backward that runs on the kept rows is not proven row-wise: {result.refusal}",
                      result.kind or RefusalKind.BACKWARD, node=result.node)
    outs = gm.graph.output_node().args[0]
    for o, spec in zip(outs, plan.out_specs):
        lay = result.layouts.get(o.name) if isinstance(o, fx.Node) else None
        if spec is not None and spec.kind == "batch":
            want = spec_layout(spec)
            if lay != want:
                raise Refused(f"the backward returns {o.name} as {lay}, but its rows are scattered back as {want}",
                              RefusalKind.BACKWARD, node=o)
        elif lay is not None and lay.kind not in ("free", "sum"):
            raise Refused(f"the backward returns {o.name} ({lay}) where no batch is scattered back",
                          RefusalKind.BACKWARD, node=o)
    counters()["backward proven"] += 1

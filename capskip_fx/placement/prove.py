"""The placement proof's entry points: the forward of a joint graph (``analyze``), a graph whose inputs' layouts
are given (``analyze_rowwise``: the loss prefix), and the backward that will run on the gathered rows
(``analyze_backward``, with sums over the rows).  Importing the ``ops_*`` modules registers their rules.
"""
from __future__ import annotations

import sympy
from torch import fx

from . import ops_backward, ops_indexing, ops_matmul, ops_per_sample, ops_pointwise, ops_reductions, ops_shape  # noqa: F401 - they register the rules
from .lattice import Layout, LayoutAnalysis
from .walk import Walk

__all__ = ["analyze", "analyze_backward", "analyze_rowwise"]


def analyze(graph: fx.Graph, sym: sympy.Symbol, exclude=()) -> LayoutAnalysis:
    """Layouts of the forward values of an AOT joint graph whose batch size is ``sym``.

    One pass in topological order; see the module docstring for the rules and the invariants.
    ``exclude``: forward nodes not analysed (an in-graph loss after the logits, whose backward runs on
    every row: see passes/insert_select.py); they get no layout and are never a reason to refuse.
    """
    if not isinstance(sym, sympy.Symbol):
        raise ValueError(f"the batch size must be a sympy Symbol (the batch dim marked dynamic), got {sym!r}")
    return Walk(graph, sym, frozenset(exclude)).run()


def analyze_rowwise(graph: fx.Graph, sym: sympy.Symbol, seeds: dict[str, Layout]) -> LayoutAnalysis:
    """Layouts of every value of a graph (a backward graph: no forward/backward split) whose inputs'
    layouts are given, ``seeds`` by placeholder name (an input not named is read from its sizes as the
    forward's inputs are).  The same rules and invariants as :func:`analyze`: ``refusal is None`` means
    every value is row-separable along its layout and every output is free or batch-major, so output row
    ``b`` depends on row ``b`` of the batch inputs and on the free ones only (passes/prefix_rows.py)."""
    if not isinstance(sym, sympy.Symbol):
        raise ValueError(f"the batch size must be a sympy Symbol, got {sym!r}")
    return Walk(graph, sym, seeds=dict(seeds)).run()


def analyze_backward(graph: fx.Graph, sym: sympy.Symbol, seeds: dict[str, Layout],
                     carriers: frozenset) -> LayoutAnalysis:
    """:func:`analyze_rowwise` over a backward graph that runs on gathered rows, with sums: a value computed
    from the inputs named in ``carriers`` (the weighted cotangents: zero on every row of weight 0) may be
    summed over its rows (a reduction or a contraction over the batch; an index_put / scatter_add / embedding
    backward placing rows by their data), giving ``sum`` (a parameter gradient); any op of sums and free values
    is a sum.  Refused besides: a sum combined with per-row values or spread back over the rows, a sum of
    values that do not carry the cotangent, rows placed by their position into a tensor without the batch
    (the row index indexing a parameter, a scatter along another dim), random numbers drawn or replayed
    (passes/validate.py)."""
    if not isinstance(sym, sympy.Symbol):
        raise ValueError(f"the batch size must be a sympy Symbol, got {sym!r}")
    return Walk(graph, sym, seeds=dict(seeds), carriers=frozenset(carriers)).run()

"""The placement proof: where the batch lies in each value of a graph (a dataflow analysis).

The user's batch dim 0 is marked dynamic, so in the joint graph every batch-carrying size is an
expression of one symbol ``s``.  ``analyze`` walks the *forward* nodes (those not reachable from a
tangent placeholder) once, in topological order, and gives every tensor value a ``Layout``:

* ``free``: the value does not depend on the batch (parameters, constants, their products);
  its sizes do not involve ``s``.
* ``batch``: exactly one dim ``dim`` holds the batch.  Its size is ``outer * s * inner`` and its
  index is ``(o*s + b)*inner + r`` (``o < outer``, ``r < inner``): row ``b`` of the model's input
  owns every element whose index along ``dim`` decomposes with that ``b``.  ``outer == 1`` is
  batch-major (``x.reshape(N*T, D)``: ``inner = T``); ``outer > 1`` is token-major
  (``x.transpose(0, 1).reshape(T*N, D)``: ``outer = T``; ``nn.MultiheadAttention``'s Linears over
  its ``(T, N, E)`` values).  The two have equal sizes (``s*T == T*s``): only the dataflow tells them
  apart.  Either is gathered along ``dim`` viewed as ``(outer, s, inner)``, at its middle axis.  The
  batch need not be in dim 0 (``(T, N, E)``: ``dim = 1``); moves (transpose, permute) follow it, and
  a reshape keeps it only where the new dim's index still decomposes as above (merging it with the
  heads, ``(T, N*H, d)``: ``inner = H``); one that splits it or interleaves it otherwise is unknown.
* ``unknown``: an op the analysis does not model consumed a batch-carrying value (``why`` names
  the op and its source line).  Every value computed from an unknown one is unknown too.

Invariants:
* Every forward tensor value is row-separable along its layout's batch dim: the elements owned by
  row ``b`` depend on row ``b`` of the inputs (and free values) only.  An op that would break this
  (row mixing: roll/sort/cumsum/flip/gather/index/scatter/select/partial slices along the batch,
  reductions over it, matmuls contracting it or pairing rows as in an (N, N) Gram, attention over
  it, combining two batch values of different layouts, BatchNorm in train mode) is refused when it
  is met: ``refusal`` names it (the message starts with "cross-example op in the forward").
* ``cat`` along the batch dim of batch values with one ``inner`` is not mixing: it stacks them as
  slabs, a token-major value with the outers summed (``torch.stack(xs, 0)`` decomposes into exactly
  that plus a view, which the reshape rule turns back into batch-major).  Slicing or splitting whole
  slabs back out is allowed too; any other slice of the batch dim is mixing.
* Unknown values are not refused where they appear, only where they matter: an unknown value that
  is a forward output or is consumed by a backward node (saved for the backward) refuses the graph.
  So does a token-major forward output (its tangent is gathered from its sizes, batch-major).
* ``refusal is None`` means: the forward is row-separable, every value the backward reads is free or
  has a batch layout, and every value the model returns is free or batch-major.  Then ``layouts``
  tells, for each saved activation, which dim to gather and its ``outer`` and ``inner`` factors.
* Values whose rows are identical or i.i.d. random (``full``/``zeros``/``rand`` of a batch shape,
  ``expand`` of a free value) fit any layout: they take batch-major when created and never
  conflict with the other operand of a pointwise op or a cat.
* ``arange(N)`` (start 0, step 1) is a *row index*: row ``b`` holds the value ``b``.  Copies of it that
  stay batch-major with inner 1 (views, slices, casts) are row indices too, and indexing a batch value
  along its batch dim with a row index (other indices free: HF's ``mask[arange(N)[:, None], kv]``)
  reads row ``b`` from row ``b``: not mixing.  So does pairing it with batch-major indices of inner 1 in
  the same broadcast dim (``x[arange(N), j]``, ``j`` one position per row: a decoder classifier's last
  token), as long as those are not computed from the row index.  Any arithmetic on it (a roll's
  ``(i + k) % N``) is not.  A row index read by the backward is refused: gathered at the kept rows it
  would hold their old numbers (passes/row_index.py gives the backward its own ``arange`` first).
  A value computed from a row index by anything but indexing (``h * arange(N)[:, None]``) that reaches an
  output or the backward is refused: the backward may recompute ``arange`` at the kept rows' count.
* Refusals met during the walk come first (the first in topological order); the checks of forward
  outputs and backward consumers come after them.  The walk itself never stops early.
* ``LayoutAnalysis.node`` is the node the refusal is about (the mixing op; for an unknown or token-major
  value, the op that lost or moved the batch, recorded in ``Layout.origin``, else the value itself), so
  a refusal names its op and source line without parsing its text.

Sizes are compared structurally (sympy monomials such as ``5*s``): no ``simplify``, and no guard is
ever added to the shape env (no ``bool()`` of a SymInt).

Keys of ``LayoutAnalysis.layouts``: forward node names for tensor values; for a node whose value is
a tuple/list (``var_mean``, ``sort``, ``split``, sdpa, ``native_dropout``, ...) one key
``f"{name}.{i}"`` per tensor element (and each ``getitem`` node has its own key as well).  SymInt /
SymFloat / None values have no key.

The known ops are data (sets of qualified op names such as ``"aten::mm"``): ``MOVE_OPS``, ``RESHAPE_OPS``,
``REDUCE_OPS``, ``ALONG_OPS``, ``SLICE_OPS``, ``MATMUL_OPS``, ``ATTENTION_OPS``, ``PER_SAMPLE_OPS``,
``FACTORY_OPS``, the backward's ``*_BACKWARD_OPS``, ... below; each table is registered to its rule with
``@rule(...)`` (one rule per op; ``op_table_markdown()`` prints the registry for docs/design.md), and
``torch.Tag.pointwise`` marks the pointwise ops.  Anything else is ``unknown`` when a batch value flows in
(and so is a node a rule fails on: the analysis never raises on a graph).

The lattice value is the ``Layout``: where the batch lies (``free`` / ``batch`` dim, outer, inner / ``sum``
over the rows, backward only / ``unknown``) and three facts about the rows' values: ``fits`` (constant or
i.i.d. rows: a factory, or moves, pointwise ops and cats of such values), ``index`` (a row index) and
``from_index`` (computed from one by arithmetic).  A rule is a function of its node and its inputs'
layouts; the walk keeps the layouts and derives the row-index facts for every rule alike (``Walk.facts``).

The package, bottom first (each module imports only those before it): ``lattice.py`` (``Layout``,
``LayoutAnalysis``, the pure functions on layouts), ``tables.py`` (the op tables), ``registry.py`` (``@rule``,
``rule_of``), ``walk.py`` (the walk and what a rule sees), the rules by op family (``ops_pointwise.py``,
``ops_reductions.py``, ``ops_shape.py``, ``ops_indexing.py``, ``ops_matmul.py``, ``ops_per_sample.py``,
``ops_backward.py``), and ``prove.py`` (the entry points).
"""
from __future__ import annotations

from .lattice import FREE, SUM, Layout, LayoutAnalysis, reshape_layout, spec_layout
from .prove import analyze, analyze_backward, analyze_rowwise
from .registry import op_table_markdown
from .walk import backward_nodes

__all__ = ["FREE", "SUM", "Layout", "LayoutAnalysis", "analyze", "analyze_backward", "analyze_rowwise",
           "backward_nodes", "op_table_markdown", "reshape_layout", "spec_layout"]

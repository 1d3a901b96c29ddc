"""Where the batch lies in each forward value of an AOT joint graph (a dataflow analysis).

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
layouts; the walk keeps the layouts and derives the row-index facts for every rule alike (``_Walk.facts``).
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Union

import sympy
import torch
from torch import fx

from .records import RefusalKind
from .symbolic import (ONE, ZERO, exact_quotient, expr_of, product, same_size, shape_exprs, symbol_dims,
                       tangent_nodes, uses_symbol)

__all__ = ["Layout", "LayoutAnalysis", "analyze", "analyze_backward", "analyze_rowwise", "backward_nodes",
           "reshape_layout", "spec_layout"]

aten = torch.ops.aten
prims = torch.ops.prims


@dataclass(frozen=True)
class Layout:
    """Where the batch lies in one tensor value."""

    kind: str  # "free" (no batch dependence), "batch", "sum" (a sum over the rows run), or "unknown"
    dim: int = 0  # batch: the dim that holds the batch index
    outer: sympy.Expr = ONE  # batch: that dim's size is outer * s * inner, index = (o*s + b)*inner + r
    inner: sympy.Expr = ONE
    why: str = field(default="", compare=False)  # unknown: the op and source line that lost track
    #                                                (token-major batch: the op that made it so)
    origin: Optional[fx.Node] = field(default=None, compare=False, repr=False)  # the node ``why`` names
    #                                               (during the walk only: LayoutAnalysis.layouts have none)
    # facts about the rows' values, not their place (equal layouts may differ in them):
    fits: bool = field(default=False, compare=False)  # rows constant or i.i.d. random: fit any layout
    index: bool = field(default=False, compare=False)  # a row index: row b holds the value b (arange(N))
    from_index: Optional[fx.Node] = field(default=None, compare=False, repr=False)  # computed from a row index
    #                                               by arithmetic: the op that used it (during the walk only)

    @property
    def gatherable(self) -> bool:
        """Rows can be selected by an ``index_select`` on ``dim`` (viewed as ``(outer, N, inner)``)."""
        return self.kind in ("free", "batch")

    @property
    def batch_major(self) -> bool:
        """Free, or the batch with no outer factor: what a tangent (gathered from its sizes) must be."""
        return self.kind == "free" or (self.kind == "batch" and self.outer == 1)

    def __str__(self) -> str:
        if self.kind == "sum":
            return "sum over rows"
        if self.kind == "batch":
            return f"batch(dim={self.dim}, outer={self.outer}, inner={self.inner})"
        return f"unknown({self.why})" if self.kind == "unknown" else "free"


FREE = Layout("free")


def spec_layout(spec: Any) -> Layout:
    """The layout a backward input's gather (or an output's scatter) assumes: the batch in ``spec.dim``,
    ``spec.outer`` slabs (token-major when > 1) of ``spec.factor`` rows per example (symbolic.Spec)."""
    return Layout("batch", spec.dim, sympy.Integer(spec.outer), sympy.Integer(spec.factor))


SUM = Layout("sum")  # backward only: a sum over the rows run of per-row values that carry the cotangent


@dataclass
class LayoutAnalysis:
    """The result of ``analyze``: per-value layouts and the first reason to refuse, if any."""

    layouts: dict[str, Layout]  # see the module docstring for the keys
    refusal: Optional[str]  # None if the forward is row-separable and its saved values gatherable
    kind: Optional[RefusalKind] = None  # the refusal's kind (CROSS_EXAMPLE: row mixing)
    node: Optional[fx.Node] = None  # where it refused: the mixing op, the op that lost the layout, the
    #                                 value that matters (its op and source line locate the refusal)


# --------------------------------------------------------------------------------------------
# op tables (data): qualified op names ("aten::mm"), not packet objects, so that ops registered after this
# module is imported (Inductor's prims._low_memory_max_pool_*) are known too, and names this torch build
# lacks are harmless.

def _packets(ns, names: str) -> frozenset:
    return frozenset(f"{ns.name}::{nm}" for nm in names.split())


# one tensor input; the batch dim survives intact (possibly moved): found again as the output's s-dim
MOVE_OPS = _packets(aten, """permute transpose t unsqueeze squeeze expand expand_as movedim alias clone
    contiguous detach lift_fresh lift_fresh_copy _to_copy to type_as repeat permute_copy transpose_copy
    t_copy unsqueeze_copy squeeze_copy alias_copy detach_copy expand_copy fill zero zeros_like ones_like
    full_like empty_like rand_like randn_like randint_like bernoulli native_dropout dropout
    feature_dropout alpha_dropout _conj resolve_conj resolve_neg positive""") | _packets(
    prims, "squeeze transpose view_of clone")
# reshapes: the batch dim's position in the flattened tensor decides the new layout
RESHAPE_OPS = _packets(aten, "view reshape _unsafe_view _reshape_alias view_copy flatten unflatten") | _packets(
    prims, "reshape collapse_view collapse split_dim")
# reductions: (dim arg index); a missing/None/[] dim means all dims
REDUCE_OPS = {p: i for names, i in (
    ("sum mean amax amin var std var_mean std_mean logsumexp any all prod max min argmax argmin nansum "
     "count_nonzero median nanmedian aminmax", 1), ("linalg_vector_norm norm", 2)) for p in _packets(aten, names)}
REDUCE_OPS.update({p: 1 for p in _packets(prims, "sum amax amin prod var xor_sum")})
# ops along one dim (shape kept or resized there): (dim arg index, default dim or None = all dims)
ALONG_OPS = {p: spec for names, spec in (
    ("softmax _softmax log_softmax _log_softmax cumsum cumprod logcumsumexp cummax cummin flip", (1, None)),
    ("sort argsort mode glu", (1, -1)), ("topk kthvalue", (2, -1)), ("roll", (2, None)), ("msort", (None, 0)),
) for p in _packets(aten, names)}
ALONG_OPS.update({p: (1, None) for p in _packets(prims, "rev")})
# slicing-like ops: along the batch they are row mixing unless they are no-ops: (dim arg index, default)
SLICE_OPS = {p: spec for names, spec in (
    ("slice slice_copy", (1, 0)), ("select select_copy narrow narrow_copy", (1, None)),
    ("split split_with_sizes unsafe_split unsafe_split_with_sizes chunk tensor_split split_copy "
     "split_with_sizes_copy", (2, 0)), ("unbind unbind_copy", (1, 0)),
) for p in _packets(aten, names)}
INDEX_SELECT_OPS = _packets(aten, "index_select")
CAT_OPS = _packets(aten, "cat concat concatenate") | _packets(prims, "cat")
STACK_OPS = _packets(aten, "stack")
INDEX_OPS = _packets(aten, "index _unsafe_index")
MASKED_INDEX_OPS = _packets(aten, "_unsafe_masked_index")
INDEX_PUT_OPS = _packets(aten, "index_put index_put_ _unsafe_index_put _index_put_impl")
MASKED_INDEX_PUT_OPS = _packets(aten, "_unsafe_masked_index_put_accumulate")
GATHER_OPS = _packets(aten, "gather take_along_dim")
SCATTER_OPS = _packets(aten, "scatter scatter_add scatter_reduce")
INDEX_UPDATE_OPS = _packets(aten, "index_add index_copy index_fill index_reduce")
SCATTER_SLICE_OPS = {p: spec for names, spec in (
    ("slice_scatter", (2, 0)), ("select_scatter", (2, None))) for p in _packets(aten, names)}
EMBEDDING_OPS = _packets(aten, "embedding")
MATMUL_OPS = _packets(aten, "mm bmm matmul mv dot vdot _int_mm")
ADD_MATMUL_OPS = _packets(aten, "addmm baddbmm addmv _addmm_activation")
# per-sample ops: every batch input has the batch in dim 0 with one layout; so do the outputs
PER_SAMPLE_OPS = _packets(aten, """convolution _convolution conv1d conv2d conv3d conv_transpose1d
    conv_transpose2d conv_transpose3d cudnn_convolution cudnn_convolution_transpose mkldnn_convolution
    convolution_overrideable max_pool1d max_pool2d max_pool3d max_pool1d_with_indices max_pool2d_with_indices
    max_pool3d_with_indices
    avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d
    _adaptive_avg_pool2d _adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d adaptive_max_pool3d
    upsample_nearest1d upsample_nearest2d upsample_nearest3d _upsample_nearest_exact1d _upsample_nearest_exact2d
    _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d upsample_bicubic2d upsample_trilinear3d
    _upsample_bilinear2d_aa _upsample_bicubic2d_aa native_group_norm group_norm grid_sampler grid_sampler_2d
    grid_sampler_3d im2col col2im reflection_pad1d reflection_pad2d reflection_pad3d replication_pad1d
    replication_pad2d replication_pad3d""") | _packets(prims, "_low_memory_max_pool_with_offsets _low_memory_max_pool_offsets_to_indices")
# attention(q, k, v, ...): q (..., L, E), k (..., S, E), v (..., S, Ev); tuple outputs (out, logsumexp, ...)
ATTENTION_OPS = _packets(aten, """_scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_flash_attention
    _scaled_dot_product_efficient_attention _scaled_dot_product_cudnn_attention scaled_dot_product_attention
    _scaled_dot_product_attention_math _scaled_dot_product_fused_attention_overrideable""")
LAYER_NORM_OPS = _packets(aten, "native_layer_norm layer_norm rms_norm _fused_rms_norm")
BATCH_NORM_OPS = _packets(aten, """native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_functional
    _native_batch_norm_legit_no_training batch_norm cudnn_batch_norm miopen_batch_norm _batch_norm_with_update
    _batch_norm_with_update_functional _batch_norm_no_update""")
# factories: rows are constant or i.i.d. random, so a batch-sized one fits any layout
NEW_OPS = _packets(aten, "new_zeros new_ones new_full new_empty new_empty_strided")
FACTORY_OPS = NEW_OPS | _packets(aten, """full zeros ones empty empty_strided empty_permuted rand randn randint
    normal scalar_tensor""") | _packets(prims, "full empty_strided empty_permuted scalar_tensor normal uniform")
PAD_OPS = _packets(aten, "constant_pad_nd")
# ---- backward-only ops (passes/validate.py walks the backward that runs)
# reductions that add the rows up (a parameter gradient); the others over the batch are mixing there too
SUM_OPS = _packets(aten, "sum nansum") | _packets(prims, "sum")
# per-sample backwards: input gradients keep the batch in dim 0, weight gradients sum over the rows
PER_SAMPLE_BACKWARD_OPS = _packets(aten, """convolution_backward convolution_backward_overrideable
    max_pool2d_with_indices_backward max_pool3d_with_indices_backward avg_pool2d_backward avg_pool3d_backward
    _adaptive_avg_pool2d_backward _adaptive_avg_pool3d_backward adaptive_max_pool2d_backward
    adaptive_max_pool3d_backward upsample_nearest1d_backward upsample_nearest2d_backward upsample_nearest3d_backward
    _upsample_nearest_exact1d_backward _upsample_nearest_exact2d_backward _upsample_nearest_exact3d_backward
    upsample_linear1d_backward upsample_bilinear2d_backward upsample_bicubic2d_backward upsample_trilinear3d_backward
    reflection_pad1d_backward reflection_pad2d_backward reflection_pad3d_backward replication_pad1d_backward
    replication_pad2d_backward replication_pad3d_backward grid_sampler_2d_backward grid_sampler_3d_backward
    native_group_norm_backward native_batch_norm_backward""")
LAYER_NORM_BACKWARD_OPS = _packets(aten, "native_layer_norm_backward _fused_rms_norm_backward")
SOFTMAX_BACKWARD_OPS = _packets(aten, "_softmax_backward_data _log_softmax_backward_data")
# attention backwards: (grad_out, q, k, v, ...) -> (dq, dk, dv, ...); the fused kernels with dropout regenerate
# their mask from a seed and offset (the batch rows 0..k-1's masks at k gathered rows)
ATTENTION_BACKWARD_OPS = _packets(aten, """_scaled_dot_product_flash_attention_for_cpu_backward
    _scaled_dot_product_flash_attention_backward _scaled_dot_product_efficient_attention_backward
    _scaled_dot_product_cudnn_attention_backward _scaled_dot_product_fused_attention_overrideable_backward
    _flash_attention_backward _efficient_attention_backward""")
EMBEDDING_BACKWARD_OPS = _packets(aten, "embedding_dense_backward embedding_backward")
# activation backwards torch does not tag pointwise
ACTIVATION_BACKWARD_OPS = _packets(aten, """hardtanh_backward leaky_relu_backward elu_backward softplus_backward
    mish_backward hardswish_backward hardsigmoid_backward log_sigmoid_backward softshrink_backward
    hardshrink_backward rrelu_with_noise_backward""")
# random numbers drawn from a seed the graph holds (Inductor's RNG, functionalised RNG, checkpoint's replay)
RNG_OPS = _packets(prims, "inductor_random inductor_seeds inductor_lookup_seed inductor_randint philox_rand")
RNG_HOPS = frozenset({"run_with_rng_state", "run_and_save_rng_state", "graphsafe_run_with_rng_state"})
# ``arange(N)``: row b holds the value b (a row index, as HF's masks build with ``torch.arange(batch_size)``)
ARANGE_OPS = _packets(aten, "arange") | _packets(prims, "iota")
# ops whose output elements are copies of input elements (views, slices, copies, casts): a row index stays
# one through them where the walk keeps its layout batch-major with inner 1 (element at row b from row b)
VALUE_KEEPING_OPS = _packets(aten, """slice slice_copy select narrow permute transpose t unsqueeze squeeze expand expand_as movedim alias clone
    contiguous detach lift_fresh lift_fresh_copy _to_copy to type_as view reshape _unsafe_view _reshape_alias
    view_copy flatten permute_copy transpose_copy t_copy unsqueeze_copy squeeze_copy alias_copy detach_copy
    expand_copy""") | _packets(prims, "squeeze transpose view_of clone reshape convert_element_type")
AS_STRIDED_OPS = _packets(aten, "as_strided") | _packets(prims, "as_strided")  # a reshape when contiguous
# functional copies of a tensor into another's shape: pointwise in effect
POINTWISE_EXTRA = _packets(aten, "copy copy_ fill_ masked_fill where _masked_scale lerp clamp") | _packets(
    prims, "where copy_to")


# --------------------------------------------------------------------------------------------
# small helpers


class _Refuse(Exception):
    """A refusal met at ``node`` (message = the refusal): row mixing, or a layout rows can't be gathered by."""

    def __init__(self, message: str, kind: RefusalKind, node: fx.Node):
        super().__init__(message)
        self.kind, self.node = kind, node


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes reachable from a tangent placeholder (the output node included); the rest is forward."""
    return _downstream(tangent_nodes(graph))


def _downstream(start: list) -> set[fx.Node]:
    """``start`` and every node that uses them, transitively."""
    seen: set[fx.Node] = set()
    stack = list(start)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.users)
    return seen


def _where(n: fx.Node) -> str:
    """`` (in <module path> (<class>), at: <source line>)``: the innermost module and the user's line (a
    library module such as BatchNorm has no line of the user's own inside it)."""
    code = [ln.strip() for ln in n.meta.get("stack_trace", "").splitlines()
            if ln.strip() and set(ln.strip()) - set("^~")]
    stack = list((n.meta.get("nn_module_stack") or {}).values())
    parts = []
    if stack:
        path, cls = stack[-1]
        path = re.sub(r"^L\['[^']*'\]\.?", "", str(path)) or "the model"
        parts.append(f"in {path} ({getattr(cls, '__name__', str(cls).rsplit('.', 1)[-1])})")
    if code:
        parts.append(f"at: {code[-1]}")
    return f" ({', '.join(parts)})" if parts else ""


def _op(n: fx.Node) -> str:
    return f"{n.name} ({n.target})"


def _packet(n: fx.Node) -> Optional[str]:
    """The qualified name of the node's op ("aten::mm"), the key of the op tables."""
    packet = getattr(n.target, "overloadpacket", None)
    return getattr(packet, "_qualified_op_name", None)


def _norm_dims(v: Any, ndim: int) -> Optional[list]:
    """A dim argument as a list of non-negative dims; None means all dims."""
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return None
    vs = v if isinstance(v, (list, tuple)) else [v]
    return [int(d) % max(ndim, 1) for d in vs]


def _arg(n: fx.Node, idx: Optional[int], names=("dim", "dims"), default: Any = None) -> Any:
    if idx is not None and len(n.args) > idx:
        return n.args[idx]
    for nm in names:
        if nm in n.kwargs:
            return n.kwargs[nm]
    return default


# --------------------------------------------------------------------------------------------
# the analysis state and the transfer rules


Result = Union[Layout, list]  # a Layout, or one Optional[Layout] per tuple element


class _Walk:
    def __init__(self, graph: fx.Graph, sym: sympy.Symbol, exclude: frozenset = frozenset(),
                 seeds: Optional[dict] = None, carriers: Optional[frozenset] = None):
        self.graph, self.sym = graph, sym
        self.seeds = seeds  # analyze_rowwise: the inputs' layouts, by name; every node is walked
        # analyze_backward: the values computed from the cotangents (zero on rows of weight 0), which may be
        # summed over the rows (SUM); None: no sums allowed (the forward, the loss prefix)
        self.sums = carriers is not None
        self.carry = _downstream([p for p in graph.find_nodes(op="placeholder") if p.name in carriers]) \
            if carriers is not None else set()
        self.part = "backward" if self.sums else "forward"
        self.bwd = backward_nodes(graph) if seeds is None else set()
        self.exclude = exclude
        self.lay: dict[fx.Node, Result] = {}
        self.refusals: list[tuple[RefusalKind, str, fx.Node]] = []

    # ---- value helpers
    def of(self, a: Any) -> Optional[Layout]:
        """Layout of an argument (None: not a tensor value)."""
        if isinstance(a, fx.Node):
            r = self.lay.get(a)
            return r if isinstance(r, Layout) else None
        return None

    def unknown(self, n: fx.Node, what: str = "") -> Layout:
        return Layout("unknown", why=f"{_op(n)}{' ' + what if what else ''}{_where(n)}", origin=n)

    def track(self, lay: Layout, out: torch.Tensor, fits: bool = False) -> Optional[Layout]:
        """``lay``'s batch dim, found again intact as the output's one s-dim (None if it isn't).  The value
        facts are the rule's to give (``fits``) or the walk's (row indices): not inherited."""
        shape = shape_exprs(out)
        ks = symbol_dims(shape, self.sym)
        if len(ks) != 1 or not same_size(shape[ks[0]], lay.outer * self.sym * lay.inner):
            return None
        return replace(lay, kind="batch", dim=ks[0], fits=fits, index=False, from_index=None)

    def fits(self, a: Any) -> bool:
        lay = self.of(a)
        return lay is not None and lay.fits

    def is_index(self, a: Any) -> bool:
        lay = self.of(a)
        return lay is not None and lay.index

    def from_index(self, a: Any) -> Optional[fx.Node]:
        """The op that computed ``a`` from a row index (``a`` itself for a row index), else None."""
        lay = self.of(a)
        return None if lay is None else lay.from_index if lay.from_index is not None else a if lay.index else None

    def from_shape(self, out: torch.Tensor) -> Optional[Layout]:
        """Batch-major layout of a value whose rows fit any layout (constant, random, expanded)."""
        shape = shape_exprs(out)
        ks = symbol_dims(shape, self.sym)
        if not ks:
            return FREE
        inner = exact_quotient(shape[ks[0]], self.sym, self.sym) if len(ks) == 1 else None
        return Layout("batch", ks[0], ONE, inner) if inner is not None else None

    def per_output(self, n: fx.Node, fn: Callable[[torch.Tensor], Optional[Layout]], what: str = "") -> Result:
        """Apply ``fn`` to each tensor of the node's value (None from fn -> unknown)."""
        val = n.meta.get("val")
        def one(v):
            if not isinstance(v, torch.Tensor):
                return None
            r = fn(v)
            return r if r is not None else self.unknown(n, what)
        if isinstance(val, (list, tuple)):
            return [one(v) for v in val]
        return one(val)

    def tensor_inputs(self, n: fx.Node) -> list:
        """(node, layout) of every tensor input (lists flattened)."""
        out = []
        for a in n.all_input_nodes:
            lay = self.of(a)
            if lay is not None:
                out.append((a, lay))
        return out

    def mixing(self, n: fx.Node, what: str) -> _Refuse:
        return _Refuse(f"cross-example op in the {self.part}: {_op(n)} {what}{_where(n)}", RefusalKind.CROSS_EXAMPLE, n)

    def summed(self, n: fx.Node, summands: list, what: str) -> Result:
        """The rows of ``summands`` added up (backward only, and only values carrying the cotangent: their
        rows of weight 0 add zero, so the rows run give the dense-masked sum); row mixing otherwise."""
        if not self.sums or not any(a in self.carry for a in summands):
            raise self.mixing(n, what)
        return self.per_output(n, lambda v: SUM if not symbol_dims(shape_exprs(v), self.sym) else None,
                               "(a sum over the rows that keeps a batch-sized dim)")

    def backward_value(self, n: fx.Node) -> Optional[Result]:
        """What every backward node is checked for first: randomness, and sums over the rows (any op of sums
        and free values is itself a sum: the sum is the same over the rows run as over all rows)."""
        if _random(n):
            drop = f" (attention dropout_p={_dropout_p(n)}, regenerated from a seed)" if _packet(n) in \
                ATTENTION_OPS | ATTENTION_BACKWARD_OPS else ""
            raise _Refuse(f"draws or replays random numbers in the backward: {_op(n)}{drop}{_where(n)}: at the "
                          "gathered rows it would draw other numbers than the dense backward (rows 0..k-1's)",
                          RefusalKind.RANDOM_BACKWARD, n)
        ins = self.tensor_inputs(n)
        if not any(l.kind == "sum" for _, l in ins):
            return None
        if any(l.kind == "batch" for _, l in ins):
            raise self.mixing(n, "combines a sum over the rows with per-row values")
        bad = self.first_unknown(ins)
        if bad is not None:
            return self.per_output(n, lambda v: bad)
        return self.per_output(n, lambda v: SUM if not symbol_dims(shape_exprs(v), self.sym) else None,
                               "(spreads a sum over the rows back over the rows)")

    # ---- the walk
    def run(self) -> LayoutAnalysis:
        for n in self.graph.nodes:
            if n.op == "output" or n in self.bwd or n in self.exclude:
                continue
            try:
                r = self.visit(n)
            except _Refuse as e:
                self.refusals.append((e.kind, str(e), e.node))
                r = self.per_output(n, lambda v: None, "(row mixing)")
            except Exception as e:  # an argument form a rule did not expect: conservative
                r = self.per_output(n, lambda v: None, f"(not analysed: {type(e).__name__}: {e})")
            if r is not None:
                self.lay[n] = r
        checks = [(RefusalKind.BATCH_LAYOUT, c, at) for c, at in self.check_uses()] + \
            [(RefusalKind.ROW_INDEX_VALUE, c, at) for c, at in self.check_row_values()]
        layouts: dict[str, Layout] = {}
        for n, r in self.lay.items():
            if isinstance(r, Layout):
                layouts[n.name] = _detached(r)
            else:
                layouts.update({f"{n.name}.{i}": _detached(x) for i, x in enumerate(r) if x is not None})
        kind, refusal, at = (self.refusals + checks)[0] if self.refusals or checks else (None, None, None)
        return LayoutAnalysis(layouts, refusal, kind, at)

    def check_row_values(self) -> list:
        """A row index used as a value (arithmetic, not indexing) that reaches an output or the backward:
        a gathered backward recomputing ``arange`` would number the kept rows 0..k-1, not by their rows.
        (message, node) pairs: the node is the op that used the row index, or the row index read."""
        lays = [(n, r) for n, r in self.lay.items() if isinstance(r, Layout)]
        for n, r in lays:
            origin = r.from_index
            if origin is not None and any(u.op == "output" or u in self.bwd for u in n.users):
                return [(f"the row index arange(N) is used as a value, not to index rows ({_op(origin)}"
                         f"{_where(origin)}): a selected-row backward would recompute it at the kept rows' count",
                         origin)]
        for n, r in lays:  # gathered, it would number the kept rows by their old rows
            if r.index and any(u in self.bwd for u in n.users):
                return [(f"the row index {_op(n)} is read by the backward{_where(n)}: gathered at the kept rows "
                         "it would index rows the backward does not have (the pass recomputes arange(N) itself "
                         "only in the backward of x[arange(N), j])", n)]
        return []

    def check_uses(self) -> list:
        """Unknown values that are forward outputs or are read by the backward; token-major outputs.
        (message, node) pairs: the node is the op that lost the layout (or made it token-major), else the
        value itself (an input whose sizes use the batch symbol oddly has no op to name)."""
        out = []
        for n, r in self.lay.items():
            if not isinstance(r, Layout) or r.batch_major or r.kind == "sum":
                continue
            for u in n.users:
                if u.op == "output":
                    role = f"is an output of the {self.part}"
                elif u in self.bwd and r.kind == "unknown":
                    role = f"is saved for the backward (read by {u.name})"
                else:
                    continue
                if r.kind == "unknown":
                    out.append((f"the batch layout of {n.name} is unknown (lost at {r.why}) and it {role}: "
                                "its rows can't be selected", r.origin or n))
                else:
                    out.append((f"{n.name} holds the batch token-major ({r}: index (o*N + b)*inner + r with "
                                f"o < {r.outer}{', since ' + r.why if r.why else ''}) and it {role}: "
                                f"the selected-row backward takes outputs batch-major only{_where(n)}", r.origin or n))
                break
        return out

    def visit(self, n: fx.Node) -> Optional[Result]:
        val = n.meta.get("val")
        if n.op == "placeholder":
            return self.seeds[n.name] if self.seeds is not None and n.name in self.seeds else self.placeholder(val)
        if n.op == "get_attr":
            return self.per_output(n, self.from_shape)
        if n.target is operator.getitem:
            src = self.lay.get(n.args[0])
            if isinstance(src, list) and isinstance(n.args[1], int) and n.args[1] < len(src):
                return src[n.args[1]]
            return None if not isinstance(val, torch.Tensor) else self.generic(n)
        is_tensor = isinstance(val, torch.Tensor) or (
            isinstance(val, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in val))
        if not is_tensor:
            if val is None and any(l.kind != "free" for _, l in self.tensor_inputs(n)):
                return self.unknown(n, "(no value recorded)")
            return None  # SymInt / SymFloat / None: not a tensor
        r = self.backward_value(n) if self.seeds is not None else None
        if r is not None:
            return r
        rule = _rule(n)
        r = rule(self, n) if rule is not None else self.generic(n)
        return self.facts(n, rule, r)

    def facts(self, n: fx.Node, rule: Any, r: Result) -> Result:
        """The value facts of ``n``'s layouts, the same for every rule.  ``fits`` only from the rules that
        make rows constant or i.i.d. (factories, moves, pointwise ops and cats of such values).  A row index
        is made by ``arange(N)`` and kept by copies that stay batch-major with inner 1; anything else
        computed from one (but indexing by it) records the op that used it (``from_index``)."""
        used = [a for a in n.all_input_nodes if self.from_index(a) is not None]
        copy = _packet(n) in VALUE_KEEPING_OPS and bool(n.args) and self.is_index(n.args[0])
        origin = next((self.of(a).from_index for a in used if self.of(a).from_index is not None), n) \
            if used and not _indexes_only(n, used) else None

        def one(lay: Optional[Layout]) -> Optional[Layout]:
            if lay is None:
                return None
            index = (rule is _arange and lay.index) or (copy and lay.kind == "batch" and lay.outer == 1
                                                         and lay.inner == 1)
            return replace(lay, fits=lay.fits and rule in _FITTING, index=index,
                           from_index=None if index else origin)
        return one(r) if isinstance(r, Layout) else [one(x) for x in r] if isinstance(r, list) else r

    def placeholder(self, val: Any) -> Optional[Layout]:
        if not isinstance(val, torch.Tensor):
            return None
        shape = shape_exprs(val)
        if shape and shape[0] == self.sym and not any(uses_symbol(e, self.sym) for e in shape[1:]):
            return Layout("batch", 0)
        if any(uses_symbol(e, self.sym) for e in (*shape, *(expr_of(st) for st in val.stride()))):
            return Layout("unknown", why="an input whose sizes or strides use the batch symbol other than as dim 0")
        return FREE

    def generic(self, n: fx.Node) -> Result:
        """An op we don't model: free in, free out; otherwise unknown."""
        ins = self.tensor_inputs(n)
        bad = [l for _, l in ins if l.kind == "unknown"]
        if bad:
            return self.per_output(n, lambda v: bad[0])
        if any(l.kind == "batch" for _, l in ins):
            return self.per_output(n, lambda v: None)
        return self.per_output(n, lambda v: FREE if not symbol_dims(shape_exprs(v), self.sym) else None,
                               "(creates a batch-sized value)")

    def batch_operands(self, n: fx.Node) -> tuple[Optional[Result], list]:
        """(what ``n`` is at once, or None; its batch operands): an unknown input makes it unknown, no batch
        input makes it the generic op's (free in, free out)."""
        ins = self.tensor_inputs(n)
        bad = self.first_unknown(ins)
        if bad is not None:
            return self.per_output(n, lambda v: bad), []
        batch = [(a, l) for a, l in ins if l.kind == "batch"]
        return (None if batch else self.generic(n)), batch

    def first_unknown(self, ins) -> Optional[Layout]:
        return next((l for _, l in ins if l.kind == "unknown"), None)

    def uses_batch_size(self, n: fx.Node, args) -> bool:
        """A SymInt/SymFloat of the batch symbol used as a value (``x / x.shape[0]``)."""
        for a in args:
            if isinstance(a, fx.Node):
                v = a.meta.get("val")
                if isinstance(v, (torch.SymInt, torch.SymFloat)) and self.sym in v.node.expr.free_symbols:
                    return True
            elif isinstance(a, (torch.SymInt, torch.SymFloat)) and self.sym in a.node.expr.free_symbols:
                return True
        return False

    def agree(self, n: fx.Node, items: list, what: str) -> Optional[Layout]:
        """The one layout of several batch operands (aligned already); row mixing if they differ."""
        strict = [(a, l) for a, l in items if not l.fits] or items[:1]
        first = strict[0][1] if strict else None
        for a, l in strict[1:]:
            if l != first:
                raise self.mixing(n, f"{what} batch values of different layouts "
                                     f"({strict[0][0].name}: {first}, {a.name}: {l})")
        if first is not None:
            for a, l in items:  # any-layout operands must at least sit in the same dim with the same size
                if l.fits and (
                        l.dim != first.dim or not same_size(l.outer * l.inner, first.outer * first.inner)):
                    raise self.mixing(n, f"{what} batch values in different dims ({a.name}: {l}, {first})")
        return first


def _indexes_only(n: fx.Node, used: list) -> bool:
    """``used`` (row indices) appear only in ``n``'s list of indices (x[arange(N), j], its index_put): reading
    rows by the index is not arithmetic on it; the index rules decide whether it is row-wise."""
    p = _packet(n)
    at = 1 if p in INDEX_OPS | INDEX_PUT_OPS else 2 if p in MASKED_INDEX_OPS | MASKED_INDEX_PUT_OPS else None
    if at is None or len(n.args) <= at:
        return False
    indices = n.args[at]
    return all(any(u is t for t in indices) for u in used) and not any(
        a in used for i, a in enumerate(n.args) if i != at)


def _detached(lay: Layout) -> Layout:
    """``lay`` without its origin node: the layouts outlive the joint graph (graph records keep them for
    the backward pass), and a node would keep that whole graph alive."""
    return lay if lay.origin is None and lay.from_index is None else replace(lay, origin=None, from_index=None)


def _aligned(lay: Layout, ndim_in: int, ndim_out: int) -> Layout:
    return replace(lay, kind="batch", dim=lay.dim + ndim_out - ndim_in)


def _ndim(a: fx.Node) -> int:
    v = a.meta.get("val")
    return v.dim() if isinstance(v, torch.Tensor) else 0


# ---- rules: (walk, node) -> Result; raise _Refuse for row mixing

_RULES: dict[str, Callable] = {}  # qualified op name -> its rule


def rule(*tables: Any) -> Callable:
    """Register the decorated function as the rule of every op in ``tables`` (sets or dicts of qualified op
    names).  One rule per op: a second registration of an op is a bug in the tables."""
    def register(fn: Callable) -> Callable:
        for table in tables:
            for p in table:
                if _RULES.setdefault(p, fn) is not fn:
                    raise AssertionError(f"{p} has two layout rules: {_RULES[p].__name__} and {fn.__name__}")
        return fn
    return register



@rule(MOVE_OPS)
def _move(w: _Walk, n: fx.Node) -> Result:
    x = w.of(n.args[0]) if n.args else None
    if x is None:
        return w.generic(n) if w.tensor_inputs(n) else _factory(w, n)
    if x.kind == "unknown":
        return w.per_output(n, lambda v: x)
    if any(l.kind != "free" for a, l in w.tensor_inputs(n) if a is not n.args[0]):
        return w.generic(n)
    if x.kind == "free":  # expand of a free value to the batch size: rows are copies
        return _factory(w, n)
    return w.per_output(n, lambda v: w.track(x, v, fits=x.fits), "(moved or resized the batch dim)")


def reshape_layout(lay: Layout, in_shape: list, out_shape: list, sym: sympy.Symbol) -> Optional[Layout]:
    """The batch layout after reshaping a value of ``in_shape`` (batch layout ``lay``) to ``out_shape``
    (sizes as sympy expressions); None if the batch index is no longer one dim's (o*s + b)*inner + r.

    Flattened, the input's index is (O*s + b)*I + r with O = prod(in dims left) * outer and
    I = inner * prod(in dims right).  The output's one s-dim k keeps b iff L = prod(out dims left)
    divides O and R = prod(out dims right) divides I: then dim k is (O/L) * s * (I/R).
    """
    if any(e == 0 for e in in_shape) or any(e == 0 for e in out_shape):
        return None
    ks = symbol_dims(out_shape, sym)
    if len(ks) != 1:
        return None
    k = ks[0]
    o_tot = product(in_shape[:lay.dim]) * lay.outer
    i_tot = lay.inner * product(in_shape[lay.dim + 1:])
    outer = exact_quotient(o_tot, product(out_shape[:k]), sym)
    inner = exact_quotient(i_tot, product(out_shape[k + 1:]), sym)
    if outer is None or inner is None or not same_size(out_shape[k], outer * sym * inner):
        return None
    return replace(lay, kind="batch", dim=k, outer=outer, inner=inner)


@rule(RESHAPE_OPS)
def _reshape(w: _Walk, n: fx.Node) -> Result:
    x = w.of(n.args[0])
    if x is None or x.kind != "batch":
        return _move(w, n) if x is not None and x.kind == "free" else w.generic(n)
    in_shape = shape_exprs(n.args[0].meta["val"])
    def one(v):
        r = reshape_layout(x, in_shape, shape_exprs(v), w.sym)
        if r is not None and r.outer != 1 and not x.why:  # remember where it became token-major
            r = replace(r, why=f"{_op(n)} merged dims left of the batch{_where(n)}", origin=n)
        return r if r is None or r.outer != 1 else Layout("batch", r.dim, r.outer, r.inner)
    return w.per_output(n, one, "(split the batch dim)")


@rule(AS_STRIDED_OPS)
def _as_strided(w: _Walk, n: fx.Node) -> Result:
    """as_strided of a contiguous tensor with contiguous strides and no offset is a reshape."""
    x = w.of(n.args[0])
    if x is None or x.kind != "batch":
        return w.generic(n)
    src, out = n.args[0].meta["val"], n.meta["val"]
    offset = n.args[3] if len(n.args) > 3 else n.kwargs.get("storage_offset")
    if (_contiguous(shape_exprs(src), [expr_of(st) for st in src.stride()])
            and _contiguous(shape_exprs(out), [expr_of(st) for st in out.stride()])
            and (offset is None or offset == 0) and expr_of(src.storage_offset()) == 0):
        return _reshape(w, n)
    return w.generic(n)


def _contiguous(shape: list, strides: list) -> bool:
    expect = ONE
    for size, st in zip(reversed(shape), reversed(strides)):
        if size != 1 and not same_size(st, expect):
            return False
        expect = expect * size
    return True


@rule(POINTWISE_EXTRA, ACTIVATION_BACKWARD_OPS)
def _pointwise(w: _Walk, n: fx.Node) -> Result:
    ins = w.tensor_inputs(n)
    bad = w.first_unknown(ins)
    if bad is not None:
        return w.per_output(n, lambda v: bad)
    if w.uses_batch_size(n, list(n.args) + list(n.kwargs.values())):
        return w.per_output(n, lambda v: None, "(uses the batch size as a value)")
    batch = [(a, l) for a, l in ins if l.kind == "batch"]
    if not batch:
        return w.generic(n)
    val = n.meta["val"]
    nd = (val if isinstance(val, torch.Tensor) else val[0]).dim()
    aligned = [(a, _aligned(l, _ndim(a), nd)) for a, l in batch]
    lay = w.agree(n, aligned, "combines")
    fits = all(l.fits for _, l in batch)
    return w.per_output(n, lambda v: w.track(lay, v, fits=fits))


def _dim_op(w: _Walk, n: fx.Node, dims, what: str) -> Result:
    """An op along ``dims`` of its first input (None = all dims): row mixing if the batch dim is one."""
    x = w.of(n.args[0])
    if x is None or x.kind == "free":
        return w.generic(n)
    if x.kind == "unknown":
        return w.per_output(n, lambda v: x)
    dl = _norm_dims(dims, _ndim(n.args[0]))
    if dl is None or x.dim in dl:
        if _packet(n) in SUM_OPS:
            return w.summed(n, [n.args[0]], what)
        raise w.mixing(n, what)
    if any(l.kind != "free" for a, l in w.tensor_inputs(n) if a is not n.args[0]):
        return w.generic(n)
    return w.per_output(n, lambda v: w.track(x, v))


@rule(REDUCE_OPS)
def _reduce(w: _Walk, n: fx.Node) -> Result:
    if torch.Tag.pointwise in getattr(n.target, "tags", ()):
        return _pointwise(w, n)  # max.other, min.other
    if len(n.args) > 1 and isinstance(n.args[1], fx.Node):
        return w.generic(n)
    return _dim_op(w, n, _arg(n, REDUCE_OPS[_packet(n)]), "reduces over the batch dim, e.g. BatchNorm in train mode "
                   "(per-example instead: LayerNorm, GroupNorm, or the BatchNorm in eval mode)")


@rule(ALONG_OPS)
def _along(w: _Walk, n: fx.Node) -> Result:
    idx, default = ALONG_OPS[_packet(n)]
    return _dim_op(w, n, _arg(n, idx, default=default),
                   "mixes rows along the batch dim (sorts, shifts, flips or accumulates over it)")


def _slab(w: _Walk, x: Layout, start: Any, length: sympy.Expr) -> Optional[Layout]:
    """The part [start, start + length) of ``x``'s batch dim, if it is whole slabs of s*inner."""
    unit = w.sym * x.inner
    start = expr_of(start.meta["val"]) if isinstance(start, fx.Node) else expr_of(start or 0)
    if start != 0 and (start.is_Number and start < 0 or exact_quotient(start, unit, w.sym) is None):
        return None
    outer = exact_quotient(length, unit, w.sym)
    return replace(x, kind="batch", outer=outer) if outer is not None else None


@rule(SLICE_OPS)
def _slice(w: _Walk, n: fx.Node) -> Result:
    """slice/narrow/split/chunk/unbind/select.  Along the batch dim only whole slabs of s*inner are
    kept (a no-op when outer == 1; a piece of a ``cat`` along the batch otherwise)."""
    idx, default = SLICE_OPS[_packet(n)]
    x = w.of(n.args[0])
    dl = _norm_dims(_arg(n, idx, default=default), _ndim(n.args[0]))
    if x is None or x.kind != "batch" or (dl is not None and x.dim not in dl):
        return _dim_op(w, n, dl, "slices the batch dim")
    val, name = n.meta["val"], str(n.target)
    outs = list(val) if isinstance(val, (list, tuple)) else [val]
    if any(not isinstance(v, torch.Tensor) or v.dim() != _ndim(n.args[0]) for v in outs):
        raise w.mixing(n, "selects one row of the batch dim")  # select / unbind: the dim is gone
    if "slice" in name and (n.args[4] if len(n.args) > 4 else n.kwargs.get("step", 1)) != 1:
        raise w.mixing(n, "slices the batch dim with a step")
    if "slice" in name or "narrow" in name:
        starts = [n.args[2] if len(n.args) > 2 else n.kwargs.get("start")]
    else:  # split-like: the pieces are consecutive
        starts, acc = [], ZERO
        for v in outs:
            starts.append(acc)
            acc = acc + expr_of(v.shape[x.dim])
    lays = [_slab(w, x, st, expr_of(v.shape[x.dim])) for st, v in zip(starts, outs)]
    if any(l is None for l in lays):
        raise w.mixing(n, "slices or splits the batch dim")
    return lays if isinstance(val, (list, tuple)) else lays[0]


@rule(PAD_OPS)
def _pad(w: _Walk, n: fx.Node) -> Result:
    """constant_pad_nd(x, pad): pairs of pads from the last dim; padding the batch dim = mixing."""
    x = w.of(n.args[0])
    if x is None or x.kind != "batch":
        return w.generic(n)
    pad, nd = list(n.args[1]), _ndim(n.args[0])
    padded = {nd - 1 - i // 2 for i, p in enumerate(pad) if not (isinstance(p, int) and p == 0)}
    if x.dim in padded:
        raise w.mixing(n, "pads the batch dim")
    return w.per_output(n, lambda v: w.track(x, v))


@rule(INDEX_SELECT_OPS)
def _index_select(w: _Walk, n: fx.Node) -> Result:
    return _dim_op(w, n, _arg(n, 1), "selects rows along the batch dim")


@rule(CAT_OPS, STACK_OPS)
def _cat(w: _Walk, n: fx.Node) -> Result:
    """cat/stack.  Along other dims the batch inputs agree; along the batch dim, inputs of one
    ``inner`` stack up as slabs: the result is token-major with the outers summed."""
    ins = [(a, w.of(a)) for a in n.args[0] if isinstance(a, fx.Node) and w.of(a) is not None]
    bad = w.first_unknown(ins)
    if bad is not None:
        return w.per_output(n, lambda v: bad)
    batch = [(a, l) for a, l in ins if l.kind == "batch"]
    if not batch:
        return w.generic(n)
    nd = n.meta["val"].dim()
    dim = int(_arg(n, 1, default=0)) % max(nd, 1)
    if _packet(n) not in STACK_OPS and any(l.dim == dim for _, l in batch):
        nonempty = [a for a, _ in ins if _ndim(a) != 1 or expr_of(a.meta["val"].shape[0]) != 0]  # legacy 1-D empties
        if len(batch) != len(nonempty) or any(l.dim != dim or l.inner != batch[0][1].inner for _, l in batch):
            raise w.mixing(n, "concatenates along the batch dim values that are not batch slabs alike")
        outer = ZERO
        for _, l in batch:
            outer = outer + l.outer
        first = batch[0][1]
        lay = replace(first, dim=dim, outer=outer) if first.why else replace(
            first, dim=dim, outer=outer, why=f"{_op(n)} along the batch dim{_where(n)}", origin=n)
        return w.per_output(n, lambda v: w.track(lay, v))
    lay = w.agree(n, batch, "concatenates")
    fits = all(l.fits for _, l in batch)
    return w.per_output(n, lambda v: w.track(lay, v, fits=fits))


@rule(INDEX_OPS, EMBEDDING_OPS)
def _index(w: _Walk, n: fx.Node, mask: Optional[fx.Node] = None) -> Result:
    """x[indices] (advanced indexing) and embedding(weight, indices)."""
    if _packet(n) in EMBEDDING_OPS:
        x, indices = n.args[0], [n.args[1]]
    elif mask is not None:
        x, indices = n.args[0], n.args[2]
    else:
        x, indices = n.args[0], n.args[1]
    xl = w.of(x)
    il = [(i, w.of(t)) for i, t in enumerate(indices) if isinstance(t, fx.Node) and w.of(t) is not None]
    if xl is not None and xl.kind == "batch" and _packet(n) not in EMBEDDING_OPS and any(i == xl.dim for i, _ in il):
        at = indices[xl.dim]
        if mask is None and xl.outer == 1 and xl.inner == 1 and w.is_index(at):
            # x[arange(N)[:, None], j] (HF's padding mask) and x[arange(N), j] with j per row (a decoder
            # classifier's last token): row b reads row b of x only, at positions of its own
            nd = max(_ndim(t) for t in indices if isinstance(t, fx.Node))
            lay = _aligned(w.of(at), _ndim(at), nd)
            if all(l.kind == "free" or (_per_row_index(w, indices[i], l, nd, lay)) for i, l in il if i != xl.dim):
                return w.per_output(n, lambda v: w.track(lay, v), "(indexed by the row index)")
        raise w.mixing(n, "indexes along the batch dim (a permutation, roll or gather of rows)")
    ins = w.tensor_inputs(n)
    bad = w.first_unknown(ins)
    if bad is not None:
        return w.per_output(n, lambda v: bad)
    ib = [(indices[i], l) for i, l in il if l.kind == "batch"]
    if mask is not None and w.of(mask) is not None and w.of(mask).kind != "free":
        return w.generic(n)
    if xl is not None and xl.kind == "batch":
        if ib:
            return w.generic(n)
        return w.per_output(n, lambda v: w.track(xl, v))
    if not ib:
        return w.generic(n)
    nd = max(_ndim(a) for a, _ in ib)  # index tensors broadcast together (aligned from the right)
    lay = w.agree(n, [(a, _aligned(l, _ndim(a), nd)) for a, l in ib], "indexes with")
    return w.per_output(n, lambda v: w.track(lay, v))


def _per_row_index(w: _Walk, t: fx.Node, lay: Layout, nd: int, row: Layout) -> bool:
    """``t`` indexes a non-batch dim of x with row b's own positions: batch-major, inner 1, broadcast to the
    row index's dim, and not computed from the row index (the backward may recompute that at k rows)."""
    return (lay.kind == "batch" and lay.outer == 1 and lay.inner == 1 and _aligned(lay, _ndim(t), nd) == row
            and w.from_index(t) is None)


@rule(MASKED_INDEX_OPS)
def _masked_index(w: _Walk, n: fx.Node) -> Result:
    return _index(w, n, mask=n.args[1])


@rule(INDEX_PUT_OPS, MASKED_INDEX_PUT_OPS)
def _index_put(w: _Walk, n: fx.Node) -> Result:
    x = w.of(n.args[0])
    masked = _packet(n) in MASKED_INDEX_PUT_OPS
    indices = n.args[2] if masked else n.args[1]
    if w.sums:
        r = _index_put_backward(w, n, x, list(indices), n.args[3] if masked else n.args[2])
        if r is not None:
            return r
    if x is not None and x.kind == "batch" and len(indices) > x.dim and indices[x.dim] is not None:
        raise w.mixing(n, "writes rows along the batch dim")
    rest = [l for a, l in w.tensor_inputs(n) if a is not n.args[0]]
    if x is None or x.kind != "batch" or any(l.kind != "free" for l in rest):
        return w.generic(n)
    return w.per_output(n, lambda v: w.track(x, v))


def _index_put_backward(w: _Walk, n: fx.Node, x: Optional[Layout], indices: list, values: Any) -> Optional[Result]:
    """The backward's index_put (None: the forward's rule decides).  A row index among the indices of a value
    that does not carry the batch (a parameter per batch position, ``table[arange(N)]``) puts the kept rows'
    gradients at their positions among the rows run, not at their rows: refused.  Into a batch value, a row
    index in its batch dim with the other indices of the row's own (``x[arange(N), j]``) writes row b into
    row b.  Into a free value with data indices (an embedding's), the rows' values are summed."""
    pos = [i for i, t in enumerate(indices) if isinstance(t, fx.Node) and w.from_index(t) is not None]
    vl = w.of(values) if isinstance(values, fx.Node) else None
    if x is not None and x.kind == "free" and pos:
        raise _Refuse(f"the row index indexes {n.args[0].name}, which does not carry the batch ({_op(n)}{_where(n)}): "
                      "row b's gradient goes to its position among the rows the backward runs, not to row b "
                      "(a parameter indexed by arange(N)?)", RefusalKind.ROW_INDEX_VALUE, n)
    if x is not None and x.kind == "batch" and x.outer == 1 and x.inner == 1 and len(indices) > x.dim \
            and w.is_index(indices[x.dim]) and vl is not None and vl.kind == "batch":
        at = indices[x.dim]
        nd = max(_ndim(t) for t in indices if isinstance(t, fx.Node))
        lay = _aligned(w.of(at), _ndim(at), nd)
        others = [(i, w.of(t)) for i, t in enumerate(indices) if i != x.dim and isinstance(t, fx.Node)]
        if all(l is not None and (l.kind == "free" or _per_row_index(w, indices[i], l, nd, lay)) for i, l in others):
            return w.per_output(n, lambda v: w.track(x, v))
        return None
    accumulate = bool(n.args[-1]) if _packet(n) not in MASKED_INDEX_PUT_OPS else True
    if x is not None and x.kind == "free" and accumulate and vl is not None and vl.kind == "batch":
        ib = [(t, w.of(t)) for t in indices if isinstance(t, fx.Node) and w.of(t) is not None and w.of(t).kind == "batch"]
        if ib and all(l == ib[0][1] and l.dim == vl.dim and (l.outer, l.inner) == (vl.outer, vl.inner) for _, l in ib):
            return w.summed(n, [values], "accumulates rows into a tensor without the batch")
    return None


@rule(GATHER_OPS)
def _gather(w: _Walk, n: fx.Node) -> Result:
    x, idx = w.of(n.args[0]), w.of(n.args[2])
    dim = int(n.args[1]) % max(_ndim(n.args[0]), 1)
    if x is not None and x.kind == "batch" and x.dim == dim:
        raise w.mixing(n, "gathers along the batch dim")
    if x is None or idx is None or "unknown" in (x.kind, idx.kind) or idx.kind != "batch":
        return w.generic(n)
    if x.kind == "batch" and x != idx:
        return w.generic(n)
    return w.per_output(n, lambda v: w.track(idx, v))


@rule(SCATTER_OPS, INDEX_UPDATE_OPS)
def _scatter(w: _Walk, n: fx.Node) -> Result:
    """scatter(x, dim, index, src) / index_add(x, dim, index, source): along the batch = mixing.

    Otherwise the index and src of a scatter must carry x's layout (a free index touches the first
    rows only: position-dependent), and an index_add's 1-D index must be free.
    """
    x = w.of(n.args[0])
    dim = int(n.args[1]) % max(_ndim(n.args[0]), 1)
    if x is not None and x.kind == "batch" and x.dim == dim:
        raise w.mixing(n, "scatters along the batch dim")
    if w.sums and x is not None and x.kind == "free":
        return _scatter_free(w, n, dim)
    if x is None or x.kind != "batch":
        return w.generic(n)
    index_like = _packet(n) in INDEX_UPDATE_OPS
    for a, l in w.tensor_inputs(n):
        if a is n.args[0]:
            continue
        ok = l.kind == "free" if index_like and a is n.args[2] else (l == x or (l.kind == "free" and _ndim(a) == 0))
        if not ok:
            return w.generic(n)
    return w.per_output(n, lambda v: w.track(x, v))


def _scatter_free(w: _Walk, n: fx.Node, dim: int) -> Result:
    """Backward: scatter/index_add into a tensor without the batch (a gathered parameter's gradient).  Along
    the index's batch dim, data indices place the rows' values: summed (scatter_add, index_add).  Along another
    dim, row b of the source lands in row b of the target, a position: at the rows run, the kept rows' values
    land at their positions among them (``torch.gather(param, 1, idx)``'s backward): refused."""
    index_like = _packet(n) in INDEX_UPDATE_OPS
    idx, src = n.args[2], n.args[3]
    il, sl = w.of(idx), w.of(src)
    if il is None or sl is None or il.kind != "batch" or sl.kind != "batch":
        return w.generic(n)
    if not index_like and il.dim != dim:
        raise _Refuse(f"scatters row b of {src.name} into row b of {n.args[0].name}, which does not carry the batch "
                      f"({_op(n)}{_where(n)}): at the rows the backward runs, a kept row's values land at its "
                      "position among them, not at its row (torch.gather of a parameter by a per-row index?)",
                      RefusalKind.ROW_INDEX_VALUE, n)
    reduce = n.args[4] if len(n.args) > 4 else n.kwargs.get("reduce", "sum")
    adds = _packet(n) in _packets(aten, "scatter_add index_add") or (
        _packet(n) == "aten::scatter_reduce" and reduce == "sum")
    if adds and sl.dim == dim and (il.outer, il.inner) == (sl.outer, sl.inner) and (not index_like or il.dim == 0):
        return w.summed(n, [src], "scatters rows into a tensor without the batch")
    raise w.mixing(n, "scatters rows into a tensor without the batch other than by adding them")


@rule(SCATTER_SLICE_OPS)
def _slice_scatter(w: _Walk, n: fx.Node) -> Result:
    idx, default = SCATTER_SLICE_OPS[_packet(n)]
    x, src = w.of(n.args[0]), w.of(n.args[1])
    dl = _norm_dims(_arg(n, idx, default=default), _ndim(n.args[0]))
    if x is not None and x.kind == "batch" and (dl is None or x.dim in dl):
        if not (src is not None and src == x):  # writing the whole batch dim is a no-op for rows
            raise w.mixing(n, "writes a slice of the batch dim")
    if x is None or src is None or x.kind != "batch" or src.kind == "unknown" or (
            src.kind == "batch" and (src.outer, src.inner) != (x.outer, x.inner)):
        return w.generic(n)
    return w.per_output(n, lambda v: w.track(x, v))


def _matmul_out(w: _Walk, n: fx.Node, a: fx.Node, b: fx.Node) -> Optional[Layout]:
    """Layout of a @ b (both batch -> they must land on one output dim with one layout)."""
    la, lb = w.of(a), w.of(b)
    nda, ndb, nd = _ndim(a), _ndim(b), n.meta["val"].dim()
    lands, contracted = [], []
    for arg, lay, ndi, is_a in ((a, la, nda, True), (b, lb, ndb, False)):
        if lay is None or lay.kind != "batch":
            continue
        if (lay.dim == ndi - 1) if is_a else (ndi == 1 or lay.dim == ndi - 2):
            contracted.append((arg, lay))
            continue
        if is_a:
            d = nd - (1 if ndb == 1 else 2) if lay.dim == ndi - 2 else lay.dim + nd - ndi
        else:
            d = nd - 1 if lay.dim == ndi - 1 else lay.dim + nd - ndi
        lands.append((arg, replace(lay, kind="batch", dim=d)))
    if contracted:
        # a weight gradient: row b of one operand meets row b of the other, summed (backward only)
        if len(contracted) == 2 and not lands and (
                (contracted[0][1].outer, contracted[0][1].inner) == (contracted[1][1].outer, contracted[1][1].inner)
                or any(l.fits for _, l in contracted)):
            return w.summed(n, [c for c, _ in contracted], f"contracts over the batch dim ({contracted[0][0].name}: "
                                                          f"{contracted[0][1]})")
        raise w.mixing(n, f"contracts over the batch dim ({contracted[0][0].name}: {contracted[0][1]})")
    if len(lands) == 2 and lands[0][1] != lands[1][1]:
        raise w.mixing(n, f"pairs rows of the batch ({a.name}: {la}, {b.name}: {lb}): an (N, N) product such as "
                          "a Gram matrix h @ h.T")
    return lands[0][1] if lands else FREE


@rule(MATMUL_OPS)
def _matmul(w: _Walk, n: fx.Node) -> Result:
    ins = w.tensor_inputs(n)
    bad = w.first_unknown(ins)
    if bad is not None:
        return w.per_output(n, lambda v: bad)
    if len(n.args) < 2 or not all(isinstance(x, fx.Node) for x in n.args[:2]):
        return w.generic(n)
    return _tracked(w, n, _matmul_out(w, n, n.args[0], n.args[1]))


@rule(ADD_MATMUL_OPS)
def _add_matmul(w: _Walk, n: fx.Node) -> Result:
    """addmm(bias, a, b) = bias + a @ b (bias broadcast)."""
    ins = w.tensor_inputs(n)
    bad = w.first_unknown(ins)
    if bad is not None:
        return w.per_output(n, lambda v: bad)
    lay = _matmul_out(w, n, n.args[1], n.args[2])
    if not isinstance(lay, Layout) or lay.kind == "sum":
        raise w.mixing(n, "adds a sum over the rows to a bias")
    bias = w.of(n.args[0])
    nd = n.meta["val"].dim()
    if bias is not None and bias.kind == "batch":
        items = [(n.args[0], _aligned(bias, _ndim(n.args[0]), nd))]
        if lay.kind == "batch":
            items.append((n.args[1], lay))
        lay = w.agree(n, items, "adds")
    return _tracked(w, n, lay)


def _tracked(w: _Walk, n: fx.Node, lay: Layout) -> Result:
    return w.per_output(n, lambda v: lay if lay.kind in ("free", "sum") else w.track(lay, v))


@rule(PER_SAMPLE_OPS)
def _per_sample(w: _Walk, n: fx.Node) -> Result:
    ins = w.tensor_inputs(n)
    batch = [(a, l) for a, l in ins if l.kind == "batch"]
    bad = w.first_unknown(ins)
    if bad is not None:
        return w.per_output(n, lambda v: bad)
    if not batch:
        return w.generic(n)
    if any(l.dim != 0 for _, l in batch):
        return w.per_output(n, lambda v: None, "(batch not in dim 0)")
    lay = w.agree(n, batch, "combines")
    summed = w.sums and any(a in w.carry for a, _ in batch)
    return w.per_output(n, lambda v: (SUM if summed else FREE) if not symbol_dims(shape_exprs(v), w.sym)
                        else w.track(lay, v))


@rule(ATTENTION_OPS)
def _attention(w: _Walk, n: fx.Node) -> Result:
    """sdpa: per sample when q, k, v (and a mask) agree on a leading batch dim; per query row when only
    q carries the batch in its L dim; attending over the batch (k/v's S dim) or contracting it is mixing."""
    ins = w.tensor_inputs(n)
    bad = w.first_unknown(ins)
    if bad is not None:
        return w.per_output(n, lambda v: bad)
    q, k, v = (w.of(a) for a in n.args[:3])
    nd = _ndim(n.args[0])
    if any(l is not None and l.kind == "batch" and l.dim == _ndim(a) - 1 for a, l in zip(n.args[:3], (q, k, v))):
        raise w.mixing(n, "contracts over the batch dim (the batch is the attention's feature dim)")
    if any(l is not None and l.kind == "batch" and l.dim == _ndim(a) - 2 for a, l in zip(n.args[1:3], (k, v))):
        raise w.mixing(n, "attends over the batch dim (the batch is the keys' sequence dim)")
    batch = [(a, _aligned(l, _ndim(a), nd)) for a, l in ins if l.kind == "batch"]
    if not batch:
        return w.generic(n)
    lay = w.agree(n, batch, "combines")  # a mask carrying the batch must agree as well
    return w.per_output(n, lambda t: FREE if not symbol_dims(shape_exprs(t), w.sym) else w.track(lay, t))


@rule(LAYER_NORM_OPS)
def _layer_norm(w: _Walk, n: fx.Node) -> Result:
    x = w.of(n.args[0])
    if x is None or x.kind != "batch" or any(l.kind != "free" for a, l in w.tensor_inputs(n) if a is not n.args[0]):
        return w.generic(n)
    normalized = n.args[1]
    if x.dim >= _ndim(n.args[0]) - len(normalized):
        raise w.mixing(n, "normalises over the batch dim")
    return w.per_output(n, lambda v: w.track(x, v))


@rule(BATCH_NORM_OPS)
def _batch_norm(w: _Walk, n: fx.Node) -> Result:
    training = next((a for a in n.args if isinstance(a, bool)), n.kwargs.get("training", False))
    name = str(n.target)
    if "no_training" in name or "no_update" in name:
        training = False
    elif "with_update" in name:
        training = True
    x = w.of(n.args[0])
    if training and x is not None and x.kind == "batch":
        raise w.mixing(n, "is BatchNorm in train mode: it normalises with statistics over the batch")
    return _per_sample(w, n)


@rule(PER_SAMPLE_BACKWARD_OPS)
def _batch_norm_backward(w: _Walk, n: fx.Node) -> Result:
    train = n.args[7] if len(n.args) > 7 else n.kwargs.get("train", False)
    x = w.of(n.args[1])
    if _packet(n) == "aten::native_batch_norm_backward" and train and x is not None and x.kind == "batch":
        raise w.mixing(n, "is BatchNorm's train-mode backward (statistics over the batch)")
    return _per_sample(w, n)


@rule(LAYER_NORM_BACKWARD_OPS)
def _layer_norm_backward(w: _Walk, n: fx.Node) -> Result:
    """native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, mask) ->
    (grad_input, grad_weight, grad_bias): per row over the normalised dims; the weight's gradients sum the rows."""
    early, batch = w.batch_operands(n)
    if early is not None:
        return early
    nd = _ndim(n.args[1])
    lay = w.agree(n, [(a, _aligned(l, _ndim(a), nd)) for a, l in batch], "combines")
    if lay.dim >= nd - len(n.args[2]):
        raise w.mixing(n, "normalises over the batch dim")
    summed = any(a in w.carry for a, _ in batch)
    return w.per_output(n, lambda v: (SUM if summed else None) if not symbol_dims(shape_exprs(v), w.sym)
                        else w.track(lay, v), "(a weight gradient without the cotangent)")


@rule(SOFTMAX_BACKWARD_OPS)
def _softmax_backward(w: _Walk, n: fx.Node) -> Result:
    """_softmax_backward_data(grad, output, dim, dtype): per row unless ``dim`` is the batch dim."""
    early, batch = w.batch_operands(n)
    if early is not None:
        return early
    lay = w.agree(n, batch, "combines")
    if int(n.args[2]) % max(_ndim(n.args[0]), 1) == lay.dim:
        raise w.mixing(n, "is a softmax's backward over the batch dim")
    return w.per_output(n, lambda v: w.track(lay, v))


@rule(ATTENTION_BACKWARD_OPS)
def _attention_backward(w: _Walk, n: fx.Node) -> Result:
    """The fused attention backwards (grad_out, q, k, v, out, logsumexp, ...): per sample when every batch input
    holds the batch in one leading dim (with dropout, _random refuses them first: the mask comes from a seed)."""
    early, batch = w.batch_operands(n)
    if early is not None:
        return early
    # every input shares the leading (batch, heads) dims of q (grad_out, q, k, v, out, a mask (B, H, L, S),
    # logsumexp (B, H, L)): the batch in one of them, the same for all, never in L, S or E
    if len({l.dim for _, l in batch}) != 1 or batch[0][1].dim >= _ndim(n.args[1]) - 2:
        return w.per_output(n, lambda v: None, "(the batch is not a leading dim)")
    lay = w.agree(n, batch, "combines")
    return w.per_output(n, lambda t: FREE if not symbol_dims(shape_exprs(t), w.sym) else w.track(lay, t))


@rule(EMBEDDING_BACKWARD_OPS)
def _embedding_backward(w: _Walk, n: fx.Node) -> Result:
    """embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq): the rows' gradients
    summed into the table by their indices (data, not positions); scaling by the batch's frequencies mixes rows."""
    g, idx = w.of(n.args[0]), w.of(n.args[1])
    scale = n.args[4] if len(n.args) > 4 else n.kwargs.get("scale_grad_by_freq", False)
    if g is None or idx is None or "unknown" in (g.kind, idx.kind) or g.kind != "batch":
        return w.generic(n)
    if scale:
        raise w.mixing(n, "scales by how often each index occurs in the batch")
    if idx.kind != "batch" or _aligned(idx, _ndim(n.args[1]), _ndim(n.args[0]) - 1) != replace(g, why="") or g.dim == _ndim(n.args[0]) - 1:
        return w.generic(n)
    return w.summed(n, [n.args[0]], "sums the rows' gradients into the table")


def _dropout_p(n: fx.Node) -> Any:
    """An attention op's ``dropout_p`` argument (by its schema), 0.0 when it has none."""
    schema = getattr(n.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" not in names:
        return 0.0
    i = names.index("dropout_p")
    v = n.args[i] if i < len(n.args) else n.kwargs.get("dropout_p", schema.arguments[i].default_value)
    return v if isinstance(v, (int, float)) else 1.0  # a symbolic rate: assume it drops


def _random(n: fx.Node) -> bool:
    """The node draws random numbers (or replays them from a saved seed and offset).  The fused attention
    kernels are tagged seeded whatever their rate: they draw only with ``dropout_p`` > 0."""
    if n.op != "call_function":
        return False
    if _packet(n) in ATTENTION_OPS | ATTENTION_BACKWARD_OPS:
        return _dropout_p(n) != 0
    if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) or _packet(n) in RNG_OPS:
        return True
    return isinstance(n.target, torch._ops.HigherOrderOperator) and n.target.name() in RNG_HOPS


@rule(FACTORY_OPS)
def _factory(w: _Walk, n: fx.Node) -> Result:
    """A value of constant or i.i.d. random rows (also ``expand``/``repeat`` of a free value)."""
    direct = [a for a in n.args if not isinstance(a, (list, tuple))] + list(n.kwargs.values())
    if w.uses_batch_size(n, direct):  # full([N, D], N)
        return w.per_output(n, lambda v: None, "(uses the batch size as a value)")
    shape_only = n.args[0] if _packet(n) in NEW_OPS else None  # new_zeros(x, size): x gives dtype/device
    if any(l.kind != "free" for a, l in w.tensor_inputs(n) if a is not shape_only):
        return w.generic(n)
    r = w.per_output(n, w.from_shape, "(batch symbol in several dims)")
    return replace(r, fits=True) if isinstance(r, Layout) and r.kind == "batch" else r


@rule(ARANGE_OPS)
def _arange(w: _Walk, n: fx.Node) -> Result:
    """``arange(N)`` (start 0, step 1, length the batch symbol): a row index; otherwise a factory."""
    if _packet(n) == "prims::iota":
        length, start, step = n.args[0], n.kwargs.get("start", 0), n.kwargs.get("step", 1)
    else:
        pos = [a for a in n.args if not isinstance(a, (torch.dtype, torch.device))]
        start, length, step = (0, pos[0], 1) if len(pos) == 1 else (pos[0], pos[1], pos[2] if len(pos) > 2 else 1)
        start, step = n.kwargs.get("start", start), n.kwargs.get("step", step)
    length, start, step = (a.meta.get("val") if isinstance(a, fx.Node) else a for a in (length, start, step))
    val = n.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() == 1 and same_size(expr_of(val.shape[0]), w.sym) \
            and _is_int(length, None, w.sym) and _is_int(start, 0) and _is_int(step, 1):
        return Layout("batch", 0, index=True)
    return w.per_output(n, lambda v: FREE if not symbol_dims(shape_exprs(v), w.sym) else None,
                        "(creates a batch-sized value)")


def _is_int(v: Any, k: Optional[int], expr: Optional[sympy.Expr] = None) -> bool:
    """``v`` is the integer ``k`` (or the expression ``expr``), structurally."""
    return isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool) \
        and same_size(expr_of(v), expr if expr is not None else sympy.Integer(k))




def _rule(n: fx.Node) -> Optional[Callable[[_Walk, fx.Node], Result]]:
    if n.op != "call_function":
        return None
    p = _packet(n)
    r = _RULES.get(p)
    if r is not None:
        return r
    if torch.Tag.pointwise in getattr(n.target, "tags", ()):
        return _pointwise
    return None


def analyze(graph: fx.Graph, sym: sympy.Symbol, exclude=()) -> LayoutAnalysis:
    """Layouts of the forward values of an AOT joint graph whose batch size is ``sym``.

    One pass in topological order; see the module docstring for the rules and the invariants.
    ``exclude``: forward nodes not analysed (an in-graph loss after the logits, whose backward runs on
    every row: see passes/insert_select.py); they get no layout and are never a reason to refuse.
    """
    if not isinstance(sym, sympy.Symbol):
        raise ValueError(f"the batch size must be a sympy Symbol (the batch dim marked dynamic), got {sym!r}")
    return _Walk(graph, sym, frozenset(exclude)).run()


def analyze_rowwise(graph: fx.Graph, sym: sympy.Symbol, seeds: dict[str, Layout]) -> LayoutAnalysis:
    """Layouts of every value of a graph (a backward graph: no forward/backward split) whose inputs'
    layouts are given, ``seeds`` by placeholder name (an input not named is read from its sizes as the
    forward's inputs are).  The same rules and invariants as :func:`analyze`: ``refusal is None`` means
    every value is row-separable along its layout and every output is free or batch-major, so output row
    ``b`` depends on row ``b`` of the batch inputs and on the free ones only (passes/prefix_rows.py)."""
    if not isinstance(sym, sympy.Symbol):
        raise ValueError(f"the batch size must be a sympy Symbol, got {sym!r}")
    return _Walk(graph, sym, seeds=dict(seeds)).run()


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
    return _Walk(graph, sym, seeds=dict(seeds), carriers=frozenset(carriers)).run()


_FITTING = frozenset({_factory, _move, _pointwise, _cat})  # the rules whose values may fit any layout


def op_table_markdown() -> str:
    """The ops the analysis knows, by rule, as the markdown table docs/design.md shows (generated from the
    registry: ``python -c "from capskip_fx.layout import op_table_markdown; print(op_table_markdown())"``)."""
    by_rule: dict[Callable, list[str]] = {}
    for p, fn in _RULES.items():
        by_rule.setdefault(fn, []).append(p)
    lines = ["| rule | ops |", "| --- | --- |"]
    for fn, ps in by_rule.items():
        ops = ", ".join(f"`{p}`" for p in sorted(ps))
        lines.append(f"| `{fn.__name__.lstrip('_')}` | {ops} |")
    lines.append("| `pointwise` | every op torch tags `pointwise` (`torch.Tag.pointwise`) |")
    return "\n".join(lines) + "\n"

"""The walk of the placement proof: one pass over a graph in topological order, giving every tensor value a
``Layout`` by its op's rule (registry.rule_of; the generic rule for ops without one), then the checks of the
values that matter (forward outputs, values the backward reads, row indices used as values).  ``Walk`` is
what a rule sees: its helpers read an argument's layout, track the batch dim into an output's shape, and
build the refusals (``Refuse``, ``Walk.mixing``).  prove.py runs it over the forward, a loss prefix or the
backward that will run.
"""
from __future__ import annotations

import operator
import re
from dataclasses import replace
from typing import Any, Callable, Optional, Union

import sympy
import torch
from torch import fx

from ..records import RefusalKind
from ..symbolic import ONE, exact_quotient, expr_of, same_size, shape_exprs, symbol_dims, tangent_nodes, uses_symbol
from .lattice import FREE, SUM, Layout, LayoutAnalysis, detached
from .registry import fitting, makes_row_index, rule_of
from .tables import (ATTENTION_BACKWARD_OPS, ATTENTION_OPS, INDEX_OPS, INDEX_PUT_OPS, MASKED_INDEX_OPS,
                     MASKED_INDEX_PUT_OPS, RNG_HOPS, RNG_OPS, VALUE_KEEPING_OPS, packet_of)

__all__ = ["Refuse", "Result", "Walk", "arg_of", "backward_nodes", "draws_random", "dropout_p_of", "located",
           "ndim_of", "norm_dims", "op_name"]


class Refuse(Exception):
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


def located(n: fx.Node) -> str:
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


def op_name(n: fx.Node) -> str:
    return f"{n.name} ({n.target})"


def norm_dims(v: Any, ndim: int) -> Optional[list]:
    """A dim argument as a list of non-negative dims; None means all dims."""
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return None
    vs = v if isinstance(v, (list, tuple)) else [v]
    return [int(d) % max(ndim, 1) for d in vs]


def arg_of(n: fx.Node, idx: Optional[int], names=("dim", "dims"), default: Any = None) -> Any:
    if idx is not None and len(n.args) > idx:
        return n.args[idx]
    for nm in names:
        if nm in n.kwargs:
            return n.kwargs[nm]
    return default


def ndim_of(a: fx.Node) -> int:
    v = a.meta.get("val")
    return v.dim() if isinstance(v, torch.Tensor) else 0


def dropout_p_of(n: fx.Node) -> Any:
    """An attention op's ``dropout_p`` argument (by its schema), 0.0 when it has none."""
    schema = getattr(n.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" not in names:
        return 0.0
    i = names.index("dropout_p")
    v = n.args[i] if i < len(n.args) else n.kwargs.get("dropout_p", schema.arguments[i].default_value)
    return v if isinstance(v, (int, float)) else 1.0  # a symbolic rate: assume it drops


def draws_random(n: fx.Node) -> bool:
    """The node draws random numbers (or replays them from a saved seed and offset).  The fused attention
    kernels are tagged seeded whatever their rate: they draw only with ``dropout_p`` > 0."""
    if n.op != "call_function":
        return False
    if packet_of(n) in ATTENTION_OPS | ATTENTION_BACKWARD_OPS:
        return dropout_p_of(n) != 0
    if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) or packet_of(n) in RNG_OPS:
        return True
    return isinstance(n.target, torch._ops.HigherOrderOperator) and n.target.name() in RNG_HOPS


Result = Union[Layout, list]  # a Layout, or one Optional[Layout] per tuple element


class Walk:
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
        return Layout("unknown", why=f"{op_name(n)}{' ' + what if what else ''}{located(n)}", origin=n)

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

    def mixing(self, n: fx.Node, what: str) -> Refuse:
        return Refuse(f"cross-example op in the {self.part}: {op_name(n)} {what}{located(n)}",
                      RefusalKind.CROSS_EXAMPLE, n)

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
        if draws_random(n):
            drop = f" (attention dropout_p={dropout_p_of(n)}, regenerated from a seed)" if packet_of(n) in \
                ATTENTION_OPS | ATTENTION_BACKWARD_OPS else ""
            raise Refuse(f"draws or replays random numbers in the backward: {op_name(n)}{drop}{located(n)}: at the "
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
            except Refuse as e:
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
                layouts[n.name] = detached(r)
            else:
                layouts.update({f"{n.name}.{i}": detached(x) for i, x in enumerate(r) if x is not None})
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
                return [(f"the row index arange(N) is used as a value, not to index rows ({op_name(origin)}"
                         f"{located(origin)}): a selected-row backward would recompute it at the kept rows' count",
                         origin)]
        for n, r in lays:  # gathered, it would number the kept rows by their old rows
            if r.index and any(u in self.bwd for u in n.users):
                return [(f"the row index {op_name(n)} is read by the backward{located(n)}: gathered at the kept rows "
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
                                f"the selected-row backward takes outputs batch-major only{located(n)}", r.origin or n))
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
        rule = rule_of(n)
        r = rule(self, n) if rule is not None else self.generic(n)
        return self.facts(n, rule, r)

    def facts(self, n: fx.Node, rule: Any, r: Result) -> Result:
        """The value facts of ``n``'s layouts, the same for every rule.  ``fits`` only from the rules that
        make rows constant or i.i.d. (factories, moves, pointwise ops and cats of such values).  A row index
        is made by ``arange(N)`` and kept by copies that stay batch-major with inner 1; anything else
        computed from one (but indexing by it) records the op that used it (``from_index``)."""
        used = [a for a in n.all_input_nodes if self.from_index(a) is not None]
        copy = packet_of(n) in VALUE_KEEPING_OPS and bool(n.args) and self.is_index(n.args[0])
        origin = next((self.of(a).from_index for a in used if self.of(a).from_index is not None), n) \
            if used and not _indexes_only(n, used) else None

        def one(lay: Optional[Layout]) -> Optional[Layout]:
            if lay is None:
                return None
            index = (makes_row_index(rule) and lay.index) or (copy and lay.kind == "batch" and lay.outer == 1
                                                         and lay.inner == 1)
            return replace(lay, fits=lay.fits and fitting(rule), index=index,
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
    p = packet_of(n)
    at = 1 if p in INDEX_OPS | INDEX_PUT_OPS else 2 if p in MASKED_INDEX_OPS | MASKED_INDEX_PUT_OPS else None
    if at is None or len(n.args) <= at:
        return False
    indices = n.args[at]
    return all(any(u is t for t in indices) for u in used) and not any(
        a in used for i, a in enumerate(n.args) if i != at)

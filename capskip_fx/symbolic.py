"""The symbolic batch dimension: the batch symbol, size algebra over it, and how a value carries it.

The wrapper marks the batch dim dynamic, so every batch-carrying size in the traced graphs is an
expression of one symbol ``s``.  A dim of size ``a*s`` (a >= 1 an integer) is the batch, possibly
flattened batch-major with ``a`` inner rows (the ``view(B*T, D)`` inputs of the matmuls).

The base module under the layout proof (placement/), the row gather (rows.py), the graph passes, the
runtime and VCAS: it imports nothing of ours but ``records.Refused``.

Sizes are compared structurally (``same_size``, ``exact_quotient``): no ``simplify`` and no guard is
ever added to the shape env (no ``bool()`` of a SymInt).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import sympy
import torch

from .records import RefusalKind, Refused

ONE, ZERO = sympy.Integer(1), sympy.Integer(0)


# -- sizes as sympy expressions ---------------------------------------------------------------------

def expr_of(v: Any) -> Optional[sympy.Expr]:
    """The sympy expression of a size (SymInt / int); None for anything else."""
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return v.node.expr
    if isinstance(v, int):
        return sympy.Integer(v)
    return None


def shape_exprs(v: torch.Tensor) -> list:
    return [expr_of(d) for d in v.shape]


def uses_symbol(e: sympy.Expr, sym: sympy.Symbol) -> bool:
    return not e.is_Number and sym in e.free_symbols


def symbol_dims(shape: list, sym: sympy.Symbol) -> list:
    """The dims of ``shape`` (expressions) whose size involves ``sym``."""
    return [k for k, e in enumerate(shape) if uses_symbol(e, sym)]


def same_size(a: sympy.Expr, b: sympy.Expr) -> bool:
    return a == b or sympy.expand(a - b) == 0


def product(xs) -> sympy.Expr:
    out = ONE
    for x in xs:
        out = out * x
    return out


def exact_quotient(a: sympy.Expr, b: sympy.Expr, sym: sympy.Symbol) -> Optional[sympy.Expr]:
    """a / b if it is an integer expression free of the batch symbol (structurally), else None."""
    if b == 0:
        return None
    q = a / b
    if q.is_Integer:
        return q if q > 0 else None
    if q.is_Number or uses_symbol(q, sym) or q.as_numer_denom()[1] != 1:
        return None
    return q


def evaluate(e: sympy.Expr, sym: sympy.Symbol, value: int) -> int:
    return int(e.xreplace({sym: value}))


# -- the batch symbol and the batch dim -------------------------------------------------------------

def is_tangent(n) -> bool:
    """A placeholder holding the incoming gradient of a forward output (AOTAutograd names them tangents_*)."""
    return n.op == "placeholder" and n.name.startswith("tangents")


def tangent_nodes(graph) -> list:
    """The joint graph's tangent placeholders."""
    return [n for n in graph.nodes if is_tangent(n)]


def batch_symbol(graph) -> Optional[sympy.Symbol]:
    """The symbol of the first primal placeholder whose dim 0 is a plain symbol, or None."""
    for n in graph.nodes:
        if n.op != "placeholder" or is_tangent(n):
            continue
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and isinstance(v.shape[0], torch.SymInt):
            e = v.shape[0].node.expr
            if isinstance(e, sympy.Symbol):
                return e
    return None


def batch_symbol_of(val: Any, marked: bool = False) -> sympy.Symbol:
    """The batch symbol from the logits' fake value (batch in dim 0).  ``marked``: an input's dim 0 was marked
    dynamic, so a static batch here was fixed by an op of the model (the refusal names that fix instead)."""
    e = expr_of(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() >= 1 else None
    if e is None or not isinstance(e, sympy.Symbol):
        if marked:
            raise Refused(f"the batch dim of the logits is static ({e}) though the input's was marked dynamic: an "
                          "op in the forward fixed the batch size (e.g. torch.take_along_dim: use gather with an "
                          "expanded index; TORCH_LOGS=dynamic names the line; docs/limits.md)",
                          RefusalKind.STATIC_BATCH)
        raise Refused(f"the batch dim of the logits is static ({e}); selected-row backward needs a "
                      "dynamic batch: capskip_fx.compile marks it, backend='capskip' too from the second step "
                      "where Dynamo recompiles on a mark (torch >= 2.12), else torch._dynamo.mark_dynamic(x, 0); "
                      "batches of size 1 specialise", RefusalKind.STATIC_BATCH)
    return e


def batch_dim(shape, sym: sympy.Symbol) -> Optional[tuple[int, int]]:
    """(dim, factor) of the one dim of size factor*sym; None if no dim carries the batch.

    Raises Refused for any other use of the symbol (two batch dims, a*s + c, s*s, ...).
    """
    found = None
    for d, s in enumerate(shape):
        e = expr_of(s)
        if e is None or sym not in e.free_symbols:
            continue
        factor = sympy.simplify(e / sym)
        if found is not None or not (factor.is_Integer and int(factor) >= 1):
            raise Refused(f"shape {tuple(shape)} uses the batch symbol {sym} in a way rows can't be gathered",
                          RefusalKind.BATCH_LAYOUT)
        found = (d, int(factor))
    return found


def batch_dim_of(v: Any, sym: sympy.Symbol) -> Optional[tuple[int, int]]:
    """(dim, factor) of a tensor value's batch dim; None if it has none or uses the symbol otherwise."""
    if not isinstance(v, torch.Tensor):
        return None
    try:
        return batch_dim(v.shape, sym)
    except Refused:
        return None


def fake_mode_of(values) -> Any:
    """The fake mode (with its shape env) of the first fake tensor among a graph's example inputs, or None."""
    return next((v.fake_mode for v in values if getattr(v, "fake_mode", None) is not None), None)


def check_not_specialised(example_inputs, sym: sympy.Symbol, others=()) -> None:
    """Refuse if compiling fixed the batch symbol (the graph would be wrong at other sizes), or one of
    ``others`` (the stride symbols the gathered copies give new values, see stride_symbols)."""
    env = getattr(fake_mode_of(example_inputs), "shape_env", None)
    if env is None:
        return
    for s in (sym, *others):
        rep = env.replacements.get(s)
        if rep is not None and not rep.free_symbols:
            what = "the batch size" if s == sym else f"the stride {s} of a gathered input"
            raise Refused(f"compiling the backward specialised {what} to {rep}", RefusalKind.SPECIALISED)


def stride_symbols(example_inputs, sym: sympy.Symbol) -> dict:
    """{stride symbol: its value in a contiguous gathered copy} for batch tensors whose dim stride is a
    symbol of its own.  Dynamo gives a non-contiguous view marked dynamic (timm's pooled ``x[:, 0]``
    into a regionally compiled head) such a stride; the gathered copy is contiguous, so the symbol's
    value at run time is the contiguous stride.  Empty where any use of a symbol does not fit that
    (other strides not contiguous, the symbol in a size or in a non-batch tensor): then spec_of refuses."""
    found: dict = {}
    bad: set = set()
    for v in example_inputs:
        if not isinstance(v, torch.Tensor):
            continue
        sizes = [expr_of(x) for x in v.shape]
        strides = [expr_of(x) for x in v.stride()]
        lone = {e for e in strides if isinstance(e, sympy.Symbol) and e != sym}
        if not lone:
            continue
        contig = [product(sizes[d + 1:]) for d in range(len(sizes))]
        batch = any(sym in e.free_symbols for e in sizes) and \
            all(f == sym for e in sizes for f in e.free_symbols)
        for e, c in zip(strides, contig):
            if e in lone:
                if not batch or found.get(e, c) != c:
                    bad.add(e)
                found[e] = c
            elif e != c:
                bad |= lone
    return {} if bad else found


# -- how a compiled graph's input carries the batch (read from its example value) -------------------

@dataclass
class Spec:
    """A backward input's batch: ``kind == "batch"`` has one dim ``dim`` of size ``outer * s * factor``,
    index ``(o * s + b) * factor + r``.  ``spec_of`` reads the sizes only, so it gives ``outer = 1``
    (batch-major, ``factor`` the whole multiple of ``s``); the layout proof (placement/) says whether that
    is so, or which ``outer`` (token-major: ``x.transpose(0, 1).reshape(T*N, D)``) the dim really has."""

    kind: str  # "static" | "symint" | "batch"
    expr: Optional[sympy.Expr] = None
    dim: int = 0
    factor: int = 1  # the inner factor
    sizes: tuple = ()
    strides: tuple = ()
    outer: int = 1


def spec_of(v: Any, sym: sympy.Symbol, strides: Optional[dict] = None) -> Spec:
    """``strides``: stride_symbols' map; SymInts using one are evaluated at the gathered rows too."""
    free_strides = set(strides or ())
    if isinstance(v, torch.SymInt):
        e = v.node.expr
        if e.free_symbols & free_strides and e.free_symbols <= free_strides | {sym}:
            return Spec("symint", expr=e.xreplace(strides))
        if sym not in e.free_symbols:  # e.g. a dynamic storage offset: its value passes through
            return Spec("static")
        if e.free_symbols != {sym}:
            raise Refused(f"backward input size {e} depends on symbols other than the batch {sym}",
                          RefusalKind.BATCH_LAYOUT)
        return Spec("symint", expr=e)
    if isinstance(v, torch.Tensor):
        free = set().union(*(expr_of(s).free_symbols for s in (*v.shape, *v.stride())))
        if not free:
            return Spec("static")
        if not free <= {sym} | free_strides or sym not in free:
            raise Refused(f"backward input of shape {tuple(v.shape)} has dynamic dims other than the batch",
                          RefusalKind.BATCH_LAYOUT)
        bd = batch_dim(v.shape, sym)
        if bd is None:
            raise Refused(f"backward input of shape {tuple(v.shape)} has the batch only in its strides",
                          RefusalKind.BATCH_LAYOUT)
        return Spec("batch", dim=bd[0], factor=bd[1], sizes=tuple(expr_of(s) for s in v.shape),
                    strides=tuple(expr_of(s).xreplace(strides) if strides else expr_of(s) for s in v.stride()))
    return Spec("static")

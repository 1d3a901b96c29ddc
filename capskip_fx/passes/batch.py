"""The symbolic batch dimension: how each value in a graph carries the batch.

The wrapper marks the batch dim dynamic, so every batch-carrying size in the traced graphs is an
expression of one symbol ``s``.  A dim of size ``a*s`` (a >= 1 an integer) is the batch, possibly
flattened batch-major with ``a`` inner rows (the ``view(B*T, D)`` inputs of the matmuls).
"""
from __future__ import annotations

from typing import Any, Optional

import sympy
import torch


class Refused(Exception):
    """A graph the pass will not rewrite; the message is the reason recorded in the report."""


def expr_of(v: Any) -> Optional[sympy.Expr]:
    if isinstance(v, torch.SymInt):
        return v.node.expr
    if isinstance(v, int):
        return sympy.Integer(v)
    return None


def has_symbol(v: Any, sym: sympy.Symbol) -> bool:
    if isinstance(v, torch.Tensor):
        return any(sym in expr_of(s).free_symbols for s in v.shape if isinstance(s, torch.SymInt))
    if isinstance(v, torch.SymInt):
        return sym in v.node.expr.free_symbols
    if isinstance(v, (tuple, list)):
        return any(has_symbol(x, sym) for x in v)
    return False


def is_tensor_value(v: Any) -> bool:
    return isinstance(v, torch.Tensor) or (isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v))


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
            raise Refused(f"shape {tuple(shape)} uses the batch symbol {sym} in a way rows can't be gathered")
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


def batch_symbol_of(val: Any) -> sympy.Symbol:
    """The batch symbol from the logits' fake value (batch in dim 0)."""
    e = expr_of(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() >= 1 else None
    if e is None or not isinstance(e, sympy.Symbol):
        raise Refused(f"the batch dim of the logits is static ({e}); selected-row backward needs a "
                      "dynamic batch: capskip_fx.compile marks it, backend='capskip' too where torch has per-dim "
                      "dynamic sources (2.11 has none), else torch._dynamo.mark_dynamic(x, 0); "
                      "batches of size 1 specialise")
    return e


def fake_mode_of(values) -> Any:
    """The fake mode (with its shape env) of the first fake tensor among a graph's example inputs, or None."""
    return next((v.fake_mode for v in values if getattr(v, "fake_mode", None) is not None), None)


def tangent_nodes(graph) -> list:
    """The joint graph's tangent placeholders (incoming gradients of the forward's outputs)."""
    return [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]


def evaluate(e: sympy.Expr, sym: sympy.Symbol, value: int) -> int:
    return int(e.xreplace({sym: value}))

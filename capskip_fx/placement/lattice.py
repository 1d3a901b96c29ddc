"""The lattice of the placement proof: where the batch lies in one tensor value (``Layout``), the proof's
result over a graph (``LayoutAnalysis``), and the pure functions on layouts (a reshape's, an alignment's).

A ``Layout`` is ``free`` (no batch dependence), ``batch`` (one dim ``dim`` of size ``outer * s * inner`` holds
the batch, index ``(o*s + b)*inner + r``), ``sum`` (backward only: a sum over the rows run) or ``unknown``
(``why`` names the op that lost it), and three facts about the rows' values: ``fits`` (constant or i.i.d.
rows), ``index`` (a row index, ``arange(N)``) and ``from_index`` (computed from one by arithmetic).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import sympy
from torch import fx

from ..records import RefusalKind
from ..symbolic import ONE, exact_quotient, product, same_size, symbol_dims

__all__ = ["FREE", "SUM", "Layout", "LayoutAnalysis", "aligned", "detached", "reshape_layout", "spec_layout"]


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



def detached(lay: Layout) -> Layout:
    """``lay`` without its origin node: the layouts outlive the joint graph (graph records keep them for
    the backward pass), and a node would keep that whole graph alive."""
    return lay if lay.origin is None and lay.from_index is None else replace(lay, origin=None, from_index=None)


def aligned(lay: Layout, ndim_in: int, ndim_out: int) -> Layout:
    return replace(lay, kind="batch", dim=lay.dim + ndim_out - ndim_in)


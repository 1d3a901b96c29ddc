"""Joint-graph pass: recognise an in-graph cross-entropy, so that its ``dL/dz`` can be derived from the forward.

A pure matcher over the forward loss region that passes/in_graph_loss.py found (nothing is rewritten here):
it reads the loss output ``L`` back to the logits ``z`` and returns a :class:`CrossEntropyGrad`, the recipe the
runtime (runtime/loss_grad.py) computes ``dL/dz`` from, on every row, for a rule that reads it; or
:class:`NotDerivable` with the reason in words.  The real loss backward (the prefix) still computes the
gradients, on the kept rows only; the derived ``dL/dz`` only feeds the rule.

What it recognises: ``F.cross_entropy`` as AOTAutograd decomposes it (log_softmax as amax/sub/exp/sum/log/sub
or ``_log_softmax``; nll_loss as gather of the label's log-probability, ``where`` on the ignored labels, sums),
with ``ignore_index``, label smoothing (the ``sum_c log p_c`` term), class weights (a weight vector that is a
graph input without gradient), reduction ``mean`` (divided by the count of counted labels, or their summed
weights) or ``sum``, then divided or multiplied by constants or by scalar graph inputs (Hugging Face's
``num_items_in_batch``); on the logits' side an upcast (``logits.float()``), views that flatten the tokens,
slices along a token dim (logits shifted) and a constant scale (a temperature); on the labels' side the causal
shift Hugging Face's ``ForCausalLMLoss`` does (``pad(labels, (0, 1), ignore_index)[..., 1:]``), slices,
clones and views.

Invariants:
  * every node the loss output depends on (back to ``z`` and the graph inputs) is accounted for by one of
    the patterns above; any other op, or a pattern in another place, is NotDerivable (nothing is guessed);
  * the loss is then exactly ``L = sum_k c_k * S_k / prod(D_k)`` with ``S_k`` the sum over the counted
    tokens (label != ignore_index) of ``log p[y]`` or ``sum_c log p_c`` (each optionally weighted by the class
    weights), ``c_k`` constants and ``D_k`` the count, the weight count or scalar inputs.  Its gradient is
    then ``dL/dx = G - softmax(x) * sum_c G`` with ``G = dL/dlog p``, mapped back through the logits' path;
  * the graph inputs the recipe reads (the labels, the class weights, the scalar divisors, the loss output's
    and the logits output's tangents) are joint-graph placeholders; insert_select passes them to the selection
    node so that the partitioner hands them to the backward (``CrossEntropyGrad.inputs`` names their order).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

import torch
from torch import fx

from .find_head import Head, outputs_and_tangents
from .in_graph_loss import InGraphLoss

aten = torch.ops.aten
prims = torch.ops.prims

_SAME = {aten.alias.default, aten.clone.default, aten.detach.default, aten._to_copy.default,
         prims.convert_element_type.default, aten.lift_fresh_copy.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


class NotDerivable(Exception):
    """The loss is not a cross-entropy the library can derive ``dL/dz`` of; the message says why."""


@dataclass(frozen=True)
class Term:
    """``coef * sum_{counted tokens} a_t / prod(denominators)``: ``kind`` ``"target"``: ``a_t = log p[y_t]``
    (times ``w[y_t]`` if ``weighted``); ``"all"``: ``a_t = sum_c log p_c`` (times ``w_c``).  Denominators:
    ``"count"`` (counted tokens), ``"weights"`` (their summed class weights) or an int (that recipe input, a
    scalar)."""

    kind: str
    weighted: bool
    coef: float
    denominators: tuple = ()


@dataclass(frozen=True)
class CrossEntropyGrad:
    """What the runtime needs to compute ``dL/dz`` from ``z`` and the recipe's inputs (runtime/loss_grad.py).

    ``inputs``: the roles of the graph inputs passed to the backward, in order (``"labels"``, ``"weight"``,
    ``"divisor"``, ``"loss_tangent"``, ``"logits_tangent"``); ``logits_ops`` / ``label_ops``: the paths from
    ``z`` and from the labels input to the flat ``(M, C)`` logits and ``(M,)`` labels the loss reads, as
    ``("flatten",)``, ``("slice", dim, start, end)``, ``("scale", c)``, ``("pad", pads, value)``."""

    inputs: tuple
    logits_ops: tuple
    label_ops: tuple
    ignore_index: int
    terms: tuple
    upcast: Optional[torch.dtype] = None  # the dtype the loss computes in when it converts the logits

    def describe(self) -> str:
        parts = [f"ignore_index={self.ignore_index}"]
        if any(t.kind == "all" for t in self.terms):
            parts.append("label smoothing")
        if any(t.weighted for t in self.terms):
            parts.append("class weights")
        if any(op[0] == "pad" for op in self.label_ops):
            parts.append("shifted labels")
        return "cross-entropy (" + ", ".join(parts) + ")"


# abstract values of the nodes on the loss's path
@dataclass(frozen=True)
class _Logits:
    ops: tuple
    upcast: Optional[torch.dtype]


@dataclass(frozen=True)
class _LogP:
    logits: _Logits
    weighted: bool = False


@dataclass(frozen=True)
class _Labels:
    leaf: fx.Node
    ops: tuple
    col: bool = False  # unsqueezed to (M, 1)


@dataclass(frozen=True)
class _Mask:  # labels != ignore_index (valid) or == (ignored)
    labels: _Labels
    ii: int
    valid: bool


@dataclass(frozen=True)
class _Index:  # where(valid, labels, 0): the gather index
    labels: _Labels
    ii: int
    col: bool


@dataclass(frozen=True)
class _Weight:
    leaf: fx.Node
    row: bool = False  # viewed (1, C) / expanded (M, C)


@dataclass(frozen=True)
class _Token:  # per counted token: coef * (log p[y] | sum_c log p_c) [* w], masked to the counted tokens
    kind: str
    weighted: bool
    coef: float
    masked: bool
    ii: Optional[int]
    logits: _Logits


@dataclass(frozen=True)
class _TokenWeight:  # w[y_t], masked
    masked: bool
    ii: Optional[int]


@dataclass(frozen=True)
class _Const:
    value: float


@dataclass(frozen=True)
class _Denom:  # a scalar the loss divides by
    what: Union[str, fx.Node]  # "count", "weights" or a scalar graph input
    ii: Optional[int] = None


@dataclass(frozen=True)
class _Sum:  # sum_k coef_k S_k / prod(denominators_k)
    terms: tuple  # of (kind, weighted, coef, denominators as _Denom), with the logits path
    logits: _Logits
    ii: int


def match_cross_entropy(graph: fx.Graph, head: Head, loss: InGraphLoss) -> tuple[CrossEntropyGrad, list]:
    """(the recipe, the graph inputs it reads, in ``recipe.inputs`` order); NotDerivable with the reason."""
    if head.rows is not None or head.linear_in is not None:
        raise NotDerivable("the logits are not a head's output as the loss reads them")
    outs = [(o, t) for _, o, t in outputs_and_tangents(graph) if o in loss.nodes]
    if len(outs) != 1:
        raise NotDerivable(f"the loss region has {len(outs)} outputs (one scalar loss expected)")
    out, t_loss = outs[0]
    v = out.meta.get("val")
    if not isinstance(v, torch.Tensor) or v.numel() != 1 or t_loss is None:
        raise NotDerivable(f"the loss output {out.name} is not a scalar with a gradient")
    m = _Matcher(head.z, loss.nodes)
    s = m.value(out)
    if not isinstance(s, _Sum):
        raise NotDerivable(f"the loss output {out.name} is not a sum over the tokens of log-probabilities")
    labels = m.labels
    if labels is None:
        raise NotDerivable("no labels found")
    ignored = {s.ii} | {d.ii for *_, dens in s.terms for d in dens if d.ii is not None}
    if len(ignored) != 1:
        raise NotDerivable(f"the loss leaves out tokens by different labels {sorted(ignored)}")
    inputs, nodes = ["labels"], [labels.leaf]
    weight = m.weight
    if weight is not None:
        inputs.append("weight")
        nodes.append(weight)
    terms = []
    for kind, weighted, coef, dens in s.terms:
        names = []
        for d in dens:
            if isinstance(d.what, fx.Node):
                if d.what not in nodes:
                    inputs.append("divisor")
                    nodes.append(d.what)
                names.append(nodes.index(d.what))
            else:
                names.append(d.what)
        terms.append(Term(kind, weighted, coef, tuple(names)))
    inputs.append("loss_tangent")
    nodes.append(t_loss)
    if head.g is not None:
        inputs.append("logits_tangent")
        nodes.append(head.g)
    return CrossEntropyGrad(tuple(inputs), s.logits.ops, labels.ops, s.ii, tuple(terms), s.logits.upcast), nodes


def _const(n) -> Optional[float]:
    """A number, or a node that makes a constant scalar tensor."""
    if isinstance(n, (int, float)) and not isinstance(n, bool):
        return float(n)
    if isinstance(n, fx.Node) and n.op == "call_function":
        if n.target is aten.scalar_tensor.default and isinstance(n.args[0], (int, float)):
            return float(n.args[0])
        if n.target is aten.full.default and list(n.args[0]) == [] and isinstance(n.args[1], (int, float)):
            return float(n.args[1])
    return None


def _int(x) -> Optional[int]:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


class _Matcher:
    def __init__(self, z: fx.Node, region: frozenset):
        self.z, self.region = z, region
        self.memo: dict = {}
        self.labels: Optional[_Labels] = None
        self.weight: Optional[fx.Node] = None

    def value(self, n):
        if n not in self.memo:
            self.memo[n] = self._value(n)
        return self.memo[n]

    def _fail(self, n, what: str = ""):
        op = n.target if isinstance(n, fx.Node) and n.op == "call_function" else getattr(n, "op", n)
        raise NotDerivable(f"{getattr(n, 'name', n)} ({op}) {what or 'is not part of a cross-entropy'}")

    def _labels(self, lab: _Labels) -> _Labels:
        if self.labels is None:
            self.labels = replace(lab, col=False)
        elif (self.labels.leaf, self.labels.ops) != (lab.leaf, lab.ops):
            raise NotDerivable("the loss reads two different label tensors")
        return lab

    def _value(self, n):
        if n is self.z:
            return _Logits((), None)
        c = _const(n)
        if c is not None:
            return _Const(c)
        if not isinstance(n, fx.Node):
            self._fail(n, "is not a number the matcher knows")
        if n.op == "placeholder":
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and not v.dtype.is_floating_point:
                return _Labels(n, ())
            if isinstance(v, torch.Tensor) and v.dim() == 0:
                return _Denom(n)
            if isinstance(v, torch.Tensor) and v.dim() == 1:
                self._weight(n)
                return _Weight(n)
            self._fail(n, "is an input the loss reads in a way the matcher does not know")
        if n.op != "call_function":
            self._fail(n)
        if n not in self.region:
            self._fail(n, "is computed outside the loss (the loss reads a value of the model other than z)")
        t, a = n.target, n.args
        if t is aten.sub.Tensor:
            lp = self._decomposed_log_softmax(n)
            if lp is not None:
                return lp
        x = self.value(a[0]) if a and isinstance(a[0], fx.Node) else None
        # ops that keep values
        if t in _SAME:
            if isinstance(x, _Logits) and t in (prims.convert_element_type.default, aten._to_copy.default):
                dt = a[1] if t is prims.convert_element_type.default else n.kwargs.get("dtype")
                if dt is not None and not dt.is_floating_point:
                    self._fail(n, "converts the logits to a non-float type")
                return _Logits(x.ops, dt or x.upcast)
            if isinstance(x, (_Logits, _Labels, _Denom, _Weight, _Sum, _Token)) or isinstance(x, _Mask):
                return x
            self._fail(n)
        if t in _VIEWS:
            shape = n.meta["val"].shape
            if isinstance(x, _Logits):
                if len(shape) == 2 and len(a[0].meta["val"].shape) >= 2:
                    return _Logits(x.ops + (("flatten",),), x.upcast) if len(a[0].meta["val"].shape) > 2 else x
                self._fail(n, "reshapes the logits other than flattening the tokens")
            if isinstance(x, _Labels) and len(shape) == 1 and not x.col:
                return _Labels(x.leaf, x.ops + ((("flatten",),) if len(a[0].meta["val"].shape) > 1 else ()))
            if isinstance(x, _Weight) and len(shape) == 2 and shape[0] == 1:
                return _Weight(x.leaf, True)
            if isinstance(x, (_Denom,)) and n.meta["val"].numel() == 1:
                return x
            self._fail(n, "is a reshape the matcher does not know")
        if t is aten.expand.default and isinstance(x, _Weight) and x.row:
            return x
        if t is aten.slice.Tensor and isinstance(x, (_Logits, _Labels)):
            dim = a[1] if len(a) > 1 else 0
            start = _int(a[2]) if len(a) > 2 else 0
            end = _int(a[3]) if len(a) > 3 else None
            step = a[4] if len(a) > 4 else 1
            ndim = a[0].meta["val"].dim()
            dim = dim % ndim
            if start is None or (len(a) > 3 and end is None) or step != 1 or dim == 0:
                self._fail(n, "slices other than along a token dim by constants")
            if isinstance(x, _Logits):
                if dim == ndim - 1:
                    self._fail(n, "slices the classes")
                return _Logits(x.ops + (("slice", dim, start, end),), x.upcast)
            return _Labels(x.leaf, x.ops + (("slice", dim, start, end),))
        if t is aten.constant_pad_nd.default and isinstance(x, _Labels) and not x.ops:
            pad = [int(p) for p in a[1]]
            value = a[2] if len(a) > 2 else 0
            if len(pad) != 2:
                self._fail(n, "pads the labels in more than the last dim")
            return _Labels(x.leaf, (("pad", tuple(pad), int(value)),))
        if t is aten.unsqueeze.default and isinstance(x, (_Labels, _Index)) and a[1] in (1, -1):
            return replace(x, col=True)
        if t in (aten.mul.Scalar, aten.div.Scalar) and isinstance(x, (_Logits, _Token, _Sum)):
            c = float(a[1]) if t is aten.mul.Scalar else 1.0 / float(a[1])
            return _scaled(x, c)
        if t in (aten.mul.Tensor, aten.div.Tensor):
            y = self.value(a[1]) if isinstance(a[1], fx.Node) else _Const(float(a[1])) if _const(a[1]) is not None \
                else self._fail(n, "multiplies by a size of the batch")
            if t is aten.mul.Tensor and isinstance(y, (_Logits, _LogP, _Token, _Sum)) and isinstance(x, _Const):
                x, y = y, x
            if isinstance(y, _Const):
                if isinstance(x, (_Logits, _Token, _Sum)):
                    return _scaled(x, y.value if t is aten.mul.Tensor else 1.0 / y.value)
                self._fail(n)
            if t is aten.mul.Tensor and isinstance(x, _LogP) and isinstance(y, _Weight) and y.row and not x.weighted:
                return _LogP(x.logits, True)
            if t is aten.div.Tensor and isinstance(x, _Sum) and isinstance(y, _Denom):
                return _Sum(tuple((k, w, c, d + (y,)) for k, w, c, d in x.terms), x.logits, x.ii)
            self._fail(n, "multiplies or divides by a value the matcher does not know")
        if t is aten.neg.default and isinstance(x, (_Token, _Sum)):
            return _scaled(x, -1.0)
        if t in (aten.add.Tensor, aten.sub.Tensor) and isinstance(x, _Sum):
            y = self.value(a[1])
            alpha = float(n.kwargs.get("alpha", 1)) * (-1 if t is aten.sub.Tensor else 1)
            if not isinstance(y, _Sum) or y.logits != x.logits or y.ii != x.ii:
                self._fail(n, "adds a value that is not a sum of log-probabilities over the same tokens")
            return _Sum(x.terms + _scaled(y, alpha).terms, x.logits, x.ii)
        # log_softmax
        if t is aten._log_softmax.default and isinstance(x, _Logits) and a[1] in (-1, a[0].meta["val"].dim() - 1):
            return _LogP(self._flat(x, a[0]))
        # labels and masks
        if t in (aten.ne.Scalar, aten.eq.Scalar) and isinstance(x, _Labels) and _int(a[1]) is not None:
            self._labels(x)
            return _Mask(x, int(a[1]), t is aten.ne.Scalar)
        if t in (aten.bitwise_not.default, aten.logical_not.default) and isinstance(x, _Mask):
            return _Mask(x.labels, x.ii, not x.valid)
        if t is aten.where.self:
            mask = self.value(a[0])
            if not isinstance(mask, _Mask):
                self._fail(n, "selects by a condition other than the ignored labels")
            on, off = (a[1], a[2]) if mask.valid else (a[2], a[1])
            if _const(off) != 0.0:
                self._fail(n, "puts a value other than 0 where the labels are ignored")
            y = self.value(on)
            if isinstance(y, _Labels):
                return _Index(y, mask.ii, y.col)
            if isinstance(y, _Token) and not y.masked:
                return _Token(y.kind, y.weighted, y.coef, True, mask.ii, y.logits)
            if isinstance(y, _TokenWeight) and not y.masked:
                return _TokenWeight(True, mask.ii)
            self._fail(n, "masks a value the matcher does not know")
        if t is aten.gather.default:
            idx = self.value(a[2])
            if not isinstance(idx, _Index):
                self._fail(n, "gathers by an index other than the labels")
            if isinstance(x, _LogP) and a[1] in (1, -1) and idx.col:
                return ("gathered", x)
            if isinstance(x, _Weight) and x.row and a[1] in (1, -1) and idx.col:
                return ("gathered_weight",)
            if isinstance(x, _Weight) and not x.row and a[1] in (0, -1) and not idx.col:  # weight[labels]
                return _TokenWeight(False, None)
            self._fail(n, "gathers in a way the matcher does not know")
        if t in (aten.squeeze.dim, aten.squeeze.dims) and isinstance(x, tuple) and \
                x[0] in ("gathered", "gathered_weight") and list(a[1:2]) in ([1], [-1], [[1]], [[-1]]):
            if x[0] == "gathered":
                return _Token("target", x[1].weighted, 1.0, False, None, x[1].logits)
            return _TokenWeight(False, None)
        if t is aten.index.Tensor and isinstance(x, _Weight) and not x.row:  # weight[labels]
            idx = self.value(a[1][0])
            if isinstance(idx, _Index) and not idx.col:
                return _TokenWeight(False, None)
            self._fail(n)
        if t is aten.sum.dim_IntList and isinstance(x, _LogP) and list(a[1]) in ([1], [-1]) \
                and not (len(a) > 2 and a[2]) and not n.kwargs.get("keepdim"):
            return _Token("all", x.weighted, 1.0, False, None, x.logits)
        if t is aten.sum.default:
            if isinstance(x, _Mask) and x.valid:
                return _Denom("count", x.ii)
            if isinstance(x, _Token):
                if not x.masked:
                    self._fail(n, "sums the tokens without leaving the ignored labels out")
                return _Sum(((x.kind, x.weighted, x.coef, ()),), x.logits, x.ii)
            if isinstance(x, _TokenWeight) and x.masked:
                return _Denom("weights", x.ii)
            self._fail(n, "sums a value the matcher does not know")
        self._fail(n)

    def _flat(self, x: _Logits, node: fx.Node) -> _Logits:
        if node.meta["val"].dim() != 2:
            raise NotDerivable("log_softmax of logits that are not flattened to (tokens, classes)")
        return x

    def _weight(self, n: fx.Node) -> None:
        if self.weight is None:
            self.weight = n
        elif self.weight is not n:
            raise NotDerivable("the loss reads two class weight vectors")

    def _decomposed_log_softmax(self, n: fx.Node) -> Optional[_LogP]:
        """``sub(s, log(sum(exp(s), [1], True)))`` with ``s = sub(x, amax(x, [1], True))``."""
        s, lg = n.args[0], n.args[1]
        if not (isinstance(s, fx.Node) and isinstance(lg, fx.Node) and lg.target is aten.log.default):
            return None
        sm = lg.args[0]
        if not (sm.target is aten.sum.dim_IntList and list(sm.args[1]) in ([1], [-1]) and _keepdim(sm)):
            return None
        ex = sm.args[0]
        if not (ex.target is aten.exp.default and ex.args[0] is s and s.target is aten.sub.Tensor):
            return None
        x, mx = s.args
        if not (isinstance(mx, fx.Node) and mx.target is aten.amax.default and mx.args[0] is x
                and list(mx.args[1]) in ([1], [-1]) and _keepdim(mx)):
            return None
        lx = self.value(x)
        if not isinstance(lx, _Logits):
            return None
        for m in (s, lg, sm, ex, mx):
            self.memo[m] = ("log_softmax part", m)
        return _LogP(self._flat(lx, x))


def _keepdim(n: fx.Node) -> bool:
    return bool(n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False))


def _scaled(x, c: float):
    if isinstance(x, _Logits):
        return x if c == 1.0 else _Logits(x.ops + (("scale", c),), x.upcast)
    if isinstance(x, _Token):
        return _Token(x.kind, x.weighted, x.coef * c, x.masked, x.ii, x.logits)
    return _Sum(tuple((k, w, coef * c, d) for k, w, coef, d in x.terms), x.logits, x.ii)

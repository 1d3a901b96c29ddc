"""Find the classifier head in the joint graph.

Invariants: the logits ``z`` are a user output of shape (s, C) (batch in dim 0) with a tangent
``g``; ``z`` is produced (through views only) by a head, and ``h`` holds the rows the rule's Gram is
built from, ``K = (D D^T) * (H H^T [+ 1 if bias])``, equal to the Gram of the per-example gradients of
every head parameter:

* one Linear, ``addmm(bias, h, W^T)`` or ``mm(h, W^T)``, optionally times a number (a uniform scale
  cancels in CAPSkip's relative bound): ``h`` is its (s, d) input, the same rows as the logits (a head
  over reshaped rows is no head);
* a sum of Linear heads with numeric weights ``sum_k c_k (W_k h_k + b_k)``: ``h`` is a new node
  ``[c_1 h_1, c_1, c_2 h_2, c_2, ...]`` (the constant columns for the heads with a bias), bias False;
* ``L[arange(N), j]`` with ``L`` (s, T, C) from a Linear and ``j`` one index per row (a decoder
  classifier's last token): ``h`` is a new node ``H[arange(N), j]`` of the Linear's (s, T, d) input;
* token-shaped logits ``(s, T, C)`` (a causal LM, token classification) from one Linear applied per
  token: a row is a sequence; ``h`` is the (s, T, d) value the Linear's (s*T, d) input is a view of
  (``Head.tokens``), and the rules read per-sequence quantities (rules/base.py ``head_gram``);
* a cosine head ``s * mm(x, normalize(W).T)`` (``W`` a (C, d) parameter normalised over its rows:
  ``div(W, [expand]([clamp_min](row norms)))`` with the norms ``linalg_vector_norm`` or its decomposition,
  as ``F.normalize`` traces; ``x`` any (s, d) input, normalised or not; ``s`` a number; no bias): the Gram
  is not the rank-one form, so ``h`` is a new (s, 1, d + 2C) node of its features ``[x, Q, s^2 a]``
  (``Head.cosine``; rules/base.py ``cosine_gram``), and the head's mm reads ``x`` back from it (saved).

A weight that is not a parameter (nor ``normalize(W)`` of one, in a single cosine head of (N, C) logits)
or a scale that is a tensor (learnable) is refused with the reason.  The logits output is found from AOT output descriptors when available
(the first plain user output that qualifies), else from the joint graph's output/tangent order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from ..records import RefusalKind, Refused
from ..symbolic import expr_of, shape_exprs, tangent_nodes
from .row_index import is_batch_arange

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default,
          aten.clone.default, aten.squeeze.dim, aten.squeeze.dims}


@dataclass
class Head:
    z: fx.Node  # logits
    g: fx.Node  # logits' tangent placeholder
    h: fx.Node  # head input
    bias: bool
    output_index: int  # which user output holds the logits
    rows: Optional[tuple] = None  # (arange(N), j): the logits are L[arange(N), j] of per-token logits L
    linear_in: Optional[fx.Node] = None  # a sum of heads: the first head's input (h holds the Gram features)
    tokens: Optional[fx.Node] = None  # token-shaped logits (s, T, C): the Linear's (s*T, d) input (h is (s, T, d))
    cosine: Optional[fx.Node] = None  # a cosine head: its mm's input x (h holds the Gram features)


def outputs_and_tangents(graph: fx.Graph) -> list[tuple[int, fx.Node, Optional[fx.Node]]]:
    """[(user_output_index, output_node, tangent_node)] for the joint graph."""
    try:
        from torch._functorch._aot_autograd.descriptors import PlainAOTOutput
        from torch._functorch._aot_autograd.fx_utils import get_all_output_and_tangent_nodes

        pairs = get_all_output_and_tangent_nodes(graph)
        out = [(d.idx, o, t) for d, (o, t) in pairs.items() if isinstance(d, PlainAOTOutput)]
        if out:
            return sorted(out, key=lambda x: x[0])
    except Exception:  # older torch without descriptors: positional fallback below
        pass
    tangents = tangent_nodes(graph)
    outs = list(graph.find_nodes(op="output"))[0].args[0]
    outs = outs[0] if isinstance(outs, (tuple, list)) and outs and isinstance(outs[0], (tuple, list)) else outs
    return [(i, o, t) for i, (o, t) in enumerate(zip(outs, tangents)) if isinstance(o, fx.Node)]


def _producer(n: fx.Node) -> fx.Node:
    while n.op == "call_function" and n.target in _VIEWS:
        n = n.args[0]
    return n


def _match_linear(z: fx.Node) -> Optional[tuple[fx.Node, bool]]:
    p = _producer(z)
    if p.op != "call_function":
        return None
    if p.target == aten.addmm.default:
        return p.args[1], True
    if p.target == aten.mm.default:
        return p.args[0], False
    if p.target in (aten.add.Tensor,):  # mm + bias
        for a, b in ((p.args[0], p.args[1]), (p.args[1], p.args[0])):
            if isinstance(a, fx.Node) and _producer(a).op == "call_function" and _producer(a).target == aten.mm.default:
                return _producer(a).args[0], True
    return None


# a Linear's weight operand reaches its parameter through these (transposes, casts under autocast)
_WEIGHT_PATH = {aten.permute.default, aten.t.default, aten.transpose.int, aten._to_copy.default, aten.alias.default,
                aten.view.default, aten.clone.default, aten.detach.default, torch.ops.prims.convert_element_type.default}


def _is_parameter(w: fx.Node) -> bool:
    while w.op == "call_function" and w.target in _WEIGHT_PATH:
        w = w.args[0]
    return w.op in ("placeholder", "get_attr")


_CASTS = {aten._to_copy.default, aten.alias.default, aten.clone.default, aten.detach.default,
          torch.ops.prims.convert_element_type.default}
_TRANSPOSES = {aten.t.default, aten.permute.default, aten.transpose.int}


def _swaps_2d(n: fx.Node) -> bool:
    """``n`` transposes a 2-D value (t, permute [1, 0], transpose 0 1)."""
    v = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
    if not isinstance(v, torch.Tensor) or v.dim() != 2:
        return False
    if n.target is aten.permute.default:
        return [d % 2 for d in n.args[1]] == [1, 0]
    if n.target is aten.transpose.int:
        return {n.args[1] % 2, n.args[2] % 2} == {0, 1}
    return True


def _strip_casts(n):
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _CASTS:
        n = n.args[0]
    return n


def _call(n, target) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is target


def _row_norm_of(n: fx.Node) -> Optional[fx.Node]:
    """The 2-D value (casts stripped) whose row norms, kept as a (C, 1) column, ``n`` is:
    ``linalg_vector_norm(W, 2, [1], keepdim=True)`` or its decompositions ``pow(sum(pow(W, 2), [1], True), 0.5)``
    and ``sqrt(sum(W * W, [1], True))``; else None."""
    if _call(n, aten.linalg_vector_norm.default):
        args = list(n.args) + [None] * (4 - len(n.args))
        order = args[1] if args[1] is not None else n.kwargs.get("ord", 2)
        dim = args[2] if args[2] is not None else n.kwargs.get("dim")
        keep = args[3] if args[3] is not None else n.kwargs.get("keepdim", False)
        return _strip_casts(n.args[0]) if (order == 2 and keep and _row_dim(dim) and "dtype" not in n.kwargs) else None
    if _call(n, aten.pow.Tensor_Scalar) and n.args[1] == 0.5:
        s = n.args[0]
    elif _call(n, aten.sqrt.default):
        s = n.args[0]
    else:
        return None
    if not (_call(s, aten.sum.dim_IntList) and _row_dim(s.args[1]) and (s.args[2] if len(s.args) > 2 else
                                                                       s.kwargs.get("keepdim", False))):
        return None
    sq = s.args[0]
    if _call(sq, aten.pow.Tensor_Scalar) and sq.args[1] == 2:
        return _strip_casts(sq.args[0])
    if _call(sq, aten.mul.Tensor) and sq.args[0] is sq.args[1]:
        return _strip_casts(sq.args[0])
    return None


def _row_dim(dim) -> bool:
    """``dim`` names only dim 1 (-1) of a 2-D value."""
    return isinstance(dim, (list, tuple)) and len(dim) == 1 and isinstance(dim[0], int) and dim[0] % 2 == 1


@dataclass
class CosineWeight:
    """``normalize(W)`` of a (C, d) parameter over its rows: ``W / clamp_min(|W_c|, eps)``."""

    norm: fx.Node  # (C, 1) row norms |W_c| (before the clamp)
    eps: Optional[float]  # the clamp's minimum (None: no clamp)


def _cosine_weight(w: fx.Node) -> Optional[CosineWeight]:
    """The mm's weight operand is ``normalize(W).T`` of a parameter ``W`` (C, d), normalised over dim 1: one
    transpose (and casts) above ``div(W, [expand]([clamp_min](row_norms(W))))`` (``_row_norm_of``)."""
    flips = 0
    while w.op == "call_function" and (w.target in _CASTS or w.target in _TRANSPOSES):
        if w.target in _TRANSPOSES:
            if not _swaps_2d(w):
                return None
            flips += 1
        w = w.args[0]
    if flips != 1 or w.op != "call_function" or w.target is not aten.div.Tensor or not isinstance(w.args[1], fx.Node):
        return None
    num, den = w.args
    if den.op == "call_function" and den.target is aten.expand.default:
        den = den.args[0]
    eps = None
    if den.op == "call_function" and den.target is aten.clamp_min.default:
        eps = _constant(den.args[1])
        if eps is None:
            return None
        den = den.args[0]
    base = _strip_casts(num)
    wv = num.meta.get("val") if isinstance(num, fx.Node) else None
    if not (isinstance(base, fx.Node) and base.op in ("placeholder", "get_attr") and isinstance(wv, torch.Tensor)
            and wv.dim() == 2 and isinstance(den, fx.Node) and _row_norm_of(den) is base):
        return None
    return CosineWeight(den, eps)


def _weight_of(p: fx.Node) -> Optional[fx.Node]:
    return p.args[2] if p.target == aten.addmm.default else p.args[1] if p.target == aten.mm.default else None


class _Unsupported(Exception):
    """A head form whose CAPSkip Gram we can't follow exactly (the message says why)."""


def _constant(c) -> Optional[float]:
    return float(c) if isinstance(c, (int, float)) and not isinstance(c, bool) else None


def _scalar_tensor(c) -> bool:
    return isinstance(c, fx.Node) and isinstance(c.meta.get("val"), torch.Tensor) and c.meta["val"].dim() == 0


def _terms(z: fx.Node) -> Optional[list]:
    """z as a sum of scaled Linear heads: [(scale, h, bias, the Linear's mm/addmm node)]; None if z is not one.

    Per-example gradient of head k's (W_k, b_k): ``c_k delta (x) [h_k; 1]``, so the Gram over all
    heads' parameters is ``(D D^T) * sum_k c_k^2 (H_k H_k^T + 1)``.
    """
    p = _producer(z)
    if p.op != "call_function":
        return None
    if p.target in (aten.addmm.default, aten.mm.default):
        w = _weight_of(p)
        if not _is_parameter(w):
            if _cosine_weight(w) is None:
                raise _Unsupported(f"the head's weight {w.name} is computed, not a parameter nor normalize(W) of one "
                                   "over its rows (a cosine head); e.g. weight norm or W * 2: CAPSkip's Gram would "
                                   "bound the computed weight's gradient, not the parameters'")
            if p.target is aten.addmm.default:
                raise _Unsupported(f"a cosine head with a bias ({p.name}): its Gram is not followed")
        m = _match_linear(p)
        return [(1.0, m[0], m[1], p)]
    if p.target in (aten.mul.Tensor, aten.div.Tensor):
        a, c = p.args[0], p.args[1]
        if p.target is aten.mul.Tensor and (_constant(a) is not None or _scalar_tensor(a)):
            a, c = c, a
        k = _constant(c)
        if _scalar_tensor(c):
            inner = _terms(a)
            if inner is not None:
                raise _Unsupported(f"the head's logits are scaled by a tensor ({c.name}; a learnable temperature or "
                                   "logit scale): its own gradient is not of the head's rank-one form, so CAPSkip's "
                                   "Gram can't follow it (fold a fixed scale in as a number)")
        if k is None or not isinstance(a, fx.Node) or k == 0:
            return None
        inner = _terms(a)
        k = k if p.target is aten.mul.Tensor else 1.0 / k
        return None if inner is None else [(sc * k, h, b, lin) for sc, h, b, lin in inner]
    if p.target in (aten.add.Tensor, aten.sub.Tensor) and len(p.args) == 2 and all(isinstance(a, fx.Node) for a in p.args):
        alpha = _constant(p.kwargs.get("alpha", 1)) or 0.0
        sign = -alpha if p.target is aten.sub.Tensor else alpha
        left, right = _terms(p.args[0]), _terms(p.args[1])
        if left is not None and right is not None:
            return left + [(sc * sign, h, b, lin) for sc, h, b, lin in right]
        m = _match_linear(p)  # mm + bias
        if m is not None:
            mm = next(_producer(a) for a in p.args if _producer(a).target == aten.mm.default)
            if not _is_parameter(mm.args[1]):
                raise _Unsupported(f"the head's weight {mm.args[1].name} is computed, not a parameter"
                                   + (" (a cosine head with a bias: its Gram is not followed)"
                                      if _cosine_weight(mm.args[1]) else ""))
            return [(1.0, m[0], m[1], mm)]
    return None


def _gram_features(graph: fx.Graph, terms: list, before: fx.Node) -> fx.Node:
    """One (N, sum d_k (+1)) input whose Gram is the heads' ``sum_k c_k^2 (H_k H_k^T + 1)``: the columns
    ``c_k h_k`` and, for a head with a bias, a constant column ``c_k``.

    With one |c_k| for all heads (a uniform factor cancels in the bound) the columns are plain copies,
    ``[h_1, 1, h_2, 1, ...]``, and each head's Linear reads its ``h_k`` back as a slice of them: the
    features are then needed by the forward, so the partitioner saves them for the selection (the same
    values, bit for bit).  Otherwise they are computed for the selection only."""
    fake = terms[0][1].meta["val"].fake_mode

    def node(target, *args, at=before):
        with graph.inserting_before(at):
            n = graph.call_function(target, args)
        vals = [[x.meta["val"] for x in a] if isinstance(a, list) else a.meta["val"] if isinstance(a, fx.Node) else a
                for a in args]
        with fake:
            n.meta["val"] = target(*vals)
        return n

    def column(h, c, at):  # (N, 1) of c: the bias's input
        v = h.meta["val"]
        with graph.inserting_before(at):
            size = graph.call_function(aten.sym_size.int, (h, 0))
            n = graph.call_function(aten.full.default, ([size, 1], c),
                                    {"dtype": v.dtype, "device": v.device, "pin_memory": False})
        size.meta["val"] = v.shape[0]
        with fake:
            n.meta["val"] = torch.full([v.shape[0], 1], c, dtype=v.dtype, device=v.device)
        return n

    order = {n: i for i, n in enumerate(graph.nodes)}
    uniform = len({abs(c) for c, *_ in terms}) == 1
    first_linear = min((lin for *_, lin in terms), key=order.__getitem__)

    def hoist(n: fx.Node, depth: int = 0) -> bool:
        """Move ``n`` (and what it needs) before the first head: pure ops of earlier values only."""
        if order[n] < order[first_linear]:
            return True
        if depth > 8 or n.op != "call_function" or n.is_impure() or n in {lin for *_, lin in terms}:
            return False
        if not all(hoist(a, depth + 1) for a in n.all_input_nodes):
            return False
        first_linear.prepend(n)
        order[n] = order[first_linear] - 0.5
        return True

    if uniform:  # an input taken after the first head ran (head(f[:, 0]) + head_dist(f[:, 1]))
        for _, h, *_ in terms:
            hoist(h)
    order = {n: i for i, n in enumerate(graph.nodes)}
    last_input = max((h for _, h, *_ in terms), key=order.__getitem__)
    if uniform and order[last_input] < order[first_linear] and len({h for _, h, *_ in terms}) == len(terms):
        at = first_linear
        parts, spans, width = [], [], 0
        for _, h, bias, _ in terms:
            d = h.meta["val"].shape[1]
            parts.append(h)
            spans.append((width, width + d))
            width += d
            if bias:
                parts.append(column(h, 1.0, at))
                width += 1
        out = node(aten.cat.default, parts, 1, at=at)
        for (_, h, _, lin), (lo, hi) in zip(terms, spans):
            lin.replace_input_with(h, node(aten.slice.Tensor, out, 1, lo, hi, at=at))
        return out
    parts = []
    for c, h, bias, _ in terms:
        parts.append(node(aten.mul.Tensor, h, c))
        if bias:
            parts.append(column(h, c, before))
    return node(aten.cat.default, parts, 1)


def _cosine_of(terms: list) -> list[Optional[CosineWeight]]:
    """Each term's cosine weight (None: a Linear's parameter)."""
    return [None if _is_parameter(_weight_of(lin)) else _cosine_weight(_weight_of(lin)) for *_, lin in terms]


def _fake_node(graph: fx.Graph, target, args: tuple, before: fx.Node, kwargs: Optional[dict] = None) -> fx.Node:
    """A new node before ``before``, its ``val`` computed under the graph's fake mode."""
    with graph.inserting_before(before):
        n = graph.call_function(target, args, kwargs or {})
    vals = [[x.meta["val"] if isinstance(x, fx.Node) else x for x in a] if isinstance(a, list)
            else a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    fake = next(v for v in (a.meta["val"] for a in n.all_input_nodes) if isinstance(v, torch.Tensor)).fake_mode
    with fake:
        n.meta["val"] = target(*vals, **(kwargs or {}))
    return n


def _cosine_features(graph: fx.Graph, lin: fx.Node, scale: float, cos: CosineWeight) -> fx.Node:
    """The (N, 1, d + 2C) Gram features of the cosine head ``z = scale * mm(x, normalize(W).T)`` (``lin`` the
    mm): ``[x, Q, scale^2 a]`` with ``a_c = 1 / n_c^2`` (``n_c = clamp_min(|W_c|, eps)``) on every row and
    ``Q_ic = z_ic m_c / n_c`` (``m_c = |W_c| > eps``: where the clamp holds, ``normalize`` has no projection
    term).  Row i's gradient of ``W_c`` is ``delta_ic (scale x_i - m_c z_ic W^_c) / n_c``, so
    ``<G_i, G_j> = sum_c delta_ic delta_jc (scale^2 a_c x_i . x_j - Q_ic Q_jc)`` (rules/base.py cosine_gram).

    The head's mm then reads ``x`` back as a slice of the features (the same values, bit for bit), so the
    forward needs them and the partitioner saves them for the selection; ``Q`` takes its own
    ``mm(x, normalize(W).T)`` (the head's would depend on the features).  Inserted before the head's mm."""
    x, w, c = lin.args[0], lin.args[1], cos.norm.meta["val"].shape[0]
    d = x.meta["val"].shape[1]

    def node(target, *args, **kwargs):
        return _fake_node(graph, target, args, lin, kwargs)

    n = node(aten.clamp_min.default, cos.norm, cos.eps) if cos.eps is not None else cos.norm
    inv = node(aten.reciprocal.default, n)
    r = node(aten.mul.Tensor, inv, node(aten.gt.Scalar, cos.norm, cos.eps)) if cos.eps is not None else inv
    r = node(aten.view.default, node(aten.mul.Tensor, r, scale) if scale != 1.0 else r, [1, c])
    q = node(aten.mul.Tensor, node(aten.mm.default, x, w), r)
    a = node(aten.view.default, node(aten.mul.Tensor, node(aten.mul.Tensor, inv, inv), scale * scale), [1, c])
    a = node(aten.expand.default, a, [node(aten.sym_size.int, x, 0), c])
    # at least float32 (autocast: a bf16 Q and a would lose the Gram to cancellation); the mm reads x back
    # cast to its own dtype, exact (a 16-bit float round-trips through float32)
    xdt = x.meta["val"].dtype
    dt = torch.promote_types(xdt, torch.float32)
    parts = [node(aten.unsqueeze.default, t if t.meta["val"].dtype == dt else node(aten._to_copy.default, t, dtype=dt), 1)
             for t in (x, q, a)]
    h = node(aten.cat.default, parts, 2)
    # saved for the selection, never recomputed in the backward (a selected-row backward reads saved values only)
    h.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    x_back = node(aten.squeeze.dim, node(aten.slice.Tensor, h, 2, 0, d), 1)
    lin.replace_input_with(x, x_back if dt == xdt else node(aten._to_copy.default, x_back, dtype=xdt))
    return h


def _same_size(a, b) -> bool:
    """Sizes equal structurally (no guard: a SymInt is compared by its expression)."""
    ea = a.node.expr if isinstance(a, torch.SymInt) else a
    eb = b.node.expr if isinstance(b, torch.SymInt) else b
    return ea == eb


def _per_row(z: fx.Node) -> Optional[tuple[fx.Node, fx.Node, fx.Node]]:
    """z = L[arange(N), j] with L (N, T, C) and j (N,) (a decoder classifier's last token): (L, arange, j)."""
    p = _producer(z)
    if p.op != "call_function" or p.target != aten.index.Tensor or len(p.args[1]) != 2:
        return None
    L, (r, j) = p.args[0], p.args[1]
    lv, zv = L.meta.get("val"), z.meta.get("val")
    if not (isinstance(r, fx.Node) and isinstance(j, fx.Node) and isinstance(lv, torch.Tensor) and lv.dim() == 3):
        return None
    sym = expr_of(zv.shape[0])
    jv = j.meta.get("val")
    if not (is_batch_arange(r, sym) and isinstance(jv, torch.Tensor) and jv.dim() == 1 and expr_of(jv.shape[0]) == sym
            and expr_of(lv.shape[0]) == sym):
        return None
    return L, r, j


def _token_input(graph: fx.Graph, h2d: fx.Node, L: fx.Node, r: fx.Node, j: fx.Node, before: fx.Node) -> Optional[fx.Node]:
    """The head input of the chosen tokens, ``H[arange(N), j]``, as a new node: H is the
    (N, T, d) value the Linear's (N*T, d) input is a view of; inserted before ``before`` (the logits)."""
    n, want = h2d, shape_exprs(L.meta["val"])[:2]
    while True:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() == 3 and shape_exprs(v)[:2] == want:
            break
        if n.op != "call_function" or n.target not in _VIEWS:
            return None
        n = n.args[0]
    with graph.inserting_before(before):
        h = graph.call_function(aten.index.Tensor, (n, [r, j]))
    with n.meta["val"].fake_mode:
        h.meta["val"] = aten.index.Tensor(n.meta["val"], [r.meta["val"], j.meta["val"]])
    return h


def _sequence_input(h2d: fx.Node, z: fx.Node) -> Optional[fx.Node]:
    """The (s, T, d) value the Linear's (s*T, d) input is a view of, for token-shaped logits z (s, T, C)."""
    n, want = h2d, shape_exprs(z.meta["val"])[:2]
    while True:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() == 3 and shape_exprs(v)[:2] == want:
            return n
        if n.op != "call_function" or n.target not in _VIEWS:
            return None
        n = n.args[0]


def _token_head(idx: int, z: fx.Node, g: fx.Node) -> tuple[Optional[Head], Optional[str]]:
    """(Head, None) for token-shaped logits (s, T, C) from one Linear per token, else (None, why not)."""
    try:
        terms = _terms(z)
    except _Unsupported as e:
        return None, f"output {idx}: {e}"
    if terms is not None and any(_cosine_of(terms)):
        return None, f"output {idx}: token-shaped logits (N, T, C) of a cosine head (its Gram is followed for (N, C) only)"
    if terms is None or len(terms) != 1:
        return None, (f"output {idx}: token-shaped logits (N, T, C) not produced by one Linear per token"
                      + (" (a sum of Linear heads)" if terms else ""))
    _, h2d, bias, _ = terms[0]
    hv = h2d.meta.get("val")
    if not isinstance(hv, torch.Tensor) or hv.dim() != 2:
        return None, f"output {idx}: token-shaped logits from a Linear whose input is not (N*T, d)"
    h = _sequence_input(h2d, z)
    if h is None:
        return None, f"output {idx}: token-shaped logits from a Linear whose input is not a view of (N, T, d)"
    return Head(z=z, g=g, h=h, bias=bias, output_index=idx, tokens=h2d), None


def find_head(graph: fx.Graph, logits_index: Optional[int] = None) -> Head:
    candidates = outputs_and_tangents(graph)
    reasons = []
    for idx, z, g in candidates:
        if logits_index is not None and idx != logits_index:
            continue
        val = z.meta.get("val")
        if g is not None and isinstance(val, torch.Tensor) and val.dim() == 3 and val.dtype.is_floating_point:
            head, why = _token_head(idx, z, g)
            if head is not None:
                return head
            reasons.append(why)
            continue
        if g is None or not isinstance(val, torch.Tensor) or val.dim() != 2:
            reasons.append(f"output {idx}: not a 2-D (N, C) or token-shaped (N, T, C) differentiable tensor")
            continue
        per_row = _per_row(z)
        try:
            terms = _terms(per_row[0] if per_row else z)
        except _Unsupported as e:
            reasons.append(f"output {idx}: {e}")
            continue
        if terms is None:
            reasons.append(f"output {idx}: not produced by a Linear (addmm/mm), a sum of Linears or a Linear "
                           "scaled by a number")
            continue
        cosines = _cosine_of(terms)
        if any(cosines):
            if len(terms) > 1 or per_row is not None:
                reasons.append(f"output {idx}: a cosine head " + ("in a sum of heads" if len(terms) > 1 else
                                                                   "read at L[arange(N), j]")
                               + " (its Gram is followed for one cosine head of (N, C) logits only)")
                continue
            sc, x, _, lin = terms[0]
            xv, nv = x.meta.get("val"), cosines[0].norm.meta["val"]
            if not (isinstance(xv, torch.Tensor) and xv.dim() == 2 and _same_size(xv.shape[0], val.shape[0])
                    and _same_size(nv.shape[0], val.shape[1]) and isinstance(nv.shape[0], int)):
                reasons.append(f"output {idx}: a cosine head whose input is not (N, d) of the logits' rows")
                continue
            h = _cosine_features(graph, lin, sc, cosines[0])
            return Head(z=z, g=g, h=h, bias=False, output_index=idx, cosine=x)
        if len(terms) > 1 and per_row is None:
            if any(not _same_size(t[1].meta["val"].shape[0], val.shape[0]) or t[1].meta["val"].dim() != 2
                   for t in terms):
                reasons.append(f"output {idx}: a sum of Linear heads over inputs not of the logits' rows")
                continue
            if len({(t[1], t[2]) for t in terms}) == 1:  # heads of one input: sum_k c_k^2 is a uniform factor
                return Head(z=z, g=g, h=terms[0][1], bias=terms[0][2], output_index=idx, linear_in=terms[0][1])
            h = _gram_features(graph, terms, z)
            return Head(z=z, g=g, h=h, bias=False, output_index=idx, linear_in=terms[0][1])
        if len(terms) > 1:
            reasons.append(f"output {idx}: L[arange(N), j] of a sum of Linear heads")
            continue
        _, h, bias, _ = terms[0]  # one Linear: a uniform scale leaves CAPSkip's relative bound unchanged
        if per_row is not None:
            L, r, j = per_row
            h = _token_input(graph, h, L, r, j, z)
            if h is None:
                reasons.append(f"output {idx}: L[arange(N), j] of a Linear whose input is not (N, T, d)")
                continue
            return Head(z=z, g=g, h=h, bias=bias, output_index=idx, rows=(r, j))
        hv = h.meta.get("val")
        if not isinstance(hv, torch.Tensor) or hv.dim() != 2:
            reasons.append(f"output {idx}: head input is not 2-D")
            continue
        if not _same_size(hv.shape[0], val.shape[0]):
            reasons.append(f"output {idx}: the head's input has {hv.shape[0]} rows, the logits {val.shape[0]} "
                           "(a Linear over reshaped rows, e.g. multiple choice)")
            continue
        return Head(z=z, g=g, h=h, bias=bias, output_index=idx)
    raise Refused("no classifier head: the model output must be logits (N, C) or (N, T, C) from a final Linear"
                  + (f" ({'; '.join(reasons)})" if reasons else ""), RefusalKind.NO_HEAD)

"""CAPSkip: cancellation-aware prefix skipping.

Among the correctly classified rows, ordered by increasing last-layer gradient norm, skip the
LONGEST prefix P_k whose summed last-layer gradient satisfies ``||S_k|| <= b * ||G||``
(G = sum over all rows).  Per-example last-layer gradients are rank one,
``g_i = delta_i (x) [h_i; 1]``, so ``<g_i, g_j> = (delta_i . delta_j)(h_i . h_j + 1)``: the Gram
``K = (D D^T) * (H H^T + 1)`` gives every prefix norm as the leading blocks of the permuted K,
i.e. the diagonal of its 2-D cumulative sum (N^2 (C + d)); running sums of the rows' gradients give the
same numbers in O(N C d) (base.prefix_sq_norms), and the cheaper route runs (base.prefix_route).  All
prefixes are scanned because ``||S_k||`` is not monotone in k (off-diagonal K entries can be negative).

Invariants (tested in tests/test_rule_capskip.py against explicit per-example gradients):
  * the skip set is a prefix of the correct rows in increasing-norm order (ties: batch order);
  * ``||S_k|| <= b ||G||`` holds for it and fails for every longer prefix;
  * misclassified rows (and rows with unknown label) are never skipped;
  * b = 0 skips exactly the rows whose gradient is zero (they are free);
  * b = 1 with every row correct skips all rows (S_N = G).
The budget is scale invariant: 1/N, loss scaling and accumulation factors cancel.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import (PREFIX_ROUTES, HeadView, Rule, Selection, check_normalize, head_gram, is_cosine, positions,
                   prefix_diagonal, prefix_route, prefix_sq_norms, scalar_one, selection_dtype)
from .labels import correct_mask


def capskip_weights(delta: Tensor, h: Tensor, correct: Tensor, budget: float, bias: bool = True,
                    sketch: Optional[int] = None, generator: Optional[torch.Generator] = None,
                    route: Optional[str] = None, block: Optional[int] = None):
    """Pure tensor core of CAPSkip (no host sync).  Returns ``(weight, bound, n_skip)``.

    ``weight``: (N,) 1 for kept rows, 0 for skipped.  ``bound``: ``||S_k|| / ||G||`` of the
    chosen prefix (0 when nothing is skipped; 0 when G = 0).  ``n_skip``: 0-dim int64.
    (N, C) rows: the prefix norms by ``route`` (base.prefix_sq_norms: ``"gram"`` or ``"running"``, both
    exact; None: the cheaper), ``block`` rows per block of the running sums (None: base.prefix_block);
    ``sketch=k`` replaces delta by ``delta P`` (P: C x k, i.i.d. N(0, 1/k), drawn from ``generator``) in the
    prefix norms, the sort key staying exact.  A cosine head's features: its Gram (base.cosine_gram).
    Token-shaped delta (N, T, C) and h (N, T, d): rows are sequences, the Gram is the sequences'
    (exact, or sketched with ``sketch`` columns: base.head_gram).
    """
    dt = selection_dtype(delta)
    n = delta.shape[0]
    d = delta
    if d.dim() == 2 and not is_cosine(d, h):
        dd = d if d.dtype == dt else d.to(dt)
        x = h if h.dtype == dt else h.to(dt)
        # the sort key from row-wise reductions: exactly tied rows (duplicates, cancelling pairs) keep batch
        # order; the bias as an implicit ones column [h, 1] (no padded copy of h).  vector_norm reduces h in
        # one pass where vecdot writes an (N, d) product first (3x slower on a cold N = 1024 x 512 h)
        nx = torch.linalg.vector_norm(x, dim=1)
        xx = torch.addcmul(scalar_one(nx), nx, nx) if bias else nx.square()  # ||[h, 1]||^2 or ||h||^2
        diag = torch.linalg.vecdot(dd, dd) * xx
        if sketch:
            dev = generator.device if generator is not None else dd.device
            p = torch.randn(dd.shape[1], sketch, generator=generator, device=dev, dtype=dt).to(dd.device)
            dd = dd @ (p / math.sqrt(sketch))
        key = torch.where(correct, diag, math.inf)
        key_sorted, order = torch.sort(key, stable=True)
        prefix_sq, _ = prefix_sq_norms(dd.index_select(0, order), x.index_select(0, order), route, block, bias)
    else:
        # the sort key from row-wise sums, not diag(K): GEMM may round equal rows differently, and
        # exactly tied rows (duplicates, cancelling pairs) must keep batch order
        K, diag, _ = head_gram(delta, h, bias, sketch, generator)
        key = torch.where(correct, diag, math.inf)
        key_sorted, order = torch.sort(key, stable=True)
        Ks = K.index_select(0, order).index_select(1, order)
        prefix_sq = prefix_diagonal(Ks)
    # correct rows first, by increasing ||g_i||^2 (stable: batch order for ties)
    prefix_sq = prefix_sq.clamp_min(0)  # ||S_k||^2, k = 1..N
    # ||G||^2 as the full prefix, so S_N == G exactly when every row is a candidate; as a ratio to it
    # (0 when G = 0: every prefix meets b * 0 only with norm 0)
    total = prefix_sq[-1] if n > 0 else prefix_sq.new_zeros(())
    ratio = prefix_sq / total.clamp_min(torch.finfo(dt).tiny)
    ks = positions(n, d.device)
    if budget == 0:  # only rows that contribute nothing are free (key 0: correct, zero gradient)
        ok = (prefix_sq == 0) & (key_sorted == 0).cumprod(0).bool()
    else:  # only correct rows: the others sort last with key inf, and ratio + 0 * inf is NaN, never <= b^2
        ok = ratio.add(key_sorted, alpha=0) <= budget * budget
    n_skip = (ks * ok).max() if n > 0 else torch.zeros((), dtype=torch.long, device=d.device)
    # row order[i] is skipped for i < n_skip; order is a permutation: the scatter writes every row
    kept_sorted = (ks > n_skip).to(dt)
    weight = kept_sorted.scatter(0, order, kept_sorted)
    bound = torch.take(F.pad(ratio, (1, 0)), n_skip).sqrt()  # ||S_0|| = 0 first; no read of n_skip
    return weight, bound, n_skip


def _select_eager(delta, h, z, targets, budget: float, bias: bool, sketch=None, generator=None, route=None):
    correct = correct_mask(delta, z, targets)
    weight, bound, _ = capskip_weights(delta, h, correct, budget, bias, sketch, generator, route)
    return weight, bound, correct


def _select_static(delta, h, z, targets, budget: float, bias: bool, route=None):
    """_select_eager under its own code object: Dynamo counts the compiled variants of the static-shape
    selection apart from the dynamic one's."""
    return _select_eager(delta, h, z, targets, budget, bias, route=route)


# The compiled selections, one per kind for every CAPSkip (a torch.compile object per rule would add its
# own Dynamo cache entries to the shared code object), and the variants each has compiled.  fullgraph=True
# turns Dynamo's recompile limit into a hard error, so a variant past the limit runs eagerly instead.
_COMPILED: dict = {}
_VARIANTS: dict = {"dynamic": set(), "static": set()}


def _compiled(kind: str, delta: Tensor, h: Tensor, targets, budget: float, bias: bool):
    """The compiled selection of ``kind`` ("dynamic": any N; "static": one compile per shape), or
    _select_eager where a new variant would pass Dynamo's recompile limit."""
    shape = tuple(delta.shape) + tuple(h.shape) if kind == "static" else tuple(min(s, 2) for s in delta.shape)
    key = (shape, delta.dtype, h.dtype, str(delta.device), budget, bias,
           None if targets is None else (targets.dtype, str(targets.device)))
    seen = _VARIANTS[kind]
    if key not in seen:
        if len(seen) >= torch._dynamo.config.recompile_limit - 1:
            return _select_eager
        seen.add(key)
    fn = _COMPILED.get(kind)
    if fn is None:
        fn = _COMPILED[kind] = (torch.compile(_select_eager, dynamic=True, fullgraph=True) if kind == "dynamic"
                                else torch.compile(_select_static, dynamic=False, fullgraph=True))
    return fn


class CAPSkip(Rule):
    """Skip the longest low-norm prefix of correct rows within relative budget ``b``.

    ``budget`` must lie in [0, 1]: at b = 1 the applied head gradient may differ from the
    dense one by up to its own norm (with every row correct, everything is skipped).
    ``bias=False`` drops the head-bias term (the ``+1``) when the head has no bias.
    ``compile``: run the selection as one Inductor-compiled graph (dynamic N; one compile per
    budget/bias), so it is fused like the rest of the step.  ``None`` (default): on CUDA only,
    where kernel-launch count matters; on CPU the eager ops cost < 1 ms at N = 128.  The running sums
    (large N) compile only with ``compile=True``, with static shapes (one compile per batch size, about 5 s
    on 2 CPU cores, and past Dynamo's recompile limit eager again; Inductor takes minutes over their padded
    blocks under a dynamic N): at N = 1024, C = 10, d = 512 on 2 threads that saves 0.02-0.03 of the forced
    rule's step in the step, while the selection alone, timed warm, ranges from 29 % faster to 11 % slower
    (docs/benchmarks.md, Selection cost).  The compiled variants are shared by every CAPSkip; one that would
    pass Dynamo's recompile limit (fullgraph=True makes that an error) runs eagerly.
    ``normalize``: ``"batch"`` (default: the loss's own 1/N, so the bound ``||S_k|| <= b ||G||``
    is the bound on the applied head gradient's change) or ``"kept"`` (mean over the kept rows;
    the bound then no longer holds as stated, algorithms.md §1.3).
    Token-shaped logits (N, T, C): a row is a sequence, every sequence is a candidate, and the Gram is the
    sequences' head gradients ``G_i = sum_t delta_it (x) [h_it; 1]``: exact while it is small, else a
    random sketch of width ``sketch`` (None: auto; 0: always exact), base.head_gram.
    (N, C) logits: the prefix norms from the Gram or from running sums, whichever costs fewer multiply-adds
    (``route=None``; ``"gram"`` or ``"running"`` to force one: the same selection up to rounding), sketched
    only when asked (``sketch=k``).
    """

    name = "capskip"
    needs_labels = True  # skips among the correctly classified rows
    reads_logits = False  # token-shaped heads: every sequence is a candidate, the Gram reads dL/dz and h

    def __init__(self, budget: float = 0.1, bias: bool = True, compile: Optional[bool] = None,
                 normalize: str = "batch", sketch: Optional[int] = None, route: Optional[str] = None):
        budget = float(budget)
        if not (0.0 <= budget <= 1.0):  # also rejects NaN
            raise ValueError(f"capskip budget must be in [0, 1], got {budget!r}; "
                             "b is the allowed relative change of the last-layer gradient")
        self.budget = budget
        self.normalize = check_normalize(normalize, "capskip")
        self.bias = bias
        if sketch is not None and (int(sketch) != sketch or sketch < 0):
            raise ValueError(f"capskip sketch must be None (auto), 0 (exact) or a width k >= 1, got {sketch!r}")
        self.sketch = None if sketch is None else int(sketch)
        if route is not None and route not in PREFIX_ROUTES:
            raise ValueError(f"capskip route must be None (auto) or one of {PREFIX_ROUTES}, got {route!r}")
        self.route = route
        self.compile = compile

    def select(self, view: HeadView) -> Selection:
        bias = self.bias and view.head_bias
        if view.tokens or self.sketch:  # eager: the sketch draws from a generator
            weight, bound, correct = _select_eager(view.delta, view.h, view.z, view.targets, self.budget, bias,
                                                   self.sketch, view.generator, self.route)
            return self.finish(Selection(weight=weight, bound=bound, info={"correct": correct}))
        route = self.route
        if route is None and not is_cosine(view.delta, view.h):
            route = prefix_route(view.n, view.delta.shape[1], view.h.shape[1] + int(bias))[0]
        if route == "running":  # static shapes, and only when asked: a compile per batch size
            kind = "static" if self.compile else None
        else:
            kind = "dynamic" if self.compile or (self.compile is None and view.delta.device.type == "cuda") else None
        fn = _select_eager if kind is None else _compiled(kind, view.delta, view.h, view.targets, self.budget, bias)
        weight, bound, correct = fn(view.delta, view.h, view.z, view.targets, self.budget, bias, route=route)
        return self.finish(Selection(weight=weight, bound=bound, info={"correct": correct}))

    def __repr__(self) -> str:
        norm = "" if self.normalize == "batch" else f", normalize={self.normalize!r}"
        route = "" if self.route is None else f", route={self.route!r}"
        return f"CAPSkip(budget={self.budget}, bias={self.bias}{norm}{route})"


"""The one interface every selection rule implements.

A rule sees what the classifier head saw in one step (a :class:`HeadView`) and returns a
:class:`Selection`: one weight per example.  ``weight == 0`` means the row is skipped (its
backward is not run); a kept row's incoming gradient is scaled by its weight (1 for
unweighted rules, ``1/pi`` for Horvitz-Thompson rules).  The loss keeps its ``1/N``: the
applied gradient is ``sum_i w_i * grad(l_i) / N``.

Normalisation (the ``normalize`` option every rule takes; :func:`normalize_weight`):
  * ``"batch"``: the weights as the rule computed them, the loss's own ``1/N`` stays
    (CAPSkip, KABENA, UB, random, forced);
  * ``"kept"``: the weights are rescaled by ``N / sum(w)``, so the step is the (weighted) mean over
    the back-propagated rows; for 0/1 weights that is ``N / k`` per kept row, i.e. the mean over
    the k kept rows.  This is Selective-Backprop's and Composer's semantics (both train on the
    selected rows' mean loss), the default of ``sb`` and ``stale_sb``.  A step that keeps nothing
    stays all zero.
Rules apply it once, through :meth:`Rule.finish`, to the Selection they return.

Rules run in the backward runtime, after the forward.  Their tensors live on the model's
device; selection math is done in float32 (or float64 when the model is float64).

Randomised rules derive from :class:`SeededRule`: draws use ``view.generator`` when the runtime
passes one, else the rule's own generator, seeded with ``seed`` and created lazily on the tensors'
device; its state is part of ``state_dict()``.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from .labels import infer_targets, per_example_ce, sequence_losses


def selection_dtype(t: Tensor) -> torch.dtype:
    """Selection math runs in float64 for float64 models, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@dataclass
class HeadView:
    """What the head saw in one step.  All row-indexed tensors have N rows."""

    # token-shaped heads (a causal LM, token classification): delta and z are (N, T, C), h (N, T, d) and
    # targets (N, T); a row is a sequence (``tokens``), and the rules read per-sequence quantities
    # (view_losses, head_gram)
    # a cosine head (``s * normalize(x) @ normalize(W).T``): h is (N, 1, d + 2C), its Gram features
    # (passes/heads/cosine.py; is_cosine, cosine_gram)
    # (N, C) dL/dz: the logits' incoming gradient (includes 1/N and any loss scale); None for a rule that
    # does not read it (Rule.reads_gradient False) when an in-graph loss's backward has not run yet
    delta: Optional[Tensor]
    h: Tensor  # (N, d) head input (penultimate features)
    z: Tensor  # (N, C) logits
    targets: Optional[Tensor] = None  # (N,) int64 labels: explicit, or inferred from delta; -1 = unknown
    index: Optional[Tensor] = None  # (N,) dataset indices when the data side provides them
    step: int = 0
    epoch: int = 0
    generator: Optional[torch.Generator] = None
    head_bias: bool = True  # the head Linear has a bias (CAPSkip's Gram gets the +1)
    # z holds the logits' values.  False (token-shaped logits, the loss outside the graph, a rule that reads
    # none: Rule.reads_logits): z is the (N, T, 1) stand-in the head graph kept instead, each token's
    # largest |z| (finite where the logits are)
    logits: bool = True

    @property
    def n(self) -> int:
        return self.z.shape[0]

    @property
    def tokens(self) -> bool:
        """Token-shaped logits (N, T, C): a row is a sequence."""
        return self.z.dim() == 3


def is_cosine(delta: Tensor, h: Tensor) -> bool:
    """(N, C) delta with (N, 1, d + 2C) h: a cosine head's Gram features."""
    return delta.dim() == 2 and h.dim() == 3


def cosine_gram(delta: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """``(K, diag)`` of a cosine head ``z = s * x @ normalize(W).T`` from its features ``h = [x, Q, s^2 a]``
    (N, 1, d + 2C) (passes/heads/cosine.py): ``a_c = 1 / |W_c|^2``, ``Q_ic = z_ic / |W_c|`` (0 where
    ``normalize``'s clamp holds).  Row i's gradient of ``W_c`` is ``delta_ic (s x_i - z_ic W^_c) / |W_c|``
    (``W^_c`` unit, ``z_ic = s x_i . W^_c``), so
    ``K = (D diag(s^2 a) D^T) * (X X^T) - (D * Q)(D * Q)^T``; the diagonal from row-wise sums (ties).
    A difference of two terms: its rounding error is relative to the first, so a row whose x lies almost
    along W_c (a confident row, ``|z_ic| ~ |s| |x_i|``) has that class's part of its Gram only to about
    ``eps / (1 - cos^2)`` (float32 selection math: eps ~ 1e-7)."""
    c = delta.shape[1]
    f = h.reshape(h.shape[0], -1)
    x, q, a = f[:, :-2 * c], f[:, -2 * c:-c], f[:1, -c:]
    da, dq = delta * a.sqrt(), delta * q
    K = (da @ da.T) * (x @ x.T) - dq @ dq.T
    return K, ((da * da).sum(1) * (x * x).sum(1) - (dq * dq).sum(1)).clamp_min(0)


def view_losses(view: HeadView, dtype: torch.dtype) -> Tensor:
    """Per-example CE in ``dtype``; NaN where the label is unknown.  Token-shaped heads: the per-sequence
    loss over the tokens that count (labels.sequence_losses)."""
    if view.tokens:
        if not view.logits:
            raise RuntimeError("capskip_fx: a rule read per-sequence losses from a head graph that kept no logits "
                               "(Rule.reads_logits is False for it); set reads_logits = True on the rule")
        return sequence_losses(view.delta, view.z, view.targets).to(dtype)
    targets = infer_targets(view.delta) if view.targets is None else view.targets.to(view.z.device).long()
    return per_example_ce(view.z, targets).to(dtype)


#: token-shaped heads: an exact form of the sequence Gram (the per-sequence gradients, N x C x (d+1) numbers,
#: or the token Gram, (N*T)^2) is used while it fits in this many elements and costs at most twice the sketch
EXACT_GRAM_ELEMENTS = 1 << 24
#: the sketch's width k (columns of the vocabulary projection P)
SKETCH_DIM = 128


def head_gram(delta: Tensor, h: Tensor, bias: bool = True, sketch: Optional[int] = None,
              generator: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor, bool]:
    """``(K, diag, exact)``: the Gram ``K_ij = <g_i, g_j>`` of the rows' head (last-layer) gradients,
    ``g_i = delta_i (x) [h_i; 1]`` (no ``1`` without a bias), its diagonal (for (N, C) rows from row-wise
    sums, so equal rows tie exactly), and whether K is exact, in the selection dtype.

    (N, C) delta: ``K = (D D^T) * (H H^T + 1)``, exact; with a cosine head's (N, 1, d + 2C) features h,
    its Gram (cosine_gram), exact.  Token-shaped (N, T, C) delta, h (N, T, d): a row is
    a sequence, ``G_i = sum_t delta_it (x) [h_it; 1] = D_i^T H~_i`` (C x (d+1)):
      * exact (``sketch=0``, or ``None`` while one of its forms fits in EXACT_GRAM_ELEMENTS and costs at most
        twice the sketch): the G_i materialised (N*T*C*(d+1) multiply-adds), or the token Gram summed per
        pair of sequences ((N*T)^2 (C+d+1)), whichever costs less (``sequence_gram_exact``);
      * sketched (``sketch=k``, or ``None`` above that, k = SKETCH_DIM): ``G~_i = P^T D_i^T H~_i`` (k x (d+1))
        with P (C x k) of i.i.d. N(0, 1/k) entries drawn from ``generator``, so
        ``E[<G~_i, G~_j>] = <G_i, G_j>`` (unbiased: ``E[P P^T] = I``), with
        ``Var[<G~_i, G~_j>] = (||S||_F^2 + tr(S^2)) / k <= 2 ||G_i||^2 ||G_j||^2 / k`` (``S = G_j G_i^T``):
        any sum of rows' gradients A (a prefix S_k, the batch's G) has ``||P^T A||^2`` unbiased for
        ``||A||^2`` with relative standard deviation at most sqrt(2/k) (docs/rules.md).
        Cost N*T*C*k for D P, N*T*k*(d+1) for the rest.
    """
    dt = selection_dtype(delta)
    d, x = delta.to(dt), h.to(dt)
    if is_cosine(d, x):  # a cosine head (no bias): its own Gram, exact
        return (*cosine_gram(d, x), True)
    if d.dim() == 2:
        one = 1 if bias else 0
        K = (d @ d.T) * (x @ x.T + one)
        # from row-wise sums, not diag(K): GEMM may round equal rows differently (CAPSkip's ties)
        return K, (d * d).sum(1) * ((x * x).sum(1) + one), True
    if bias:
        x = torch.cat([x, torch.ones_like(x[..., :1])], -1)
    n, t, c = d.shape
    e = x.shape[-1]
    cost = {"sequences": n * t * c * e, "tokens": (n * t) ** 2 * (c + e)}  # multiply-adds of each exact form
    size = {"sequences": n * c * e, "tokens": (n * t) ** 2}
    if sketch is None:  # auto: exact where a form fits and costs at most twice the sketch, else the sketch
        sketch_cost = (n * t + 16) * c * SKETCH_DIM  # D P, and drawing P (~16 multiply-adds a normal)
        fits = [r for r in cost if size[r] <= EXACT_GRAM_ELEMENTS and cost[r] <= 2 * sketch_cost]
        sketch = 0 if fits else SKETCH_DIM
    if sketch == 0:
        route = min(cost, key=cost.__getitem__)
        K = sequence_gram_exact(d, x, route)
        return K, K.diagonal().clone(), True
    dev = generator.device if generator is not None else d.device
    p = torch.randn(c, sketch, generator=generator, device=dev, dtype=dt).to(d.device) / math.sqrt(sketch)
    g = torch.einsum("ntk,nte->nke", d @ p, x).reshape(n, -1)  # P^T D_i^T H~_i, (N, k (d+1))
    return g @ g.T, (g * g).sum(1), False


def sequence_gram_exact(d: Tensor, x: Tensor, route: str) -> Tensor:
    """The exact sequence Gram of (N, T, C) ``d`` and (N, T, e) ``x`` (``x`` already holds the bias column):
    ``"sequences"`` materialises each ``G_i = D_i^T X_i`` (N C e numbers); ``"tokens"`` sums the token Gram
    ``(D D^T) * (X X^T)`` ((N T)^2 numbers) over each pair of sequences' blocks."""
    n, t, c = d.shape
    if route == "sequences":
        g = torch.einsum("ntc,nte->nce", d, x).reshape(n, -1)
        return g @ g.T
    if route != "tokens":
        raise ValueError(f"route must be 'sequences' or 'tokens', got {route!r}")
    df, xf = d.reshape(n * t, c), x.reshape(n * t, -1)
    return ((df @ df.T) * (xf @ xf.T)).view(n, t, n, t).sum((1, 3))


#: CAPSkip's prefix-norm routes over rank-one rows (prefix_sq_norms)
PREFIX_ROUTES = ("gram", "running")
#: the running-sum route's smallest block: batched matmuls of fewer rows run far below the machine's rate
MIN_PREFIX_BLOCK = 32
#: from this many rows the smallest block doubles: the exclusive prefix ``E @ u`` costs ``(N / B)^2 C e``,
#: as much as the block sums at N = 1024 with 32-row blocks; 64-row blocks ran 14-27 % faster at N = 1024
#: and 4096 with C = 10 on 2 threads, 32-row ones 10-20 % faster at N = 256
#: (benchmarks/results/prefix_block_sweep_t2.json)
LARGE_BATCH_ROWS = 512
#: the running-sum route's extra ops (about ten) priced in multiply-adds (~50 us on one CPU thread)
RUNNING_FIXED_COST = 1 << 21
#: a multiply-add in the running sums' small batched matmuls against one in the Gram's large ones: at 1.0 the
#: model picked the running sums at N = 256, C = 100 where the Gram ran 14-35 % faster on 2 threads
#: (docs/benchmarks.md, Selection cost)
RUNNING_MAC_COST = 1.5


def prefix_block(c: int, e: int, n: int = 0) -> int:
    """Rows per block of the running-sum route for N = ``n`` rows (a power of two): per row it costs ``2 C e``
    (the block sums, the products with the running sum) plus ``B (C + e)`` (its block's Gram), and the
    running sums themselves ``(N / B)^2 C e`` in all.  B near ``C e / (C + e)``, at least MIN_PREFIX_BLOCK
    rows, twice that from LARGE_BATCH_ROWS rows: a measured floor (the small batched matmuls run below the
    machine's rate, which counting multiply-adds misses), not the cost model's minimum."""
    floor = MIN_PREFIX_BLOCK * (2 if n >= LARGE_BATCH_ROWS else 1)
    return max(floor, 1 << max(0, round(math.log2(max(1.0, c * e / (c + e))))))


def prefix_route(n: int, c: int, e: int) -> tuple[str, int]:
    """``(route, block)`` of least cost for N rank-one rows ``d_i (x) x_i`` (C by e), in multiply-adds: the
    Gram ``N^2 (C + e)`` while N is small against ``C e / (C + e)``, else running sums
    ``N (2 C e + B (C + e)) + (N / B)^2 C e`` (the last: the exclusive prefix over the blocks, a matmul),
    each at RUNNING_MAC_COST, plus their fixed cost (RUNNING_FIXED_COST)."""
    b = prefix_block(c, e, n)
    nb = -(-n // b)
    gram = n * n * (c + e)
    running = RUNNING_MAC_COST * (n * (2 * c * e + b * (c + e)) + nb * nb * c * e) + RUNNING_FIXED_COST
    return ("gram", n) if gram <= running else ("running", b)


def prefix_diagonal(K: Tensor) -> Tensor:
    """The diagonal of K's 2-D cumulative sum, ``sum_{i, i' <= j} K[..., i, i']`` for every j, over the last
    two dims.  Scans along the last dim only (``K.cumsum(-1)``, then the upper triangle's column sums): a scan
    down the rows of a wide tensor strides by a whole row per element and, at power-of-two widths, collides
    in the cache (8x slower on a 1024 x 1024 K)."""
    return torch.triu(K.cumsum(-1)).sum(-2)


def _constant(cache: dict, key: tuple, make) -> Tensor:
    """``make()``, made once per ``key`` in ``cache`` (at most 64 keys: ragged batch sizes keep the memory
    bounded); made afresh while compiling, where Dynamo would guard on the dict and recompile as it grows.
    The tensors are shared: never modify one in place."""
    if torch.compiler.is_compiling():
        return make()
    t = cache.get(key)
    if t is None:
        if len(cache) >= 64:
            cache.clear()
        t = cache[key] = make()
    return t


_ONE: dict = {}


def scalar_one(like: Tensor) -> Tensor:
    """A 0-dim 1 of ``like``'s dtype and device, made once per key (``torch.addcmul(one, a, a)`` is ``a^2 + 1``
    in one op).  Never modify it in place."""
    return _constant(_ONE, (like.dtype, like.device), lambda: torch.ones((), dtype=like.dtype, device=like.device))


_EXCLUSIVE: dict = {}


def exclusive_prefix(nb: int, like: Tensor) -> Tensor:
    """(nb, nb) strictly lower-triangular ones (``like``'s dtype and device), made once per key: ``E @ u`` is
    u's exclusive running sum over dim 0, a matmul where ``cumsum(0)`` of a wide u strides through memory."""
    return _constant(_EXCLUSIVE, (nb, like.dtype, like.device),
                     lambda: torch.ones(nb, nb, dtype=like.dtype, device=like.device).tril_(-1))


def prefix_sq_norms(d: Tensor, x: Tensor, route: Optional[str] = None, block: Optional[int] = None,
                    bias: bool = False) -> tuple[Tensor, str]:
    """``(||S_k||^2 for k = 1..N, route)`` with ``S_k = sum_{i<=k} d_i (x) x_i``: rows already in prefix order,
    ``d`` (N, C), ``x`` (N, e); ``bias``: each x_i with an implicit ones column ``[x_i, 1]``, whose part of
    ``||S_k||^2`` is ``||sum_{i<=k} d_i||^2`` (no padded copy of x).  Both routes are exact (float rounding apart):
      * ``"gram"``: ``K = (D D^T) * (X X^T)``, the diagonal of its 2-D cumulative sum (N^2 numbers);
      * ``"running"``: blocks of B rows; before block b the running sum ``S_b`` (C x e) of the earlier blocks,
        and for row j of the block ``||S_b + P_j||^2 = ||S_b||^2 + 2 <S_b, P_j> + ||P_j||^2`` with ``P_j`` the
        block's own prefix: ``<S_b, g_i> = d_i^T S_b x_i`` and the block's B x B Gram.  All blocks at once
        (batched matmuls, no Python loop); O(N C e + N B (C + e) + (N / B)^2 C e) multiply-adds (the last:
        the running sums before each block, a strictly lower-triangular matmul), O(N (C + e)) memory.
    ``route`` None: prefix_route's choice; ``block`` None: prefix_block's."""
    n, c = d.shape
    e = x.shape[1]
    if route is None:
        route, auto_block = prefix_route(n, c, e + int(bias))
        block = block or auto_block
    if route not in PREFIX_ROUTES:
        raise ValueError(f"prefix route must be one of {PREFIX_ROUTES} or None, got {route!r}")
    if route == "gram" or n == 0:
        dd, xx = torch.inner(d, d), torch.inner(x, x)
        # (D D^T) * (X X^T + 1) as D D^T + (D D^T) * (X X^T): one op, no (N, N) ones
        return prefix_diagonal(torch.addcmul(dd, dd, xx) if bias else dd * xx), "gram"
    return _running_sq_norms(d, x, block or prefix_block(c, e + int(bias), n), bias), "running"


def _running_sq_norms(d: Tensor, x: Tensor, block: int, bias: bool) -> Tensor:
    """prefix_sq_norms's ``"running"`` route, ``block`` rows per block.  The bias column's share of S_b is
    ``sigma_b = sum d_i`` over the earlier blocks (C numbers a block): never a running sum down all N rows,
    whose ``cumsum(0)`` over a wide d strides through memory (2.6 ms at N = 1024, C = 1000)."""
    n, c = d.shape
    e = x.shape[1]
    bs = max(1, int(block))
    nb = -(-n // bs)
    pad = nb * bs - n  # zero rows at the end: they add nothing, and their prefixes are dropped
    if pad:
        d, x = torch.cat([d, d.new_zeros(pad, c)]), torch.cat([x, x.new_zeros(pad, e)])
    db, xb = d.reshape(nb, bs, c), x.reshape(nb, bs, e)
    xt = xb.transpose(1, 2)
    ex = exclusive_prefix(nb, d)
    u = db.transpose(1, 2) @ xb  # (nb, C, e): each block's summed gradient
    s = (ex @ u.reshape(nb, -1)).view(u.shape)  # the running sum before each block
    # <S_b, g_i> = d_i . (S_b x_i) or (d_i S_b) . x_i: the product over the smaller of C and e first, so
    # the (nb, B, min(C, e)) temporary is the small one
    cross = (torch.linalg.vecdot(db, (s @ xt).transpose(1, 2)) if c <= e
             else torch.linalg.vecdot(db @ s, xb))
    dd, xx = db @ db.transpose(1, 2), xb @ xt
    before = torch.linalg.vector_norm(s.view(nb, -1), dim=1).square()  # ||S_b||^2, one pass
    if bias:  # [x_i, 1]: S_b's last column sigma_b, and the blocks' Grams (D D^T) * (X X^T + 1)
        sigma = ex @ db.sum(1)
        cross = cross + (db @ sigma[:, :, None]).squeeze(-1)
        before = before + torch.linalg.vecdot(sigma, sigma)
        own = prefix_diagonal(torch.addcmul(dd, dd, xx))
    else:
        own = prefix_diagonal(dd * xx)  # ||P_j||^2
    out = before[:, None] + 2 * cross.cumsum(1) + own
    return out.reshape(-1)[:n]


_POSITIONS: dict = {}


def positions(n: int, device: torch.device) -> Tensor:
    """``1..n`` (int64) on ``device``, made once per (n, device): rules compare against it every step (an
    arange is one more eager op).  Never modify it in place."""
    return _constant(_POSITIONS, (n, torch.device(device)), lambda: torch.arange(1, n + 1, device=device))


@dataclass
class Selection:
    """A rule's decision: ``weight[i] == 0`` skips row i."""

    weight: Tensor  # (N,) float, finite, >= 0
    bound: Optional[Tensor] = None  # scalar tensor; for capskip ||S_k|| / ||G||
    info: dict[str, Any] = field(default_factory=dict)
    # kept rows (weight != 0) when the host knows it without reading the device (a fixed count): the
    # step then reads nothing.  Set it only if the rule's state never depends on the step's values: it
    # runs even on a step that falls back (non-finite), with no read to undo it.
    count: Optional[int] = None


#: the values of every rule's ``normalize`` option
NORMALIZE = ("batch", "kept")


def check_normalize(value: str, rule: str) -> str:
    if value not in NORMALIZE:
        raise ValueError(f"{rule} normalize must be one of {NORMALIZE}, got {value!r}")
    return value


def normalize_weight(weight: Tensor, mode: str) -> Tensor:
    """``"batch"``: ``weight`` unchanged.  ``"kept"``: ``weight * N / sum(weight)`` (``N / k`` per
    kept row for 0/1 weights; all-zero weights stay zero).  No host sync."""
    if mode == "batch" or weight.numel() == 0:
        return weight
    tot = weight.sum()
    scale = weight.shape[0] / tot.clamp_min(torch.finfo(weight.dtype).tiny)
    return torch.where(tot > 0, weight * scale, weight)


class Journal:
    """What one step changed in a rule's state, so that a step that falls back can be undone: O(what the step
    wrote), never a copy of the whole state.  A rule notes each change BEFORE making it: ``attr`` before it
    rebinds an attribute (the old object is kept: rebind, never modify that object in place afterwards),
    ``rows`` before it writes rows of a tensor in place (their old values are kept)."""

    def __init__(self) -> None:
        self._undo: list = []
        self.drawn: list = []  # generators whose state is already noted

    def attr(self, obj: Any, name: str) -> None:
        old = getattr(obj, name)
        self._undo.append(lambda: setattr(obj, name, old))

    def rows(self, t: Tensor, index: Tensor) -> None:
        """``t[index]`` is about to be written in place (any index ``t[index] = v`` accepts)."""
        old = t[index].clone()
        self._undo.append(lambda: t.__setitem__(index, old))

    def call(self, undo) -> None:
        """Run ``undo()`` when the step is undone (after the later changes' undos)."""
        self._undo.append(undo)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


class Rule:
    """Base class: subclasses set ``name`` and ``needs_labels`` and implement :meth:`select`.

    Rules with state (histories, controllers, counters) keep it in plain attributes listed
    in ``_state_keys`` so that ``state_dict()`` round-trips it.  The runtime also runs ``select``
    before it reads whether the step falls back (NaN, unusable dL/dz, bad labels), so a step is a
    transaction: :meth:`begin_step` before ``select``, then :meth:`commit_step` or :meth:`undo_step`.  A rule
    that sets ``journaled = True`` notes each change of its state in ``self.journal`` (a :class:`Journal`, None
    outside a step) before making it, so undoing costs what the step touched; any other rule is undone from a
    copy of its ``state_dict()`` taken at :meth:`begin_step` (state kept elsewhere would see the step).
    """

    name: str = "rule"
    _state_keys: tuple[str, ...] = ()
    normalize: str = "batch"  # see the module docstring; rules take it as an option
    # reads labels (correctness, per-example CE): the runtime then also falls back on an all-zero dL/dz
    # or, without explicit targets, a dL/dz that is not a softmax's.  True unless a rule says otherwise.
    needs_labels: bool = True
    # reads ``view.delta`` (dL/dz).  False: the rule chooses from h, z, labels and its own state only, so
    # with an in-graph loss the runtime may choose before that loss's backward and run it on the kept rows
    # (passes/prefix_rows.py); ``view.delta`` is None then.
    reads_gradient: bool = True
    # reads the values of token-shaped logits (N, T, C) (per-sequence losses, view_losses).  False: with the
    # loss outside the compiled graph, a head graph keeps a (N, T, 1) stand-in for the logits instead of the
    # logits themselves and returns them uncopied (``view.logits`` False; passes/insert_select.py).  The graph
    # is built for the rule set at its compile: a rule set later that reads them runs dense steps, with a note.
    reads_logits: bool = True
    # notes its own state changes in ``self.journal`` (begin_step); False: undone from a state_dict() copy
    journaled: bool = False
    journal: Optional[Journal] = None

    def finish(self, sel: Selection) -> Selection:
        """Apply ``self.normalize`` to ``sel.weight`` (every rule returns through this)."""
        sel.weight = normalize_weight(sel.weight, self.normalize)
        return sel

    def select(self, view: HeadView) -> Selection:  # pragma: no cover - interface
        raise NotImplementedError

    # -- a step as a transaction ------------------------------------------------------------
    def begin_step(self) -> None:
        """Open the step's transaction (the runtime calls it before ``select``)."""
        j = Journal()
        if not self.journaled:
            saved = self.state_dict()
            j.call(lambda: self.load_state_dict(saved))
        self.journal = j

    def commit_step(self) -> None:
        """Keep the step's changes."""
        self.journal = None

    def undo_step(self) -> None:
        """Put the state back as it was at :meth:`begin_step`."""
        j, self.journal = self.journal, None
        if j is not None:
            j.undo()

    def note_attr(self, name: str) -> None:
        """``self.<name>`` is about to be rebound (in a step: noted for the undo)."""
        if self.journal is not None:
            self.journal.attr(self, name)

    def note_rows(self, t: Tensor, index: Tensor) -> None:
        """Rows ``index`` of the state tensor ``t`` are about to be written in place."""
        if self.journal is not None:
            self.journal.rows(t, index)

    def state_dict(self) -> dict[str, Any]:
        out = {}
        for k in self._state_keys:
            v = getattr(self, k)
            out[k] = v.clone() if isinstance(v, Tensor) else v
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in self._state_keys:
            if k in state:
                v = state[k]
                setattr(self, k, v.clone() if isinstance(v, Tensor) else v)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class SeededRule(Rule):
    """A rule that draws random numbers; list ``"generator_state"`` in ``_state_keys``."""

    def __init__(self, seed: Optional[int] = None):
        # a seed of its own: its own generator; none: the runtime's (seeded by compile(seed=...))
        self.own_seed = seed is not None
        self.seed = 0 if seed is None else int(seed)
        self._generator: Optional[torch.Generator] = None

    def generator(self, view: HeadView) -> torch.Generator:
        if view.generator is not None and not self.own_seed:
            return view.generator
        dev = view.z.device
        g = self._generator
        if g is None or g.device.type != dev.type:
            self.note_attr("_generator")
            g = torch.Generator(device=dev)
            g.manual_seed(self.seed)
            self._generator = g
        elif self.journal is not None and not any(x is g for x in self.journal.drawn):
            self.journal.drawn.append(g)  # its state before the step's first draw (small: the copy may stay)
            state = g.get_state()
            self.journal.call(lambda: g.set_state(state))
        return g

    def uniform(self, view: HeadView, n: int, dtype: torch.dtype) -> Tensor:
        """``n`` U[0, 1) draws on the view's device (drawn where the generator lives)."""
        g = self.generator(view)
        u = torch.rand(n, generator=g, device=g.device, dtype=dtype)
        return u if u.device == view.z.device else u.to(view.z.device)

    @property
    def generator_state(self) -> Optional[dict[str, Any]]:
        g = self._generator
        return None if g is None else {"device": str(g.device), "state": g.get_state()}

    @generator_state.setter
    def generator_state(self, value: Optional[dict[str, Any]]) -> None:
        if value is None:
            self._generator = None  # the next draw reseeds with ``seed``, as a fresh rule would
            return
        try:
            g = torch.Generator(device=value["device"])
            g.set_state(value["state"].clone())
        except RuntimeError as e:  # e.g. a CUDA state loaded where no CUDA exists
            warnings.warn(f"capskip_fx: {type(self).__name__} cannot restore its generator state ({e}); reseeding "
                          f"with seed={self.seed}", stacklevel=2)
            g = None
        self._generator = g

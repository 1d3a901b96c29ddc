"""Token-shaped heads (logits (N, T, C): a causal LM, token classification): a row is a sequence.

The rules read per-sequence quantities (rules/base.py ``view_losses`` / ``head_gram``); the backward runs on
the kept sequences and is exact for the reported weights: the loss keeps its normaliser (the mean over the
batch's counted tokens), a skipped sequence's tokens contribute nothing, a kept one's are unchanged.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import capskip_fx
from capskip_fx.rules import Rule
from capskip_fx.rules.base import HeadView, head_gram, sequence_gram_exact, view_losses
from capskip_fx.rules.registry import RULES as RULES_BY_NAME
from capskip_fx.rules.capskip import capskip_weights

N, T, C, D, V = 8, 5, 11, 6, 20


class TokenModel(nn.Module):
    """Embedding -> per-token MLP -> a Linear per token: logits (N, T, C)."""

    def __init__(self, bias: bool = True):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.body = nn.Linear(D, D)
        self.head = nn.Linear(D, C, bias=bias)

    def forward(self, x):
        return self.head(torch.tanh(self.body(self.emb(x))))


class ScaledTokenModel(TokenModel):
    """A learnable temperature after the per-token Linear: CAPSkip's Gram can't follow it."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return super().forward(x) * self.scale


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (N, T), generator=g)
    y = torch.randint(0, C, (N, T), generator=g)
    y[1, 2:] = -100  # padding: ignored tokens
    y[3, :] = -100  # a sequence with no counted token: zero gradient
    return x, y


def _loss(z, y, reduction="mean"):
    return F.cross_entropy(z.reshape(-1, C), y.reshape(-1), ignore_index=-100, reduction=reduction)


def _weighted_reference(model, x, y, weight):
    """Float64 dense reference of the selection: token t of sequence i weighs w_i, the normaliser stays the
    number of counted tokens of the whole batch."""
    ref = copy.deepcopy(model)
    per = _loss(ref(x), y, reduction="none").view(N, T)
    count = (y != -100).sum()
    ((per * weight[:, None]).sum() / count).backward()
    return {k: p.grad for k, p in ref.named_parameters()}


def _grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _rel_err(grads, refs):
    assert grads.keys() == refs.keys(), f"gradients of {sorted(grads)} vs reference {sorted(refs)}"
    return max((grads[k] - r).norm().item() / max(r.norm().item(), 1e-12) for k, r in refs.items())


SB = {"keep": 0.5, "sample": False, "start": 0.0, "end": 1.0}
RULES = [("random", {"keep": 0.5}), ("sb", SB), ("ub", {"b": 0.5}),
         ("kabena", {"tau": 1.0}), ("capskip", {"budget": 0.6})]


@pytest.mark.parametrize("rule,options", RULES, ids=[r for r, _ in RULES])
def test_token_head_selects_sequences_exactly(rule, options):
    torch.manual_seed(0)
    model = TokenModel().double()
    x, y = _batch()
    cm = capskip_fx.compile(model, rule=rule, backend="aot_eager", **options)
    ref_model = copy.deepcopy(model)
    _loss(cm(x), y).backward()
    st = capskip_fx.stats(cm)
    assert st.mode == "selected", f"{rule}: not selected: {st}"
    assert 0 < st.kept < N, f"{rule}: kept {st.kept} of {N}: nothing skipped, the path is not exercised"
    assert st.rows < N, f"{rule}: the backward ran {st.rows} rows, not the kept sequences"
    rec = capskip_fx.report(cm)
    assert any(r["role"] == "head" and r["backward"] == "selected rows" for r in rec), rec
    err = _rel_err(_grads(model), _weighted_reference(ref_model, x, y, st.weight.double()))
    assert err < 1e-10, f"{rule}: gradients differ from the float64 reference of the same selection: {err}"


def test_the_logits_are_not_gathered_when_the_backward_never_reads_them():
    """z (N, T, C) is read by the selection only: the gathered backward gets a view of its first rows."""
    torch.manual_seed(0)
    model = TokenModel().double()
    x, y = _batch()
    cm = capskip_fx.compile(model, rule="random", keep=0.5, backend="aot_eager")
    _loss(cm(x), y).backward()
    plan = next(r for r in cm.backend.records if r.head).plan
    assert plan.select_args[1] in plan.unread, f"logits input {plan.select_args[1]} gathered (unread {plan.unread})"


def _saved_shapes(fn):
    """Shapes of the tensors autograd saves while ``fn`` runs (the compiled graph's saved activations), and
    the storages (data pointers) of those saved with the (N, T, C) logits' shape."""
    shapes, logits_storages = [], set()

    def pack(t):
        shapes.append(tuple(t.shape))
        if tuple(t.shape) == (N, T, C):
            logits_storages.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, shapes, logits_storages


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("rule,options", RULES, ids=[r for r, _ in RULES])
def test_token_logits_are_kept_only_for_rules_that_read_them(rule, options, backend):
    """The loss outside the model: a rule that reads no logits' values (Rule.reads_logits False) gets a
    graph that saves a (N, T, 1) stand-in, not the (N, T, C) logits; SB and K-ABENA (per-sequence losses)
    save the logits.  Either way they are returned uncopied: no second logits-sized tensor.  Where the
    selection reads them (SB, K-ABENA), an in-place edit before backward() raises, naming the fix; elsewhere
    the edit is the user's, and the gradients equal the float64 reference of the same selection and edit."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = TokenModel().double() if backend == "aot_eager" else TokenModel()
    ref_model = copy.deepcopy(model).double()
    x, y = _batch()
    cm = capskip_fx.compile(model, rule=rule, backend=backend, **options)
    reads = cm.rule.reads_logits
    assert reads == (rule in ("sb", "kabena")), f"{rule}: reads_logits {reads}"
    if reads:  # the selection reads the returned logits' memory
        z, _, _ = _saved_shapes(lambda: cm(x))
        with pytest.raises(RuntimeError, match="modified in place before backward"):
            z.mul_(2.0)
            _loss(z, y).backward()
        model.zero_grad()
    z, saved, logits_storages = _saved_shapes(lambda: cm(x))
    assert (z.untyped_storage().data_ptr() in logits_storages) == reads, \
        f"{rule}: the returned logits should be the saved ones iff the rule reads them (no copy)"
    z = z.clone() if reads else z
    z.mul_(2.0)
    _loss(z, y).backward()
    st = capskip_fx.stats(cm)
    assert st.mode == "selected" and st.rows < N, f"{rule}: {st}"
    assert ((N, T, C) in saved) == reads, f"{rule} (reads_logits {reads}): saved {saved}"
    assert ((N, T, 1) in saved) == (not reads), f"{rule}: the stand-in should be saved iff the logits are not: {saved}"
    if not next(r for r in cm.backend.records if r.head).cached:  # a cached graph's pass ran when it was stored
        assert counters["capskip"]["token logits not kept"] == int(not reads), dict(counters["capskip"])
    head = next(r for r in capskip_fx.report(cm) if r["role"] == "head")
    assert head["logits_kept"] == reads, head
    ref = copy.deepcopy(ref_model)
    per = _loss(ref(x) * 2.0, y, reduction="none").view(N, T)
    ((per * st.weight.double()[:, None]).sum() / (y != -100).sum()).backward()
    err = _rel_err(_grads(model), {k: p.grad.to(_grads(model)[k].dtype) for k, p in ref.named_parameters()})
    assert err < (1e-10 if backend == "aot_eager" else 1e-5), f"{rule} ({backend}): gradients differ by {err}"


class SquaredTokenModel(TokenModel):
    """Returns the logits and their squares: the backward of the square reads the logits' storage."""

    def forward(self, x):
        z = super().forward(x)
        return z, z.pow(2)


@pytest.mark.parametrize("rule,options", [("capskip", {"budget": 0.6}), ("sb", SB)], ids=["capskip", "sb"])
def test_the_logits_are_copied_when_the_backward_reads_their_storage(rule, options):
    """Another op of the graph saves the logits (CAPSkip keeps none of its own, SB keeps them): the returned
    logits are a copy (returned as a view of the same storage, an in-place edit would change what that op's
    backward reads, unseen by autograd's version check); the edit then leaves the square's gradient exact."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SquaredTokenModel().double()
    ref = copy.deepcopy(model)
    x, y = _batch()
    cm = capskip_fx.compile(model, rule=rule, backend="aot_eager", **options)
    z, sq = cm(x)
    z.mul_(2.0)
    (_loss(z, y) + sq.mean()).backward()
    st = capskip_fx.stats(cm)
    assert 0 < st.kept < N, st  # dense-masked: dL/dz is computed in the backward (the square adds to it)
    w = st.weight.double()
    rz, rsq = ref(x)
    per = _loss(rz * 2.0, y, reduction="none").view(N, T)
    ((per * w[:, None]).sum() / (y != -100).sum() + (rsq.sum((1, 2)) * w).sum() / rsq.numel()).backward()
    err = _rel_err(_grads(model), {k: p.grad for k, p in ref.named_parameters()})
    assert err < 1e-10, f"the edit of the returned logits reached the square's backward: gradients differ by {err}"


class LossInsideTokenModel(TokenModel):
    """The loss inside the model (Hugging Face's labels=): returns (loss, logits)."""

    def forward(self, x, y):
        z = super().forward(x)
        return _loss(z, y), z


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("rule,options", [("capskip", {"budget": 0.6}), ("random", {"keep": 0.5})], ids=["capskip", "random"])
def test_editing_uncopied_logits_before_backward_raises(rule, options, backend):
    """With the loss inside, token logits are returned uncopied and the backward reads their memory: an
    in-place edit of them before backward() would reach the gradients (plain torch.compile with Inductor
    lets it, silently).  It raises, naming the fix; an edit of a clone changes nothing."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = LossInsideTokenModel().double()
    x, y = _batch()
    cm = capskip_fx.compile(model, rule=rule, backend=backend, **options)
    loss, z = cm(x, y)
    with pytest.raises(RuntimeError, match=r"modified in place before backward|is a view and is being modified"):
        z.mul_(100.0)  # torch 2.15 with aot_eager refuses the edit itself
        loss.backward()
    model.zero_grad()
    ref = copy.deepcopy(model)
    loss, z = cm(x, y)
    z.clone().mul_(100.0)
    loss.backward()
    st = capskip_fx.stats(cm)
    assert 0 < st.kept < N, st
    per = _loss(TokenModel.forward(ref, x), y, reduction="none").view(N, T)
    ((per * st.weight.double()[:, None]).sum() / (y != -100).sum()).backward()
    err = _rel_err(_grads(model), {k: p.grad for k, p in ref.named_parameters()})
    assert err < 1e-10, f"{rule} ({backend}): gradients differ from the reference by {err}"


def test_a_rule_that_reads_logits_set_later_runs_dense_with_the_reason():
    """A graph compiled for CAPSkip keeps no token logits; SB set afterwards reads them: its steps run dense
    (exact), the rule's state untouched, with a warning that names the fix."""
    from capskip_fx.records import RefusalKind

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TokenModel().double()
    x, y = _batch()
    cm = capskip_fx.compile(model, rule="capskip", budget=0.6, backend="aot_eager")
    _loss(cm(x), y).backward()
    assert capskip_fx.stats(cm).mode == "selected", capskip_fx.stats(cm)
    cm.rule = capskip_fx.rules.make_rule("sb", **SB)
    ref_model = copy.deepcopy(model)
    model.zero_grad()
    with pytest.warns(UserWarning, match=r"reads token logits.*torch\._dynamo\.reset\(\)"):
        _loss(cm(x), y).backward()
    st = capskip_fx.stats(cm)
    assert st.mode == "dense" and st.kept == st.rows == N, st
    assert st.fallback is not None and st.fallback.kind is RefusalKind.LOGITS_NOT_KEPT, st.fallback
    assert cm.rule.hist_pos == 0, f"SB's history advanced {cm.rule.hist_pos} rows: the rule ran"
    err = _rel_err(_grads(model), _weighted_reference(ref_model, x, y, torch.ones(N, dtype=torch.float64)))
    assert err < 1e-10, f"the dense step's gradients differ from the reference by {err}"


NO_LOGITS = sorted(n for n, make in RULES_BY_NAME.items() if isinstance(make(), Rule) and not make().reads_logits)


def test_the_rules_that_read_no_logits():
    assert NO_LOGITS == ["capskip", "dense", "forced", "random", "ub"], (
        f"registered rules declaring reads_logits=False: {NO_LOGITS}")


@pytest.mark.parametrize("name", NO_LOGITS)
def test_a_rule_that_reads_no_logits_chooses_the_same_from_the_stand_in(name):
    """``reads_logits = False`` is a promise the compiled graph acts on (it keeps a (N, T, 1) stand-in for
    token logits): every registered rule that makes it chooses the same weights from the stand-in as from
    the logits, from the same generator state."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(N, T, C, generator=g, dtype=torch.float64)
    y = torch.randint(0, C, (N, T), generator=g)
    delta = (z.softmax(-1) - F.one_hot(y, C).double()) / (N * T)
    h = torch.randn(N, T, D, generator=g, dtype=torch.float64)
    stand_in = z.abs().amax(-1, keepdim=True)
    out = []
    for zz, kept in ((z, True), (stand_in, False)):
        rule = RULES_BY_NAME[name]()
        view = HeadView(delta=delta, h=h, z=zz, generator=torch.Generator().manual_seed(1), logits=kept)
        rule.begin_step()
        out.append(rule.select(view).weight)
        rule.commit_step()
    assert torch.equal(out[0], out[1]), f"{name}: weights from the logits {out[0]} vs from the stand-in {out[1]}"


def test_stale_sb_pairs_sequence_losses_with_dataset_indices():
    torch.manual_seed(0)
    model = TokenModel().double()
    x, y = _batch(5)
    cm = capskip_fx.compile(model, rule="stale_sb", prime_epochs=0, backend="aot_eager")
    ref_model = copy.deepcopy(model)
    _loss(cm(x, capskip_index=torch.arange(N)), y).backward()
    st = capskip_fx.stats(cm)
    assert st.mode == "selected", f"the backward should run on the kept sequences: {st}"
    assert 0 < st.kept < N, f"the rule should keep some sequences and skip others: {st}"
    assert st.rows < N, f"the backward should run on fewer than all {N} sequences: {st}"
    err = _rel_err(_grads(model), _weighted_reference(ref_model, x, y, st.weight.double()))
    assert err < 1e-10, err
    cached = cm.rule.cache_loss[:N]
    with torch.no_grad():
        want = _loss(ref_model(x), y, reduction="none").view(N, T).sum(1)  # a token mean: each sequence's sum
    assert torch.allclose(cached.double(), want, rtol=1e-6), f"cached {cached} vs per-sequence losses {want}"


def test_token_head_without_bias_and_the_sketch_stay_exact():
    """A sketched Gram changes which sequences CAPSkip keeps, never the exactness of the backward."""
    torch.manual_seed(0)
    model = TokenModel(bias=False).double()
    x, y = _batch(1)
    cm = capskip_fx.compile(model, rule="capskip", budget=0.6, sketch=4, backend="aot_eager")
    ref_model = copy.deepcopy(model)
    _loss(cm(x), y).backward()
    st = capskip_fx.stats(cm)
    assert st.mode == "selected", f"the backward should run on the kept sequences: {st}"
    assert 0 < st.kept < N, f"the rule should keep some sequences and skip others: {st}"
    err = _rel_err(_grads(model), _weighted_reference(ref_model, x, y, st.weight.double()))
    assert err < 1e-10, f"sketched selection: gradients differ from the reference: {err}"


def test_token_head_with_a_learnable_scale_is_refused_with_the_reason():
    model = ScaledTokenModel().double()
    x, y = _batch()
    cm = capskip_fx.compile(model, rule="random", keep=0.5, backend="aot_eager")
    with pytest.warns(UserWarning, match="no classifier head"):
        _loss(cm(x), y).backward()
    st = capskip_fx.stats(cm)
    assert st.mode == "dense", f"the step should fall back to dense: {st}"
    assert st.kept == N, f"a dense step keeps every sequence: {st}"
    assert "learnable temperature" in st.fallback, st.fallback


def _each_sequence_alone(ref, x, y, read):
    """``read(ref.head)`` after back-propagating each sequence alone, with the batch's token normaliser."""
    count = (y != -100).sum()
    out = []
    for i in range(N):
        ref.zero_grad()
        (_loss(ref(x[i:i + 1]), y[i:i + 1], reduction="sum") / count).backward()
        out.append(read(ref.head))
    return out


def test_skipped_sequences_carry_no_gradient_and_kept_ones_are_unchanged():
    """The head's weight gradient is the sum of the kept sequences' own gradients (each computed alone,
    with the batch's normaliser)."""
    torch.manual_seed(0)
    model = TokenModel().double()
    x, y = _batch(2)
    ref = copy.deepcopy(model)
    cm = capskip_fx.compile(model, rule="random", keep=0.5, backend="aot_eager")
    _loss(cm(x), y).backward()
    w = capskip_fx.stats(cm).weight.double()
    per_seq = _each_sequence_alone(ref, x, y, lambda head: head.weight.grad.clone())
    want = sum(wi * g for wi, g in zip(w, per_seq))
    got = model.head.weight.grad
    assert (got - want).norm() < 1e-10 * want.norm(), "head gradient != sum of the kept sequences' gradients"


# -- per-sequence losses ------------------------------------------------------------------------------


def _view(delta, h, z, targets=None, bias=True):
    return HeadView(delta=delta, h=h, z=z, targets=targets, head_bias=bias)


def _delta_of(z, y, per_sequence_mean: bool):
    z = z.detach().requires_grad_(True)
    per = _loss(z, y, reduction="none").view(z.shape[:2])
    valid = (y != -100)
    if per_sequence_mean:
        loss = (per.sum(1) / valid.sum(1).clamp_min(1)).mean()
    else:
        loss = per.sum() / valid.sum()
    loss.backward()
    return z.grad


@pytest.mark.parametrize("per_sequence_mean", [False, True], ids=["token-mean", "sequence-mean"])
def test_sequence_losses_follow_the_reduction_and_ignore_tokens(per_sequence_mean):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(N, T, C, generator=g, dtype=torch.float64)
    _, y = _batch()
    delta = _delta_of(z, y, per_sequence_mean)
    got = view_losses(_view(delta, torch.zeros(N, T, D, dtype=torch.float64), z), torch.float64)
    per = _loss(z, y, reduction="none").view(N, T)
    count = (y != -100).sum(1)
    want = per.sum(1) / count.clamp_min(1) if per_sequence_mean else per.sum(1)
    has = count > 0
    assert (got[~has] == 0).all(), f"a sequence without counted tokens has a nonzero loss: {got[~has]}"
    assert torch.allclose(got[has], want[has], rtol=1e-9), f"{got} vs {want}"
    z2 = z.clone()
    z2[y == -100] += 5.0  # ignored tokens' logits never count
    got2 = view_losses(_view(delta, torch.zeros(N, T, D, dtype=torch.float64), z2), torch.float64)
    assert torch.allclose(got2[has], got[has], rtol=1e-12), "an ignored token changed a sequence's loss"


def test_explicit_token_targets_with_ignore_index():
    """capskip_targets for a token head: one label per logits position, -100 ignored."""
    torch.manual_seed(0)
    model = TokenModel().double()
    x, y = _batch(3)
    cm = capskip_fx.compile(model, rule="sb", backend="aot_eager", **SB)
    ref_model = copy.deepcopy(model)
    _loss(cm(x, capskip_targets=y), y).backward()
    st = capskip_fx.stats(cm)
    assert st.mode == "selected", f"the backward should run on the kept sequences: {st}"
    assert 0 < st.kept < N, f"the rule should keep some sequences and skip others: {st}"
    err = _rel_err(_grads(model), _weighted_reference(ref_model, x, y, st.weight.double()))
    assert err < 1e-10, err
    with torch.no_grad():
        losses = _loss(ref_model(x), y, reduction="none").view(N, T).sum(1)
    kept = st.weight > 0
    dropped = ~kept & ((y != -100).sum(1) > 0)
    # SB (keep=0.5, no sampling) keeps the highest per-sequence losses (the sum: a token-mean loss)
    assert int(kept.sum()) == N // 2, st.weight
    assert losses[kept].min() >= losses[dropped].max(), f"kept losses {losses[kept]}, dropped {losses[dropped]}"


def test_token_targets_of_the_wrong_shape_fail_at_the_forward():
    model = TokenModel().double()
    x, y = _batch()
    cm = capskip_fx.compile(model, rule="sb", backend="aot_eager", **SB)
    with pytest.raises(ValueError, match=r"\(N, T\) for token-shaped logits"):
        cm(x, capskip_targets=y[:, :-1])


def test_out_of_range_token_targets_name_the_vocabulary_with_a_stand_in():
    """CAPSkip keeps a (N, T, 1) stand-in of the logits: a label outside [-1, C) still raises with C itself."""
    torch._dynamo.reset()
    model = TokenModel().double()
    x, y = _batch()
    bad = y.clone()
    bad[0, 0] = C
    cm = capskip_fx.compile(model, rule="capskip", budget=0.6, backend="aot_eager")
    with pytest.raises(ValueError, match=rf"class labels in \[-1, {C}\) for logits with {C} classes"):
        _loss(cm(x, capskip_targets=bad), y).backward()
    head = next(r for r in capskip_fx.report(cm) if r["role"] == "head")
    assert not head["logits_kept"], head


# -- the sequence Gram ----------------------------------------------------------------------------------


def _per_sequence_head_grads(delta, h, bias):
    """Brute force: G_i = d/d(W, b) sum_t delta_it . (W h_it + b), one sequence at a time."""
    c, d = delta.shape[-1], h.shape[-1]
    out = []
    for i in range(delta.shape[0]):
        W = torch.zeros(c, d, dtype=delta.dtype, requires_grad=True)
        b = torch.zeros(c, dtype=delta.dtype, requires_grad=True)
        z = h[i] @ W.T + (b if bias else 0)
        gw, gb = torch.autograd.grad((delta[i] * z).sum(), (W, b), allow_unused=True)
        out.append(torch.cat([gw.flatten()] + ([gb] if bias else [])))
    return torch.stack(out)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 5), t=st.integers(1, 4), c=st.integers(2, 6), d=st.integers(1, 4), bias=st.booleans(),
       seed=st.integers(0, 2 ** 16), ignored=st.floats(0.0, 0.8))
def test_exact_sequence_gram_equals_brute_force(n, t, c, d, bias, seed, ignored):
    g = torch.Generator().manual_seed(seed)
    delta = torch.randn(n, t, c, generator=g, dtype=torch.float64)
    delta = delta * (torch.rand(n, t, 1, generator=g, dtype=torch.float64) >= ignored)  # ignored tokens: delta 0
    h = torch.randn(n, t, d, generator=g, dtype=torch.float64)
    K, diag, exact = head_gram(delta, h, bias, sketch=0)
    G = _per_sequence_head_grads(delta, h, bias)
    assert exact, "sketch=0 must be exact"
    assert torch.allclose(K, G @ G.T, atol=1e-10), "sequence Gram != brute-force per-sequence inner products"
    assert torch.allclose(diag, (G * G).sum(1), atol=1e-10), "diagonal != per-sequence squared norms"
    x = torch.cat([h, torch.ones_like(h[..., :1])], -1) if bias else h
    for route in ("sequences", "tokens"):  # both exact forms, whichever head_gram picked
        Kr = sequence_gram_exact(delta, x, route)
        assert torch.allclose(Kr, G @ G.T, atol=1e-10), f"the {route} form != brute-force inner products"


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2 ** 16), bias=st.booleans())
def test_sketched_sequence_gram_is_unbiased(seed, bias):
    """E[K~] = K over the sketch's draws; the error of a mean over S draws is within 5 standard errors of
    the stated model, Var[K~_ij] <= 2 ||G_i||^2 ||G_j||^2 / k."""
    g = torch.Generator().manual_seed(seed)
    n, t, c, d, k, draws = 3, 3, 40, 3, 8, 400
    delta = torch.randn(n, t, c, generator=g, dtype=torch.float64)
    h = torch.randn(n, t, d, generator=g, dtype=torch.float64)
    K, diag, _ = head_gram(delta, h, bias, sketch=0)
    gen = torch.Generator().manual_seed(seed + 1)
    mean = sum(head_gram(delta, h, bias, sketch=k, generator=gen)[0] for _ in range(draws)) / draws
    scale = (diag[:, None] * diag[None, :]).sqrt()
    sd = (2.0 / k / draws) ** 0.5 * scale
    assert ((mean - K).abs() <= 5 * sd + 1e-12).all(), f"sketch mean {mean} vs exact {K} (sd {sd})"
    _, _, exact = head_gram(delta, h, bias, sketch=k, generator=gen)
    assert not exact, "a sketched Gram must say it is not exact"


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2 ** 16), budget=st.floats(0.05, 1.0))
def test_capskip_sequence_bound_is_the_brute_force_prefix_norm(seed, budget):
    """The skipped sequences are the longest prefix in increasing ||G_i|| order with ||S_k|| <= b ||G||, and
    the reported bound is ||S_k|| / ||G|| from the per-sequence gradients."""
    g = torch.Generator().manual_seed(seed)
    n, t, c, d = 6, 3, 4, 3
    delta = torch.randn(n, t, c, generator=g, dtype=torch.float64)
    h = torch.randn(n, t, d, generator=g, dtype=torch.float64)
    correct = torch.ones(n, dtype=torch.bool)
    weight, bound, n_skip = capskip_weights(delta, h, correct, budget, True, sketch=0)
    G = _per_sequence_head_grads(delta, h, True)
    skipped = weight == 0
    total = G.sum(0).norm()
    assert int(n_skip) == int(skipped.sum()), "n_skip != skipped rows"
    want = G[skipped].sum(0).norm() / total if skipped.any() else torch.zeros(())
    assert abs(float(bound) - float(want)) < 1e-9, f"bound {float(bound)} != brute force {float(want)}"
    assert float(bound) <= budget + 1e-12, "the bound exceeds the budget"
    order = G.norm(dim=1).argsort(stable=True).tolist()
    k = int(skipped.sum())
    assert set(order[:k]) == set(torch.nonzero(skipped).flatten().tolist()), "skip set is not the norm prefix"
    for kk in range(k + 1, n + 1):
        assert G[order[:kk]].sum(0).norm() > budget * total, f"a longer prefix ({kk}) fits the budget"


def test_capskip_bound_of_a_compiled_step_matches_per_sequence_gradients():
    """Counters: the compiled step's reported bound is the one of the head's per-sequence gradients."""
    torch.manual_seed(0)
    model = TokenModel().double()
    x, y = _batch(4)
    ref = copy.deepcopy(model)
    cm = capskip_fx.compile(model, rule="capskip", budget=0.6, backend="aot_eager")
    _loss(cm(x), y).backward()
    st = capskip_fx.stats(cm)
    assert st.mode == "selected", f"the backward should run on the kept sequences: {st}"
    assert 0 < st.kept < N, f"the rule should keep some sequences and skip others: {st}"
    per = torch.stack(_each_sequence_alone(
        ref, x, y, lambda head: torch.cat([head.weight.grad.flatten(), head.bias.grad])))
    skipped = st.weight.double() == 0
    want = per[skipped].sum(0).norm() / per.sum(0).norm()
    assert abs(float(st.bound) - want.item()) < 1e-9, f"bound {float(st.bound)} vs per-sequence {want.item()}"

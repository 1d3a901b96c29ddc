"""Heads other than one Linear: a Linear scaled by a number (a temperature), a sum of Linear heads
(distilled models), a normalised (cosine) head, and the refused forms (a learnable scale, a weight computed
otherwise than ``normalize(W)``, a cosine head with a bias).

Gradients are checked against a float64 dense reference of the same selection; CAPSkip's bound against
the per-example gradients of every head parameter, computed one example at a time."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx

N = 16
pytestmark = pytest.mark.usefixtures("many_compiles")  # conftest: every test compiles its own model


class Net(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.body = nn.Linear(6, 2 * 8)
        self.head, self.head_dist = nn.Linear(8, 3), nn.Linear(8, 3)
        self.scale = nn.Parameter(torch.tensor(3.0))

    def forward(self, x):
        f = self.body(x).tanh().view(x.shape[0], 2, 8)
        x0, x1 = f.sum(1), f.prod(1)
        if self.kind == "scaled":
            return 10.0 * self.head(x0)
        if self.kind == "temperature":
            return self.head(x0) / 0.07
        if self.kind == "distilled":
            return (self.head(x0) + self.head_dist(x1)) / 2
        if self.kind == "distilled_tokens":  # timm's deit_*_distilled: two tokens of one sequence
            return (self.head(f[:, 0]) + self.head_dist(f[:, 1])) / 2
        if self.kind == "one_input":  # two heads of one input, weights 0.7 and 0.3
            return 0.7 * self.head(x0) + 0.3 * self.head_dist(x0)
        if self.kind == "weighted":
            return 0.7 * self.head(x0) - 0.3 * self.head_dist(x1)
        if self.kind == "learnable":
            return self.scale * self.head(x0)
        if self.kind == "weight_penalty":  # a number times a scalar of the head's weight, added to every logit
            return self.head(x0) + 0.1 * self.head.weight.pow(2).sum()
        w = self.head.weight
        if self.kind == "cosine":  # the scale folds into the mm's input
            return 10 * F.normalize(x0, dim=-1) @ F.normalize(w, dim=-1).T
        if self.kind == "cosine_after":  # a temperature after the mm
            return F.linear(F.normalize(x0), F.normalize(w)) / 0.07
        if self.kind == "cosine_raw":  # h not normalised, no scale: the logits are the mm itself
            return x0 @ F.normalize(w, dim=1).T
        if self.kind == "cosine_learnable":
            return self.scale * (F.normalize(x0) @ F.normalize(w).T)
        if self.kind == "cosine_bias":
            return F.linear(F.normalize(x0), F.normalize(w), self.head.bias)
        if self.kind == "cosine_dim0":  # normalised over the classes: not a cosine head
            return F.normalize(x0) @ F.normalize(w, dim=0).T
        return F.normalize(x0) @ (w * 2).T  # "computed": a weight computed otherwise than normalize(W)


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)


def _head_params(kind):
    return ["head.weight", "head.bias"] + (["head_dist.weight", "head_dist.bias"] if kind != "scaled" and kind != "temperature" else [])


def _step(kind, rule, backend_="aot_eager", **opts):
    torch.manual_seed(0)
    model = Net(kind)
    ref = copy.deepcopy(model).double()
    x, y = _data()
    cm = capskip_fx.compile(model, rule=rule, backend=backend_, **opts)
    F.cross_entropy(cm(x), y).backward()
    st = capskip_fx.stats(cm)
    w = st.weight.double() if st.weight is not None else torch.ones(N, dtype=torch.float64)  # dense: every row
    (F.cross_entropy(ref(x.double()), y, reduction="none") * w).mean().backward()
    for k, p in model.named_parameters():
        r = dict(ref.named_parameters())[k].grad
        if r is None:
            assert p.grad is None or p.grad.abs().max() == 0, (
                f"{k} gets no gradient in the reference, but the compiled {kind} head gave it a nonzero one")
            continue
        err = ((p.grad.double() - r).norm() / max(r.norm(), 1e-6)).item()
        assert err <= 1e-5, f"{kind} head with rule {rule}: {k}'s gradient differs from the reference by {err:.2e}"
    return model, ref, st, x, y


@pytest.mark.parametrize("kind", ["scaled", "temperature"])
def test_scaled_linear_head_selects_rows(kind):
    _, _, st, _, _ = _step(kind, "random", keep=0.5)
    assert st.mode == "selected", f"a {kind} Linear head should be found and its rows selected: {st}"
    assert st.kept == 8, f"keep=0.5 of the 16-row batch should keep 8: {st}"
    assert st.rows == 8, f"the backward should run on the 8 kept rows only: {st}"


def _per_example(ref, kind, x, y):
    rows = []
    params = dict(ref.named_parameters())
    for i in range(N):
        ref.zero_grad()
        (F.cross_entropy(ref(x[i:i + 1].double()), y[i:i + 1]) / N).backward()
        rows.append(torch.cat([params[k].grad.flatten() for k in _head_params(kind)]))
    return torch.stack(rows)


def _check_within_budget(reported: float, bound: float, what: str, budget: float = 0.3):
    """The promise itself: the head's gradient changes by at most b, as reported and as computed in float64
    (up to float32 rounding of the rule's own sums)."""
    assert reported <= budget * (1 + 1e-5) and bound <= budget * (1 + 1e-4), (
        f"{what}: skipping should change the head's gradient by at most b={budget}: "
        f"reported {reported:.6f}, float64 {bound:.6f}")


def _check_reported_bound(st, per, what: str, budget: float = 0.3):
    """CAPSkip skipped some rows but not all, its reported bound is ||S_k|| / ||G|| of the head's
    per-example gradients ``per`` (N, P), and within ``budget``.  Returns (the skipped rows' mask, their count)."""
    skipped = st.weight.double() == 0
    k = int(skipped.sum())
    assert 0 < k < N, f"{what}: CAPSkip should skip some rows and keep some: {st}"
    bound = (per[skipped].sum(0).norm() / per.sum(0).norm()).item()
    assert abs(float(st.bound) - bound) < 1e-4, (
        f"{what}: the reported bound {float(st.bound):.6f} should be ||S_k||/||G|| of the head's gradients, {bound:.6f}")
    _check_within_budget(float(st.bound), bound, what, budget)
    return skipped, k


@pytest.mark.parametrize("kind", ["scaled", "temperature", "distilled", "distilled_tokens", "weighted", "one_input"])
def test_capskip_bound_follows_every_head_parameter(kind):
    """The bound CAPSkip reports is ||S_k|| / ||G|| of the per-example gradients of all head parameters
    (for two heads, both), and no longer prefix in increasing-norm order of the correct rows fits."""
    torch.manual_seed(0)
    model = Net(kind)
    ref = copy.deepcopy(model).double()
    x, _ = _data(1)
    with torch.no_grad():
        y = ref(x.double()).argmax(1)  # every row correct
    cm = capskip_fx.compile(model, rule="capskip", budget=0.3, backend="aot_eager")
    F.cross_entropy(cm(x), y).backward()
    st = capskip_fx.stats(cm)
    per = _per_example(ref, kind, x, y)
    skipped, k = _check_reported_bound(st, per, f"{kind} (every row correct, b=0.3)")
    total = per.sum(0).norm()
    order = per.norm(dim=1).argsort().tolist()
    assert set(order[:k]) == set(torch.nonzero(skipped).flatten().tolist()), (
        f"{kind}: CAPSkip should skip the {k} rows of smallest gradient norm {sorted(order[:k])}, "
        f"skipped {torch.nonzero(skipped).flatten().tolist()}")
    longer = [kk for kk in range(k + 1, N + 1) if per[order[:kk]].sum(0).norm() <= 0.3 * total]
    assert not longer, f"{kind}: skipping {longer} rows would also fit the budget, CAPSkip stopped at {k}"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("kind", ["distilled", "distilled_tokens", "one_input"])
def test_distilled_head_selects_rows(kind, backend):
    _, _, st, _, _ = _step(kind, "random", keep=0.5, backend_=backend)
    assert st.mode == "selected", f"a {kind} two-head model ({backend}) should run selected rows: {st}"
    assert st.kept == 8, f"keep=0.5 of the 16-row batch should keep 8: {st}"
    assert st.rows == 8, f"the backward should run on the 8 kept rows only: {st}"


def test_heads_with_unequal_weights_run_dense_masked_exactly():
    """0.7 * head - 0.3 * head_dist: the Gram features are scaled copies the forward does not need, so
    they are computed in the backward: the rule still applies, exact, on all rows."""
    _, _, st, _, _ = _step("weighted", "random", keep=0.5)
    assert st.mode == "dense-masked", f"unequally weighted heads need the Gram features in the backward: {st}"
    assert st.kept == 8, f"the rule should still keep 8 of 16 rows (weighted 0 in the dense backward): {st}"


def test_report_counts_the_steps_of_a_head_whose_selection_stays_in_the_graph():
    """The unequally weighted heads' graph runs its selection inside its backward: report() still counts
    each of its backwards (steps, last) and gives the reason with its fix."""
    torch.manual_seed(0)
    cm = capskip_fx.compile(Net("weighted"), rule="random", keep=0.5, backend="aot_eager")
    x, y = _data()
    for _ in range(2):
        F.cross_entropy(cm(x), y).backward()
    row = capskip_fx.report(cm)[0]
    assert (row["role"], row["backward"], row["last"]) == ("head", "dense-masked", "dense-masked"), row
    assert row["steps"] == {"dense-masked": 2}, f"both backwards should be counted: {row}"
    assert "give them one weight" in row["reason"], f"the reason should name the fix: {row['reason']}"


@pytest.mark.parametrize("kind,why", [("learnable", "learnable temperature"), ("computed", "computed, not a parameter"),
                                      ("cosine_learnable", "learnable temperature"),
                                      ("cosine_bias", "cosine head with a bias"),
                                      ("cosine_dim0", "computed, not a parameter"),
                                      ("weight_penalty", "not produced by a Linear")])
def test_heads_capskip_cannot_follow_are_refused_with_the_reason(kind, why):
    _, _, st, _, _ = _step(kind, "random", keep=0.5)
    assert st.mode == "dense", f"a {kind} head CAPSkip cannot follow should run dense: {st}"
    assert "no classifier head" in st.fallback, f"the fallback should say no classifier head was found: {st.fallback!r}"
    assert why in st.fallback, f"the fallback should say why ({why!r}): {st.fallback!r}"


class Heads(nn.Module):
    """sum_k c_k * Linear_k(input_k): inputs drawn from two features, biases on or off."""

    def __init__(self, weights, inputs, biases):
        super().__init__()
        self.body = nn.Linear(6, 16)
        self.heads = nn.ModuleList(nn.Linear(8, 3, bias=b) for b in biases)
        self.weights, self.inputs = weights, inputs

    def forward(self, x):
        f = self.body(x).tanh().view(x.shape[0], 2, 8)
        feats = (f.sum(1), f.prod(1))
        z = None
        for c, i, head in zip(self.weights, self.inputs, self.heads):
            term = c * head(feats[i])
            z = term if z is None else z + term
        return z


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from([0.5, 1.0, -0.3, 2.0]), st.integers(0, 1), st.booleans()),
                min_size=1, max_size=3))
@pytest.mark.heavy
def test_capskip_gram_of_any_sum_of_heads_is_the_parameters(heads):
    """Any sum of scaled Linear heads: exact gradients, and CAPSkip's bound equals ||S_k|| / ||G|| of the
    per-example gradients of every head's weight and bias."""
    torch.manual_seed(0)
    model = Heads(*zip(*heads))
    ref = copy.deepcopy(model).double()
    x, _ = _data(2)
    with torch.no_grad():
        y = ref(x.double()).argmax(1)
    cm = capskip_fx.compile(model, rule="capskip", budget=0.3, backend="aot_eager")
    F.cross_entropy(cm(x), y).backward()
    st_ = capskip_fx.stats(cm)
    assert st_.mode in ("selected", "dense-masked"), f"a sum of Linear heads {heads} should apply the rule: {st_}"
    w = st_.weight.double()
    (F.cross_entropy(ref(x.double()), y, reduction="none") * w).mean().backward()
    for (k, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        err = ((p.grad.double() - r.grad).norm() / max(r.grad.norm(), 1e-6)).item()
        assert err <= 1e-5, f"heads {heads}: {k}'s gradient differs from the reference by {err:.2e}"
    params = [p for k, p in ref.named_parameters() if k.startswith("heads.")]
    per = []
    for i in range(N):
        ref.zero_grad()
        (F.cross_entropy(ref(x[i:i + 1].double()), y[i:i + 1]) / N).backward()
        per.append(torch.cat([p.grad.flatten() for p in params]))
    per = torch.stack(per)
    total = per.sum(0).norm()
    if total == 0:
        return
    bound = (per[w == 0].sum(0).norm() / total).item()
    assert abs(float(st_.bound) - bound) < 1e-4, (
        f"heads {heads}: the reported bound {float(st_.bound):.6f} should be ||S_k||/||G|| of every head's "
        f"weight and bias, {bound:.6f}")
    _check_within_budget(float(st_.bound), bound, f"heads {heads}")


COSINE = ["cosine", "cosine_after", "cosine_raw"]


@pytest.mark.parametrize("rule,opts", [("random", dict(keep=0.5)), ("capskip", dict(budget=0.3)), ("kabena", dict(tau=1.0)),
                                       ("sb", dict(keep=0.5, prime_epochs=0))])
@pytest.mark.parametrize("kind,backend", [(k, "aot_eager") for k in COSINE] + [("cosine_after", "inductor")])
def test_cosine_head_selects_rows_exactly(kind, backend, rule, opts):
    """s * normalize(h) @ normalize(W).T (the scale before or after the mm, h normalised or not) is a head: the
    backward runs on the kept rows only, and every gradient equals the float64 reference of the step's weights."""
    _, _, st_, _, _ = _step(kind, rule, backend_=backend, **opts)
    assert st_.mode == "selected", f"a {kind} head with rule {rule} should run selected rows: {st_}"
    assert 0 < st_.rows < N, f"{rule} on the {kind} head should keep some rows and skip some: {st_}"
    assert st_.rows == st_.kept, f"the backward should run on the kept rows only: {st_}"


def _cosine_per_example(ref, x, y):
    """Each row's gradient of the head weight (the cosine head's only parameter), one example at a time."""
    rows = []
    for i in range(N):
        ref.zero_grad()
        (F.cross_entropy(ref(x[i:i + 1].double()), y[i:i + 1]) / N).backward()
        rows.append(ref.head.weight.grad.flatten().clone())
    return torch.stack(rows)


@pytest.mark.parametrize("kind,tiny", [(k, False) for k in COSINE] + [("cosine", True)])
def test_capskip_bound_follows_the_cosine_weight(kind, tiny):
    """CAPSkip's bound is ||S_k|| / ||G|| of the per-example gradients of W, normalize's projection included,
    and no longer prefix of the correct rows in increasing-norm order fits.  ``tiny``: one class's row norm is
    below normalize's eps (1e-12), where the clamp holds and W_c's gradient has no projection."""
    torch.manual_seed(0)
    model = Net(kind)
    if tiny:
        with torch.no_grad():
            model.head.weight[1] *= 1e-13
    ref = copy.deepcopy(model).double()
    x, _ = _data(1)
    with torch.no_grad():
        pred = ref(x.double()).argmax(1)
    y = pred.clone()  # every row correct
    if tiny:
        y[:4] = 1  # and four rows labelled class 1, so W_1 (below eps) gets a larger gradient
    cm = capskip_fx.compile(model, rule="capskip", budget=0.3, backend="aot_eager")
    F.cross_entropy(cm(x), y).backward()
    st_ = capskip_fx.stats(cm)
    assert st_.mode == "selected", f"the {kind} head should run selected rows: {st_}"
    per = _cosine_per_example(ref, x, y)
    skipped, k = _check_reported_bound(st_, per, f"the {kind} head (b=0.3)")
    total = per.sum(0).norm()
    correct = [i for i in per.norm(dim=1).argsort().tolist() if pred[i] == y[i]]
    assert set(correct[:k]) == set(torch.nonzero(skipped).flatten().tolist()), (
        f"{kind}: CAPSkip should skip the {k} correct rows of smallest gradient norm {sorted(correct[:k])}, "
        f"skipped {torch.nonzero(skipped).flatten().tolist()}")
    longer = [kk for kk in range(k + 1, len(correct) + 1) if per[correct[:kk]].sum(0).norm() <= 0.3 * total]
    assert not longer, f"{kind}: skipping {longer} rows would also fit the budget, CAPSkip stopped at {k}"


def _cosine_features(x, w, s):
    """The features find_head builds for ``s * x @ normalize(W).T`` (no clamp): [x, z / |W_c|, s^2 / |W_c|^2]."""
    n = w.norm(dim=1)
    z = s * x @ (w / n[:, None]).T
    return torch.cat([x, z / n, (s * s / n ** 2).expand(x.shape[0], -1)], 1).unsqueeze(1), z


@pytest.mark.inductor
def test_cosine_capskip_compiled_selection_equals_eager():
    """CAPSkip's Inductor-compiled selection (the default on CUDA) reads the cosine features as the eager one."""
    from capskip_fx.rules import HeadView
    from capskip_fx.rules.capskip import CAPSkip

    g = torch.Generator().manual_seed(0)
    x, w = F.normalize(torch.randn(12, 4, generator=g)), torch.randn(5, 4, generator=g)
    feats, z = _cosine_features(x, w, 3.0)
    y = z.argmax(1)
    view = HeadView(delta=torch.softmax(z, 1) - F.one_hot(y, 5), h=feats, z=z, targets=y, head_bias=False)
    eager, compiled = CAPSkip(0.3, compile=False).select(view), CAPSkip(0.3, compile=True).select(view)
    assert 0 < int((eager.weight == 0).sum()) < 12, f"the case should skip some rows and keep some: {eager.weight}"
    assert torch.equal(eager.weight, compiled.weight), f"compiled {compiled.weight} != eager {eager.weight}"
    assert torch.allclose(eager.bound, compiled.bound, atol=1e-6), f"bounds {compiled.bound} != {eager.bound}"


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(1, 9), st.integers(2, 7), st.integers(1, 6), st.sampled_from([1.0, -0.5, 3.0, 16.0]),
       st.booleans(), st.integers(0, 2 ** 16))
def test_cosine_gram_is_the_per_example_autograd_gram(n, c, d, s, unit_rows, seed):
    """base.head_gram on a cosine head's features equals the Gram of W's per-example gradients computed by
    torch.func (vmap of grad) in float64, for h normalised or not and any scale s."""
    from capskip_fx.rules.base import head_gram

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    x = F.normalize(x) if unit_rows else x
    w = torch.randn(c, d, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, c, (n,), generator=g)

    def loss(w_, xi, yi):
        return F.cross_entropy(s * xi[None] @ F.normalize(w_).T, yi[None])

    per = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(w, x, y).reshape(n, -1)
    feats, z = _cosine_features(x, w, s)
    delta = torch.softmax(z, 1) - F.one_hot(y, c)  # dL_i/dz_i
    K, diag, exact = head_gram(delta, feats, bias=True)
    want = per @ per.T
    # the Gram is a difference of two terms: rounding is relative to the first (exactly cancelling for d = 1)
    first = (delta ** 2 * feats[:, 0, -c:]).sum(1) * (x * x).sum(1)
    scale = torch.maximum(want.abs().max(), first.max()).clamp_min(1e-300)
    assert exact, "a cosine head's Gram is exact"
    assert ((K - want).abs().max() / scale).item() < 1e-10, (
        f"cosine Gram (n={n}, C={c}, d={d}, s={s}) differs from the per-example autograd Gram: "
        f"{(K - want).abs().max().item():.3e} of {scale.item():.3e}")
    assert ((diag - want.diagonal()).abs().max() / scale).item() < 1e-10, (
        "the cosine Gram's diagonal (row-wise sums) should equal the per-example gradients' squared norms")


def test_cosine_head_under_autocast_selects_rows_and_keeps_the_gradients():
    """bf16 autocast: the head's mm reads its input back from the (float32) features cast to bf16, bit for bit,
    so the selected step's gradients equal the autocast eager reference of the same weights."""
    torch.manual_seed(0)
    model = Net("cosine_after")
    ref = copy.deepcopy(model)
    x, y = _data()
    # verify off: the equality below, not verify's 1e-3 spot check, decides
    cm = capskip_fx.compile(model, rule="capskip", budget=0.3, backend="aot_eager", verify=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cm(x)
        loss = F.cross_entropy(out, y)
    assert out.dtype == torch.bfloat16, f"the cosine head should run in bf16 under autocast, got {out.dtype}"
    loss.backward()
    st_ = capskip_fx.stats(cm)
    assert st_.mode == "selected", f"the cosine head under autocast should run selected rows: {st_}"
    assert 0 < st_.rows < N, f"CAPSkip should keep some rows and skip some: {st_}"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = F.cross_entropy(ref(x), y, reduction="none")
    (losses * st_.weight.float()).mean().backward()
    for (k, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        if r.grad is None:
            continue
        err = ((p.grad.double() - r.grad.double()).norm() / max(r.grad.double().norm(), 1e-6)).item()
        assert torch.equal(p.grad, r.grad), (
            f"autocast cosine head: {k}'s gradient should equal the autocast reference, differs by {err:.2e}")


class CosineWithLoss(nn.Module):
    """A cosine head with the loss inside the model (Hugging Face's ``labels=``): returns (loss, logits)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3, bias=False)

    def forward(self, x, y):
        z = F.linear(F.normalize(self.body(x).tanh()), F.normalize(self.head.weight)) / 0.07
        return F.cross_entropy(z, y), z


def test_cosine_head_with_an_in_graph_loss_selects_rows_and_bounds_w():
    """The loss inside the model: the rule reads the gradient into the head's mm (the logits' times the
    scale, a uniform factor), CAPSkip's bound is still ||S_k|| / ||G|| of W's per-example gradients, and the
    gradients equal the float64 reference."""
    torch.manual_seed(0)
    model = CosineWithLoss()
    ref = copy.deepcopy(model).double()
    x, _ = _data(1)
    with torch.no_grad():
        y = ref(x.double(), torch.zeros(N, dtype=torch.long))[1].argmax(1)  # every row correct
    cm = capskip_fx.compile(model, rule="capskip", budget=0.3, backend="aot_eager", logits_index=1)
    cm(x, y)[0].backward()
    st_ = capskip_fx.stats(cm)
    assert st_.mode == "selected", f"a cosine head with an in-graph loss should run selected rows: {st_}"
    skipped = st_.weight.double() == 0
    assert 0 < int(skipped.sum()) < N, f"CAPSkip should skip some rows and keep some: {st_}"
    (F.cross_entropy(ref(x.double(), y)[1], y, reduction="none") * st_.weight.double()).mean().backward()
    for (k, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        err = ((p.grad.double() - r.grad).norm() / max(r.grad.norm(), 1e-6)).item()
        assert err <= 1e-5, f"in-graph loss, cosine head: {k}'s gradient differs from the reference by {err:.2e}"
    per = []
    for i in range(N):
        ref.zero_grad()
        (ref(x[i:i + 1].double(), y[i:i + 1])[0] / N).backward()
        per.append(ref.head.weight.grad.flatten().clone())
    per = torch.stack(per)
    bound = (per[skipped].sum(0).norm() / per.sum(0).norm()).item()
    assert abs(float(st_.bound) - bound) < 1e-4, (
        f"the reported bound {float(st_.bound):.6f} should be ||S_k||/||G|| of W's gradients, {bound:.6f}")
    _check_within_budget(float(st_.bound), bound, "in-graph loss, cosine head")

"""The batch outside dim 0: ``(T, N, E)`` values (``nn.MultiheadAttention``, either ``batch_first``;
torchvision's ViT) and the token-major ``(T*N, E)`` rows their Linears multiply.

The layout proof tracks such values per row, and the selected-row backward gathers each saved tensor
along the dim the proof found, viewed ``(outer, N, inner)`` at its middle axis.  Gradients are checked
against a float64 dense eager reference of the same selection, with ``verify=False`` so the gathered
backward itself is compared (a verify mismatch would otherwise fall back silently to dense-masked).
Ops that mix the moved batch dim stay refused with the reason.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import capskip_fx
from capskip_fx.rows import gather_rows, scatter_rows
from capskip_fx.symbolic import Spec

from conftest import max_rel_err, reference_grads

pytestmark = pytest.mark.usefixtures("many_compiles")  # conftest: every test compiles its own model

N, T, DIN, C = 8, 5, 4, 3
KEEP = torch.tensor([1, 4, 6])  # not a prefix: a gather that took the first rows would be caught


class MHAClassifier(nn.Module):
    """Tokens -> MultiheadAttention (batch_first as given) with a residual -> mean over tokens -> head."""

    def __init__(self, batch_first: bool, d: int = 8):
        super().__init__()
        self.batch_first = batch_first
        self.inp = nn.Linear(DIN, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=batch_first)
        self.head = nn.Linear(d, C)

    def forward(self, x):  # (N, T, DIN)
        h = self.inp(x)
        if not self.batch_first:
            h = h.transpose(0, 1)  # (T, N, d): the layout batch_first=False expects
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h.mean(1 if self.batch_first else 0))


class TransposedBody(nn.Module):
    """An explicit ``x.transpose(0, 1)`` body: a bmm over the tokens and a tanh (saved with the batch in dim 1),
    per-token Linear, LayerNorm and GELU on ``(T, N, d)`` (its Linear's rows token-major), a residual,
    then a mean over the tokens (dim 0)."""

    def __init__(self, d: int = 6):
        super().__init__()
        self.inp, self.fc, self.ln, self.head = nn.Linear(DIN, d), nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, C)
        self.w = nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x):
        h = self.inp(x).transpose(0, 1)  # (T, N, d)
        h = h + torch.tanh(torch.bmm(h, self.w.expand(h.shape[0], -1, -1)))  # per token: saved with the batch in dim 1
        h = h + F.gelu(self.fc(self.ln(h)))
        return self.head(h.mean(0))


def tiny_vit():
    from torchvision.models.vision_transformer import VisionTransformer
    model = VisionTransformer(image_size=32, patch_size=8, num_layers=1, num_heads=2, hidden_dim=32, mlp_dim=64,
                              num_classes=C)
    nn.init.normal_(model.heads.head.weight, std=0.2)  # torchvision zeroes it: no gradient would reach the encoder
    return model


def _data(model_kind: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (N, 3, 32, 32) if model_kind == "vit" else (N, T, DIN)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randint(0, C, (N,), generator=g)


def _selected_steps(model, backend="aot_eager", steps=2, kind="tokens", **opts):
    """``steps`` forced-rule steps keeping KEEP; asserts each is selected and exact; returns the compiled model."""
    cm = capskip_fx.compile(model, rule="forced", keep=lambda n: KEEP, backend=backend, verify=False, **opts)
    for step in range(steps):
        x, y = _data(kind, step)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(cm(x), y).backward()
        st_ = capskip_fx.stats(cm)
        assert st_.mode == "selected", f"step {step}: {st_} ({st_.fallback})"
        assert st_.kept == len(KEEP) < N, f"step {step}: kept {st_.kept} of {st_.n}"
        assert st_.rows < N, f"step {step}: the backward ran {st_.rows} rows"
        grads = {k: p.grad for k, p in model.named_parameters()}
        err = max_rel_err(grads, reference_grads(model, x, y, st_.weight))
        assert err < 1e-10, f"step {step}: max rel. error {err:.3g} against the float64 reference"
    return cm


def _head_record(cm):
    recs = [r for r in cm.backend.records if r.head]
    assert len(recs) == 1, [r.as_dict() for r in cm.backend.records]
    return recs[0]


def _token_major_specs(rec) -> list:
    return [(s.dim, s.outer, s.factor) for s in rec.plan.specs if s.kind == "batch" and s.outer != 1]


@pytest.mark.parametrize("batch_first", [True, False])
def test_mha_classifier_selects_rows_exactly(batch_first):
    torch.manual_seed(0)
    model = MHAClassifier(batch_first).double()
    cm = _selected_steps(model)
    rec = _head_record(cm)
    assert rec.backward == "selected rows", rec.as_dict()
    assert rec.reason in (None, "-", ""), rec.reason
    # the in- and out-projections' saved (T*N, d) inputs are gathered token-major, (T, N, 1)
    assert (0, T, 1) in _token_major_specs(rec), rec.plan.specs


@pytest.mark.heavy
def test_torchvision_tiny_vit_selects_rows_exactly():
    torch.manual_seed(0)
    model = tiny_vit().double()
    cm = _selected_steps(model, kind="vit")
    rec = _head_record(cm)
    assert rec.backward == "selected rows", rec.as_dict()
    tokens = (32 // 8) ** 2 + 1  # patches and the class token
    grad = model.encoder.layers[0].self_attention.in_proj_weight.grad
    assert grad is not None, "no gradient reached the attention: the check would be vacuous"
    assert grad.norm() > 0, "the attention's gradient is zero: the check would be vacuous"
    assert (0, tokens, 1) in _token_major_specs(rec), rec.plan.specs


def test_transposed_body_gathers_along_dim_1():
    torch.manual_seed(0)
    model = TransposedBody().double()
    cm = _selected_steps(model)
    rec = _head_record(cm)
    dims = {(s.dim, s.outer) for s in rec.plan.specs if s.kind == "batch"}
    assert (1, 1) in dims, rec.plan.specs  # (T, N, d) values saved with the batch in dim 1
    assert (0, T) in dims, rec.plan.specs  # the Linear's (T*N, d) rows, token-major


# -- refused: ops that mix the moved batch dim -------------------------------------------------------

class MixesMovedBatch(nn.Module):
    def __init__(self, how: str, d: int = 6):
        super().__init__()
        self.how = how
        self.inp, self.head = nn.Linear(DIN, d), nn.Linear(d, C)

    def forward(self, x):
        h = self.inp(x).transpose(0, 1)  # (T, N, d): the batch in dim 1
        if self.how == "reduce":  # centre over the batch (dim 1)
            h = h - h.mean(1, keepdim=True)
        elif self.how == "matmul":  # (T, d, N) @ (T, N, d): contracts the batch
            h = h + torch.tanh(h @ (h.transpose(1, 2) @ h))
        elif self.how == "interleave":  # (T, N, d) flattened and re-cut as N rows: row b holds other rows' tokens
            h = h.reshape(x.shape[0], -1)[:, :h.shape[-1]].unsqueeze(0)
            h = torch.sigmoid(h * 2.0)
        return self.head(h.mean(0))


@pytest.mark.parametrize("how,reason", [
    ("reduce", "reduces over the batch dim"),
    ("matmul", "over the batch dim"),
    ("interleave", "unknown"),
])
def test_mixing_the_moved_batch_is_refused(how, reason):
    torch.manual_seed(0)
    model = MixesMovedBatch(how).double()
    cm = capskip_fx.compile(model, rule="forced", keep=lambda n: KEEP, backend="aot_eager", verify=False)
    x, y = _data("tokens", 0)
    with pytest.warns(UserWarning):
        F.cross_entropy(cm(x), y).backward()
    st_ = capskip_fx.stats(cm)
    assert st_.mode == "dense", f"the refused model's step should be dense: {st_}"
    assert st_.kept == N, f"a dense step keeps every row: {st_}"
    assert st_.fallback is not None, f"a dense step should say why: {st_}"
    assert reason in st_.fallback, f"the reason should name {reason!r}: {st_.fallback!r}"
    grads = {k: p.grad for k, p in model.named_parameters()}
    err = max_rel_err(grads, reference_grads(model, x, y, torch.ones(N, dtype=torch.float64)))
    assert err < 1e-10, f"dense fallback: max rel. error {err:.3g}"


# -- the gather and scatter along (outer, N, inner) --------------------------------------------------

@settings(max_examples=60, deadline=None, derandomize=True)
@given(outer=st.integers(1, 3), inner=st.integers(1, 3), n=st.integers(2, 5), before=st.integers(0, 2),
       after=st.integers(0, 2), data=st.data())
def test_gather_and_scatter_follow_the_layout(outer, inner, n, before, after, data):
    """x's batch dim is ``before`` (after ``before`` dims of size 2), index (o*n + b)*inner + r; gathering
    rows ``idx`` keeps exactly the elements of those rows, in order; scattering back zeroes the others."""
    k = data.draw(st.integers(1, n))
    idx = torch.tensor(data.draw(st.permutations(range(n)))[:k])
    shape = [2] * before + [outer * n * inner] + [3] * after
    owner = (torch.arange(outer * n * inner) // inner) % n  # the row each position of the batch dim belongs to
    x = torch.randn(shape, dtype=torch.float64)
    spec = Spec("batch", dim=before, factor=inner, outer=outer)
    out_shape = list(shape)
    out_shape[before] = outer * k * inner
    contig = torch.empty(out_shape).stride()
    y = gather_rows(x, spec, idx, n, out_shape, contig)
    ref = torch.cat([x.narrow(before, p, 1) for o in range(outer) for b in idx.tolist()
                     for p in range((o * n + b) * inner, (o * n + b + 1) * inner)], before)
    assert torch.equal(y, ref), (spec, idx)
    back = scatter_rows(y, spec, idx, n)
    kept = torch.isin(owner, idx).view([-1 if d == before else 1 for d in range(len(shape))]).expand(shape)
    assert torch.equal(back, torch.where(kept, x, torch.zeros_like(x))), (spec, idx)


def test_vcas_runs_exact_on_a_token_major_graph():
    """VCAS's segments read the backward's values batch-major from their sizes: on a graph holding a
    token-major value it builds nothing, says why, and the backward is the exact dense one."""
    torch.manual_seed(0)
    model = MHAClassifier(batch_first=True).double()
    cm = capskip_fx.compile(model, rule="vcas", backend="aot_eager")
    x, y = _data("tokens", 0)
    F.cross_entropy(cm(x), y).backward()
    note = capskip_fx.report(cm)[0]["vcas"]
    assert note is not None, "the graph should note why VCAS did not apply"
    assert "token-major" in note, f"the note should name the token-major dim: {note!r}"
    assert not cm.backend.state.runners, "a VCAS runner was built"
    grads = {k: p.grad for k, p in model.named_parameters()}
    err = max_rel_err(grads, reference_grads(model, x, y, torch.ones(N, dtype=torch.float64)))
    assert err < 1e-10, f"max rel. error {err:.3g}"

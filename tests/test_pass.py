"""The pass fired: graph records, matmul row counts, compiled variants, refusals and bad input."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx
from capskip_fx.rules import Forced

from conftest import compiled, make_input, max_rel_err, reference_grads, selected_step
from helpers.models import GraphBreak

N, T = 8, 65  # deit img 32 / patch 4: 64 patches + CLS


def test_backward_matmuls_run_on_kept_rows():
    model, cm = compiled("deit", torch.float32, "aot_eager")
    cm.rule = Forced(keep=lambda n: torch.tensor([1, 4, 6]))
    x = make_input("deit", N, torch.float32)
    selected_step(cm, x, torch.zeros(N, dtype=torch.long))  # the first gathered step is also verified on N rows
    graphs = len(cm.backend.records)  # the model is shared: earlier tests may have compiled it already
    selected_step(cm, x, torch.zeros(N, dtype=torch.long))
    assert len(cm.backend.records) == graphs, "the same input twice recompiled the model"
    rec = cm.backend.records[-1]
    assert rec.backward == "selected rows" and rec.plan.gathered_inputs > 10
    dims = [d for _, shapes in rec.matmul_shapes for s in shapes for d in s]
    assert len(rec.matmul_shapes) >= 8  # qkv, proj, fc1, fc2 (+ head): dX and dW each
    assert 3 * T in dims and 3 in dims  # token rows and head rows at k = 3
    assert N * T not in dims and N not in dims  # nothing at the full batch


def test_variants_bounded_over_varying_k_and_batch():
    model, cm = compiled("mlp", torch.float64, "aot_eager")
    gen = torch.Generator().manual_seed(0)
    graphs = variants = None
    for step, (n, k) in enumerate([(8, 2), (8, 5), (8, 8), (8, 1), (5, 3), (8, 7), (6, 0)]):
        keep = torch.randperm(n, generator=gen)[:k]
        cm.rule = Forced(keep=lambda _, keep=keep: keep) if k else Forced(keep=lambda n: torch.zeros(n, dtype=torch.bool))
        x = make_input("mlp", n, torch.float64, seed=step)
        y = torch.randint(0, 5, (n,))
        grads, w = selected_step(cm, x, y)
        assert max_rel_err(grads, reference_grads(model, x, y, w)) < 1e-10
        if k == 0:
            assert all(g.abs().max() == 0 for g in grads.values())  # zeros, not None
        if step == 0:  # the model is shared: count what compiles after this test's first step
            graphs, variants = len(cm.backend.records), capskip_fx.stats(cm).variants
    assert len(cm.backend.records) == graphs, "a new batch size or kept count recompiled the forward"
    assert capskip_fx.stats(cm).variants == variants, "a new batch size or kept count compiled another backward"
    assert {2, 5, 3, 7} <= cm.backend.records[-1].row_counts, (
        f"the backward should have run at every kept count, ran at {cm.backend.records[-1].row_counts}")


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)  # BN makes a conv bias grad ~0
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        return self.head(self.bn(self.conv(x)).relu().mean((2, 3)))


def test_batchnorm_train_mode_refused_dense_and_correct():
    torch.manual_seed(0)
    model = BNNet().double()
    cm = capskip_fx.compile(model, rule="forced", keep=0.25, backend="aot_eager")
    x = torch.randn(8, 3, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 5, (8,))
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="cross-example"):
        F.cross_entropy(cm(x), y).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    st = capskip_fx.stats(cm)
    assert st.fallback and "cross-example" in st.fallback and st.kept == 8
    rec = cm.backend.records[0]
    assert rec.coupled and not rec.head and rec.backward == "dense" and "cross-example" in rec.reason
    F.cross_entropy(ref(x), y).backward()
    assert max_rel_err(grads, {k: p.grad for k, p in ref.named_parameters()}) < 1e-10


def test_batchnorm_eval_mode_is_not_coupled():
    torch.manual_seed(0)
    model = BNNet().double().eval()
    cm = capskip_fx.compile(model, rule="forced", keep=0.5, backend="aot_eager")
    x = torch.randn(8, 3, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 5, (8,))
    grads, w = selected_step(cm, x, y)
    assert cm.backend.records[0].backward == "selected rows"
    assert max_rel_err(grads, reference_grads(model, x, y, w)) < 1e-10


@pytest.mark.parametrize("b", [-0.5, 1.01, float("nan"), None, "0.1"])
def test_bad_budget_raises_at_compile(b):
    with pytest.raises(ValueError, match=r"budget must be a number in \[0, 1\]"):
        capskip_fx.compile(nn.Linear(3, 2), budget=b)


def test_unknown_rule_lists_valid_names():
    with pytest.raises(ValueError, match="valid names: .*capskip.*dense"):
        capskip_fx.compile(nn.Linear(3, 2), rule="nope")


def test_no_linear_head_falls_back_with_reason():
    class NoHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3))

        def forward(self, x):
            return (x[:, :, None] * self.w).sum(1)

    cm = capskip_fx.compile(NoHead(), backend="aot_eager")
    x = torch.randn(6, 4)
    with pytest.warns(UserWarning, match="no classifier head"):
        F.cross_entropy(cm(x), torch.zeros(6, dtype=torch.long)).backward()
    assert "no classifier head" in capskip_fx.stats(cm).fallback


class TokenMajor(nn.Module):
    """Flattens (T, N) token-major before a Linear: a batch dim of size T*N that is NOT batch-major."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):  # (N, T, 4)
        t = self.fc(x.transpose(0, 1).reshape(-1, 4)).relu()
        return self.head(t.reshape(x.shape[1], x.shape[0], 4).mean(0))


@pytest.mark.parametrize("verify", [True, False])
def test_token_major_flattening_is_gathered_token_major(verify):
    """s*T and T*s are the same size: the dataflow, not the sizes, proves the layout.  The Linear's
    saved (T*N, 4) input is gathered as (T, N, 4) at its middle axis (a batch-major gather of T rows per
    example would take the wrong rows); exact with or without the verify check."""
    torch.manual_seed(0)
    model = TokenMajor().double()
    cm = capskip_fx.compile(model, rule="forced", keep=lambda n: torch.tensor([0, 2]), backend="aot_eager",
                            verify=verify)
    x = torch.randn(6, 5, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    F.cross_entropy(cm(x), y).backward()
    st = capskip_fx.stats(cm)
    assert (st.mode, st.kept, st.rows) == ("selected", 2, 2), st
    grads = {k: p.grad for k, p in model.named_parameters()}
    err = max_rel_err(grads, reference_grads(model, x, y, st.weight))
    assert err < 1e-10, err
    rec = cm.backend.records[0]
    assert rec.head and rec.backward == "selected rows", rec.as_dict()
    assert any((s.dim, s.outer, s.factor) == (0, 5, 1) for s in rec.plan.specs if s.kind == "batch"), rec.plan.specs


def test_string_backend_with_options():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    opt = torch.compile(model, backend="capskip", options={"rule": "forced", "keep": 0.5, "backend": "aot_eager"})
    for n in (8, 6):
        x = torch.randn(n, 6, dtype=torch.float64)
        y = torch.randint(0, 3, (n,))
        torch._dynamo.mark_dynamic(x, 0)
        model.zero_grad()
        F.cross_entropy(opt(x), y).backward()
        st = capskip_fx.stats(opt)
        assert st.n == n and st.kept == n // 2 and st.variants == 1
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        assert max_rel_err(grads, reference_grads(model, x, y, st.weight)) < 1e-10
    assert capskip_fx.report(opt)[0]["backward"] == "selected rows"
    assert capskip_fx.stats(model).n == 6  # the original module finds its backend too
    with pytest.raises(TypeError, match="capskip_fx.compile"):
        capskip_fx.stats(nn.Linear(2, 2))  # a module no capskip backend compiled


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_graph_break_body_graph_reuses_head_selection(backend):
    torch.manual_seed(0)
    model = GraphBreak().double()
    cm = capskip_fx.compile(model, rule="forced", keep=lambda n: torch.tensor([1, 4]), backend=backend)
    for step in range(3):
        x = make_input("mlp", 8, torch.float64, seed=step)[:, :6].contiguous()
        y = torch.randint(0, 3, (8,))
        grads, w = selected_step(cm, x, y)
        assert max_rel_err(grads, reference_grads(model, x, y, w)) < 1e-10
    roles = {r["role"]: r for r in capskip_fx.report(cm)}
    assert set(roles) == {"head", "body"} and len(cm.backend.records) == 2
    assert all(r["backward"] == "selected rows" and r["row_counts"] == [2] for r in roles.values())
    if backend == "aot_eager":
        body = next(r for r in cm.backend.records if r.body)
        assert [s for _, s in body.matmul_shapes] == [[(8, 2), (2, 6)]]  # dW_a from the 2 kept rows


@pytest.mark.inductor
def test_varying_batch_and_k_on_inductor_deit_compiles_once():
    """Ragged batches and data-dependent k on a ViT through Inductor: one graph, one backward variant
    (LayerNorm backward with a dynamic batch must not specialise)."""
    model, cm = compiled("deit", torch.float32, "inductor")
    cm.rule = Forced(keep=lambda n: torch.arange(0, n, 2))
    graphs = variants = None
    for n in (8, 5, 8, 3, 12, 7):
        x = make_input("deit", n, torch.float32, seed=n)
        y = torch.randint(0, 10, (n,))
        grads, w = selected_step(cm, x, y)
        assert max_rel_err(grads, reference_grads(model, x, y, w)) < 1e-5
        assert capskip_fx.stats(cm).rows == (n + 1) // 2
        if graphs is None:  # the model is shared: count what compiles after this test's first step
            graphs, variants = len(cm.backend.records), capskip_fx.stats(cm).variants
    assert len(cm.backend.records) == graphs, "a new batch size recompiled the forward"
    assert capskip_fx.stats(cm).variants == variants, "a new batch size or kept count compiled another backward"

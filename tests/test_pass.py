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
    selected_step(cm, x, torch.zeros(N, dtype=torch.long))  # compiles the model if no earlier test did
    graphs = len(cm.backend.records)  # the model is shared: earlier tests may have compiled it already
    selected_step(cm, x, torch.zeros(N, dtype=torch.long))
    assert len(cm.backend.records) == graphs, "the same input twice recompiled the model"
    rec = cm.backend.records[-1]
    assert rec.backward == "selected rows", f"the DeiT graph's backward should run selected rows, not {rec.backward}"
    assert rec.plan.gathered_inputs > 10, (
        f"every block's saved activations should be gathered, only {rec.plan.gathered_inputs} were")
    dims = [d for _, shapes in rec.matmul_shapes for s in shapes for d in s]
    assert len(rec.matmul_shapes) >= 8, (  # qkv, proj, fc1, fc2 (+ head): dX and dW each
        f"the backward should run the qkv, proj, fc1 and fc2 matmuls (dX and dW), saw {len(rec.matmul_shapes)}")
    assert 3 * T in dims, f"the token matmuls should run on the 3 kept rows' {3 * T} tokens; sizes seen: {sorted(set(dims))}"
    assert 3 in dims, f"the head's matmuls should run on the 3 kept rows; sizes seen: {sorted(set(dims))}"
    assert N * T not in dims, f"no matmul should run on the full batch's {N * T} tokens; sizes seen: {sorted(set(dims))}"
    assert N not in dims, f"no matmul should run on the full batch of {N} rows; sizes seen: {sorted(set(dims))}"


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
        err = max_rel_err(grads, reference_grads(model, x, y, w))
        assert err < 1e-10, f"batch {n}, k={k}: gradients differ from the float64 reference by {err:.2e}"
        if k == 0:
            nonzero = [name for name, g in grads.items() if g.abs().max() != 0]
            assert not nonzero, f"with no row kept every gradient should be zero (not None); nonzero: {nonzero}"
        if step == 0:  # the model is shared: count what compiles after this test's first step
            graphs, variants = len(cm.backend.records), capskip_fx.stats(cm).variants
    assert len(cm.backend.records) == graphs, "a new batch size or kept count recompiled the forward"
    assert capskip_fx.stats(cm).variants == variants, "a new batch size or kept count compiled another backward"
    counts = cm.backend.records[-1].row_counts
    assert {2, 5, 3, 7} <= counts, f"the backward should have run at k = 2, 5, 3 and 7 rows; it ran at {sorted(counts)}"


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
    assert st.fallback, "BatchNorm in train mode mixes rows: the step should report a dense fallback"
    assert "cross-example" in st.fallback, f"the fallback should name the row mixing: {st.fallback!r}"
    assert st.kept == 8, f"a dense step keeps every row (8), kept {st.kept}"
    rec = cm.backend.records[0]
    assert rec.coupled, f"the record should mark the graph as coupling rows: {rec.as_dict()}"
    assert not rec.head, f"a coupled graph should get no selection head: {rec.as_dict()}"
    assert rec.backward == "dense", f"a coupled graph's backward should run dense, not {rec.backward}"
    assert "cross-example" in rec.reason, f"the record's reason should name the row mixing: {rec.reason!r}"
    F.cross_entropy(ref(x), y).backward()
    err = max_rel_err(grads, {k: p.grad for k, p in ref.named_parameters()})
    assert err < 1e-10, f"the dense fallback's gradients should equal plain PyTorch's, differ by {err:.2e}"


def test_batchnorm_eval_mode_is_not_coupled():
    torch.manual_seed(0)
    model = BNNet().double().eval()
    cm = capskip_fx.compile(model, rule="forced", keep=0.5, backend="aot_eager")
    x = torch.randn(8, 3, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 5, (8,))
    grads, w = selected_step(cm, x, y)
    backward = cm.backend.records[0].backward
    assert backward == "selected rows", f"BatchNorm in eval mode is per row: the backward should be selected, not {backward}"
    err = max_rel_err(grads, reference_grads(model, x, y, w))
    assert err < 1e-10, f"eval-mode BatchNorm gradients differ from the float64 reference by {err:.2e}"


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
    fallback = capskip_fx.stats(cm).fallback
    assert "no classifier head" in fallback, f"the fallback should say no classifier head was found: {fallback!r}"


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
    assert st.mode == "selected", f"a token-major flattening should still run selected rows: {st}"
    assert st.kept == 2, f"the forced rule keeps rows 0 and 2: {st}"
    assert st.rows == 2, f"the backward should run on the 2 kept rows only: {st}"
    grads = {k: p.grad for k, p in model.named_parameters()}
    err = max_rel_err(grads, reference_grads(model, x, y, st.weight))
    assert err < 1e-10, f"token-major gather (verify={verify}): gradients differ from the reference by {err:.2e}"
    rec = cm.backend.records[0]
    assert rec.head, f"the graph should have its selection head: {rec.as_dict()}"
    assert rec.backward == "selected rows", f"the graph's backward should be selected, not {rec.backward}"
    assert any((s.dim, s.outer, s.factor) == (0, 5, 1) for s in rec.plan.specs if s.kind == "batch"), (
        f"the Linear's (T*N, 4) input should be gathered token-major (dim 0, outer T=5); specs: {rec.plan.specs}")


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
        assert st.n == n, f"the string backend should see the whole batch of {n}: {st}"
        assert st.kept == n // 2, f"options keep=0.5 should keep {n // 2} of {n} rows: {st}"
        assert st.variants == 1, f"a new batch size should reuse the one backward variant: {st}"
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        err = max_rel_err(grads, reference_grads(model, x, y, st.weight))
        assert err < 1e-10, f"batch {n}: the string backend's gradients differ from the reference by {err:.2e}"
    backward = capskip_fx.report(opt)[0]["backward"]
    assert backward == "selected rows", f"the string backend's graph should run selected rows, not {backward}"
    n_seen = capskip_fx.stats(model).n
    assert n_seen == 6, f"stats() of the original module should find its backend (last batch 6), saw {n_seen}"
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
        err = max_rel_err(grads, reference_grads(model, x, y, w))
        assert err < 1e-10, f"step {step} across a graph break ({backend}): gradients differ by {err:.2e}"
    roles = {r["role"]: r for r in capskip_fx.report(cm)}
    assert set(roles) == {"head", "body"}, f"a graph break should give one head and one body graph, got roles {set(roles)}"
    graphs = len(cm.backend.records)
    assert graphs == 2, f"the model with one graph break should compile 2 graphs, not {graphs}"
    for role, r in roles.items():
        assert r["backward"] == "selected rows", f"the {role} graph's backward should be selected, not {r['backward']}"
        assert r["row_counts"] == [2], f"the {role} graph should run on the 2 kept rows, ran at {r['row_counts']}"
    if backend == "aot_eager":
        body = next(r for r in cm.backend.records if r.body)
        shapes = [s for _, s in body.matmul_shapes]
        assert shapes == [[(8, 2), (2, 6)]], f"the body's dW should come from the 2 kept rows only; matmuls: {shapes}"


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
        err = max_rel_err(grads, reference_grads(model, x, y, w))
        assert err < 1e-5, f"batch {n} on Inductor: gradients differ from the reference by {err:.2e}"
        rows = capskip_fx.stats(cm).rows
        assert rows == (n + 1) // 2, f"batch {n}: the backward should run on the {(n + 1) // 2} even rows, ran on {rows}"
        if graphs is None:  # the model is shared: count what compiles after this test's first step
            graphs, variants = len(cm.backend.records), capskip_fx.stats(cm).variants
    assert len(cm.backend.records) == graphs, "ragged batches recompiled the forward"
    assert capskip_fx.stats(cm).variants == variants, (
        "the LayerNorm backward must not specialise: a new batch size compiled another backward variant")

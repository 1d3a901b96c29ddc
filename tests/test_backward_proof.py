"""passes/validate.py: the backward that runs on gathered rows is proven, not assumed.

Two halves.  Hand-built backward graphs (make_fx, symbolic batch) check each obligation of the proof in
isolation: sums over the rows only of weighted cotangents, rows never placed by their position, no random
numbers drawn or replayed (the fused attention backwards with dropout cannot run on this CPU: their graphs
are traced on meta kernels), outputs as the runtime scatters them.  Then end to end, with ``verify=False``
so the proof alone stands between a wrong gathered backward and the user: models whose forward is row-wise
but whose backward is not (a parameter per batch position, ``torch.gather`` of a parameter, a random mask
beside a token-major value) are exact against a float64 reference and dense-masked with the reason, and a
plain model still runs its proven gathered backward.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._inductor import config as inductor_config
from torch.fx.experimental.proxy_tensor import make_fx

import capskip_fx
from torch._inductor.utils import fresh_inductor_cache
from capskip_fx.placement import Layout, analyze_backward
from capskip_fx.records import RefusalKind, counters

aten, prims = torch.ops.aten, torch.ops.prims
N, C, D, T = 3, 5, 7, 4  # distinct sizes: make_fx gives each its own symbol only where sizes differ


def proof(f, *xs, weight: int = -1):
    """analyze_backward over ``f`` traced with a symbolic batch; input ``weight`` is the weight (the carrier)."""
    gm = make_fx(f, tracing_mode="symbolic")(*xs)
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sym = ph[0].meta["val"].shape[0].node.expr
    res = analyze_backward(gm.graph, sym, {}, frozenset({ph[weight].name}))
    out = gm.graph.output_node().args[0]
    outs = [res.layouts.get(o.name) for o in (out if isinstance(out, (list, tuple)) else [out])]
    return res, outs


def w_(n=N):
    return torch.ones(n)


# ---- sums over the rows ------------------------------------------------------------------------

def test_weight_gradient_is_a_sum_and_input_gradient_stays_per_row():
    def f(g, h, wt, w):
        gw = g * w.view(-1, 1)
        return gw @ wt, gw.t() @ h, gw.sum(0)  # input grad, weight grad, bias grad
    res, outs = proof(f, torch.randn(N, C), torch.randn(N, D), torch.randn(C, D), w_())
    assert res.refusal is None, res.refusal
    assert outs[0] == Layout("batch", 0) and outs[1].kind == "sum" and outs[2].kind == "sum"


def test_sum_of_a_value_without_the_cotangent_is_refused():
    """Summing saved activations over the rows run would miss the rows not run: only weighted cotangents."""
    def f(g, h, w):
        return g * w.view(-1, 1), h.sum(0)
    res, _ = proof(f, torch.randn(N, C), torch.randn(N, D), w_())
    assert res.kind is RefusalKind.CROSS_EXAMPLE and "reduces over the batch" in res.refusal


@pytest.mark.parametrize("dim", [0, -2])
def test_negative_dims_are_the_batch_dim(dim):
    """A reduction over dim -2 of an (N, D) value is over the batch (normalised, not read as dim -2 != 0)."""
    def f(g, h, w):
        return h - h.mean(dim, keepdim=True) + g * w.view(-1, 1)
    res, _ = proof(f, torch.randn(N, D), torch.randn(N, D), w_())
    assert res.kind is RefusalKind.CROSS_EXAMPLE


def test_a_sum_combined_with_rows_is_refused():
    """Row b of the result would read every row: on the rows not run, dense-masked is nonzero."""
    def f(g, w):
        gw = g * w.view(-1, 1)
        return gw - gw.sum(0, keepdim=True)
    res, _ = proof(f, torch.randn(N, C), w_())
    assert res.kind is RefusalKind.CROSS_EXAMPLE and "sum over the rows with per-row values" in res.refusal


def test_a_sum_spread_back_over_the_rows_is_refused():
    def f(g, w):
        s = (g * w.view(-1, 1)).sum(0)
        return s.expand(g.shape[0], C).clone()
    res, _ = proof(f, torch.randn(N, C), w_())
    assert res.refusal is not None and "spreads a sum" in res.refusal


def test_any_function_of_sums_is_a_sum():
    def f(g, h, w):
        gw = (g * w.view(-1, 1)).t() @ h
        return (gw * 2).sqrt().norm() + gw.sum()
    res, outs = proof(f, torch.randn(N, C).abs(), torch.randn(N, D).abs(), w_())
    assert res.refusal is None and outs[0].kind == "sum"


# ---- rows placed by position or by data -------------------------------------------------------

def test_row_index_into_a_parameter_shaped_tensor_is_refused():
    """table[arange(N)]'s backward: row b's gradient goes to table row b; at gathered rows, to its position."""
    def f(g, w):
        gw = g * w.view(-1, 1)
        rows = torch.arange(gw.shape[0])
        return aten.index_put(torch.zeros(8, C), [rows], gw, True)
    res, _ = proof(f, torch.randn(N, C), w_())
    assert res.kind is RefusalKind.ROW_INDEX_VALUE and "does not carry the batch" in res.refusal


def test_row_index_into_a_batch_shaped_tensor_stays_per_row():
    """x[arange(N), j]'s backward writes row b into row b: gathered, it stays exact."""
    def f(g, j, w):
        gw = g * w.view(-1, 1)
        rows = torch.arange(gw.shape[0])
        return aten.index_put(gw.new_zeros(gw.shape[0], T, C), [rows, j], gw, True)
    res, outs = proof(f, torch.randn(N, C), torch.randint(0, T, (N,)), w_())
    assert res.refusal is None, res.refusal
    assert outs[0] == Layout("batch", 0)


def test_scatter_across_a_parameter_row_by_row_is_refused():
    """torch.gather(param, 1, idx)'s backward puts row b's gradient in param row b (its position)."""
    def f(g, idx, w):
        return torch.zeros(8, C).scatter_add(1, idx, g * w.view(-1, 1))
    res, _ = proof(f, torch.randn(N, 2), torch.randint(0, C, (N, 2)), w_())
    assert res.kind is RefusalKind.ROW_INDEX_VALUE


def test_scatter_by_data_into_a_table_is_a_sum():
    """index_select / gather along the index's own batch dim: rows land by their data, summed."""
    def f(g, idx, w):
        gw = g * w.view(-1, 1)
        return torch.zeros(11, C).index_add(0, idx, gw), torch.zeros(11, C).scatter_add(0, idx[:, None].expand(-1, C), gw)
    res, outs = proof(f, torch.randn(N, C), torch.randint(0, 11, (N,)), w_())
    assert res.refusal is None, res.refusal
    assert [o.kind for o in outs] == ["sum", "sum"]


@pytest.mark.parametrize("scale", [False, True])
def test_embedding_backward(scale):
    def f(g, ids, w):
        return aten.embedding_dense_backward(g * w.view(-1, 1, 1), ids, 11, -1, scale)
    res, outs = proof(f, torch.randn(N, T, C), torch.randint(0, 11, (N, T)), w_())
    if scale:  # counts of each index in the batch: other rows' counts
        assert res.kind is RefusalKind.CROSS_EXAMPLE
    else:
        assert res.refusal is None and outs[0].kind == "sum"


# ---- random numbers in the backward ------------------------------------------------------------

def _sdpa_inputs():
    q = torch.randn(N, 2, T, 8)
    return q, q.clone(), q.clone(), q.clone(), torch.randn(N, 2, T)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_fused_attention_backward_regenerating_dropout_is_refused(dropout_p):
    """CUDA's memory-efficient SDPA backward regenerates its dropout mask from a seed and offset: at k
    gathered rows it would draw rows 0..k-1's masks.  Without dropout it is per sample."""
    def f(g, q, k, v, lse, w):
        seed, off = torch.tensor(0), torch.tensor(0)
        out = q.clone()
        r = aten._scaled_dot_product_efficient_attention_backward(g * w.view(-1, 1, 1, 1), q, k, v, None, out, lse,
                                                                   seed, off, dropout_p, [True, True, True, False])
        return r[0], r[1], r[2]
    q, k, v, g, lse = _sdpa_inputs()
    res, outs = proof(f, g, q, k, v, lse, w_())
    if dropout_p:
        assert res.kind is RefusalKind.RANDOM_BACKWARD and "dropout" in res.refusal
    else:
        assert res.refusal is None, res.refusal
        assert all(o == Layout("batch", 0) for o in outs)


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_flash_attention_backward(dropout_p):
    def f(g, q, k, v, lse, w):
        seed, off = torch.tensor(0), torch.tensor(0)
        r = aten._scaled_dot_product_flash_attention_backward(g * w.view(-1, 1, 1, 1), q, k, v, q.clone(), lse,
                                                               None, None, T, T, dropout_p, False, seed, off)
        return r[0], r[1], r[2]
    q, k, v, g, lse = _sdpa_inputs()
    res, _ = proof(f, g, q, k, v, lse, w_())
    assert (res.kind is RefusalKind.RANDOM_BACKWARD) == bool(dropout_p), res.refusal


def test_random_ops_in_the_backward_are_refused():
    def dropout(g, w):
        return aten.native_dropout(g * w.view(-1, 1), 0.5, True)[0]

    def inductor_rng(g, w):
        seed = prims.inductor_lookup_seed(prims.inductor_seeds(1, torch.device("cpu")), 0)
        return g * w.view(-1, 1) * prims.inductor_random([g.shape[0], C], seed, "rand")

    def replay(g, w, state):  # activation checkpointing's RNG replay
        from torch._prims.rng_prims import run_with_rng_state
        m = run_with_rng_state(state, aten.rand.default, [g.shape[0], C], dtype=torch.float32,
                               device=torch.device("cpu"))
        return g * w.view(-1, 1) * m

    for f, extra in ((dropout, ()), (inductor_rng, ()), (replay, (torch.get_rng_state(),))):
        res, _ = proof(f, torch.randn(N, C), w_(), *extra, weight=1)
        assert res.kind is RefusalKind.RANDOM_BACKWARD, (f.__name__, res.refusal)


# ---- end to end, verify off --------------------------------------------------------------------

class PositionTable(nn.Module):
    """A learned vector per batch position (``self.table[torch.arange(N)]``)."""

    def __init__(self):
        super().__init__()
        self.fc, self.table, self.head = nn.Linear(6, 6), nn.Parameter(torch.randn(8, 6)), nn.Linear(6, 3)

    def forward(self, x):
        return self.head((self.fc(x) + self.table[torch.arange(x.shape[0])]).relu())


class PositionTable2D(PositionTable):
    """``self.table[torch.arange(N), j]`` with a column per row."""

    def forward(self, x):
        j = (x[:, 0].abs() * 3).long().clamp(max=5)
        return self.head((self.fc(x) + self.table[torch.arange(x.shape[0]), j][:, None]).relu())


class GatherParam(nn.Module):
    """``torch.gather(param, 1, idx)`` with a per-row index: output row b reads parameter row b."""

    def __init__(self):
        super().__init__()
        self.fc, self.p, self.head = nn.Linear(6, 6), nn.Parameter(torch.randn(8, 5)), nn.Linear(8, 3)

    def forward(self, x):
        idx = (x[:, :2].abs() * 3).long().clamp(max=4)
        return self.head(torch.cat([self.fc(x).relu(), torch.gather(self.p, 1, idx)], 1))


class TokenMajorMask(nn.Module):
    """A random mask drawn for a token-major (T*N, E) value: saved, it must be gathered as the value is."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):  # (N, T, 6)
        t = self.fc(x.transpose(0, 1).reshape(-1, 6)).relu()
        m = (torch.rand(t.shape, dtype=torch.float32) > 0.5).to(t.dtype)
        return self.head((t * m).reshape(x.shape[1], x.shape[0], 6).mean(0))


CASES = {
    "position_table": (PositionTable, (8, 6), RefusalKind.ROW_INDEX_VALUE),
    "position_table_2d": (PositionTable2D, (8, 6), RefusalKind.ROW_INDEX_VALUE),
    "gather_param": (GatherParam, (8, 6), RefusalKind.ROW_INDEX_VALUE),
    "token_major_mask": (TokenMajorMask, (8, 4, 6), RefusalKind.CROSS_EXAMPLE),
}


def _steps(model_cls, shape, backend, steps=3):
    """Steps of rule random (keep 0.5: kept rows not a prefix) with verify off; yields (stats, rel err) per
    step against a float64 eager reference of the rule's weights (same random draws: fallback_random)."""
    torch.manual_seed(0)
    model = model_cls()
    cm = capskip_fx.compile(model, rule="random", keep=0.5, backend=backend, verify=False)
    for step in range(steps):
        torch.manual_seed(10 + step)
        x, y = torch.randn(*shape), torch.randint(0, 3, (shape[0],))
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        F.cross_entropy(cm(x), y).backward()
        st = capskip_fx.stats(cm)
        ref = copy.deepcopy(model).double()
        ref.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        (F.cross_entropy(ref(x.double()), y, reduction="none") * st.weight.double()).sum().div(shape[0]).backward()
        err = max((p.grad.double() - q.grad).norm().item() / q.grad.norm().item()
                  for p, q in zip(model.parameters(), ref.parameters()) if q.grad is not None and q.grad.norm() > 0)
        yield st, err, cm


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_backward_not_row_wise_is_dense_masked_with_the_reason(case, backend):
    model_cls, shape, kind = CASES[case]
    before = counters()[f"refused: {kind.value}"]
    with inductor_config.patch(fallback_random=True):
        for st, err, cm in _steps(model_cls, shape, backend):
            assert err < 1e-5, f"{case} step {st.step}: gradient off by {err:.3g} ({st})"
            assert st.mode == "dense-masked" and 0 < st.kept < shape[0], st
            assert "not proven row-wise" in str(st.fallback), st.fallback
    assert counters()[f"refused: {kind.value}"] > before
    assert "not proven row-wise" in str(capskip_fx.report(cm))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_row_wise_backward_is_proven_and_gathered(backend):
    """The proof fires on every rewritten backward and passes a plain model: kept rows gathered, exact."""
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.norm, self.head = nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 3)

        def forward(self, x):
            return self.head(self.norm(self.fc(x)).relu())

    before = counters()["backward proven"]
    with fresh_inductor_cache():  # a graph served from the cache was proven when first compiled: not counted
        for st, err, _ in _steps(Plain, (8, 6), backend):
            assert err < 1e-5 and st.mode == "selected" and st.rows == st.kept == 4, (err, st)
    assert counters()["backward proven"] > before


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_a_position_table_indexed_by_arange_of_tokens_stays_selected(backend):
    """``pos[arange(T)]``: an arange of the tokens, not of the batch; its backward (the table's gradient,
    summed over the rows run) keeps its own length: only arange(N) is renumbered for the kept rows."""
    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.pos, self.head = nn.Linear(6, 6), nn.Parameter(torch.randn(7, 6)), nn.Linear(6, 3)

        def forward(self, x):  # (N, T, 6), T = 5
            h = self.fc(x) + self.pos[torch.arange(x.shape[1])]
            return self.head(h.relu().mean(1))

    for st, err, _ in _steps(Positions, (8, 5, 6), backend):
        assert err < 1e-5 and st.mode == "selected" and st.rows == 4, (err, st)

"""gather="graph": the kept-row gather and the input-gradient scatter as ops of the compiled backward
(passes/gather_in_graph.py).  Gradients against the float64 dense reference, the counter and record
that prove the rewrite ran, and the eager-gather fallback where it is refused."""
from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx
from capskip_fx.rules import Forced
from capskip_fx import backend as backend_mod
from capskip_fx.passes import pipeline
from capskip_fx.records import RefusalKind, Refused
from capskip_fx.passes.gather_in_graph import check_full_rows_free
from capskip_fx.records import counters
from conftest import make_deit, max_rel_err, reference_grads


def _step(cm, model, x, y, keep):
    cm.rule = Forced(keep=lambda _: keep)
    model.zero_grad(set_to_none=True)
    F.cross_entropy(cm(x), y).backward()
    st = capskip_fx.stats(cm)
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    return grads, st


def _check(cm, model, shape, steps, tol):
    for n, keep in steps:
        torch.manual_seed(n)
        x, y = torch.randn(n, *shape, dtype=torch.float64), torch.randint(0, 10, (n,))
        grads, st = _step(cm, model, x, y, torch.tensor(keep))
        assert st.kept == len(keep), (st.kept, st.rows)
        assert st.rows < n, (st.kept, st.rows)
        assert max_rel_err(grads, reference_grads(model, x, y, st.weight)) < tol, (
            f"batch {n}, keep {keep}: the in-graph gather's gradients differ from the reference; rel. error "
            f"{max_rel_err(grads, reference_grads(model, x, y, st.weight))!r}")


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    torch.__version__ < "2.12", reason="torch<2.12: float64 CPU SDPA backward under Inductor fails in torch "
    "(pytorch/pytorch#185539)"))])
def test_deit_gathers_in_graph_exactly(backend):
    torch.manual_seed(0)
    model = make_deit(depth=1).double()
    before = counters()["gather_in_graph"]
    cm = capskip_fx.compile(model, rule="dense", backend=backend, gather="graph")
    # caches off: a graph served from an earlier run's cache skips the pass, and the counter must see it run
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        _check(cm, model, (3, 32, 32), [(12, [0, 3, 4, 9]), (9, [8, 1]), (12, [5])], 1e-9)
    assert not any(r.cached for r in cm.backend.records), "with the caches off no graph may come from a cache: the counter must see the pass run"
    head = next(r for r in cm.backend.records if r.head)
    assert head.gather == "graph", f"gather='graph' should gather the head's saved rows inside the graph, not {head.gather!r}"
    assert head.gather_refused is None, f"the in-graph gather should not be refused on DeiT, got {head.gather_refused!r}"
    assert counters()["gather_in_graph"] == before + 1, (
        f"the in-graph gather pass should have run once for the one graph: counter {counters()['gather_in_graph']!r}, "
        f"was {before!r}")
    assert head.row_counts == {4, 2}, f"the head should run at 4 rows and at 2 (min_rows pads 1 kept row to 2), ran at {head.row_counts!r}"  # min_rows pads 1 kept row to 2


class _Broken(nn.Module):
    """A graph break between two blocks: the head graph's backward returns the batch-shaped gradient of
    its input (scattered back to N rows inside the graph), and a flattened (N*T, D) matmul input."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10)

    def forward(self, x):  # x: (N, T=3, 6)
        h = torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        h = F.gelu(self.b(h.reshape(-1, 8))).reshape(x.shape[0], 3, 8)
        return self.head(h.mean(1))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_graph_break_scatters_input_gradients_in_graph(backend):
    torch.manual_seed(0)
    model = _Broken().double()
    cm = capskip_fx.compile(model, rule="dense", backend=backend, gather="graph")
    _check(cm, model, (3, 6), [(10, [1, 2, 7]), (7, [0, 6])], 1e-9)
    recs = [r for r in cm.backend.records if r.plan is not None]
    assert recs, [r.as_dict() for r in cm.backend.records]
    assert all(r.gather == "graph" for r in recs), [r.as_dict() for r in cm.backend.records]
    head = next(r for r in recs if r.head)
    assert any(s is not None and s.kind == "batch" for s in head.plan.out_specs), (
        f"{backend}: the input gradient across the graph break should be scattered back by rows; out specs "
        f"{head.plan.out_specs}")  # an input gradient scattered
    assert any(s.kind == "batch" and s.factor == 3 for s in head.plan.specs), (
        f"{backend}: the flattened (N*T, D) input should be gathered with factor T=3; specs {head.plan.specs}")  # a flattened (N*T, D) input


def test_refused_rewrite_keeps_the_eager_gather(monkeypatch):
    def refuse(*a, **k):
        raise Refused("in-graph gather: refused for the test", RefusalKind.IN_GRAPH_GATHER)

    monkeypatch.setattr(pipeline, "gather_in_graph", refuse)
    torch.manual_seed(0)
    model = _Broken().double()
    cm = capskip_fx.compile(model, rule="dense", backend="aot_eager", gather="graph")
    _check(cm, model, (3, 6), [(10, [1, 2, 7])], 1e-9)
    head = next(r for r in cm.backend.records if r.head)
    assert head.gather == "eager", f"a refused in-graph rewrite should fall back to the eager gather (not dense), got {head.gather!r}"
    assert "refused for the test" in head.gather_refused, (
        f"the record should keep why the in-graph gather was refused, got {head.gather_refused!r}")
    assert "refused for the test" in head.as_dict()["gather"], (
        f"the report's gather column should show the refusal, got {head.as_dict()['gather']!r}")


def test_guard_on_the_full_row_count_is_refused():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    with mode:
        x = mode.from_tensor(torch.empty(4, 3))
    n = sympy.Symbol("n", positive=True, integer=True)
    check_full_rows_free([x], n, len(env.guards))  # nothing about n: fine
    env.replacements[n] = sympy.Integer(8)
    with pytest.raises(Refused, match="replaced the full row count"):
        check_full_rows_free([x], n, len(env.guards))


def test_gather_option_is_checked():
    with pytest.raises(ValueError, match="gather must be"):
        capskip_fx.compile(nn.Linear(3, 2), gather="device")


# -- static row buckets and Inductor modes (CUDA graphs record one graph per row count) ------------------

@pytest.mark.parametrize("n,buckets,granule", [(16, 4, 1), (13, 4, 1), (16, 8, 3), (7, 1, 1)])
def test_buckets_bound_the_row_counts(n, buckets, granule):
    cfg = capskip_fx.CapskipConfig(buckets=buckets, granule=granule, min_rows=1)
    counts = {cfg.bucket(k, n) for k in range(n + 1)}
    assert len(counts - {n}) <= buckets, (
        f"n={n}: row counts below N should fall into at most {buckets} buckets (fewer graphs), got {sorted(counts - {n})!r}")
    assert all(k <= cfg.bucket(k, n) <= n for k in range(n + 1)), (
        f"n={n}: a bucket must hold the kept rows (>= k) and never exceed the batch N; buckets "
        f"{[cfg.bucket(k, n) for k in range(n + 1)]}")


def test_reduce_overhead_sets_cudagraphs_and_buckets(monkeypatch):
    cfg = capskip_fx.CapskipConfig(mode="reduce-overhead")
    assert cfg.buckets == 8, f"reduce-overhead should default to 8 row buckets (bounded CUDA graphs), got {cfg.buckets!r}"
    assert cfg.inductor_options() == {"triton.cudagraphs": True}, (
        f"reduce-overhead should turn on Inductor's CUDA graphs, options {cfg.inductor_options()!r}")
    assert capskip_fx.CapskipConfig(mode="reduce-overhead", buckets=2).buckets == 2, (
        "an explicit buckets= should override reduce-overhead's default")
    assert capskip_fx.CapskipConfig(mode="max-autotune-no-cudagraphs").buckets is None, (
        "a mode without CUDA graphs needs no row buckets")
    with pytest.raises(ValueError, match="reduce-overhead"):  # torch's message lists the modes
        capskip_fx.CapskipConfig(mode="fast")
    seen = []
    inner = backend_mod.CapskipBackend._inner

    def spy(self, rec, gm, example_inputs, **kw):
        seen.append(torch._inductor.config.triton.cudagraphs)
        return inner(self, rec, gm, example_inputs, **kw)

    monkeypatch.setattr(backend_mod.CapskipBackend, "_inner", spy)
    torch.manual_seed(0)
    model = _Broken().double()
    # on CPU Inductor skips CUDA graphs (its log says why); the graphs, buckets and gradients are the same
    cm = capskip_fx.compile(model, rule="dense", backend="aot_eager", mode="reduce-overhead", gather="graph")
    _check(cm, model, (3, 6), [(16, [1, 2, 7]), (16, [0, 3, 5, 6, 9])], 1e-9)
    assert seen, "the backend's inner compile was never called: the spy saw no graph"
    assert all(seen), f"every graph should compile with CUDA graphs on under reduce-overhead; seen {seen}"
    head = next(r for r in cm.backend.records if r.head)
    assert head.row_counts == {4, 6}, f"3 and 5 kept rows of 16 should pad to multiples of ceil(16 / 8) = 2: 4 and 6, ran at {head.row_counts!r}"  # multiples of ceil(16 / 8)

"""gather="graph": the selected backward also compiled taking all N rows and the kept-row index, its gathers
fused into its first reads (passes/gather_in_graph.py).  Gradients against the float64 dense reference, the
counter and record that prove the twin was built and ran, dense-masked steps on the plain graph, and the
eager gather where the rewrite is refused."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx
from capskip_fx.passes import pipeline
from capskip_fx.records import RefusalKind, Refused, counters
from capskip_fx.rules import Forced
from conftest import make_deit, max_rel_err, reference_grads

pytestmark = pytest.mark.heavy  # compiles: out of the fast tier


def _check(cm, model, shape, steps, tol):
    """Each (n, keep): one step keeping ``keep`` of n rows; its gradients against the float64 reference."""
    for n, keep in steps:
        torch.manual_seed(n)
        x, y = torch.randn(n, *shape, dtype=torch.float64), torch.randint(0, 10, (n,))
        cm.rule = Forced(keep=lambda _, k=torch.tensor(keep): k)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(cm(x), y).backward()
        st = capskip_fx.stats(cm)
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        assert st.kept == len(keep), f"batch {n}: the step should keep {len(keep)} rows, kept {st.kept}"
        err = max_rel_err(grads, reference_grads(model, x, y, st.weight))
        assert err < tol, f"batch {n}, keep {keep}: gradients differ from the float64 reference, rel. error {err:.2e}"


class _Broken(nn.Module):
    """A graph break between two blocks: the head graph's backward returns the batch-shaped gradient of its
    input (scattered back to N rows), and reads a flattened (N*T, D) saved input."""

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


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    torch.__version__ < "2.12", reason="torch<2.12: float64 CPU SDPA backward under Inductor fails in torch "
    "(pytorch/pytorch#185539)"))])
def test_deit_gathers_in_graph_exactly(backend):
    torch.manual_seed(0)
    model = make_deit(depth=1).double()
    before = counters()["gather_in_graph"]
    cm = capskip_fx.compile(model, rule="dense", backend=backend, gather="graph")
    # caches off: a graph served from a cache is not rebuilt, and the counter must see the pass run
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        _check(cm, model, (3, 32, 32), [(12, [0, 3, 4, 9]), (9, [8, 1]), (12, [5]), (12, list(range(12)))], 1e-9)
    head = next(r for r in cm.backend.records if r.head)
    assert head.gather == "graph", f"gather='graph' should build the head's gathering twin, got {head.gather!r}"
    assert counters()["gather_in_graph"] == before + 1, (
        f"the twin should be built once for the one graph: counter {counters()['gather_in_graph']}, was {before}")
    assert head.graph_gathers == 3, (
        f"the three steps that keep a subset should run the twin (the all-rows step runs the plain graph "
        f"dense-masked), ran it {head.graph_gathers} times")
    assert head.modes["dense-masked"] == 1, f"the all-rows step should run dense-masked: {head.as_dict()['steps']}"
    assert head.as_dict()["graph_gathers"] == 3 and head.as_dict()["gather"] == "graph", head.as_dict()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_graph_break_with_input_gradients(backend):
    """The head graph after a break returns its input's gradient at the kept rows; the runtime scatters it
    back to N rows, and the graph before the break runs on the same rows."""
    torch.manual_seed(0)
    model = _Broken().double()
    cm = capskip_fx.compile(model, rule="dense", backend=backend, gather="graph")
    _check(cm, model, (3, 6), [(10, [1, 2, 7]), (7, [0, 6])], 1e-9)
    recs = [r for r in cm.backend.records if r.plan is not None]
    assert recs and all(r.gather == "graph" for r in recs), [r.as_dict() for r in cm.backend.records]
    assert all(r.graph_gathers == 2 for r in recs), [r.as_dict() for r in recs]
    head = next(r for r in recs if r.head)
    assert any(s is not None and s.kind == "batch" for s in head.plan.out_specs), (
        f"{backend}: the input gradient across the break should be scattered back by rows: {head.plan.out_specs}")
    assert any(s.kind == "batch" and s.factor == 3 for s in head.plan.specs), (
        f"{backend}: the flattened (N*T, D) input should be gathered with factor T=3: {head.plan.specs}")


def test_verify_checks_the_twin():
    """verify runs the twin and the dense-masked reference on the first informative step, and counts it."""
    torch.manual_seed(0)
    model = _Broken().double()
    cm = capskip_fx.compile(model, rule="dense", backend="aot_eager", gather="graph", verify=True)
    _check(cm, model, (3, 6), [(10, [1, 2, 7])], 1e-9)
    head = next(r for r in cm.backend.records if r.head)
    assert head.graph_gathers == 1 and head.checks == 1 and head.verified, head.as_dict()


def test_refused_rewrite_keeps_the_eager_gather(monkeypatch):
    def refuse(*a, **k):
        raise Refused("in-graph gather: refused for the test", RefusalKind.IN_GRAPH_GATHER)

    monkeypatch.setattr(pipeline, "compile_gathering", refuse)
    torch.manual_seed(0)
    model = _Broken().double()
    cm = capskip_fx.compile(model, rule="dense", backend="aot_eager", gather="graph")
    _check(cm, model, (3, 6), [(10, [1, 2, 7])], 1e-9)
    head = next(r for r in cm.backend.records if r.head)
    assert head.gather == "eager (in-graph gather: refused for the test)", (
        f"a refused rewrite should fall back to the eager gather (not dense) and say why, got {head.gather!r}")
    assert head.graph_gathers == 0 and head.modes["selected"] == 1, head.as_dict()


def test_eager_gather_by_default():
    torch.manual_seed(0)
    model = _Broken().double()
    cm = capskip_fx.compile(model, rule="dense", backend="aot_eager")
    _check(cm, model, (3, 6), [(10, [1, 2, 7])], 1e-9)
    head = next(r for r in cm.backend.records if r.head)
    assert head.gather == "eager" and head.graph_gathers == 0, head.as_dict()


def test_bad_gather_names_the_values():
    with pytest.raises(ValueError, match=r"gather must be one of \('eager', 'graph'\)"):
        capskip_fx.compile(nn.Linear(2, 2), gather="fused")

"""Eager aten ops per training step (issue 32, item 3): the runtime's glue around the compiled graphs.

Counted by capskip_fx.debug.count_eager_ops: aten ops dispatched outside Inductor's compiled graphs, each
once where it is called (forward, the loss outside the model, backward).  Under aot_eager every graph op
would count, so these tests compile with Inductor (a tiny MLP: seconds).  The bounds are on the ops a rule
adds to a plain torch.compile step, which the same counter measures in the same process (its own ops
depend on torch's autograd, not on us).  Totals per step before (benchmarks/results/cpu_eager_ops_before.md)
and now (cpu_eager_ops.md): plain 8; dense 28 -> 13, forced 49 -> 24, capskip 123 -> 61, sb 102 -> 61,
random 58 -> 28."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx
from capskip_fx.debug import eager_ops_per_step
from torch._inductor.utils import fresh_inductor_cache

pytestmark = pytest.mark.inductor

N, D, HIDDEN, C = 16, 12, 16, 5
WARMUP, STEPS = 4, 3  # warm-up: compile, the verify steps

# rule options -> (most ops a step may add to plain torch.compile's, the mode its measured steps run)
BOUNDS = {
    "dense": (dict(rule="dense"), 6, "dense-masked"),  # was 20
    "forced": (dict(rule="forced", keep=0.5), 16, "selected"),  # was 41 (49 in all)
    "capskip": (dict(rule="capskip", budget=0.5), 53, "selected"),  # was 115 (123 in all)
    "sb": (dict(rule="sb", keep=0.5, start=0, end=1, interrupt=0), 53, "selected"),  # was 94
    "random": (dict(rule="random", keep=0.5), 20, "selected"),  # was 50
}


def _steps(opts):
    """Per measured step: (eager ops, ops run inside the compiled graphs, the step's stats or None)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, C))
    # compiled into a fresh cache and a reset Dynamo: a graph another test's cache entry serves may run without
    # Inductor's profiler range around it, and its ops would count as eager
    torch._dynamo.reset()
    with fresh_inductor_cache():
        cm = torch.compile(model) if opts is None else capskip_fx.compile(model, backend="inductor", **opts)
        return _run(model, cm, opts)


def _run(model, cm, opts):
    g = torch.Generator().manual_seed(0)
    batches = ((torch.randn(N, D, generator=g), torch.randint(0, C, (N,), generator=g)) for _ in range(WARMUP + STEPS))
    measured = eager_ops_per_step(cm, model, batches, WARMUP, capskip_fx.stats if opts is not None else None)
    return [(len(ops), sum(ops.in_graphs.values()), st, ops) for ops, st in measured]


@pytest.fixture(scope="module")
def plain():
    steps = _steps(None)
    eager = {e for e, _, _, _ in steps}
    assert len(eager) == 1, f"plain torch.compile's steps must count the same ops; counted {sorted(eager)}"
    return steps[0]


def test_counter_separates_eager_ops_from_compiled_graphs(plain):
    eager, in_graphs, _, ops = plain
    assert ops.eager["aten::cross_entropy_loss"] == 1, f"the loss outside the model runs eagerly: {ops.eager}"
    assert not any("mm" in name for name in ops.eager), f"the compiled graphs' matmuls counted as eager: {ops.eager}"
    assert in_graphs >= 3, f"the compiled graphs' extern matmuls (forward and backward) must be seen: {ops.in_graphs}"


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_eager_ops_per_step(plain, name):
    opts, bound, mode = BOUNDS[name]
    steps = _steps(opts)
    assert any(st.mode == mode for _, _, st, _ in steps), (
        f"{name}: no measured step ran {mode}; modes {[st.mode for _, _, st, _ in steps]}")
    for eager, in_graphs, st, ops in steps:
        added = eager - plain[0]
        assert added <= bound, (
            f"{name} ({st.mode}, kept {st.kept}/{st.n}): {eager} eager aten ops per step, {added} more than plain "
            f"torch.compile's {plain[0]} (at most {bound}); by op: {dict(ops.eager.most_common())}")
        assert in_graphs == plain[1], (
            f"{name}: the compiled graphs dispatch {in_graphs} ops themselves, plain torch.compile's {plain[1]}: the "
            f"head graph's copy of the logits must be a fused kernel, not a Python op; {dict(ops.in_graphs)}")


def test_returned_logits_may_be_modified_in_place():
    """The head graph returns a copy of the logits it saves, compiled as a clone Inductor keeps (the saved
    z and the copy are both outputs): eager code may modify the returned logits in place."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, C))
    cm = capskip_fx.compile(model, backend="inductor", rule="forced", keep=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(N, D, generator=g), torch.randint(0, C, (N,), generator=g)
        model.zero_grad(set_to_none=True)
        z = cm(x)
        z.mul_(2.0)  # bumps the returned tensor's version: the saved one must be another tensor
        F.cross_entropy(z, y).backward()
    st = capskip_fx.stats(cm)
    assert (st.mode, st.kept, st.rows) == ("selected", N // 2, N // 2), st

"""passes/pipeline.py: the joint passes as one function returning a frozen result with a typed refusal,
and GraphRecord's split into a frozen compile record and run-time fields."""
from __future__ import annotations

import dataclasses
import itertools
import types

import pytest
import torch
import torch.nn as nn
from torch._inductor.compile_fx import compile_fx

from capskip_fx.passes import pipeline
from capskip_fx.passes.insert_select import SELECT, SELECTION_OPS
from capskip_fx.records import BackwardMode, GraphRecord, Refusal, RefusalKind, counters


class _Stop(Exception):
    pass


_ids = itertools.count()


def _call(model, x):
    return model(x)


def _joint(model: nn.Module, ctx: pipeline.JointContext):
    """(the joint graph after the joint passes, every result they delivered); compile_fx stops there."""
    results: list = []
    graphs: list = []

    def deliver(result):
        results.append(result)

    class _Capture(pipeline.JointPass):
        def __call__(self, graph):
            super().__call__(graph)
            graphs.append(graph)
            raise _Stop

    def backend(gm, example_inputs):
        try:
            return compile_fx(gm, example_inputs, config_patches={
                "joint_custom_pre_pass": _Capture(ctx, "test", deliver)})
        except Exception:
            if not graphs:
                raise
            return gm.forward

    torch.manual_seed(0)
    x = torch.randn(6, 4, dtype=torch.float64)
    torch._dynamo.mark_dynamic(x, 0)
    fn = types.FunctionType(_call.__code__.replace(co_name=f"_pipeline_capture_{next(_ids)}"), globals())
    with torch._functorch.config.patch(enable_autograd_cache=False):
        torch.compile(fn, backend=backend, fullgraph=True)(model.double(), x)
    assert graphs, "no joint graph captured"
    return graphs[0], results


def _selection_nodes(graph) -> list:
    return [n for n in graph.nodes if n.target in SELECTION_OPS]


def test_joint_inserts_one_select_and_returns_a_frozen_result():
    graph, results = _joint(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3)), pipeline.JointContext(7))
    assert len(results) == 1, f"one result per graph, got {results}"
    res = results[0]
    assert res.head, f"a head graph, got {res!r}"
    assert not res.body, f"a head graph, got {res!r}"
    assert res.refusal is None, f"a head graph, got {res!r}"
    assert res.masked_tangents == 1, f"the logits' tangent masked, got {res.masked_tangents}"
    assert res.head_bias is True, "the head Linear has a bias"
    sel = _selection_nodes(graph)
    assert len(sel) == 1, f"one capskip::select, got {sel}"
    assert sel[0].target is SELECT, f"one capskip::select, got {sel}"
    assert sel[0].args[-1] == 7, "the selection node carries the context's registry key"
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.head = False
    with pytest.raises(TypeError):
        res.layouts["x"] = None  # the layout proof is read-only
    assert pipeline.joint(graph, pipeline.JointContext(7)) is None, "a second run leaves the graph alone"
    assert len(_selection_nodes(graph)) == 1, "still one selection node after a second run"


@pytest.mark.parametrize("on_coupling", ["dense", "error"])
def test_joint_refuses_row_mixing_with_a_typed_refusal(on_coupling):
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    graph, (res,) = _joint(model, pipeline.JointContext(1, on_coupling=on_coupling))
    assert res.refusal is not None, f"got {res.refusal!r}"
    assert res.refusal.kind is RefusalKind.CROSS_EXAMPLE, f"got {res.refusal!r}"
    assert str(res.refusal) == res.refusal.detail, res.refusal.detail
    assert "BatchNorm" in res.refusal.detail, res.refusal.detail
    assert not res.head, "a refused graph gets no selection node"
    assert not _selection_nodes(graph), "a refused graph gets no selection node"
    assert res.record_fields()["coupled"], "a cross-example refusal marks the record coupled"
    if on_coupling == "error":
        assert res.error is not None, res.error
        assert "on_coupling='error'" in res.error, res.error
    else:
        assert res.error is None, res.error


def test_joint_leaves_a_graph_refused_before_aot_alone():
    refused = Refusal(RefusalKind.UNDECLARED_FUNCTION, "declared nowhere")
    graph, (res,) = _joint(nn.Sequential(nn.Linear(4, 3)), pipeline.JointContext(1, refused=refused))
    assert res.refusal is refused, f"the context's refusal is the result's, got {res.refusal!r}"
    assert not _selection_nodes(graph), "no selection node in a graph refused before AOT"


def test_record_compile_fields_change_only_through_settle():
    rec = GraphRecord(index=0, nodes=1)
    with pytest.raises(AttributeError, match="compile field"):
        rec.plan = object()
    counters().clear()
    first = Refusal(RefusalKind.NO_HEAD, "first")
    assert rec.settle(head=True, refusal=first) is first, "a graph's first refusal is returned (to warn)"
    assert rec.settle(refusal=Refusal(RefusalKind.BATCH_LAYOUT, "second"), backward=BackwardMode.DENSE) is None, (
        "a second refusal for a graph that already has one must be dropped (None returned, no second warning)")
    assert rec.reason == "first", (rec.reason, rec.backward)
    assert rec.backward == BackwardMode.DENSE, (rec.reason, rec.backward)
    assert counters()[f"refused: {RefusalKind.NO_HEAD.value}"] == 1, dict(counters())
    assert counters()[f"refused: {RefusalKind.BATCH_LAYOUT.value}"] == 0, "a later refusal is not counted"
    assert not rec.refuse(Refusal(RefusalKind.VERIFY, "later"), BackwardMode.DENSE_MASKED), "not the first"
    assert rec.backward == BackwardMode.DENSE_MASKED, (rec.backward, rec.reason)
    assert rec.reason == "first", (rec.backward, rec.reason)


def test_run_time_demotion_keeps_the_compile_record():
    rec = GraphRecord(index=0, nodes=1)
    rec.settle(head=True)
    rec.demoted = "a Linear output that is not the returned logits"
    assert not rec.head, rec.as_dict()
    assert rec.body, rec.as_dict()
    assert rec.no_head == rec.demoted, rec.as_dict()
    assert rec.compiled.head, "the compile record still says what the pass did"
    assert not rec.compiled.body, "the compile record still says what the pass did"
    assert rec.as_dict()["role"] == "body", rec.as_dict()

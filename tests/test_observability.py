"""What a user sees: stats() and report() as printed, the INFO line, counters, structured-trace artifacts."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx
from capskip_fx.runtime import stats as stats_mod


def _step(cm, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    F.cross_entropy(cm(torch.randn(n, 6, generator=g)), torch.randint(0, 3, (n,), generator=g)).backward()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))


def test_stats_repr_and_report_table():
    cm = capskip_fx.compile(_model(), rule="capskip", budget=0.3, backend="aot_eager")
    _step(cm)
    text = repr(capskip_fx.stats(cm))
    for field in ("n=8", "kept=", "rows=", "bound=", "fallback=None", "variants=1"):
        assert field in text, f"the stats repr should show {field!r} (a step's summary at a glance), got {text!r}"
    assert "tensor" not in text, f"the stats repr should elide the weight tensor, got {text!r}"  # the weight is elided
    rep = capskip_fx.report(cm)
    assert rep[0]["role"] == "head", f"the MLP's one graph is its head graph, report says role {rep[0]['role']!r}"
    assert rep.rows == list(rep), f"a report should iterate over its rows: rows {rep.rows!r}, iterated {list(rep)!r}"
    lines = str(rep).splitlines()
    assert lines[0].split()[:3] == ["graph", "role", "backward"], (
        f"the report table should start with its header (graph, role, backward), got {lines[0]!r}")
    assert lines[1].split()[:2] == ["0", "head"], (
        f"the table's first row should be graph 0, the head, got {lines[1]!r}")


def test_report_says_not_yet_verified_and_explains_its_columns():
    """A gathered graph no informative step has checked reads "not yet", not as a failure; "yes" once one
    has; the table ends with what its columns mean."""
    cm = capskip_fx.compile(_model(), rule="forced", keep=1.0, backend="aot_eager")
    _step(cm)  # every row kept: nothing to compare, so not verified yet
    rep = capskip_fx.report(cm)
    assert rep[0]["backward"] == "selected rows", rep.rows
    assert rep[0]["verified"] is False, rep.rows
    text = str(rep)
    assert "not yet" in text.splitlines()[1], text
    assert "verified: yes = a gathered step matched" in text, text
    assert "dense-masked (all rows" in text, text
    cm2 = capskip_fx.compile(_model(), rule="forced", keep=0.5, backend="aot_eager")
    _step(cm2)
    line = str(capskip_fx.report(cm2)).splitlines()[1]
    assert " yes " in line, line
    assert "not yet" not in line, line


def test_info_line_rate_limited(caplog, monkeypatch):
    monkeypatch.setattr(stats_mod, "LOG_EVERY_S", 3600.0)
    cm = capskip_fx.compile(_model(), rule="forced", keep=0.5, backend="aot_eager")
    with caplog.at_level(logging.INFO, logger="capskip_fx"):
        for s in range(4):
            _step(cm, seed=s)
    lines = [r.getMessage() for r in caplog.records if r.name == "capskip_fx"]
    assert lines == ["capskip_fx step 0 (selected): kept 4/8 rows, backward ran on 4; run: kept 50.0%, ran 50.0% "
                     "of rows over 1 steps"], lines


@pytest.mark.subprocess
def test_structured_trace_has_the_rewritten_backward(tmp_path):
    code = textwrap.dedent("""
        import torch, torch.nn as nn, torch.nn.functional as F, capskip_fx
        m = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
        cm = capskip_fx.compile(m, rule="forced", keep=0.5, backend="aot_eager")
        F.cross_entropy(cm(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
    """)
    env = dict(os.environ, TORCH_TRACE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    text = "".join(p.read_text() for p in tmp_path.iterdir())
    assert "capskip_backward_graph_0" in text, f"TORCH_TRACE should hold the rewritten backward as an artifact named capskip_backward_graph_0; trace {text[:2000]!r}"
    assert "capskip_w" in text, f"the traced backward should read the selection weight capskip_w; trace {text[:2000]!r}"


class _CentredMLP(nn.Module):
    """Row mixing in the user's own line (h - h.mean(0)), then a library module that mixes rows."""

    def __init__(self, bn: bool):
        super().__init__()
        self.fc, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.bn = nn.BatchNorm1d(8) if bn else None

    def forward(self, x):
        h = self.fc(x)
        if self.bn is not None:
            h = self.bn(h)
        else:
            h = h - h.mean(0)
        return self.head(h)


def _refused_steps(cm, sizes):
    """Train steps at the given batch sizes; the capskip_fx warnings they raised."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s, n in enumerate(sizes):
            _step(cm, n=n, seed=s)
    return [str(w.message) for w in caught if str(w.message).startswith("capskip_fx:")]


def test_refusal_names_the_op_and_the_users_source_line():
    """A refusal at a node in the user's code carries the aten op and the user's line, and report() and
    the warning show them."""
    torch.manual_seed(0)
    cm = capskip_fx.compile(_CentredMLP(bn=False), rule="random", keep=0.5, backend="aot_eager")
    warned = _refused_steps(cm, [8])
    refusal = cm.backend.records[0].refusal
    assert refusal is not None, "h - h.mean(0) mixes rows: the graph must be refused"
    assert refusal.op == "aten.mean.dim", f"the refused op: {refusal.op!r}"
    assert refusal.source_line is not None, "the user's line is in Dynamo's stack trace"
    assert refusal.source_line.startswith("test_observability.py:"), refusal.source_line
    assert refusal.source_line.endswith("h = h - h.mean(0)"), refusal.source_line
    assert refusal.module is None or "Linear" not in refusal.module, f"the mean is in no submodule: {refusal.module}"
    text = str(capskip_fx.report(cm))
    assert "graph 0 refused at: op aten.mean.dim" in text, text
    assert refusal.source_line in text, text
    assert len(warned) == 1, warned
    assert refusal.source_line in warned[0], warned


def test_refusal_inside_batchnorm_names_the_module_path():
    """Inside a library module the innermost frames are torch's: the refusal names the module path and
    class, and the user's line that called it (not torch/nn/functional.py)."""
    torch.manual_seed(0)
    cm = capskip_fx.compile(_CentredMLP(bn=True), rule="random", keep=0.5, backend="aot_eager")
    warned = _refused_steps(cm, [8])
    refusal = cm.backend.records[0].refusal
    assert refusal is not None, "BatchNorm in train mode mixes rows: the graph must be refused"
    assert refusal.op is not None, f"the refused op: {refusal.op!r}"
    assert "var_mean" in refusal.op, f"the refused op: {refusal.op!r}"
    assert refusal.module == "bn (BatchNorm1d)", f"the module path: {refusal.module!r}"
    assert refusal.source_line is not None, "the line that called self.bn is the user's"
    assert refusal.source_line.endswith("h = self.bn(h)"), refusal.source_line
    assert "functional.py" not in refusal.source_line, refusal.source_line
    assert len(warned) == 1, warned
    assert "in bn (BatchNorm1d)" in warned[0], warned


def test_refusal_warns_once_per_graph():
    """A refused graph warns once, however many steps and recompiles (new batch sizes) follow; a second
    refused graph (after a graph break) warns once too, naming its own module."""
    torch.manual_seed(0)
    cm = capskip_fx.compile(_CentredMLP(bn=True), rule="random", keep=0.5, backend="aot_eager")
    warned = _refused_steps(cm, [8, 9, 10, 8])
    assert len(warned) == 1, f"one refused graph, warned {len(warned)} times: {warned}"

    class TwoParts(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8))
            self.b = nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 3))

        def forward(self, x):
            h = self.a(x)
            torch._dynamo.graph_break()
            return self.b(h)

    torch.manual_seed(0)
    cm2 = capskip_fx.compile(TwoParts(), rule="random", keep=0.5, backend="aot_eager")
    warned = _refused_steps(cm2, [8, 9, 10])
    refused = [r for r in cm2.backend.records if r.refusal is not None]
    assert len(refused) == 2, f"two refused graphs expected: {capskip_fx.report(cm2)}"
    assert len(warned) == 2, f"two refused graphs, {len(warned)} warnings: {warned}"
    assert "in a.1 (BatchNorm1d)" in warned[0], warned
    assert "in b.0 (BatchNorm1d)" in warned[1], warned

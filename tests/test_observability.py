"""What a user sees: stats() and report() as printed, the INFO line, counters, structured-trace artifacts."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

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
        assert field in text
    assert "tensor" not in text  # the weight is elided
    rep = capskip_fx.report(cm)
    assert rep[0]["role"] == "head" and rep.rows == list(rep)
    lines = str(rep).splitlines()
    assert lines[0].split()[:3] == ["graph", "role", "backward"] and lines[1].split()[:2] == ["0", "head"]


def test_report_says_not_yet_verified_and_explains_its_columns():
    """A gathered graph no informative step has checked reads "not yet", not as a failure; "yes" once one
    has; the table ends with what its columns mean."""
    cm = capskip_fx.compile(_model(), rule="forced", keep=1.0, backend="aot_eager")
    _step(cm)  # every row kept: nothing to compare, so not verified yet
    rep = capskip_fx.report(cm)
    assert rep[0]["backward"] == "selected rows" and rep[0]["verified"] is False, rep.rows
    text = str(rep)
    assert "not yet" in text.splitlines()[1], text
    assert "verified: yes = a gathered step matched" in text and "dense-masked (all rows" in text, text
    cm2 = capskip_fx.compile(_model(), rule="forced", keep=0.5, backend="aot_eager")
    _step(cm2)
    line = str(capskip_fx.report(cm2)).splitlines()[1]
    assert " yes " in line and "not yet" not in line, line


def test_info_line_rate_limited(caplog, monkeypatch):
    monkeypatch.setattr(stats_mod, "LOG_EVERY_S", 3600.0)
    cm = capskip_fx.compile(_model(), rule="forced", keep=0.5, backend="aot_eager")
    with caplog.at_level(logging.INFO, logger="capskip_fx"):
        for s in range(4):
            _step(cm, seed=s)
    lines = [r.getMessage() for r in caplog.records if r.name == "capskip_fx"]
    assert lines == ["capskip_fx step 0 (selected): kept 4/8 rows, backward ran on 4; run: kept 50.0%, ran 50.0% "
                     "of rows over 1 steps"], lines


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
    assert "capskip_backward_graph_0" in text and "capskip_w" in text

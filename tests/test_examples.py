"""The example scripts run as documented (fast settings)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess  # starts Python processes

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs_and_skips_rows():
    out = subprocess.run([sys.executable, "examples/quickstart.py", "--backend", "aot_eager", "--epochs", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("epoch 1:")]
    kept, seen = map(int, lines[0].split("kept ")[1].split(" rows")[0].split("/"))
    ran = int(lines[0].split("backward ran on ")[1].split(" ")[0])
    assert 0 < kept <= ran < seen, (  # rows were skipped, and the backward ran on fewer rows than forwarded
        f"the quickstart must keep some but not all rows in epoch 1 and run fewer than all: kept {kept}, "
        f"ran {ran} of {seen}")
    table = out.stdout[out.stdout.index("graph  role"):].splitlines()  # report() prints as a table
    assert "head  selected rows" in table[1], (
        f"report() must list the training graph as a head whose backward runs on selected rows; it reads {table[1]!r}")
    assert "none (inference graph)" in table[2], (
        f"the no_grad accuracy pass's graph must be listed as an inference graph (no backward); it reads {table[2]!r}")

"""benchmarks/interleaved.py runs on the harness's model and data and reports per-arm ratios with intervals."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--", "--depth", "1", "--embed-dim", "16", "--num-heads", "2", "--img-size", "16", "--patch-size", "4",
        "--train-subset", "256", "--batch-size", "32", "--backend", "eager"]


def _bench(*argv):
    return subprocess.run([sys.executable, "benchmarks/interleaved.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.subprocess
def test_tiny_run_reports_ratios_with_intervals(tmp_path):
    p = _bench("--blocks", "3", "--rounds", "2", "--warmup", "1", "--arms", "dense",
               "forced:keep=0.5", "infobatch", "--out", str(tmp_path / "r"), *TINY, "--threads", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads((tmp_path / "r.json").read_text())
    rows = {r["arm"]: r for r in data["rows"]}
    assert list(rows) == ["torch.compile", "dense", "forced:keep=0.5", "infobatch"], (
        f"the report should list the torch.compile baseline, then the arms in the order given; got {list(rows)!r}")
    assert rows["forced:keep=0.5"]["kept_frac"] == 0.5, (
        f"the forced keep=0.5 arm should report half its rows kept, got {rows['forced:keep=0.5']['kept_frac']!r}")
    assert rows["dense"]["kept_frac"] == 1.0, (
        f"the dense arm keeps every row, reported {rows['dense']['kept_frac']!r}")
    assert rows["torch.compile"]["ratio"] == 1.0, (
        f"the baseline's ratio to itself should be exactly 1, got {rows['torch.compile']['ratio']!r}")
    for r in rows.values():
        assert len(r["block_ratios"]) == 3, f"{r['arm']}: one ratio per block (--blocks 3), got {len(r['block_ratios'])!r}"
        assert all(x > 0 for x in r["block_ratios"]), f"{r['arm']}: a time ratio must be positive, got {r['block_ratios']}"
        assert r["ratio_lo"] <= r["ratio"] <= r["ratio_hi"], f"{r['arm']}: the ratio should lie inside its interval: {r['ratio_lo']} <= {r['ratio']} <= {r['ratio_hi']}"
        assert math.isfinite(r["ratio_hi"]), f"{r['arm']}: the interval's upper end should be finite with 3 blocks, got {r['ratio_hi']}"
        assert r["ratio"] == pytest.approx(sum(r["block_ratios"]) / 3, rel=1e-12), (
            f"{r['arm']}: the ratio should be the mean of the block ratios {r['block_ratios']}, got {r['ratio']!r}")
        per_block = [a / d for a, d in zip(r["block_ratios"], rows["dense"]["block_ratios"])]
        mean = sum(per_block) / 3
        assert r["vs_dense_lo"] <= mean <= r["vs_dense_hi"], (
            f"{r['arm']}: the interval of r vs dense should hold the mean of its per-block ratios to dense "
            f"({mean}): [{r['vs_dense_lo']}, {r['vs_dense_hi']}]")
    assert rows["dense"]["vs_dense_lo"] == rows["dense"]["vs_dense_hi"] == 1.0, (
        f"dense over itself, block by block, is exactly 1: [{rows['dense']['vs_dense_lo']}, {rows['dense']['vs_dense_hi']}]")
    assert data["env"]["dataset"] == "digits", (
        f"the run should record the harness's dataset (digits), got {data['env']['dataset']!r}")
    assert data["env"]["threads"] == 1, f"--threads 1 after -- must be the thread count used, got {data['env']['threads']}"
    assert data["env"]["blocks"] == 3, f"the run should record --blocks 3, got {data['env']['blocks']!r}"
    written = data["written"]
    assert written["threads"] == 1 and written["utc"][:2] == "20" and written["torch"] == torch.__version__, (
        f"the raw file should say when, with which torch and on how many threads it was written: {written!r}")
    md = (tmp_path / "r.md").read_text()
    assert md.rstrip().splitlines()[-1].startswith(f"Written {written['utc']}") and "1 thread(s)" in md, (
        f"the table's last line should say when and where it was written; table: {md!r}")
    assert "| forced:keep=0.5 | 0.500 |" in md, f"the markdown table should show the forced arm's kept fraction 0.500; table: {md!r}"
    assert "r vs torch.compile [95% CI]" in md, f"the markdown table should head its ratio column with the baseline and the interval; table: {md!r}"


@pytest.fixture(scope="module")
def interleaved():
    """benchmarks/interleaved.py as a module: its argument checks run in this process (the tiny run above
    runs the script as a process)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))  # its results_io
    try:
        spec = importlib.util.spec_from_file_location("interleaved_bench", ROOT / "benchmarks" / "interleaved.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return mod


def test_bad_arms_fail_naming_the_fix(interleaved, capsys):
    """Bad arms and settings stop the benchmark before any data loads, saying what to do instead."""
    with pytest.raises(SystemExit, match="benchmarks/step_time.py"):
        interleaved.parse(["--arms", "stale_sb", "--out", "x", *TINY])
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        interleaved.parse(["--arms", "sb:keep", "--out", "x", *TINY])
    with pytest.raises(SystemExit) as stop:
        interleaved.parse(["--blocks", "1", *TINY])
    assert stop.value.code != 0, f"--blocks 1 exited with {stop.value.code!r}"
    err = capsys.readouterr().err
    assert "--blocks must be >= 2" in err, f"argparse's message for --blocks 1: {err!r}"


def test_threads_after_the_separator_are_honoured(interleaved):
    """--threads given with the capskip-train flags (after `--`) is the benchmark's thread count too."""
    a, cfg, _ = interleaved.parse(["--out", "x", *TINY, "--threads", "1"])
    assert a.threads == 1 and cfg.threads == 1, f"--threads 1 after -- must set the benchmark's threads, got {a.threads}"
    a, _, _ = interleaved.parse(["--threads", "2", "--out", "x", *TINY])
    assert a.threads == 2, f"--threads 2 before -- is kept, got {a.threads}"
    with pytest.raises(SystemExit):
        interleaved.parse(["--threads", "2", "--out", "x", *TINY, "--threads", "1"])


def test_r_vs_dense_is_the_centre_of_its_interval(interleaved):
    """The point estimate and the interval of r vs dense come from the same per-block ratios."""
    rows = [{"arm": "dense", "ratio": 1.1, "block_ratios": [1.0, 1.2, 1.1]},
            {"arm": "x", "ratio": 0.8, "block_ratios": [0.5, 1.0, 0.9]}]
    interleaved.vs_dense(rows)
    x = rows[1]
    per = [0.5 / 1.0, 1.0 / 1.2, 0.9 / 1.1]
    assert x["vs_dense"] == pytest.approx(sum(per) / 3), f"r vs dense: the mean of per-block ratios, got {x['vs_dense']}"
    assert x["vs_dense"] != pytest.approx(0.8 / 1.1), "not the ratio of the block means"
    assert (x["vs_dense_lo"] + x["vs_dense_hi"]) / 2 == pytest.approx(x["vs_dense"]), "the interval is centred on r"


def test_at_share_moves_an_arm_along_the_forced_slope(interleaved):
    """--at ARM=K: the arm's own per-block ratio (selection cost included) moved to share K along the forced
    arms' slope."""
    rows = [{"arm": "dense", "ratio": 1.0, "block_ratios": [1.0, 1.0], "block_rows_frac": [1.0, 1.0]},
            {"arm": "forced:keep=0.2", "ratio": 0.6, "block_ratios": [0.6, 0.6], "block_rows_frac": [0.2, 0.2]},
            {"arm": "forced:keep=0.6", "ratio": 0.8, "block_ratios": [0.8, 0.8], "block_rows_frac": [0.6, 0.6]},
            {"arm": "kabena", "ratio": 0.9, "block_ratios": [0.9, 0.9], "block_rows_frac": [0.6, 0.6]}]
    interleaved.vs_dense(rows)
    interleaved.at_share(rows, {"kabena": 0.4})
    at = rows[3]["at"]
    assert at["slope"] == pytest.approx(0.5), f"(0.8 - 0.6) / (0.6 - 0.2) = 0.5 per unit share, got {at['slope']}"
    assert at["r"] == pytest.approx(0.8), (  # 0.9 at 0.6, minus 0.5 x 0.2: its 0.1 selection cost over forced stays
        f"kabena at share 0.4: 0.9 - 0.5 x (0.6 - 0.4) = 0.8, got {at['r']}")
    assert "at" not in rows[1], "only the arms named by --at get an r at a share"

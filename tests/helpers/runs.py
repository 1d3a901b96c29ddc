"""Training-run fixtures shared by the harness tests: run directories written by hand, runs cut short."""
from __future__ import annotations

import csv

import pytest
import yaml


def write_run(root, name, seed, curve, backward_rows=10, **cfg):
    """A run directory as ``capskip-train`` leaves it: config.yaml and summary.csv with one row per
    (wall-clock s, eval top-1) of ``curve``."""
    d = root / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"dataset": "mnist", "seed": seed, **cfg}))
    with open(d / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["epoch", "eval_top1", "wall_clock_s", "backward_rows", "rows"])
        w.writeheader()
        for e, (t, acc) in enumerate(curve, 1):
            w.writerow({"epoch": e, "eval_top1": acc, "wall_clock_s": t, "backward_rows": backward_rows, "rows": 10})
    return d


class Crash(Exception):
    """The process dying mid-run."""


def run_killed_at_evaluation(monkeypatch, loop, n: int, run) -> None:
    """``run()`` killed at its ``n``-th evaluation (after the previous epoch's checkpoint)."""
    real_evaluate, calls = loop.evaluate, []

    def evaluate(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise Crash
        return real_evaluate(*a, **k)

    monkeypatch.setattr(loop, "evaluate", evaluate)
    with pytest.raises(Crash):
        run()
    monkeypatch.setattr(loop, "evaluate", real_evaluate)

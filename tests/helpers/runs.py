"""Training-run fixtures shared by the harness tests: run directories written by hand, runs cut short."""
from __future__ import annotations

import csv
import json

import pytest
import yaml


def write_run(root, name, seed, curve, backward_rows=10, finished=True, **cfg):
    """A run directory as ``capskip-train`` leaves it: config.yaml and summary.csv with one row per
    (wall-clock s, eval top-1) of ``curve``; a finished run's result.json unless ``finished`` is False."""
    d = root / name
    d.mkdir(parents=True)
    if finished:
        (d / "result.json").write_text(json.dumps({"final_top1": curve[-1][1] if curve else None}))
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


# the per-epoch values a resumed run must reproduce exactly (times are measured, not computed)
EXACT = ("epoch", "steps", "train_loss", "eval_top1", "eval_loss", "backward_rows", "rows", "rows_seen",
         "mean_kept_frac", "lr", "checks", "violations", "fallbacks")


def assert_resumed_exactly(full_rows, resumed_rows, full: dict, res: dict) -> None:
    """A resumed run's summary rows and result equal the uninterrupted run's (the EXACT columns,
    final top-1 and step count)."""
    for ra, rb in zip(full_rows, resumed_rows):
        assert {k: ra[k] for k in EXACT} == {k: rb[k] for k in EXACT}, (
            f"epoch {ra.get('epoch')}: resumed {[(k, rb[k]) for k in EXACT if ra[k] != rb[k]]} "
            f"vs uninterrupted {[(k, ra[k]) for k in EXACT if ra[k] != rb[k]]}")
    assert res["final_top1"] == full["final_top1"], (
        f"resumed final top-1 {res['final_top1']!r} vs uninterrupted {full['final_top1']!r}")
    assert res["steps"] == full["steps"], f"resumed steps {res['steps']!r} vs uninterrupted {full['steps']!r}"

"""The tuned-baseline experiment's tables: the validation choice over a grid, and compare.md's paired Δ
against the tuned matched dense and its time to accuracy (run directories written by hand)."""
from __future__ import annotations

import json

import pytest

from capskip_fx.train import tuned, tuned_report
from helpers.runs import write_run


def _finish(d, top1, steps=10):
    (d / "result.json").write_text(json.dumps({"final_top1": top1, "steps": steps}))


def test_select_picks_the_best_mean_and_lists_every_configuration(tmp_path):
    scores = {"cosine-lr1e-3-b128": (90.0, 92.0), "linear-lr2e-3-bfit": (91.5, 91.0), "truncated-lr4e-3-b128": (95.0, 80.0)}
    for c, per in scores.items():
        for s, v in zip((100, 101), per):
            _finish(write_run(tmp_path, f"dense-at-capskip-{c}-s{s}", s, [(1, v)]), v)
    out = tmp_path / "sel.md"
    best = tuned.select(tmp_path, "dense-at-capskip", list(scores), ["100", "101"], out)
    assert best == "linear-lr2e-3-bfit", f"the highest mean (91.25) wins, not the best single seed; got {best}"
    text = out.read_text()
    for c in scores:
        assert f"| {c} |" in text, f"every configuration is listed with its scores: {c} missing from {text}"
    assert "| linear-lr2e-3-bfit | 91.50 | 91.00 | 91.25 | **chosen** |" in text, text
    with pytest.raises(SystemExit, match="no result.json"):
        tuned.select(tmp_path, "dense-at-capskip", ["cosine-lr9e-3-b128"], ["100"], out)
    assert tuned.select(tmp_path, "dense-at-capskip", [*scores, "cosine-lr9e-3-b128"], ["100", "101"], out,
                        partial=True) == "", "a partial grid chooses nothing"
    text = out.read_text()
    assert "PARTIAL" in text and "| cosine-lr9e-3-b128 | — | — | — |  |" in text, text
    assert "**chosen**" not in text, "nothing is marked chosen in a partial table"


def test_compare_pairs_each_arm_with_its_tuned_dense(tmp_path):
    runs = tmp_path / "runs"
    for s, (d, c, t, sm) in enumerate([(95.0, 94.0, 93.0, 92.0), (96.0, 94.5, 94.5, 93.0), (95.5, 94.0, 93.0, 92.5)]):
        _finish(write_run(runs, f"dense-s{s}", s, [(10, 90.0), (20, d)], rule="dense", lr=1e-3, batch_size=128), d)
        _finish(write_run(runs, f"capskip-s{s}", s, [(8, 91.0), (14, c)], backward_rows=3, rule="capskip", budget=0.7,
                          lr=1e-3, batch_size=128), c)
        _finish(write_run(runs, f"dense-tuned-capskip-s{s}", s, [(7, 92.0), (14, t)], rule="dense", schedule="linear",
                          lr=2e-3, batch_size=193), t, steps=7)
        _finish(write_run(runs, f"dense-sm-capskip-s{s}", s, [(14, sm)], rule="dense", lr=1e-3, batch_size=128), sm)
    page = tuned_report.compare(runs, tmp_path / "out")
    row = next(l for l in page.splitlines() if l.startswith("| capskip b = 0.7 |"))
    # capskip - tuned: +1.0, 0.0, +1.0 -> mean +0.67
    assert "+0.67 [" in row and "(n = 3)" in row, f"capskip's Δ vs the tuned dense, paired over 3 seeds: {row}"
    assert "30.0 %" in row, f"rows back-propagated: 3 of 10, got {row}"
    assert "| 0.65 |" in row, f"compute: (10 forwarded + 3 back) / dense's (10 + 10) = 0.65, got {row}"
    tuned_row = next(l for l in page.splitlines() if l.startswith("| dense tuned at capskip's budget |"))
    assert "linear, lr 0.002, batch 193" in tuned_row, f"the tuned configuration is shown: {tuned_row}"
    sm_row = next(l for l in page.splitlines() if l.startswith("| dense re-annealed at capskip's budget |"))
    assert "-1.00 [" in sm_row, f"re-annealed - tuned: -1.0, -1.5, -0.5 -> -1.00: {sm_row}"
    assert len(row.split("|")) - 2 <= 8, "at most 8 columns"
    # time to accuracy: target = mean dense final = 95.5; capskip never reaches it; 99 % = 94.545
    tta = next(l for l in page.splitlines() if l.startswith("| capskip b = 0.7 |") and "never" in l)
    assert "never (0/3)" in tta, f"capskip never reaches dense's 95.5: {tta}"
    assert (tmp_path / "out" / "time_to_accuracy.png").is_file(), "the time-to-accuracy figure is written"

"""The comparison table's statistics: t intervals over seeds, paired differences, time to accuracy."""
from __future__ import annotations

import math

import pytest

from capskip_fx.train import cli, plots, report
from helpers.runs import write_run

T975_DF2 = 4.302652729911275  # Student t, 97.5% quantile, 2 degrees of freedom


_run = write_run


def test_intervals_paired_differences_and_time_to_accuracy(tmp_path):
    finals = {"dense": [90.0, 91.0, 92.0], "tm": [89.0, 89.5, 91.0], "capskip": [91.5, 90.0, 92.5]}
    for s in range(3):
        _run(tmp_path, f"dense-s{s}", s, [(10, 80.0), (20, finals["dense"][s])], rule="dense")
        _run(tmp_path, f"tm-s{s}", s, [(6, 80.0), (12, finals["tm"][s])], rule="dense", time_budget=12)
        # capskip reaches 91 (dense's mean final) half-way through its second epoch on seeds 0 and 2
        _run(tmp_path, f"capskip-s{s}", s, [(5, 81.0), (11, finals["capskip"][s])], rule="capskip", budget=0.3)
    table = report.compare_table(report.find_runs([tmp_path]), wide=True)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table.splitlines()[2:]}
    half = T975_DF2 * 1.0 / math.sqrt(3)  # dense: sd 1
    assert rows["dense"][1] == f"91.00 [{91 - half:.2f}, {91 + half:.2f}]", (
        "dense's finals 90, 91, 92 give 91.00 with a 95% Student-t interval (sd 1, 2 degrees of freedom); "
        f"the cell reads {rows['dense'][1]!r}")
    d = [a - b for a, b in zip(finals["capskip"], finals["tm"])]  # +2.5, +0.5, +1.5
    m, sd = sum(d) / 3, math.sqrt(sum((x - sum(d) / 3) ** 2 for x in d) / 2)
    assert rows["capskip b=0.3"][4] == f"{m:+.2f} [{m - T975_DF2 * sd / math.sqrt(3):+.2f}, {m + T975_DF2 * sd / math.sqrt(3):+.2f}]", (
        "capskip's Δ vs time-matched dense pairs each seed (+2.5, +0.5, +1.5): their mean and t interval; "
        f"the cell reads {rows['capskip b=0.3'][4]!r}")
    assert rows["dense time-matched"][4] == "n/a", (
        "the time-matched dense run is not compared with itself, so its Δ vs time-matched is n/a; "
        f"the cell reads {rows['dense time-matched'][4]!r}")
    assert rows["capskip b=0.3"][2] == "n/a", (
        "with no step-matched dense run, capskip's Δ vs step-matched is n/a; "
        f"the cell reads {rows['capskip b=0.3'][2]!r}")
    # time to 91: dense seeds 1, 2 reach it at 20 and 10 + 10 * (91 - 80) / (92 - 80); median of those two
    dense_t = sorted([20.0, 10 + 10 * 11 / 12])
    cap_t = sorted([5 + 6 * (91 - 81) / (91.5 - 81), 5 + 6 * (91 - 81) / (92.5 - 81)])
    assert rows["capskip b=0.3"][7] == f"{(sum(cap_t) / 2) / (sum(dense_t) / 2):.2f} (2/3)", (
        "capskip reaches dense's final top-1 (91) on 2 of 3 seeds; its time is their median over dense's; "
        f"the cell reads {rows['capskip b=0.3'][7]!r}")
    assert rows["dense time-matched"][7] == f"{12 / (sum(dense_t) / 2):.2f} (1/3)", (  # only seed 2: 91.0 at 12 s
        "only seed 2 of the time-matched run reaches 91 (at 12 s): 12 s over dense's median, (1/3); "
        f"the cell reads {rows['dense time-matched'][7]!r}")


def test_one_seed_has_no_interval_and_plots_draw_bands(tmp_path):
    _run(tmp_path, "dense-s0", 0, [(10, 80.0), (20, 90.0)], rule="dense")
    for s in range(2):
        _run(tmp_path, f"capskip-s{s}", s, [(5, 81.0 + s), (11, 90.0 + s)], rule="capskip", budget=0.3)
    table = cli.compare([tmp_path], tmp_path / "cmp")
    assert "| dense | 1 | 90.00 |" in table, (
        f"with one seed, dense's final top-1 has no interval (90.00 alone); table {table!r}")
    for p in plots.PLOTS:
        assert (tmp_path / "cmp" / p).stat().st_size > 1000, (
            f"compare's plot {p} is under 1000 bytes, too small to hold the curves and their bands")
    mean, half = report.band([[1.0, 2.0], [3.0, 4.0]])
    assert mean.tolist() == [2.0, 3.0], (
        f"a band's centre is the mean over runs at each point ([1, 3] -> 2, [2, 4] -> 3), got {mean.tolist()}")
    assert half == pytest.approx([12.706204736174698 * math.sqrt(2) / math.sqrt(2)] * 2), (  # t(0.975, 1) * sd / sqrt(n)
        f"a band's half-width over two runs is t(0.975, 1) x sd / sqrt(2), got {half!r}")


def _logged(d, data_ms, n=20, hit=None):
    """Steps with ``data_ms`` of data loading each (a compile step with a huge one, left out), and result.json."""
    import json

    with open(d / "steps.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "data_time_s": 5.0, "compile_step": True}) + "\n")
        for i in range(1, n):
            f.write(json.dumps({"step": i, "data_time_s": data_ms / 1e3 * (1 + 0.01 * (i % 3)),
                                "compile_step": False}) + "\n")
    if hit is not None:
        (d / "result.json").write_text(json.dumps({"time_budget_hit": hit}))


def test_table_marks_missed_budgets_and_loaded_machines(tmp_path, capsys):
    """The README's busy-machine case: the time-matched run finished its epochs before capskip's clock
    (budget not hit) and capskip's data time per step drifted from dense's by a third."""
    for s in range(2):
        _run(tmp_path, f"dense-s{s}", s, [(10, 80.0), (20, 90.0)], rule="dense")
        _logged(tmp_path / f"dense-s{s}", 27.3)
        _run(tmp_path, f"tm-s{s}", s, [(10, 80.0), (20, 90.0)], rule="dense", time_budget=26.6)
        _logged(tmp_path / f"tm-s{s}", 27.0, hit=s == 1)  # seed 0 ran out of epochs first
        _run(tmp_path, f"capskip-s{s}", s, [(8, 81.0), (15, 90.5)], rule="capskip", budget=0.3)
        _logged(tmp_path / f"capskip-s{s}", 18.3 if s == 1 else 27.5)  # seed 1 on a quieter machine
        _run(tmp_path, f"sb-s{s}", s, [(8, 81.0), (15, 90.5)], rule="sb", keep=0.5)
        _logged(tmp_path / f"sb-s{s}", 27.3 * (1 + 0.19))  # drifted, but within the threshold
        _run(tmp_path, f"stale-s{s}", s, [(8, 81.0), (15, 90.5)], rule="stale_sb", budget=0.3)
        _logged(tmp_path / f"stale-s{s}", 27.3 * 2)  # its batch filter runs in the loader: its own data time
    runs = report.find_runs([tmp_path])
    assert [r.budget_missed for r in runs if r.config.get("time_budget")] == [True, False], (
        "seed 0's time-matched run finished its epochs before its budget (missed), seed 1's hit it; got "
        f"{[r.budget_missed for r in runs if r.config.get('time_budget')]}")
    assert report.load_drift(runs[0], None) != report.load_drift(runs[0], None), (  # NaN without dense
        "with no dense run to compare with, the load drift is NaN (unequal to itself), "
        f"got {report.load_drift(runs[0], None)}")
    table = cli.compare([tmp_path], tmp_path / "cmp", wide=True)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table.splitlines()[2:] if line.startswith("| ")}
    assert "dense time-matched †" in rows, (  # the row itself
        f"the time-matched row must carry † since seed 0 missed its budget; rows {list(rows)}")
    assert rows["capskip b=0.3"][4].endswith("†"), (  # its Δ is against a run that was not time-matched
        "capskip's Δ vs time-matched compares with a run that missed its budget, so the cell must carry †; "
        f"it reads {rows['capskip b=0.3'][4]!r}")
    assert rows["capskip b=0.3"][6].endswith("‡"), (
        "capskip's data time on seed 1 drifted a third from dense's, so its × dense wall-clock must carry ‡ "
        f"(loaded machine); it reads {rows['capskip b=0.3'][6]!r}")
    assert not rows["sb keep=0.5"][6].endswith("‡"), (
        "sb's data time drifted 19%, within the threshold, so its × dense wall-clock must carry no ‡; "
        f"it reads {rows['sb keep=0.5'][6]!r}")
    # data ms/step: the steady steps' median (27.3 x 1.01), the compile step's 5 s left out
    assert rows["dense"][13] == "27.6 ± 0.0", (
        "dense's data ms/step is its steady steps' median (27.3 x 1.01), the compile step's 5 s left out; "
        f"the cell reads {rows['dense'][13]!r}")
    stale = next(k for k in rows if k.startswith("stale_sb"))
    assert not rows[stale][6].endswith("‡"), (
        "Stale-SB selects in the data loader, so its data time is no load probe: no ‡ on its × dense; "
        f"it reads {rows[stale][6]!r}")
    missed, = [l for l in table.splitlines() if l.startswith("†")]
    loaded, = [l for l in table.splitlines() if l.startswith("‡")]
    assert "seed(s) 0 finished all epochs before the time budget (20 s < 27 s)" in missed, (
        f"the † note must say seed 0 finished all epochs before its time budget (20 s < 27 s); it reads {missed!r}")
    assert loaded.startswith("‡ capskip b=0.3"), (
        f"the ‡ note must name capskip b=0.3, the run measured on a loaded machine; it reads {loaded!r}")
    assert "-33% (seed 1: 18.5 vs 27.6 ms)" in loaded, (
        f"the ‡ note must give capskip's drift, its seed and both data times per step; it reads {loaded!r}")
    err = capsys.readouterr().err
    assert err.count("warning: ") == 2, (
        f"compare must warn once for the missed budget and once for the loaded machine; stderr {err!r}")
    assert "benchmarks/interleaved.py" in err, (
        f"the loaded-machine warning must point to benchmarks/interleaved.py for load-free timing; stderr {err!r}")
    assert "‡" in (tmp_path / "cmp" / "compare.md").read_text(), (
        "compare.md must carry the ‡ mark too, not only the printed table")
    assert ("distortion checks" in \
        (tmp_path / "cmp" / "compare.md").read_text()), (
        "compare.md must say how its wall-clock is measured (distortion checks left out, among others)")
    # a looser threshold takes the load mark off; nothing is marked on clean runs
    assert "‡" not in report.compare_table(runs, drift=0.5, wide=True).split("\n\n")[0], (
        "a looser drift threshold (50%) must take the ‡ mark off the table")
    clean = [r for r in runs if r.seed == 1 and r.config.get("rule") != "capskip"]
    assert not report.table_warnings(clean), (
        f"runs on a steady machine that met their budgets need no warning, got {report.table_warnings(clean)}")


def test_rows_by_epoch_is_each_epoch_share_of_its_own_rows():
    """summary.csv counts rows cumulatively: each epoch's share is the difference of the counts."""
    run = report.Run(path=None, config={}, summary=[
        {"epoch": 1, "backward_rows": 80, "rows": 100},
        {"epoch": 2, "backward_rows": 130, "rows": 200},   # 50 of the second 100
        {"epoch": 3, "backward_rows": 150, "rows": 280}])  # 20 of 80 (a smaller last epoch)
    assert plots.rows_by_epoch(run) == [0.8, 0.5, 0.25], (
        f"per-epoch shares should be 80/100, 50/100, 20/80, got {plots.rows_by_epoch(run)}")
    old = report.Run(path=None, config={}, summary=[{"epoch": 1, "eval_top1": 50.0}])
    assert plots.rows_by_epoch(old) == [], "a summary without row counts has no per-epoch shares to plot"


def test_default_table_is_narrow_and_counts_the_rows_the_backward_ran_on(tmp_path):
    """Without --wide: at most 8 columns, none reading n/a on every row, and "backward rows" is the rows the
    backward ran on (stats().rows: kept plus padding), not the kept rows."""
    import json

    for s in range(2):
        _run(tmp_path, f"dense-s{s}", s, [(10, 80.0), (20, 90.0)], rule="dense")
        d = _run(tmp_path, f"capskip-s{s}", s, [(8, 81.0), (15, 90.5)], backward_rows=3, rule="capskip", budget=0.3)
        with open(d / "steps.jsonl", "w") as f:  # 3 kept rows padded to 4 on each of 2 steps
            for i in range(2):
                f.write(json.dumps({"step": i, "kept": 3 if i else 0, "rows_run": 4, "n": 10}) + "\n")
    table = report.compare_table(report.find_runs([tmp_path]))
    header = [c.strip() for c in table.splitlines()[0].split("|")[1:-1]]
    assert len(header) <= 8, f"the default table has at most 8 columns, got {len(header)}: {header}"
    assert "Δ vs own step-matched dense (pp, paired) [95% CI]" not in header, (
        f"no step-matched runs here: that column reads n/a on every row and is left out; header {header}")
    rows = {line.split("|")[1].strip(): dict(zip(header, (c.strip() for c in line.split("|")[1:-1])))
            for line in table.splitlines()[2:] if line.startswith("| ")}
    assert rows["capskip b=0.3"]["backward rows"] == "8", (
        f"backward rows: the rows the backward ran on (4 + 4), not the kept rows (3); got {rows['capskip b=0.3']}")
    wide = report.compare_table(report.find_runs([tmp_path]), wide=True)
    assert len(wide.splitlines()[0].split("|")) - 2 == len(report.COLUMNS), "--wide shows every column"

"""Training harness: CLI/config, the loop's outputs, time budget, distortion checks, compare.

Runs use backend="eager" (the core's masked dense backward) and tiny ViTs on the digits dataset.
"""
from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

import capskip_fx
from capskip_fx import train
from capskip_fx.train import loop, plots, report

torch.set_num_threads(1)

TINY = ["--dataset", "digits", "--img-size", "16", "--patch-size", "4", "--depth", "1", "--embed-dim", "16",
        "--num-heads", "2", "--batch-size", "32", "--train-subset", "96", "--eval-subset", "64",
        "--backend", "eager", "--threads", "1", "--warmup-epochs", "0"]


# ---------------------------------------------------------------- helpers

def _read(out: Path):
    steps = [json.loads(l) for l in (out / "steps.jsonl").read_text().splitlines()]
    checks = [json.loads(l) for l in (out / "checks.jsonl").read_text().splitlines()]
    with open(out / "summary.csv", newline="") as f:
        summary = list(csv.DictReader(f))
    return steps, checks, summary


# ---------------------------------------------------------------- tests

def test_smoke_run_writes_everything(tmp_path, capsys):
    out = tmp_path / "run"
    res = train.run([*TINY, "--rule", "capskip", "--budget", "0.2", "--epochs", "1", "--check-every", "1",
                     "--out", str(out)])
    steps, checks, summary = _read(out)
    assert len(steps) == 3 == res["steps"], (  # 96 / 32, last batch not ragged
        f"96 rows in batches of 32 make 3 steps, all logged and counted; logged {len(steps)}, counted {res['steps']}")
    assert {"step", "epoch", "loss", "kept", "n", "bound", "lr", "step_time_s"} <= set(steps[0]), (
        f"each steps.jsonl row must carry step, rows, loss, bound, lr and time; the first has {sorted(steps[0])}")
    assert all(s["n"] == 32 and 0 <= s["kept"] <= 32 for s in steps), (
        "every step sees a full batch of 32 rows and back-propagates between 0 and 32 of them; (n, kept) per step: "
        f"{[(s['n'], s['kept']) for s in steps]}")
    assert len(summary) == 1, f"one epoch writes one summary.csv row, got {len(summary)}"
    row = summary[0]
    assert int(row["backward_rows"]) == sum(s["kept"] for s in steps), (
        "the summary's backward_rows must add up the rows each step kept "
        f"({sum(s['kept'] for s in steps)}), got {row['backward_rows']}")
    # compile_s may be 0: with the graphs in Inductor's and AOTAutograd's caches a compile step costs no more
    assert float(row["wall_clock_s"]) > 0, (
        f"a run takes time, so its wall-clock must be positive, got {row['wall_clock_s']}")
    assert float(row["compile_s"]) >= 0, f"compile time is a duration and cannot be negative, got {row['compile_s']}"
    assert 0 <= float(row["eval_top1"]) <= 100, f"top-1 accuracy is a percentage in [0, 100], got {row['eval_top1']}"
    # exact distortion check: capskip's head guarantee holds, and matches the rule's own bound
    assert len(checks) == 3, (
        f"--check-every 1 checks the gradient's distortion on each of the 3 steps, checks.jsonl has {len(checks)}")
    for c in checks:
        assert c["rel_l2_head"] <= 0.2 + 1e-4, (
            "capskip b=0.2 promises a head-gradient relative L2 error within its budget 0.2; "
            f"step {c['step']} measured {c['rel_l2_head']}")
        assert not c["violation"], (
            f"a check within capskip's promised bound was flagged a violation at step {c['step']}")
        assert c["rel_l2_head"] == pytest.approx(c["bound"], abs=1e-4), (
            "the measured head-gradient error must equal the bound capskip computes for its own selection; "
            f"measured {c['rel_l2_head']}, bound {c['bound']}")
    assert int(row["violations"]) == 0, (
        f"no check broke capskip's bound, so the summary must count 0 violations, got {row['violations']}")
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["in_chans"] == 1, (
        f"digits images are greyscale, so the resolved config must say 1 input channel, got {cfg['in_chans']}")
    assert cfg["img_size"] == 16, f"the resolved config must keep --img-size 16, got {cfg['img_size']}"
    assert cfg["patch_size"] == 4, f"the resolved config must keep --patch-size 4, got {cfg['patch_size']}"
    assert cfg["label"] == "capskip b=0.2", (
        f"the run's label names its rule and budget (capskip b=0.2), got {cfg['label']!r}")
    assert cfg["backend"] == "eager", f"the resolved config must keep --backend eager, got {cfg['backend']!r}"
    for p in plots.PLOTS:
        assert (out / p).stat().st_size > 0, f"the run wrote an empty plot {p}"
    assert json.loads((out / "result.json").read_text())["label"] == "capskip b=0.2", (
        "result.json must carry the run's label (capskip b=0.2), as config.yaml does")
    text = capsys.readouterr().out
    assert "[data] digits" in text, f"the run must log which dataset it loaded ('[data] digits'); output was {text!r}"
    assert "epoch 1 step 3/3" in text, (  # plain log lines when not a TTY
        f"without a TTY the progress goes out as plain log lines, up to 'epoch 1 step 3/3'; output was {text!r}")


def test_dense_check_is_exact_and_forced_is_not(tmp_path):
    train.run([*TINY, "--rule", "dense", "--epochs", "1", "--check-every", "2", "--out", str(tmp_path / "d")])
    _, checks, _ = _read(tmp_path / "d")
    assert len(checks) == 1, f"--check-every 2 over 3 steps checks the gradient once, checks.jsonl has {len(checks)}"
    assert checks[0]["step"] == 1, f"with --check-every 2 the one check falls on step 1, got step {checks[0]['step']}"
    assert checks[0]["rel_l2_all"] < 1e-5, (
        "the dense rule back-propagates every row, so its gradient must match the dense reference "
        f"(relative L2 < 1e-5), got {checks[0]['rel_l2_all']}")
    assert checks[0]["cos_all"] > 1 - 1e-6, (
        f"the dense rule's gradient must point along the dense reference's (cosine 1), got {checks[0]['cos_all']}")
    train.run([*TINY, "--rule", "forced", "--keep", "0.5", "--epochs", "1", "--check-every", "1",
               "--out", str(tmp_path / "f")])
    steps, checks, summary = _read(tmp_path / "f")
    assert all(s["kept"] == 16 for s in steps), (
        f"forced keep=0.5 back-propagates 16 of each batch's 32 rows; kept per step {[s['kept'] for s in steps]}")
    assert all(c["rel_l2_head"] > 1e-3 for c in checks), (
        "skipping half the rows must change the head gradient measurably (relative L2 > 1e-3) at every check; "
        f"measured {[c['rel_l2_head'] for c in checks]}")
    assert int(summary[0]["violations"]) == 0, (  # only capskip promises a bound
        f"only capskip promises a bound, so forced skipping counts no violations, got {summary[0]['violations']}")


def test_violations_are_counted_not_raised(tmp_path, monkeypatch):
    def broken(*a, **k):
        return {"cos_all": 0.5, "rel_l2_all": 0.9, "cos_head": 0.5, "rel_l2_head": 0.9, "dense_loss": 1.0}

    monkeypatch.setattr(loop, "distortion_check", broken)  # the name the loop calls
    res = train.run([*TINY, "--epochs", "1", "--check-every", "1", "--out", str(tmp_path / "v")])
    _, checks, summary = _read(tmp_path / "v")
    assert res["violations"] == 3 == int(summary[0]["violations"]), (
        "a distortion check that breaks the bound on each of the 3 steps must be counted 3 times, not raised; "
        f"result {res['violations']}, summary.csv {summary[0]['violations']}")
    assert all(c["violation"] for c in checks), (
        f"every check that breaks the bound must be flagged in checks.jsonl, got {[c['violation'] for c in checks]}")


def test_config_file_overridden_by_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("dataset: digits\nlr: 1e-3\nepochs: 3\nrule: sb\nmodel-kwargs: {drop_rate: 0.1}\n"
                 "time_budget: null\n")
    cfg = train.parse_config(["--config", str(f), "--epochs", "1", "--budget", "0.2", "--model-kw", "qkv_bias=false",
                              "--rule-opt", "beta=2"])
    assert cfg.lr == 1e-3, f"with no --lr flag the lr comes from the config file (1e-3), got {cfg.lr!r}"
    assert isinstance(cfg.lr, float), (  # YAML 1.1 reads 1e-3 as a string
        f"the config file's lr 1e-3 must be a number, not the string YAML 1.1 reads, got a {type(cfg.lr).__name__}")
    assert cfg.epochs == 1, f"--epochs 1 on the command line must override the file's epochs: 3, got {cfg.epochs!r}"
    assert cfg.rule == "sb", f"with no --rule flag the rule comes from the config file (sb), got {cfg.rule!r}"
    assert cfg.budget == 0.2, f"--budget 0.2 on the command line must reach the config, got {cfg.budget!r}"
    assert cfg.dataset == "digits", (
        f"with no --dataset flag the dataset comes from the config file (digits), got {cfg.dataset!r}")
    assert cfg.model_kwargs == {"drop_rate": 0.1, "qkv_bias": False}, (
        "--model-kw qkv_bias=false must be added to the file's model-kwargs (drop_rate 0.1), as a bool; "
        f"got {cfg.model_kwargs!r}")
    assert cfg.rule_options == {"beta": 2}, (
        f"--rule-opt beta=2 must reach the rule's options as the number 2, got {cfg.rule_options!r}")
    with pytest.raises(SystemExit, match="takes no arguments|unexpected keyword"):  # checked before any work
        train.parse_config(["--config", str(f), "--rule", "dense", "--rule-opt", "foo=2"])
    assert train.parse_config(["--config", str(f), "--train-subset", "none"]).train_subset is None, (
        "--train-subset none must mean the whole training set (None)")
    f.write_text("epochz: 3\n")
    with pytest.raises(SystemExit):
        train.parse_config(["--config", str(f)])
    with pytest.raises(SystemExit):
        train.parse_config(["--amp", "fp16"])


def test_resolved_config_round_trips(tmp_path):
    import numpy as np

    out = tmp_path / "r"
    np.random.seed(12345)
    train.run([*TINY, "--rule", "dense", "--epochs", "1", "--check-every", "0", "--seed", "3", "--out", str(out)])
    assert np.random.get_state()[1][0] == np.random.RandomState(3).get_state()[1][0], (
        "a run seeds numpy's global generator with --seed (a transform may draw from it; checkpoints carry it)")
    again = train.parse_config(["--config", str(out / "config.yaml")])
    assert again == train.TrainConfig(**yaml.safe_load((out / "config.yaml").read_text())), (
        f"the config.yaml a run writes must parse back to the config it ran with, got {again!r}")
    assert again.out == str(out), (
        f"the resolved config must record the folder the run wrote to ({out}), got {again.out!r}")
    assert again.device == "cpu", f"the resolved config must record the device the run used (cpu), got {again.device!r}"


def test_time_budget_stops_early(tmp_path):
    out = tmp_path / "t"
    res = train.run([*TINY, "--rule", "dense", "--epochs", "50", "--check-every", "0", "--time-budget", "0.02",
                     "--out", str(out)])
    steps, _, summary = _read(out)
    assert res["time_budget_hit"], "a 0.02 s time budget must stop a 50-epoch run, and the result must say it did"
    assert len(steps) < 50 * 3, (
        f"the time budget must stop the run before all 50 epochs' 150 steps, it ran {len(steps)}")
    assert len(summary) == len({int(r["epoch"]) for r in summary}), (
        f"summary.csv must hold one row per epoch, none twice; epochs {[r['epoch'] for r in summary]}")
    assert summary[-1]["time_budget_hit"] == "1", (
        f"the last summary row must mark the epoch the time budget stopped, got {summary[-1]['time_budget_hit']!r}")
    assert summary[-1]["eval_top1"] != "", (  # evaluated at the stop
        "the run must be evaluated where the time budget stops it, so the last summary row needs a top-1")
    assert res["wall_clock_s"] >= 0.02, (
        f"a run stopped by a 0.02 s time budget must have run at least 0.02 s, got {res['wall_clock_s']}")
    with pytest.raises(SystemExit, match="already spent its time budget of 0.02 s"):  # not trained on
        train.run(["--resume", str(out / "checkpoint.pt")])


def test_rule_options_reach_the_rule():
    cfg = train.TrainConfig(rule="random", match="capskip", budget=0.3, rule_options={"unbiased": True})
    cm = capskip_fx.compile(torch.nn.Linear(4, 3), rule=cfg.rule, budget=cfg.budget, backend="eager",
                            **train.rule_options(cfg))
    assert cm.rule.match.budget == 0.3, (
        f"random matched to capskip must pass the run's budget 0.3 to that capskip, got {cm.rule.match.budget!r}")
    assert cm.rule.unbiased, (  # the matched capskip gets b, not its default
        "the rule option unbiased=True must reach the random rule")
    assert train.rule_options(train.TrainConfig(rule="sb", keep=0.4)) == {"keep": 0.4}, (
        "--keep 0.4 with rule sb must become the rule option keep=0.4, and nothing else")


def test_lr_schedule():
    cfg = train.TrainConfig(epochs=10, warmup_epochs=1, lr=1.0, min_lr=0.0)
    assert train.lr_at(cfg, 0.05) == pytest.approx(0.5), (
        f"half-way through the 1-epoch warm-up the lr is half its peak, got {train.lr_at(cfg, 0.05)}")
    assert train.lr_at(cfg, 0.1) == pytest.approx(1.0), (
        f"at the end of warm-up the lr reaches its peak 1.0, got {train.lr_at(cfg, 0.1)}")
    assert train.lr_at(cfg, 0.55) == pytest.approx(0.5), (
        f"half-way through the cosine decay the lr is half-way from peak to min_lr, got {train.lr_at(cfg, 0.55)}")
    assert train.lr_at(cfg, 1.0) == pytest.approx(0.0), (
        f"at the end of training the cosine reaches min_lr 0, got {train.lr_at(cfg, 1.0)}")


def test_compile_clock_excludes_warmup():
    c = train.CompileClock()
    c.add(0.0, 5.0, True)  # first step compiles
    assert c.compile_s == 5.0, (
        f"with no steady step yet, all 5 s of the first compile step count as compile time, got {c.compile_s}")
    assert c.wall_s == 0.0, (
        f"with no steady step yet, none of the first compile step counts as training time, got {c.wall_s}")
    for _ in range(4):
        c.add(0.1, 1.0, False)
    c.add(0.0, 3.0, True)  # a new variant
    assert c.compile_s == pytest.approx(4.0 + 2.0), (
        "compile time is each compile step's excess over the steady steps' median (1 s): 4 s + 2 s, "
        f"got {c.compile_s}")
    assert c.wall_s == pytest.approx(4 * 1.1 + 2 * 1.0), (
        "training time keeps the data time and a steady step's worth of each compile step: 4 x 1.1 + 2 x 1.0 s, "
        f"got {c.wall_s}")


def _fake_run(d: Path, rule: str, seed: int, top1: list[float], wall: list[float], kept: float,
              finished: bool = True, **cfg):
    d.mkdir(parents=True)
    if finished:  # a finished run's result.json (compare marks a run without one as unfinished)
        (d / "result.json").write_text(json.dumps({"final_top1": top1[-1], "steps": 20}))
    (d / "config.yaml").write_text(yaml.safe_dump({"rule": rule, "budget": 0.1, "seed": seed, **cfg}))
    with open(d / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["epoch", "eval_top1", "wall_clock_s", "backward_rows", "rows",
                                          "mean_kept_frac", "violations"])
        w.writeheader()
        for e, (a, t) in enumerate(zip(top1, wall), 1):
            w.writerow({"epoch": e, "eval_top1": a, "wall_clock_s": t, "backward_rows": int(kept * 100 * e),
                        "rows": 100 * e, "mean_kept_frac": kept, "violations": 0})
    (d / "steps.jsonl").write_text("".join(json.dumps({"step": i, "kept": int(kept * 10), "n": 10}) + "\n"
                                           for i in range(20)))


def test_compare_renders_table_and_plots(tmp_path):
    runs = tmp_path / "runs"
    _fake_run(runs / "dense-s0", "dense", 0, [80, 85], [10, 20], 1.0)
    _fake_run(runs / "dense-s1", "dense", 1, [82, 87], [10, 20], 1.0)
    _fake_run(runs / "cap-s0", "capskip", 0, [81, 86], [5, 10], 0.4)
    _fake_run(runs / "cap-s1", "capskip", 1, [80, 84], [5, 10], 0.4)
    _fake_run(runs / "dense-tm-s0", "dense", 0, [70, 75], [5, 10], 1.0, time_budget=10.0)
    out = tmp_path / "cmp"
    table = train.run(["compare", str(runs / "cap-s0"), str(runs / "cap-s1"), str(runs / "dense-s0"),
                       str(runs / "dense-s1"), str(runs / "dense-tm-s0"), "--out", str(out), "--wide"])
    lines = table.strip().splitlines()
    # dense first; no step-matched run, so its step-time column is n/a
    assert lines[2].startswith("| dense | 2 | 86.00 [73.29, 98.71] | n/a | n/a | +10.00 | 20.0 ± 0.0 | 1.00 [1.00, 1.00] |"), (
        f"dense row (top-1 CI, step-time r, Δ, time, ratio) wrong: {lines[2]!r}; header {lines[0]!r}")
    cap = next(l for l in lines if l.startswith("| capskip b=0.1 "))
    assert "| 2 | 85.00 [72.29, 97.71] | n/a | n/a | +11.00 |" in cap, f"capskip row wrong: {cap!r}"
    assert "| 0.50 [0.50, 0.50] |" in cap, (
        f"capskip took half dense's wall-clock on both seeds, so × dense must read 0.50 [0.50, 0.50]: {cap!r}")
    assert "0.400" in cap, f"capskip's row must show its mean kept fraction 0.400: {cap!r}"
    assert any(l.startswith("| dense time-matched | 1 | 75.00 | n/a | n/a |") for l in lines), (
        "the time-matched dense run (one seed, 75.00 top-1) must get its own row, labelled dense time-matched")
    assert (out / "compare.md").read_text().count("\n|---") == 1, (  # one table
        "runs of one dataset must make one table in compare.md (one header rule)")
    for p in plots.PLOTS:
        assert (out / p).stat().st_size > 0, f"compare wrote an empty plot {p}"
    # a parent folder is searched for run directories
    assert train.run(["compare", str(runs), "--out", str(tmp_path / "cmp2"), "--wide"]) == table, (
        "compare on the parent folder must find the same runs, and render the same table, as naming each run")


def test_compare_marks_an_unfinished_run(tmp_path):
    """A run with no result.json (killed after its first epoch) is marked § with its epochs done, in the table
    and on stderr, not shown as a finished run."""
    runs = tmp_path / "runs"
    _fake_run(runs / "dense-s0", "dense", 0, [80, 85], [10, 20], 1.0, epochs=2)
    _fake_run(runs / "cap-s0", "capskip", 0, [81], [5], 0.4, finished=False, epochs=2)
    table = train.run(["compare", str(runs), "--out", str(tmp_path / "cmp")])
    cap = next(l for l in table.splitlines() if l.startswith("| capskip"))
    assert "§" in cap, f"the unfinished run's row should be marked: {cap!r}"
    assert "§ capskip b=0.1: unfinished, no result.json (seed 0: 1 of 2 epochs)" in table, table
    assert "§" not in next(l for l in table.splitlines() if l.startswith("| dense")), table


def test_compare_pairs_step_matched_dense_by_seed(tmp_path):
    """A dense run made with --steps-of a rule run (and its --ratio) fills that rule's step-matched columns."""
    runs = tmp_path / "runs"
    _fake_run(runs / "dense-s0", "dense", 0, [80, 85], [10, 20], 1.0)
    _fake_run(runs / "cap-s0", "capskip", 0, [81, 86], [5, 10], 0.4)
    _fake_run(runs / "cap-s1", "capskip", 1, [80, 84], [5, 10], 0.4)
    _fake_run(runs / "sm-s0", "dense", 0, [78, 83], [5, 10], 1.0, steps_of=str(runs / "cap-s0"), ratio=0.6)
    _fake_run(runs / "sm-s1", "dense", 1, [79, 82], [5, 10], 1.0, steps_of=str(runs / "cap-s1"), ratio=0.6)
    table = train.run(["compare", str(runs), "--out", str(tmp_path / "cmp"), "--wide"])
    cap = next(l for l in table.splitlines() if l.startswith("| capskip b=0.1 "))
    cells = [c.strip() for c in cap.split("|")[1:-1]]
    # seed 0: 86 - 83 = +3, seed 1: 84 - 82 = +2 -> mean +2.50 over n=2
    assert cells[3].startswith("+2.50"), (
        f"Δ vs step-matched dense is the mean of each seed's difference (+3, +2), +2.50; the cell reads {cells[3]!r}")
    assert cells[3].endswith("(n=2)"), (
        f"Δ vs step-matched dense pairs 2 seeds and must say (n=2); the cell reads {cells[3]!r}")
    assert cells[4] == "0.6", f"step-time r cell should be the step-matched runs' --ratio, got {cells[4]!r}"
    # moved runs (a results folder): steps_of no longer names a run here, the folder name still does
    moved = tmp_path / "moved"
    shutil.copytree(runs, moved)
    shutil.rmtree(runs)
    table = train.run(["compare", str(moved), "--out", str(tmp_path / "cmp"), "--wide"])
    cap = next(l for l in table.splitlines() if l.startswith("| capskip b=0.1 "))
    cell = [c.strip() for c in cap.split("|")[1:-1]][3]
    assert cell.startswith("+2.50"), f"moved runs should still pair with their step-matched dense; the cell reads {cell!r}"
    runs = moved
    # with the interleaved benchmark's JSON, the ratio carries the interval of the arm it was read from
    speed = tmp_path / "speed.json"
    speed.write_text(json.dumps({"rows": [
        {"arm": "dense", "vs_dense": 1.0, "vs_dense_lo": 1.0, "vs_dense_hi": 1.0},
        {"arm": "forced:keep=0.300", "vs_dense": 0.5996, "vs_dense_lo": 0.50, "vs_dense_hi": 0.70},  # same r, other rows
        {"arm": "forced:keep=0.400", "vs_dense": 0.6004, "vs_dense_lo": 0.55, "vs_dense_hi": 0.65}]}))
    table = train.run(["compare", str(runs), "--out", str(tmp_path / "cmp"), "--speed", str(speed), "--wide"])
    cap = next(l for l in table.splitlines() if l.startswith("| capskip b=0.1 "))
    cell = [c.strip() for c in cap.split("|")[1:-1]][4]
    assert cell == "0.6 [0.550, 0.650]", (
        f"step-time r should carry the interval of the arm timing capskip's 40 % of rows, the cell reads {cell!r}")


def test_cli_errors_come_before_any_work(tmp_path, capsys):
    """A bad budget or data folder fails at once, with the option named, and writes nothing."""
    from capskip_fx import train as cli

    for argv, msg in ((["--budget", "2.0"], "budget must be a number in [0, 1]"),
                      (["--data-dir", str(tmp_path / "nope")], "is not a folder"),
                      (["--rule", "forced", "--keep", "3"], "keep fraction must be in (0, 1]"),
                      (["--rule", "capskip", "--keep", "0.5"], "keep (a fixed kept fraction) is an option of rules"),
                      (["--lr", "-1"], "lr must be >= 0 and min_lr in [0, lr]"),
                      (["--min-lr", "1"], "lr must be >= 0 and min_lr in [0, lr]"),
                      (["--weight-decay", "-5"], "weight_decay and check_tol must be >= 0"),
                      (["--threads", "0"], "threads >= 1"),
                      (["--img-size", "0"], "img_size must be >= 1"),
                      (["--device", "banana"], "device 'banana' is not a device"),
                      (["--vcas-opt", "bogus=1"], "vcas options (--vcas-opt): VCAS.__init__() got an unexpected"),
                      (["--vcas-opt", "freq=-3"], "VCAS freq must be a positive int"),
                      (["--rule", "capskip", "--infobatch-ratio", "0.3"], "--infobatch-ratio set InfoBatch's pruning"),
                      (["--config", str(tmp_path / "nope.yaml")], "nope.yaml: no such file")):
        with pytest.raises(SystemExit, match=re.escape(msg)):
            cli.run([*argv, "--out", str(tmp_path / "run")])
        assert not (tmp_path / "run").exists(), f"a bad option ({argv}) must fail before the output folder is created"
    with pytest.raises(SystemExit):
        cli.run(["--help"])
    assert "--budget" in capsys.readouterr().out, (  # the default sub-command's flags, at the top level
        "--help at the top level must list the default train sub-command's flags, --budget among them")


def test_compare_splits_runs_of_different_datasets(tmp_path):
    runs = [report.Run(path=tmp_path / n, config={"dataset": d, "rule": "dense", "seed": 0},
                       summary=[{"eval_top1": 50.0, "wall_clock_s": 1.0}]) for n, d in (("a", "digits"), ("b", "mnist"))]
    table = report.compare_table(runs)
    assert "### digits" in table, f"runs of different datasets get a section each; no '### digits' heading in {table!r}"
    assert "### mnist" in table, f"runs of different datasets get a section each; no '### mnist' heading in {table!r}"
    assert table.count("| run |") == 2, (
        f"each of the two datasets gets its own table, found {table.count('| run |')} header rows")

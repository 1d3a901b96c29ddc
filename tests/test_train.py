"""Training harness: CLI/config, the loop's outputs, time budget, distortion checks, compare.

Runs use backend="eager" (the core's masked dense backward) and tiny ViTs on the digits dataset.
"""
from __future__ import annotations

import csv
import json
import re
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
    assert len(steps) == 3 == res["steps"], 'expected len(steps) == 3 == res["steps"]'  # 96 / 32, last batch not ragged
    assert {"step", "epoch", "loss", "kept", "n", "bound", "lr", "step_time_s"} <= set(steps[0]), (
        f'expected {{"step", "epoch", "loss", "kept", "n"... <= set(steps[0]), got set(steps[0]) = {set(steps[0])!r}')
    assert all(s["n"] == 32 and 0 <= s["kept"] <= 32 for s in steps), (
        'expected all(s["n"] == 32 and 0 <= s["kept"] <= 32 for s in steps)')
    assert len(summary) == 1, f"expected len(summary) == 1, got {len(summary)!r}"
    row = summary[0]
    assert int(row["backward_rows"]) == sum(s["kept"] for s in steps), (
        f'expected int(row["backward_rows"]) == sum(s["kept"] for s in steps), got {int(row["backward_rows"])!r}')
    # compile_s may be 0: with the graphs in Inductor's and AOTAutograd's caches a compile step costs no more
    assert float(row["wall_clock_s"]) > 0, (
        f'expected float(row["wall_clock_s"]) > 0, got {float(row["wall_clock_s"])!r}')
    assert float(row["compile_s"]) >= 0, f'expected float(row["compile_s"]) >= 0, got {float(row["compile_s"])!r}'
    assert 0 <= float(row["eval_top1"]) <= 100, 'expected 0 <= float(row["eval_top1"]) <= 100'
    # exact distortion check: capskip's head guarantee holds, and matches the rule's own bound
    assert len(checks) == 3, f"expected len(checks) == 3, got {len(checks)!r}"
    for c in checks:
        assert c["rel_l2_head"] <= 0.2 + 1e-4, (
            f'expected c["rel_l2_head"] <= 0.2 + 1e-4, got {c["rel_l2_head"]!r} vs {0.2 + 1e-4!r}')
        assert not c["violation"], 'expected not c["violation"]'
        assert c["rel_l2_head"] == pytest.approx(c["bound"], abs=1e-4), (
            f'expected c["rel_l2_head"] == pytest.approx(c["bound"], abs=1e-4), got {c["rel_l2_head"]!r}')
    assert int(row["violations"]) == 0, f'expected int(row["violations"]) == 0, got {int(row["violations"])!r}'
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["in_chans"] == 1, f'expected cfg["in_chans"] == 1, got {cfg["in_chans"]!r}'
    assert cfg["img_size"] == 16, f'expected cfg["img_size"] == 16, got {cfg["img_size"]!r}'
    assert cfg["patch_size"] == 4, f'expected cfg["patch_size"] == 4, got {cfg["patch_size"]!r}'
    assert cfg["label"] == "capskip b=0.2", f'expected cfg["label"] == "capskip b=0.2", got {cfg["label"]!r}'
    assert cfg["backend"] == "eager", f'expected cfg["backend"] == "eager", got {cfg["backend"]!r}'
    for p in plots.PLOTS:
        assert (out / p).stat().st_size > 0, 'expected (out / p).stat().st_size > 0'
    assert json.loads((out / "result.json").read_text())["label"] == "capskip b=0.2", (
        'expected json.loads((out / "result.json").read_text())["label"] == "capskip ...')
    text = capsys.readouterr().out
    assert "[data] digits" in text, f'expected "[data] digits" in text, got text = {text!r}'
    assert "epoch 1 step 3/3" in text, f'expected "epoch 1 step 3/3" in text, got text = {text!r}'  # plain log lines when not a TTY


def test_dense_check_is_exact_and_forced_is_not(tmp_path):
    train.run([*TINY, "--rule", "dense", "--epochs", "1", "--check-every", "2", "--out", str(tmp_path / "d")])
    _, checks, _ = _read(tmp_path / "d")
    assert len(checks) == 1, f"expected len(checks) == 1, got {len(checks)!r}"
    assert checks[0]["step"] == 1, f'expected checks[0]["step"] == 1, got {checks[0]["step"]!r}'
    assert checks[0]["rel_l2_all"] < 1e-5, f'expected checks[0]["rel_l2_all"] < 1e-5, got {checks[0]["rel_l2_all"]!r}'
    assert checks[0]["cos_all"] > 1 - 1e-6, (
        f'expected checks[0]["cos_all"] > 1 - 1e-6, got {checks[0]["cos_all"]!r} vs {1 - 1e-6!r}')
    train.run([*TINY, "--rule", "forced", "--keep", "0.5", "--epochs", "1", "--check-every", "1",
               "--out", str(tmp_path / "f")])
    steps, checks, summary = _read(tmp_path / "f")
    assert all(s["kept"] == 16 for s in steps), 'expected all(s["kept"] == 16 for s in steps)'
    assert all(c["rel_l2_head"] > 1e-3 for c in checks), 'expected all(c["rel_l2_head"] > 1e-3 for c in checks)'
    assert int(summary[0]["violations"]) == 0, (
        f'expected int(summary[0]["violations"]) == 0, got {int(summary[0]["violations"])!r}')  # only capskip promises a bound


def test_violations_are_counted_not_raised(tmp_path, monkeypatch):
    def broken(*a, **k):
        return {"cos_all": 0.5, "rel_l2_all": 0.9, "cos_head": 0.5, "rel_l2_head": 0.9, "dense_loss": 1.0}

    monkeypatch.setattr(loop, "distortion_check", broken)  # the name the loop calls
    res = train.run([*TINY, "--epochs", "1", "--check-every", "1", "--out", str(tmp_path / "v")])
    _, checks, summary = _read(tmp_path / "v")
    assert res["violations"] == 3 == int(summary[0]["violations"]), (
        'expected res["violations"] == 3 == int(summary[0]["violations"])')
    assert all(c["violation"] for c in checks), 'expected all(c["violation"] for c in checks)'


def test_config_file_overridden_by_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("dataset: digits\nlr: 1e-3\nepochs: 3\nrule: sb\nmodel-kwargs: {drop_rate: 0.1}\n"
                 "time_budget: null\n")
    cfg = train.parse_config(["--config", str(f), "--epochs", "1", "--budget", "0.2", "--model-kw", "qkv_bias=false",
                              "--rule-opt", "beta=2"])
    assert cfg.lr == 1e-3, f"expected cfg.lr == 1e-3, got {cfg.lr!r}"
    assert isinstance(cfg.lr, float), 'expected isinstance(cfg.lr, float)'  # YAML 1.1 reads 1e-3 as a string
    assert cfg.epochs == 1, f"expected cfg.epochs == 1, got {cfg.epochs!r}"
    assert cfg.rule == "sb", f'expected cfg.rule == "sb", got {cfg.rule!r}'
    assert cfg.budget == 0.2, f"expected cfg.budget == 0.2, got {cfg.budget!r}"
    assert cfg.dataset == "digits", f'expected cfg.dataset == "digits", got {cfg.dataset!r}'
    assert cfg.model_kwargs == {"drop_rate": 0.1, "qkv_bias": False}, (
        f'expected cfg.model_kwargs == {{"drop_rate": 0.1, "qkv_bias": False}}, got {cfg.model_kwargs!r}')
    assert cfg.rule_options == {"beta": 2}, f'expected cfg.rule_options == {{"beta": 2}}, got {cfg.rule_options!r}'
    with pytest.raises(SystemExit, match="takes no arguments|unexpected keyword"):  # checked before any work
        train.parse_config(["--config", str(f), "--rule", "dense", "--rule-opt", "foo=2"])
    assert train.parse_config(["--config", str(f), "--train-subset", "none"]).train_subset is None, (
        'expected train.parse_config(["--config", str(f), "--train-subset", "none"])....')
    f.write_text("epochz: 3\n")
    with pytest.raises(SystemExit):
        train.parse_config(["--config", str(f)])
    with pytest.raises(SystemExit):
        train.parse_config(["--amp", "fp16"])


def test_resolved_config_round_trips(tmp_path):
    out = tmp_path / "r"
    train.run([*TINY, "--rule", "dense", "--epochs", "1", "--check-every", "0", "--out", str(out)])
    again = train.parse_config(["--config", str(out / "config.yaml")])
    assert again == train.TrainConfig(**yaml.safe_load((out / "config.yaml").read_text())), (
        f"expected again == train.TrainConfig(**yaml.safe_load((o..., got {again!r}")
    assert again.out == str(out), f"expected again.out == str(out), got {again.out!r} vs {str(out)!r}"
    assert again.device == "cpu", f'expected again.device == "cpu", got {again.device!r}'


def test_time_budget_stops_early(tmp_path):
    out = tmp_path / "t"
    res = train.run([*TINY, "--rule", "dense", "--epochs", "50", "--check-every", "0", "--time-budget", "0.02",
                     "--out", str(out)])
    steps, _, summary = _read(out)
    assert res["time_budget_hit"], f'expected res["time_budget_hit"] to be true, got {res["time_budget_hit"]!r}'
    assert len(steps) < 50 * 3, f"expected len(steps) < 50 * 3, got {len(steps)!r} vs {50 * 3!r}"
    assert len(summary) == len({int(r["epoch"]) for r in summary}), (
        f'expected len(summary) == len({{int(r["epoch"]) for r in summary}}), got {len(summary)!r}')
    assert summary[-1]["time_budget_hit"] == "1", (
        f'expected summary[-1]["time_budget_hit"] == "1", got {summary[-1]["time_budget_hit"]!r}')
    assert summary[-1]["eval_top1"] != "", f'expected summary[-1]["eval_top1"] != "", got {summary[-1]["eval_top1"]!r}'  # evaluated at the stop
    assert res["wall_clock_s"] >= 0.02, f'expected res["wall_clock_s"] >= 0.02, got {res["wall_clock_s"]!r}'


def test_rule_options_reach_the_rule():
    cfg = train.TrainConfig(rule="random", match="capskip", budget=0.3, rule_options={"unbiased": True})
    cm = capskip_fx.compile(torch.nn.Linear(4, 3), rule=cfg.rule, budget=cfg.budget, backend="eager",
                            **train.rule_options(cfg))
    assert cm.rule.match.budget == 0.3, f"expected cm.rule.match.budget == 0.3, got {cm.rule.match.budget!r}"
    assert cm.rule.unbiased, f"expected cm.rule.unbiased to be true, got {cm.rule.unbiased!r}"  # the matched capskip gets b, not its default
    assert train.rule_options(train.TrainConfig(rule="sb", keep=0.4)) == {"keep": 0.4}, (
        'expected train.rule_options(train.TrainConfig(rule="sb", keep=0.4)) == {"kee...')


def test_lr_schedule():
    cfg = train.TrainConfig(epochs=10, warmup_epochs=1, lr=1.0, min_lr=0.0)
    assert train.lr_at(cfg, 0.05) == pytest.approx(0.5), 'expected train.lr_at(cfg, 0.05) == pytest.approx(0.5)'
    assert train.lr_at(cfg, 0.1) == pytest.approx(1.0), 'expected train.lr_at(cfg, 0.1) == pytest.approx(1.0)'
    assert train.lr_at(cfg, 0.55) == pytest.approx(0.5), 'expected train.lr_at(cfg, 0.55) == pytest.approx(0.5)'
    assert train.lr_at(cfg, 1.0) == pytest.approx(0.0), 'expected train.lr_at(cfg, 1.0) == pytest.approx(0.0)'


def test_compile_clock_excludes_warmup():
    c = train.CompileClock()
    c.add(0.0, 5.0, True)  # first step compiles
    assert c.compile_s == 5.0, f"expected c.compile_s == 5.0, got {c.compile_s!r}"
    assert c.wall_s == 0.0, f"expected c.wall_s == 0.0, got {c.wall_s!r}"
    for _ in range(4):
        c.add(0.1, 1.0, False)
    c.add(0.0, 3.0, True)  # a new variant
    assert c.compile_s == pytest.approx(4.0 + 2.0), (
        f"expected c.compile_s == pytest.approx(4.0 + 2.0), got {c.compile_s!r}")
    assert c.wall_s == pytest.approx(4 * 1.1 + 2 * 1.0), (
        f"expected c.wall_s == pytest.approx(4 * 1.1 + 2 * 1.0), got {c.wall_s!r}")


def _fake_run(d: Path, rule: str, seed: int, top1: list[float], wall: list[float], kept: float, **cfg):
    d.mkdir(parents=True)
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
                       str(runs / "dense-s1"), str(runs / "dense-tm-s0"), "--out", str(out)])
    lines = table.strip().splitlines()
    # dense first; no step-matched run, so its step-time column is n/a
    assert lines[2].startswith("| dense | 2 | 86.00 [73.29, 98.71] | n/a | n/a | +10.00 | 20.0 ± 0.0 | 1.00 [1.00, 1.00] |"), (
        f"dense row (top-1 CI, step-time r, Δ, time, ratio) wrong: {lines[2]!r}; header {lines[0]!r}")
    cap = next(l for l in lines if l.startswith("| capskip b=0.1 "))
    assert "| 2 | 85.00 [72.29, 97.71] | n/a | n/a | +11.00 |" in cap, f"capskip row wrong: {cap!r}"
    assert "| 0.50 [0.50, 0.50] |" in cap, f'expected "| 0.50 [0.50, 0.50] |" in cap, got cap = {cap!r}'
    assert "0.400" in cap, f'expected "0.400" in cap, got cap = {cap!r}'
    assert any(l.startswith("| dense time-matched | 1 | 75.00 | n/a | n/a |") for l in lines), (
        'expected any(l.startswith("| dense time-matched | 1 | 75.00 | n/a | n/a |") ...')
    assert (out / "compare.md").read_text().count("\n|---") == 1, (
        'expected (out / "compare.md").read_text().count("\\n|---") == 1')  # one table
    for p in plots.PLOTS:
        assert (out / p).stat().st_size > 0, 'expected (out / p).stat().st_size > 0'
    # a parent folder is searched for run directories
    assert train.run(["compare", str(runs), "--out", str(tmp_path / "cmp2")]) == table, (
        'expected train.run(["compare", str(runs), "--out", str(tmp_path / "cmp2")]) ...')


def test_compare_pairs_step_matched_dense_by_seed(tmp_path):
    """A dense run made with --steps-of a rule run (and its --ratio) fills that rule's step-matched columns."""
    runs = tmp_path / "runs"
    _fake_run(runs / "dense-s0", "dense", 0, [80, 85], [10, 20], 1.0)
    _fake_run(runs / "cap-s0", "capskip", 0, [81, 86], [5, 10], 0.4)
    _fake_run(runs / "cap-s1", "capskip", 1, [80, 84], [5, 10], 0.4)
    _fake_run(runs / "sm-s0", "dense", 0, [78, 83], [5, 10], 1.0, steps_of=str(runs / "cap-s0"), ratio=0.6)
    _fake_run(runs / "sm-s1", "dense", 1, [79, 82], [5, 10], 1.0, steps_of=str(runs / "cap-s1"), ratio=0.6)
    table = train.run(["compare", str(runs), "--out", str(tmp_path / "cmp")])
    cap = next(l for l in table.splitlines() if l.startswith("| capskip b=0.1 "))
    cells = [c.strip() for c in cap.split("|")[1:-1]]
    # seed 0: 86 - 83 = +3, seed 1: 84 - 82 = +2 -> mean +2.50 over n=2
    assert cells[3].startswith("+2.50") and cells[3].endswith("(n=2)"), f"step-matched Δ cell wrong: {cells[3]!r}"
    assert cells[4] == "0.6", f"step-time r cell should be the step-matched runs' --ratio, got {cells[4]!r}"


def test_cli_errors_come_before_any_work(tmp_path, capsys):
    """A bad budget or data folder fails at once, with the option named, and writes nothing."""
    from capskip_fx import train as cli

    for argv, msg in ((["--budget", "2.0"], "budget must be a number in [0, 1]"),
                      (["--data-dir", str(tmp_path / "nope")], "is not a folder"),
                      (["--rule", "forced", "--keep", "3"], "keep fraction must be in (0, 1]")):
        with pytest.raises(SystemExit, match=re.escape(msg)):
            cli.run([*argv, "--out", str(tmp_path / "run")])
        assert not (tmp_path / "run").exists(), 'expected not (tmp_path / "run").exists()'
    with pytest.raises(SystemExit):
        cli.run(["--help"])
    assert "--budget" in capsys.readouterr().out, 'expected "--budget" in capsys.readouterr().out'  # the default sub-command's flags, at the top level


def test_compare_splits_runs_of_different_datasets(tmp_path):
    runs = [report.Run(path=tmp_path / n, config={"dataset": d, "rule": "dense", "seed": 0},
                       summary=[{"eval_top1": 50.0, "wall_clock_s": 1.0}]) for n, d in (("a", "digits"), ("b", "mnist"))]
    table = report.compare_table(runs)
    assert "### digits" in table, f'expected "### digits" in table, got table = {table!r}'
    assert "### mnist" in table, f'expected "### mnist" in table, got table = {table!r}'
    assert table.count("| run |") == 2, f'expected table.count("| run |") == 2, got {table.count("| run |")!r}'

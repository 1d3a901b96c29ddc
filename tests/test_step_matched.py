"""Step-matched baselines: ``--steps-of RUN --ratio r`` gives a dense run round(r x RUN's steps) steps with
its own complete warm-up + cosine, and compare pairs each rule run with it per seed."""
from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from capskip_fx import train
from capskip_fx.train import loop, report
from helpers.runs import write_run

torch.set_num_threads(1)

TINY = ["--dataset", "digits", "--img-size", "16", "--patch-size", "4", "--depth", "1", "--embed-dim", "16",
        "--num-heads", "2", "--batch-size", "32", "--train-subset", "96", "--eval-subset", "64",
        "--backend", "eager", "--threads", "1", "--check-every", "0", "--lr", "1e-2", "--min-lr", "1e-4"]


def _lrs(out):
    return [json.loads(l)["lr"] for l in (out / "steps.jsonl").read_text().splitlines()]


def test_step_matched_run_has_its_own_complete_schedule(tmp_path):
    rule = tmp_path / "rule"
    res = train.run([*TINY, "--rule", "forced", "--keep", "0.5", "--epochs", "2", "--warmup-epochs", "1",
                     "--out", str(rule)])
    assert res["steps"] == 6, (  # 2 epochs of 3 steps
        f"the rule run to match trains 2 epochs of 3 steps (6), got {res['steps']}")
    for ratio, steps, epochs in ((0.5, 3, 1), (0.74, 4, 2), (1.5, 9, 3)):
        out = tmp_path / f"dense-{ratio}"
        r = train.run([*TINY, "--rule", "dense", "--epochs", "2", "--warmup-epochs", "1", "--steps-of", str(rule),
                       "--ratio", str(ratio), "--out", str(out)])
        assert r["steps"] == steps == round(ratio * 6), (
            f"--ratio {ratio} of the rule run's 6 steps must give round({ratio} x 6) = {steps} steps, got {r['steps']}")
        assert r["max_steps"] == steps, (
            f"the step-matched run must record its step limit round({ratio} x 6) = {steps}, got {r['max_steps']}")
        with open(out / "summary.csv", newline="") as f:
            assert len(list(csv.DictReader(f))) == epochs, (  # as many epochs as its steps need
                f"a run of {steps} steps of 3 per epoch must write {epochs} epoch rows to summary.csv")
        lrs = _lrs(out)
        # warm-up over the first half (1 of 2 epochs' worth), then cosine down to min_lr at the last step
        cfg = train.parse_config([*TINY, "--epochs", "2", "--warmup-epochs", "1", "--max-steps", str(steps)])
        assert lrs == pytest.approx([loop.lr_at(cfg, (i + 1) / steps) for i in range(steps)]), (
            f"a {steps}-step run needs its own full schedule: warm-up, then cosine to its last step; lrs {lrs!r}")
        assert lrs[-1] == pytest.approx(1e-4), (
            f"the cosine must reach min_lr 1e-4 at the step-matched run's last step, got {lrs[-1]!r}")
        assert max(lrs) == pytest.approx(1e-2, rel=0.3), (
            f"the warm-up must reach close to the peak lr 1e-2 before the cosine, got at most {max(lrs)!r}")
    # resumed: a finished step-matched run says so
    with pytest.raises(SystemExit, match="already made its 3 steps"):
        train.run(["--resume", str(tmp_path / "dense-0.5" / "checkpoint.pt")])


def test_steps_of_errors_name_the_fix(tmp_path):
    with pytest.raises(SystemExit, match="steps_of needs --ratio"):
        train.run([*TINY, "--rule", "dense", "--steps-of", str(tmp_path)])
    with pytest.raises(SystemExit, match="no result.json there"):
        train.run([*TINY, "--rule", "dense", "--steps-of", str(tmp_path), "--ratio", "0.7"])
    (tmp_path / "result.json").write_text(json.dumps({"steps": 10}))
    with pytest.raises(SystemExit, match=r"contradicts steps_of: round\(0.7 x 10\) = 7"):
        train.run([*TINY, "--rule", "dense", "--steps-of", str(tmp_path), "--ratio", "0.7", "--max-steps", "5"])
    with pytest.raises(SystemExit, match="max_steps must be >= 1"):
        train.run([*TINY, "--max-steps", "0"])
    with pytest.raises(SystemExit, match="step-match a dense run instead"):
        train.run([*TINY, "--rule", "infobatch", "--max-steps", "4"])


def _run(root, name, seed, acc, **cfg):
    return write_run(root, name, seed, [(10, acc)], backward_rows=5, **cfg)


def test_compare_pairs_each_rule_with_its_own_step_matched_dense(tmp_path):
    T975_DF2 = 4.302652729911275
    cap = {0: 90.0, 1: 91.0, 2: 93.0}
    kab = {0: 89.0, 1: 90.0, 2: 90.5}
    for s in range(3):
        _run(tmp_path, f"dense-s{s}", s, 92.0, rule="dense")
        c = _run(tmp_path, f"capskip-s{s}", s, cap[s], rule="capskip", budget=0.3)
        k = _run(tmp_path, f"kabena-s{s}", s, kab[s], rule="kabena")
        # step-matched dense, each to its own rule run, with that rule's own ratio
        _run(tmp_path, f"dense-cap-s{s}", s, 89.0 + s / 2, rule="dense", steps_of=str(c), ratio=0.74, max_steps=74)
        _run(tmp_path, f"dense-kab-s{s}", s, 88.0, rule="dense", steps_of=str(k), ratio=0.9, max_steps=90)
    runs = report.find_runs([tmp_path])
    assert sum(r.is_dense_reference for r in runs) == 3, (  # step-matched runs are not the dense reference
        "only the 3 plain dense runs are the dense reference, not the step-matched ones; counted "
        f"{sum(r.is_dense_reference for r in runs)}")
    table = report.compare_table(runs, wide=True)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table.splitlines()[2:] if line.startswith("| ")}
    assert (set(rows) == {"dense", "capskip b=0.3", "kabena", "dense step-matched ×0.74 to capskip b=0.3",
                         "dense step-matched ×0.9 to kabena"}), (
        f"each rule and each step-matched dense run (named for its ratio and rule) gets one row; rows {sorted(rows)}")
    d = [cap[s] - (89.0 + s / 2) for s in range(3)]  # +1.0, +1.5, +3.0
    m = sum(d) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / 2)
    h = T975_DF2 * sd / math.sqrt(3)
    assert rows["capskip b=0.3"][2] == f"{m:+.2f} [{m - h:+.2f}, {m + h:+.2f}] (n=3)", (
        "capskip's Δ vs step-matched pairs each seed with its own matched dense (+1.0, +1.5, +3.0): mean, t interval, "
        f"n=3; the cell reads {rows['capskip b=0.3'][2]!r}")
    assert rows["kabena"][2].startswith("+1.83 ["), (  # its own matched dense (88.0), not capskip's
        "kabena's Δ must be against its own step-matched dense (88.0), not capskip's: +1.83; "
        f"the cell reads {rows['kabena'][2]!r}")
    assert rows["dense"][2] == "n/a", (
        f"dense is the reference and has no step-matched Δ, so n/a; the cell reads {rows['dense'][2]!r}")
    assert rows["dense step-matched ×0.74 to capskip b=0.3"][2] == "n/a", (
        "a step-matched dense run has no step-matched Δ of its own, so n/a; "
        f"the cell reads {rows['dense step-matched ×0.74 to capskip b=0.3'][2]!r}")
    assert rows["capskip b=0.3"][3] == "0.74", f"capskip's step-time r column: {rows['capskip b=0.3'][3]!r}"
    assert rows["kabena"][3] == "0.9", f"kabena's step-time r column: {rows['kabena'][3]!r}"
    assert rows["dense"][3] == "n/a", "dense has no step-matched run, so no r"


def test_schedules_after_the_warm_up():
    """cosine and truncated share the cosine's shape (truncated differs in the steps it spans, tested below);
    linear holds the peak until the last decay_frac of progress, then falls linearly to min_lr."""
    cfg = train.TrainConfig(epochs=10, warmup_epochs=1, lr=1.0, min_lr=0.0, schedule="linear", decay_frac=0.2)
    assert loop.lr_at(cfg, 0.05) == pytest.approx(0.5), "the warm-up is the same under every schedule"
    assert loop.lr_at(cfg, 0.5) == loop.lr_at(cfg, 0.8) == 1.0, (
        f"linear: constant at the peak until 1 - decay_frac = 0.8, got {loop.lr_at(cfg, 0.5)}, {loop.lr_at(cfg, 0.8)}")
    assert loop.lr_at(cfg, 0.9) == pytest.approx(0.5), f"linear: half-way down its decay, got {loop.lr_at(cfg, 0.9)}"
    assert loop.lr_at(cfg, 1.0) == pytest.approx(0.0), f"linear: min_lr at the end, got {loop.lr_at(cfg, 1.0)}"
    cos = train.TrainConfig(epochs=10, warmup_epochs=1, lr=1.0, min_lr=0.0, schedule="cosine")
    assert loop.lr_at(cos, 0.9) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.8 / 0.9))), "cosine unchanged"
    with pytest.raises(ValueError, match="schedule 'warm' not in"):
        train.TrainConfig(schedule="warm")
    with pytest.raises(ValueError, match="truncated.*max-steps"):
        train.TrainConfig(schedule="truncated")
    with pytest.raises(ValueError, match="budget_batch.*max-steps"):
        train.TrainConfig(budget_batch=True)


def test_truncated_and_linear_runs_follow_their_schedules(tmp_path):
    """4 steps of a 2-epoch run of 3 steps per epoch: truncated follows the 6-step schedule and stops above
    min_lr; linear and cosine end at min_lr on their 4th step."""
    lrs = {}
    for sched in ("cosine", "truncated", "linear"):
        out = tmp_path / sched
        r = train.run([*TINY, "--rule", "dense", "--epochs", "2", "--warmup-epochs", "1", "--max-steps", "4",
                       "--schedule", sched, "--out", str(out)])
        assert r["steps"] == 4, f"{sched}: --max-steps 4 makes 4 steps, got {r['steps']}"
        lrs[sched] = _lrs(out)
    cfg = train.parse_config([*TINY, "--epochs", "2", "--warmup-epochs", "1", "--max-steps", "4", "--schedule",
                              "truncated"])
    assert lrs["truncated"] == pytest.approx([loop.lr_at(cfg, (i + 1) / 6) for i in range(4)]), (
        f"truncated: the 2 epochs' (6 steps') schedule, cut after 4 steps; got {lrs['truncated']}")
    assert lrs["truncated"][-1] > 1e-3, f"truncated stops before its cosine ends, got {lrs['truncated'][-1]}"
    assert lrs["cosine"][-1] == pytest.approx(1e-4) and lrs["linear"][-1] == pytest.approx(1e-4), (
        f"cosine and linear reach min_lr at the last step: {lrs['cosine'][-1]}, {lrs['linear'][-1]}")
    assert lrs["linear"][1] == pytest.approx(1e-2), f"linear holds the peak after the warm-up: {lrs['linear']}"


def test_budget_batch_spends_the_steps_in_the_epochs(tmp_path):
    assert loop.budget_batch_size(8000, 16, 992) == 129, "992 steps in 16 epochs of 8000 rows: 62 an epoch, batch 129"
    b = loop.budget_batch_size(8000, 16, 662)
    assert 16 * (8000 // b) >= 662 > 16 * (8000 // (b + 1)), (
        f"the largest batch whose 16 epochs hold 662 steps, got {b}")
    out = tmp_path / "bb"
    r = train.run([*TINY, "--rule", "dense", "--epochs", "2", "--max-steps", "4", "--budget-batch", "--out", str(out)])
    assert r["steps"] == 4, f"the run makes its 4 steps, got {r['steps']}"
    import yaml
    batch = yaml.safe_load((out / "config.yaml").read_text())["batch_size"]
    assert batch == 48, f"96 rows, 2 epochs, 4 steps: batch 48 (2 steps an epoch), got {batch}"
    with open(out / "summary.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 2, "4 steps of 2 per epoch: 2 epochs"


def test_random_replays_a_runs_per_step_kept_counts(tmp_path):
    """--keep-counts-of RUN: random keeps exactly RUN's per-step counts (at least 1), normalised as asked."""
    ref = tmp_path / "capskip"
    train.run([*TINY, "--rule", "capskip", "--budget", "0.5", "--epochs", "2", "--out", str(ref)])
    out = tmp_path / "random"
    train.run([*TINY, "--rule", "random", "--keep-counts-of", str(ref), "--rule-opt", "normalize=kept", "--epochs", "2",
               "--out", str(out)])
    want = [max(1, json.loads(l)["kept"]) for l in (ref / "steps.jsonl").read_text().splitlines()]
    got = [json.loads(l)["kept"] for l in (out / "steps.jsonl").read_text().splitlines()]
    assert got == want, f"random must keep capskip's per-step counts {want}, kept {got}"
    assert len(set(want)) > 1 or want[0] < 32, f"the reference should skip some rows for the test to mean much: {want}"
    with pytest.raises(ValueError, match="keep_counts_of"):
        train.TrainConfig(rule="sb", keep_counts_of=str(ref))

"""Training-harness checkpoints: checkpoint.pt each epoch, --resume (bit-exact), --initial-checkpoint
(checkpoint.pt / state_dict / safetensors, class-count change), --pretrained offline, early path errors.

Runs are the tiny digits ViTs of test_train.py (seconds each; the inductor resume compiles once cold)."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from capskip_fx import train
from capskip_fx.train import checkpoint, loop
from helpers.runs import assert_resumed_exactly, run_killed_at_evaluation

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--dataset", "digits", "--img-size", "16", "--patch-size", "4", "--depth", "1", "--embed-dim", "16",
        "--num-heads", "2", "--batch-size", "32", "--train-subset", "96", "--eval-subset", "64",
        "--threads", "1", "--warmup-epochs", "0", "--lr", "1e-2"]




def _summary(out: Path) -> list[dict]:
    with open(out / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines()]


@pytest.mark.parametrize("backend, rule", [
    ("aot_eager", ["--rule", "sb", "--keep", "0.5"]),  # history + generator in the rule state
    ("inductor", ["--rule", "capskip", "--budget", "0.5"]),
    # the loader's data-side filter (its draws and counts) and the rule's loss cache; epoch 2 drops rows
    ("aot_eager", ["--rule", "stale_sb", "--rule-opt", "beta=1"]),
])
@pytest.mark.heavy
def test_resume_is_bit_exact(tmp_path, monkeypatch, backend, rule):
    argv = [*TINY, "--backend", backend, *rule, "--epochs", "3", "--check-every", "2"]
    full = train.run([*argv, "--out", str(tmp_path / "full")])

    # the same run killed in epoch 2 after its steps (they reach steps.jsonl) but before its checkpoint
    run_killed_at_evaluation(monkeypatch, loop, 2, lambda: train.run([*argv, "--out", str(tmp_path / "cut")]))
    cut = tmp_path / "cut"
    ck = torch.load(cut / "checkpoint.pt", weights_only=True)  # plain containers and tensors only
    assert ck["epoch"] == 1, (
        f"the run killed in epoch 2 must leave epoch 1's checkpoint as the last one written; got epoch {ck['epoch']!r}")
    assert ck["counters"]["step"] == 3, (
        f"the checkpoint must record the 3 optimizer steps of epoch 1; got step {ck['counters']['step']!r}")
    assert "_capskip" in ck["model"], (
        f"the checkpoint must hold the capskip rule state (_capskip) with the model, or a resume restarts the rule; got keys {sorted(ck['model'])!r}")
    assert {"torch", "numpy", "python", "loader"} <= set(ck["rng"]), (
        f"the checkpoint must hold every RNG stream (torch, numpy, python, loader) for a bit-exact resume; got {sorted(ck['rng'])!r}")
    assert ck["config"]["backend"] == backend, (
        f"the checkpoint must record the backend so --resume rebuilds the same run; got {ck['config']['backend']!r}, ran {backend!r}")
    stale = "stale_sb" in rule
    assert len(_jsonl(cut / "steps.jsonl")) == 6 or stale, (
        "epoch 2's steps must reach steps.jsonl before the kill (6 rows), so the resume must cope with rows past the checkpoint")  # epoch 2's steps, past the checkpoint
    epoch1 = _summary(cut)

    res = train.run(["--resume", str(cut / "checkpoint.pt")])  # the config comes from the checkpoint
    a, b = _summary(tmp_path / "full"), _summary(cut)
    assert len(b) == 3, f"after the resume summary.csv must have one row per epoch (3); got {len(b)!r}"
    assert b[0] == epoch1[0], (
        f"the resume must keep epoch 1's summary row as written; got {b[0]!r}, was {epoch1[0]!r}")  # rows continued, epoch 1's kept as written
    assert_resumed_exactly(a, b, full, res)
    assert full["steps"] == 9 if not stale else full["steps"] < 9 and full["forward_frac"] < 1, (
        f"the full run must take 9 steps (3 per epoch), or fewer with stale_sb dropping rows; got {full['steps']!r} steps")
    assert res["backward_rows"] == full["backward_rows"], (
        f"the resumed run must back-propagate exactly the rows the uninterrupted run did; got {res['backward_rows']!r} vs {full['backward_rows']!r}")
    assert res["resumed_from"] == str(cut / "checkpoint.pt"), (
        f"the result must name the checkpoint it resumed from; got {res['resumed_from']!r}")
    # wall-clock continues from the checkpoint's
    assert (float(b[1]["wall_clock_s"]) > float(b[0]["wall_clock_s"]) == pytest.approx(ck["clock"]["total"] -
                                                                                     float(b[0]["compile_s"]))), (
        f"wall-clock must continue from the checkpoint's total, not restart at 0; got {b[0]['wall_clock_s']!r} then {b[1]['wall_clock_s']!r}")
    sa, sb = _jsonl(tmp_path / "full" / "steps.jsonl"), _jsonl(cut / "steps.jsonl")
    assert [(s["step"], s["loss"], s["kept"]) for s in sa] == [(s["step"], s["loss"], s["kept"]) for s in sb], (
        "the resumed run's steps (step, loss, kept rows) must match the uninterrupted run bit for bit")
    ca, cb = _jsonl(tmp_path / "full" / "checks.jsonl"), _jsonl(cut / "checks.jsonl")
    assert [(c["step"], c["rel_l2_head"]) for c in ca] == [(c["step"], c["rel_l2_head"]) for c in cb], (
        "the resumed run's exactness checks (step, rel_l2_head) must match the uninterrupted run bit for bit")
    assert json.loads((cut / "result.json").read_text())["final_top1"] == full["final_top1"], (
        f"the resumed run must end at the same top-1 accuracy as the uninterrupted run; got {json.loads((cut / 'result.json').read_text())['final_top1']!r} vs {full['final_top1']!r}")
    assert torch.load(cut / "checkpoint.pt", weights_only=True)["epoch"] == 3, (
        "the resumed run must write its final checkpoint at epoch 3")


def test_resume_needs_something_left_to_train(tmp_path):
    out = tmp_path / "r"
    train.run([*TINY, "--backend", "eager", "--epochs", "1", "--check-every", "0", "--out", str(out)])
    with pytest.raises(SystemExit, match="already finished epoch 1 of 1; pass --epochs"):
        train.run(["--resume", str(out / "checkpoint.pt")])
    res = train.run(["--resume", str(out / "checkpoint.pt"), "--epochs", "2"])  # flags override its config
    assert res["steps"] == 6, (
        f"resuming a finished 1-epoch run with --epochs 2 must train one more epoch (3 steps, 6 in all); got {res['steps']!r}")
    assert [r["epoch"] for r in _summary(out)] == ["1", "2"], (
        f"summary.csv must continue with epoch 2 after epoch 1; got epochs {[r['epoch'] for r in _summary(out)]!r}")


def test_a_run_folder_holds_one_run(tmp_path, monkeypatch):
    """A fresh run into a folder that holds another run (other options) is refused, naming --out and
    --resume, and leaves that run's files alone; the same run started again from scratch clears the old
    results first (a crash would otherwise leave them for compare)."""
    out = tmp_path / "r"
    argv = [*TINY, "--backend", "eager", "--epochs", "1", "--check-every", "0", "--out", str(out)]
    train.run([*argv, "--rule", "capskip", "--budget", "0.1"])
    before = (out / "result.json").read_text()
    with pytest.raises(SystemExit, match=r"holds another run \(capskip b=0.1; budget 0.1 -> 0.5\).*--resume"):
        train.run([*argv, "--rule", "capskip", "--budget", "0.5"])
    assert (out / "result.json").read_text() == before, "a refused run must leave the other run's result alone"
    (out / "stale.txt").write_text("not a run file")
    # the same run again (threads are not what a run computes), killed at its first evaluation
    run_killed_at_evaluation(monkeypatch, loop, 1,
                             lambda: train.run([*argv, "--rule", "capskip", "--budget", "0.1", "--threads", "1"]))
    assert not (out / "result.json").exists() and not (out / "summary.csv").exists(), (
        "the same run started again must clear the earlier run's results before it trains")
    assert (out / "stale.txt").exists(), "only the files a run writes are cleared"


def test_a_run_that_never_stepped_leaves_its_folder_free(tmp_path, monkeypatch):
    """A run that stopped after writing its config but before any step (here: the loaders fail) holds no
    results: another run may take its folder."""
    from helpers.runs import Crash

    out = tmp_path / "r"
    argv = [*TINY, "--backend", "eager", "--epochs", "1", "--check-every", "0", "--max-steps", "1", "--out", str(out)]

    def no_loaders(*a, **k):
        raise Crash

    monkeypatch.setattr(loop, "make_loaders", no_loaders)
    with pytest.raises(Crash):
        train.run([*argv, "--budget", "0.5"])
    assert (out / "config.yaml").is_file() and not (out / "steps.jsonl").exists()
    monkeypatch.undo()
    res = train.run([*argv, "--budget", "0.1"])
    assert res["steps"] == 1 and "b=0.1" in res["label"], res


def test_resume_keeps_its_rule_and_relabels_changed_options(tmp_path, capsys):
    """--resume with another --rule is refused (the rule state would load into another rule); an option
    changed on resume (--max-steps) runs, and a label the options made is made again from them."""
    out = tmp_path / "r"
    train.run([*TINY, "--backend", "eager", "--epochs", "1", "--check-every", "0", "--rule", "sb", "--keep", "0.5",
               "--max-steps", "2", "--out", str(out)])
    with pytest.raises(SystemExit, match="continues a sb run: --rule capskip"):
        train.run(["--resume", str(out / "checkpoint.pt"), "--rule", "capskip"])
    capsys.readouterr()
    res = train.run(["--resume", str(out / "checkpoint.pt"), "--max-steps", "5", "--epochs", "2"])
    assert res["steps"] == 5 and "5 steps" in res["label"] and "2 steps" not in res["label"], res["label"]
    # the 2-step run stopped inside its 3-step epoch: the resume says what it leaves out
    assert "epoch 1 stopped after 2 of its 3 steps; the run goes on with epoch 2" in capsys.readouterr().err


def test_resume_from_a_copied_checkpoint_keeps_the_step_log(tmp_path):
    """A checkpoint copied out of its run folder resumes into the run's folder (its config's out) and keeps
    the steps logged before it (they were read from the copy's folder, which has none)."""
    out, saved = tmp_path / "r", tmp_path / "saved"
    train.run([*TINY, "--backend", "eager", "--epochs", "1", "--check-every", "0", "--out", str(out)])
    saved.mkdir()
    (saved / "ep1.pt").write_bytes((out / "checkpoint.pt").read_bytes())
    train.run(["--resume", str(saved / "ep1.pt"), "--epochs", "2"])
    steps = [s["step"] for s in _jsonl(out / "steps.jsonl")]
    assert steps == list(range(6)), f"the log should hold both epochs' steps 0-5: {steps}"


def test_atomic_save_never_leaves_a_truncated_file(tmp_path):
    path = tmp_path / "checkpoint.pt"
    checkpoint.save({"epoch": 1, "w": torch.arange(1000)}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full")  # fails half-way through the write

    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save({"epoch": 2, "w": torch.arange(10**6), "x": Unpicklable()}, path)
    old = torch.load(path, weights_only=True)
    assert old["epoch"] == 1, f"a failed save must leave the previous checkpoint in place; got epoch {old['epoch']!r}"
    assert torch.equal(old["w"], torch.arange(1000)), (
        "a failed save must leave the previous checkpoint's tensors intact, not truncated")
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"], (
        f"a failed save must not leave a temporary file behind; got {[p.name for p in tmp_path.iterdir()]!r}")  # no temp file left behind


# ---------------------------------------------------------------- --initial-checkpoint

@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("src") / "run"
    res = train.run([*TINY, "--backend", "eager", "--epochs", "1", "--check-every", "0", "--out", str(out)])
    return out, res


def _formats(src: Path, tmp_path: Path) -> dict[str, Path]:
    from safetensors.torch import save_file

    sd = {k: v for k, v in torch.load(src / "checkpoint.pt", weights_only=True)["model"].items() if k != "_capskip"}
    torch.save(sd, tmp_path / "plain.pth")
    save_file(sd, str(tmp_path / "w.safetensors"))
    return {"checkpoint": src / "checkpoint.pt", "state_dict": tmp_path / "plain.pth",
            "safetensors": tmp_path / "w.safetensors"}


@pytest.mark.parametrize("fmt", ["checkpoint", "state_dict", "safetensors"])
def test_initial_checkpoint_formats(tmp_path, capsys, source_run, fmt):
    src, src_res = source_run
    path = _formats(src, tmp_path)[fmt]
    out = tmp_path / "ft"
    # lr 0: AdamW leaves the weights as loaded, so the eval loss must be the source run's final one
    train.run([*TINY, "--backend", "eager", "--epochs", "1", "--check-every", "0", "--lr", "0", "--min-lr", "0",
               "--initial-checkpoint", str(path), "--out", str(out)])
    assert _summary(out)[0]["eval_loss"] == _summary(src)[0]["eval_loss"], (
        f"with lr 0 the loaded weights stay as they are, so the eval loss must equal the source run's; got {_summary(out)[0]['eval_loss']!r} vs {_summary(src)[0]['eval_loss']!r}")
    assert _summary(out)[0]["eval_top1"] == _summary(src)[0]["eval_top1"] != "", (
        f"with lr 0 the eval top-1 must equal the source run's (and be reported); got {_summary(out)[0]['eval_top1']!r} vs {_summary(src)[0]['eval_top1']!r}")
    text = capsys.readouterr().out
    assert "[init] missing keys (0): none" in text, (
        f"loading a full-match {fmt} file must report no missing keys; got output {text!r}")
    assert "[init] unexpected keys (0): none" in text, (
        f"loading a full-match {fmt} file must report no unexpected keys; got output {text!r}")


def test_initial_checkpoint_changes_class_count_and_reports_keys(tmp_path, capsys, source_run):
    import timm

    src, _ = source_run
    sd = checkpoint.read_weights(src / "checkpoint.pt")  # 10 digit classes
    assert "_capskip" not in sd, (
        f"read_weights must strip the capskip rule state from the model weights; got keys {sorted(sd)!r}")
    assert sd["head.weight"].shape[0] == 10, (
        f"the source run's head must have 10 outputs (the digit classes); got {sd['head.weight'].shape[0]!r}")
    sd["extra.weight"] = torch.zeros(2)
    del sd["norm.bias"]
    torch.manual_seed(1)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, num_classes=5, img_size=16, patch_size=4,
                              depth=1, embed_dim=16, num_heads=2, in_chans=1)
    fresh_head = {k: v.clone() for k, v in model.head.state_dict().items()}
    rep = checkpoint.load_weights(model, model.head, sd, "src")
    assert rep == {"missing": ["norm.bias"], "unexpected": ["extra.weight"], "reinitialised": ["head.bias", "head.weight"]}, (
        f"load_weights must report the missing and unexpected keys and the head re-initialised for the new class count; got {rep!r}")
    assert all(torch.equal(model.head.state_dict()[k], v) for k, v in fresh_head.items()), (
        "a head re-initialised for a new class count must keep its fresh init, not take the checkpoint's")  # keeps its init
    assert torch.equal(model.blocks[0].attn.qkv.weight, sd["blocks.0.attn.qkv.weight"]), (
        "the body weights must be loaded from the checkpoint")
    text = capsys.readouterr().out
    assert "missing keys (1): norm.bias" in text, f"the missing key must be reported to the user; got output {text!r}"
    assert "unexpected keys (1): extra.weight" in text, (
        f"the unexpected key must be reported to the user; got output {text!r}")
    assert "re-initialised (class count differs): head.bias, head.weight" in text, (
        f"the re-initialised head must be reported with its reason; got output {text!r}")
    # a body shape mismatch is an error, not a silent partial load
    sd["blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    with pytest.raises(SystemExit, match=r"blocks.0.attn.qkv.weight: checkpoint \(3, 3\) vs model \(48, 16\)"):
        checkpoint.load_weights(model, model.head, sd, "src")


def test_safetensors_missing_names_the_install(tmp_path, monkeypatch):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"\0" * 16)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(SystemExit, match="pip install safetensors"):
        checkpoint.read_weights(f)


# ---------------------------------------------------------------- failing early

def test_bad_checkpoint_paths_fail_before_any_data(tmp_path, capsys, source_run):
    src, _ = source_run
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    plain = tmp_path / "plain.pth"
    torch.save({"w": torch.zeros(2)}, plain)
    out = tmp_path / "run"
    cases = [(["--resume", str(tmp_path / "nope.pt")], "resume '.*nope.pt' is not a file"),
             (["--initial-checkpoint", str(tmp_path / "nope.pt")], "initial_checkpoint '.*nope.pt' is not a file"),
             (["--resume", str(plain)], "not a capskip-train checkpoint.pt .*use --initial-checkpoint"),
             (["--resume", str(garbage)], "--resume .*garbage.pt: cannot read it"),
             (["--initial-checkpoint", str(garbage)], "--initial-checkpoint .*garbage.pt: cannot read it")]
    for argv, msg in cases:
        with pytest.raises(SystemExit, match=msg):
            train.run([*TINY, "--backend", "eager", *argv, "--out", str(out)])
        assert not out.exists(), f"a bad checkpoint path must fail before the output folder is created ({argv!r})"
    assert "[data]" not in capsys.readouterr().out, "a bad checkpoint path must fail before any data is loaded"


@pytest.mark.subprocess
def test_pretrained_offline_fails_at_start_naming_initial_checkpoint(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "TORCH_HOME": str(tmp_path / "th"),
           "PYTHONPATH": str(ROOT)}
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "capskip_fx.train", *TINY, "--backend", "eager", "--pretrained",
                        "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, (
        f"an offline --pretrained must fail with a clear message, not a traceback; got stderr {p.stderr!r}")
    assert "--initial-checkpoint" in p.stderr, (
        f"the offline --pretrained error must point to --initial-checkpoint as the way out; got stderr {p.stderr!r}")
    assert "could not fetch timm's pretrained weights for 'deit_tiny_patch16_224'" in p.stderr, (
        f"the offline --pretrained error must say which timm weights it could not fetch; got stderr {p.stderr!r}")
    assert "[data]" not in p.stdout, "an offline --pretrained must fail before any data is loaded"
    assert not out.exists(), "an offline --pretrained must fail before the output folder is created"

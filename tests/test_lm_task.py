"""``--task lm``: next-byte language modelling on the Python standard library's source with a tiny
transformers causal LM, through the training CLI."""
from __future__ import annotations

import json
import math

import pytest
import torch

from capskip_fx import train
from capskip_fx.train import text

pytest.importorskip("transformers")

TINY_LM = ["--task", "lm", "--dataset", "pytext", "--model", "gpt2", "--depth", "1", "--embed-dim", "32",
           "--num-heads", "2", "--seq-len", "32", "--train-subset", "256", "--eval-subset", "64", "--epochs", "1",
           "--batch-size", "32", "--backend", "aot_eager", "--warmup-epochs", "0", "--lr", "3e-3", "--threads", "1"]


def test_pytext_rows_are_next_byte_pairs_and_the_test_split_is_held_apart():
    data = text.load_pytext(16, log=lambda *_: None)
    x, y, idx = data.train.__getitems__([0, 5, 7])
    assert x.shape == (3, 16), f"x shape {tuple(x.shape)}"
    assert torch.equal(x[:, 1:], y[:, :-1]), "y must be x shifted by one token"
    assert torch.equal(idx, torch.tensor([0, 5, 7])), "indices must be the rows asked for"
    assert int(x.max()) < text.VOCAB, "tokens are bytes"
    src, _ = text.stdlib_bytes(limit=10_000)
    first = bytes(data.train.split.images[0].tolist())
    assert src.startswith(first), "row 0 is the corpus's first window"
    assert len(data.test) == (len(data.train) + len(data.test)) // 10, "the last 10 % of the windows are the test set"


def test_lm_loss_is_the_token_mean_and_per_sequence_mean():
    g = torch.Generator().manual_seed(0)
    z, y = torch.randn(3, 5, 7, generator=g), torch.randint(0, 7, (3, 5), generator=g)
    per_token = torch.nn.functional.cross_entropy(z.permute(0, 2, 1), y, reduction="none")  # (3, 5)
    torch.testing.assert_close(text.lm_loss(z, y), per_token.mean(), msg="mean over every token of the batch")
    torch.testing.assert_close(text.lm_loss(z, y, reduction="none"), per_token.mean(1), msg="each sequence's mean")
    torch.testing.assert_close(text.lm_loss(z, y, reduction="sum"), per_token.sum(), msg="sum over every token")


@pytest.mark.parametrize("flags, fix", [(["--task", "lm"], "--dataset pytext"),
                                        (["--dataset", "pytext"], "--task lm"),
                                        (["--task", "lm", "--dataset", "pytext", "--model", "deit_tiny_patch16_224"],
                                         "gpt2")])
def test_lm_config_errors_name_the_fix(flags, fix):
    with pytest.raises((SystemExit, ValueError), match=fix.replace("-", r"\-")):
        train.parse_config(flags)


@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.heavy
def test_tiny_lm_trains_through_the_cli(tmp_path, model):
    out = tmp_path / model
    r = train.run([*TINY_LM, "--model", model, "--rule", "dense", "--out", str(out)])
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert len(rows) == 8, f"256 rows / 32 per batch = 8 steps, got {len(rows)}"
    assert rows[-1]["loss"] < rows[0]["loss"], f"training loss did not fall: {rows[0]['loss']} -> {rows[-1]['loss']}"
    summary = (out / "summary.csv").read_text().splitlines()
    eval_loss = float(summary[-1].split(",")[4])
    assert eval_loss < math.log(text.VOCAB), f"eval loss {eval_loss} is no better than uniform bytes"
    assert 0 < r["final_top1"] <= 100, f"token accuracy {r['final_top1']} out of range"

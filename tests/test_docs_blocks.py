"""Every Python block of README.md and docs/recipes.md runs here, so a recipe cannot drift from the code.

Blocks that stand for a user's own model, data or long run (``model``, ``loader``, ``TrainingArguments(...)``)
get tiny stand-ins in their namespace (``STAND_INS``); every graph compiles with aot_eager (Inductor takes
minutes on 2 cores): that is the only change to the code the docs show, besides ``fully_shard``, a no-op
stand-in in the regional recipe (FSDP2 needs a process group; tests/test_fsdp.py runs it).
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import capskip_fx

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.heavy  # Trainer, Lightning: a minute in all


def _blocks(name: str) -> list[tuple[str, str]]:
    text = (ROOT / name).read_text()
    return [(f"{name}:{i}", b) for i, b in enumerate(re.findall(r"```python\n(.*?)```", text, re.S))]


BLOCKS = _blocks("README.md") + _blocks("docs/recipes.md")


class _Blocks(nn.Module):
    """A stand-in model with repeated blocks and a head (compile_regions' input)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(20, 20), nn.GELU()) for _ in range(2)])
        self.head = nn.Linear(20, 5)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _loop_stand_ins(tmp_path) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 5))
    data = torch.utils.data.TensorDataset(torch.randn(64, 20), torch.randint(0, 5, (64,)))
    loader = torch.utils.data.DataLoader(data, batch_size=16, drop_last=True)
    import torch.nn.functional as F

    return {"model": model, "loader": loader, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "F": F,
            "capskip_fx": capskip_fx, "torch": torch}


def _hf_stand_ins(tmp_path) -> dict:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=3))
    ds = [{"input_ids": torch.randint(1, 50, (8,)), "labels": i % 3} for i in range(32)]

    def training_arguments(*_):  # stands for the user's TrainingArguments(...)
        return transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, logging_steps=1,
                                              per_device_train_batch_size=8, use_cpu=True, report_to=[],
                                              save_strategy="no", dataloader_drop_last=True, disable_tqdm=True)

    return {"model": model, "ds": ds, "Trainer": transformers.Trainer, "TrainingArguments": training_arguments,
            "capskip_fx": capskip_fx}


def _check_loop(ns):
    run = capskip_fx.summary(ns.get("cm") or ns.get("m") or ns.get("lit") or ns["model"])
    assert run.steps >= 2 and run.n > 0, run


def _check_hf(ns, tmp_path):
    model, trainer = ns["model"], ns["trainer"]
    st = capskip_fx.stats(model)
    assert (st.mode, st.kept, st.rows, st.fallback) == ("selected", 4, 4, None), st
    assert any("capskip/steps_selected" in h for h in trainer.state.log_history), trainer.state.log_history
    metrics = trainer.evaluate(ns.get("ds", [])[:16] or None)
    assert "eval_loss" in metrics, "Trainer found no labels: the in-place compile lost the signature"
    assert not [k for k in metrics if k.startswith("capskip/")], metrics
    trainer.save_model(str(tmp_path / "saved"))
    fresh = type(model).from_pretrained(str(tmp_path / "saved"))
    for (k, a), (k2, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert k == k2 and torch.equal(a, b), f"{k} did not reload as saved"


def _check_recipes_hf(ns, tmp_path):
    _check_hf(ns, tmp_path)
    for (k, a), b in zip(ns["model"].state_dict().items(), ns["reloaded"].state_dict().values()):
        assert torch.equal(a, b), f"the recipe's reloaded model differs in {k}"


def _check_regions(ns):
    import torch.nn.functional as F

    model = ns["model"]
    for _ in range(2):
        F.cross_entropy(model(torch.randn(8, 20)), torch.randint(0, 5, (8,))).backward()
    roles = [r["role"] for r in capskip_fx.report(model)]
    assert roles[-1] == "head" and set(roles[:-1]) == {"body"}, capskip_fx.report(model)
    assert capskip_fx.summary(model).steps == 2


# (a line the block holds, its stand-ins, its check, fully_shard stood in)
STAND_INS = [
    ("model = capskip_fx.compile(model, budget=0.1)", _loop_stand_ins, lambda ns, _: _check_loop(ns), False),
    ('model.compile(backend="capskip")                            # CAPSKIP_BUDGET', _loop_stand_ins,
     lambda ns, _: _check_loop(ns), False),
    ("trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds)", _hf_stand_ins, _check_hf,
     False),
    ("capskip_fx.compile_regions(model, rule=\"capskip\", budget=0.3)   # or blocks", lambda _: {"model": _Blocks(),
     "capskip_fx": capskip_fx}, lambda ns, _: _check_regions(ns), False),
    ("cm = capskip_fx.compile(model, rule=\"capskip\"", lambda _: {}, lambda ns, _: _check_loop(ns), False),
    ("m = torch.compile(model, backend=\"capskip\", options=", lambda _: {}, lambda ns, _: _check_loop(ns), False),
    ("reloaded = BertForSequenceClassification.from_pretrained", lambda _: {}, _check_recipes_hf, False),
    ("class Lit(L.LightningModule):", lambda _: {}, lambda ns, _: _check_loop(ns), False),
    ("for block in model.blocks:", lambda _: {"model": _Blocks()}, lambda ns, _: _check_regions(ns), True),
]


@pytest.mark.parametrize("where,code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_doc_block_runs(where, code, tmp_path, monkeypatch):
    found = [s for s in STAND_INS if s[0] in code]
    assert len(found) == 1, f"{where}: give this block one entry in STAND_INS (its stand-ins and check):\n{code}"
    _, stand_ins, check, drop_fsdp = found[0]
    if "import lightning" in code:
        pytest.importorskip("lightning")
    if "transformers" in code:
        pytest.importorskip("transformers")
    for var in ("CAPSKIP_RULE", "CAPSKIP_BUDGET", "CAPSKIP_OPTIONS"):  # a block's os.environ.setdefault is undone
        monkeypatch.delenv(var, raising=False)
    if "args=TrainingArguments(...)" in code:  # the README's recipe takes its rule from the environment
        monkeypatch.setenv("CAPSKIP_RULE", "forced")
        monkeypatch.setenv("CAPSKIP_OPTIONS", "keep=0.5")
    from capskip_fx import api, config, dynamo_entry

    def aot_eager(rule, options):  # the stand-in for Inductor (minutes on 2 cores)
        return config.split_options(rule, {"backend": "aot_eager", **options})

    monkeypatch.setattr(api, "split_options", aot_eager)
    monkeypatch.setattr(dynamo_entry, "split_options", aot_eager)
    monkeypatch.chdir(tmp_path)  # the recipes write out/
    ns = {"__name__": "__doc_block__", **stand_ins(tmp_path)}
    if drop_fsdp:  # FSDP2 needs a process group (tests/test_fsdp.py): fully_shard stands in as a no-op
        code = code.replace("from torch.distributed.fsdp import fully_shard\n", "")
        ns["fully_shard"] = lambda module: module
    exec(compile(code, where, "exec"), ns)
    check(ns, tmp_path)


@pytest.mark.subprocess
def test_readme_rows_skipped_snippet_prints_the_line_it_shows():
    """The README's check that rows are really skipped prints exactly the line the README shows."""
    text = (ROOT / "README.md").read_text()
    code = re.search(r"python - <<'EOF'\n(.*?)\nEOF", text, re.S).group(1)
    shown = re.search(r"It prints `(StepStats\(.*?\))`", text).group(1)
    env_line = re.search(r"(CAPSKIP_RULE=\S+) (CAPSKIP_OPTIONS=\S+) python - <<'EOF'", text)
    import os

    env = dict(os.environ, **dict(kv.split("=", 1) for kv in env_line.groups()))
    env["CAPSKIP_OPTIONS"] += ",backend=aot_eager"  # Inductor: the same line, minutes on 2 cores
    out = subprocess.run([sys.executable, "-"], input=code, env=env, capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].split("   #")[0] == shown, (out.stdout, shown)

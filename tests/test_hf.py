"""Hugging Face Trainer with the capskip backend, on tiny models built from configs (no download).

HF models compute the loss inside when given ``labels``: the in-graph loss path (insert_select) selects
on dL/dz in the backward.  ``TrainingArguments(torch_compile_backend="capskip")`` is rejected by
accelerate (its DynamoBackend enum lists fixed names), so the recipe passes the compiled model:
``Trainer(model=torch.compile(model, backend="capskip"), args=TrainingArguments(..., remove_unused_columns=False))``.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import capskip_fx

transformers = pytest.importorskip("transformers")


def _bert():
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg), lambda g: {"input_ids": torch.randint(0, 50, (8,), generator=g)}


def _vit():
    cfg = transformers.ViTConfig(image_size=16, patch_size=8, num_channels=1, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32, num_labels=3,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.ViTForImageClassification(cfg), lambda g: {"pixel_values": torch.randn(1, 16, 16, generator=g)}


class _Data(torch.utils.data.Dataset):
    def __init__(self, make):
        self.make = make

    def __len__(self):
        return 32

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {**self.make(g), "labels": i % 3}


@pytest.mark.parametrize("make", [_bert, _vit], ids=["bert", "vit"])
def test_trainer_skips_rows_with_the_in_model_loss(make, monkeypatch, tmp_path):
    monkeypatch.setenv("CAPSKIP_RULE", "forced")
    monkeypatch.setenv("CAPSKIP_OPTIONS", "keep=0.5,backend=aot_eager")
    torch.manual_seed(0)
    model, sample = make()
    opt = torch.compile(model, backend="capskip")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=2,
                                          report_to=[], use_cpu=True, save_strategy="no", dataloader_drop_last=True,
                                          remove_unused_columns=False, disable_tqdm=True)
    transformers.Trainer(model=opt, args=args, train_dataset=_Data(sample)).train()
    st = capskip_fx.stats(opt)
    assert (st.n, st.kept, st.rows) == (8, 4, 4)
    rep = capskip_fx.report(opt)
    assert any(r["role"] == "head" and r["backward"] == "selected rows" for r in rep)
    # one step by hand on the same compiled model: gradients == the eager reference of the kept rows
    batch = torch.utils.data.default_collate([_Data(sample)[i] for i in range(8, 16)])
    ref = copy.deepcopy(model).eval()
    model.zero_grad()
    opt(**batch).loss.backward()
    w = capskip_fx.stats(opt).weight
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    ref.zero_grad()
    labels = batch.pop("labels")
    (F.cross_entropy(ref(**batch).logits, labels, reduction="none") * w).mean().backward()
    refs = {k: p.grad for k, p in ref.named_parameters() if k in grads}
    # floor at 1e-6 of the whole gradient: attention key biases have an exactly-zero true gradient (softmax
    # shift invariance) and carry float32 rounding noise on both sides
    total = torch.sqrt(sum(r.double().pow(2).sum() for r in refs.values())).item()
    err = max((grads[k] - r).double().norm().item() / max(r.double().norm().item(), 1e-6 * total) for k, r in refs.items())
    assert err < 1e-4


def test_trainer_with_the_model_compiled_in_place(monkeypatch, tmp_path):
    """The README recipe: ``model.compile(backend="capskip")`` keeps the model's class and signature, so
    Trainer finds ``labels`` (eval_loss without label_names), saves clean keys, and the callback logs the
    run summary."""
    from capskip_fx.integrations.hf import add_callback

    monkeypatch.setenv("CAPSKIP_RULE", "forced")
    monkeypatch.setenv("CAPSKIP_OPTIONS", "keep=0.5,backend=aot_eager")
    torch.manual_seed(0)
    model, sample = _bert()
    model.compile(backend="capskip")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=3,
                                          logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                                          dataloader_drop_last=True, disable_tqdm=True,
                                          per_device_eval_batch_size=8)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data(sample), eval_dataset=_Data(sample))
    add_callback(trainer)
    trainer.train()
    st = capskip_fx.stats(model)
    assert (st.mode, st.n, st.kept, st.rows) == ("selected", 8, 4, 4), st
    logged = [h for h in trainer.state.log_history if "capskip/kept_pct" in h]
    assert logged, f"no capskip fields in the logs: {trainer.state.log_history}"
    assert logged[-1]["capskip/kept_pct"] == 50.0 and logged[-1]["capskip/steps"] == 3, logged[-1]
    assert "eval_loss" in trainer.evaluate(), "Trainer found the labels (model signature kept)"
    trainer.save_model(str(tmp_path / "saved"))
    fresh = type(model).from_pretrained(str(tmp_path / "saved"))
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), f"{k} did not reload as saved"

"""Real clients of ``torch.compile(model, backend="capskip")``: a timm train.py-style loop, the Hugging Face
``Trainer`` and PyTorch Lightning, each on a tiny model, with the CAPSKIP_* settings they would get from the
environment.  Each asserts that rows are skipped, that ``capskip_fx.stats`` / ``report`` work on what the
client holds, and that one step's gradients equal the float64 eager reference ``sum_i w_i * loss_i / N``
(``w = stats(m).weight``, ``loss_i`` the client's own per-example loss).

The last tests pin two library bugs found while writing these (they fail until fixed; see their docstrings).
"""
from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx
from capskip_fx.dynamo_entry import STATIC_FIRST, backend_of

pytestmark = pytest.mark.heavy  # out of the fast tier (pyproject.toml markers)


# -- helpers -----------------------------------------------------------------------------------------------
def _env(monkeypatch, **env):
    """Exactly these CAPSKIP_* settings (what a user exports before ``python train.py``)."""
    for k in ("CAPSKIP_RULE", "CAPSKIP_BUDGET", "CAPSKIP_OPTIONS", "ACCELERATE_DYNAMO_BACKEND"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def _grads(model: nn.Module) -> dict:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def grad_err(grads: dict, ref: dict) -> float:
    """Max over parameters of ||g - r|| / max(||r||, 1e-6 * ||r_all||).  The floor matters: some gradients
    are mathematically zero (attention's key bias: softmax ignores a per-row constant) and are pure rounding
    noise (~1e-22) in both runs, so a plain per-parameter relative error is meaningless for them."""
    assert set(grads) == set(ref), set(grads) ^ set(ref)
    total = torch.sqrt(sum((r.double() ** 2).sum() for r in ref.values())).item()
    return max((g.double() - ref[k].double()).norm().item() / max(ref[k].double().norm().item(), 1e-6 * total)
               for k, g in grads.items())


def _reference_grads(ref_model: nn.Module, forward, per_row_loss, weight) -> dict:
    """Dense eager float64 gradient of sum_i w_i * loss_i / N."""
    ref_model = ref_model.double().train()
    ref_model.zero_grad(set_to_none=True)
    losses = per_row_loss(forward(ref_model))
    (losses * weight.to(losses.dtype)).sum().div(losses.shape[0]).backward()
    return _grads(ref_model)


def _head_selected(rep) -> bool:
    return any(r["role"] == "head" and r["backward"] == "selected rows" for r in rep)


def _reasons(rep) -> list:
    return sorted({r["reason"] for r in rep if r["reason"] and r["reason"] != "-"})


# ==========================================================================================================
# (a) timm: train.py's train_one_epoch with --torchcompile capskip
# ==========================================================================================================
def per_row_label_smoothing(z, y, s):
    """timm LabelSmoothingCrossEntropy per row: (1 - s) * nll + s * mean(-log p)."""
    logp = z.log_softmax(-1)
    return (1 - s) * -logp.gather(1, y[:, None]).squeeze(1) + s * -logp.mean(-1)


def per_row_soft_target(z, t):
    """timm SoftTargetCrossEntropy per row: sum(-t * log p)."""
    return (-t * z.log_softmax(-1)).sum(-1)


class StepCheck:
    """Records, on the first step whose selection keeps some but not all rows, what the exactness check
    needs: the model before the step (deep copy), the step's (mixed) input and target, the gradients
    before clipping and the rule's weight.  Also every step's StepStats."""

    def __init__(self, compiled):
        self.compiled = compiled
        self.done = None
        self.seen = []
        self._pre = None

    def before_forward(self, model: nn.Module) -> None:
        if self.done is None:
            self._pre = copy.deepcopy(model)

    def after_backward(self, model: nn.Module, input, target) -> None:
        st = capskip_fx.stats(self.compiled)
        self.seen.append(st)
        if self.done is None and 0 < st.kept < st.n:
            self.done = types.SimpleNamespace(ref=self._pre, input=input.clone(), target=target.clone(),
                                              grads=_grads(model), weight=st.weight.clone(), stats=st)


def train_one_epoch(epoch, task, loader, optimizer, args, mixup_fn=None, check=None, num_updates=0):
    """timm train.py's train_one_epoch (no prefetcher, no AMP, no DDP, grad_accum_steps=1), with two
    observation points for the test (``check``)."""
    from timm import utils

    if args.mixup_off_epoch and epoch >= args.mixup_off_epoch and mixup_fn is not None:
        mixup_fn.mixup_enabled = False
    trainable_module = task.get_trainable_module()
    trainable_module.train()
    optimizer.zero_grad()
    losses = []
    for batch_idx, (input, target) in enumerate(loader):
        input, target = input.to(dtype=args.model_dtype), target
        if mixup_fn is not None:
            input, target = mixup_fn(input, target)
        if check is not None:
            check.before_forward(utils.unwrap_model(trainable_module))
        result = task(input, target)  # ClassificationTask: criterion(model(input), target), loss outside the model
        loss = result["loss"]
        loss.backward()
        if check is not None:
            check.after_backward(utils.unwrap_model(trainable_module), input, target)
        if args.clip_grad is not None:
            utils.dispatch_clip_grad(task.get_clip_parameters(exclude_head="agc" in args.clip_mode),
                                     value=args.clip_grad, mode=args.clip_mode)  # torch.nn.utils.clip_grad_norm_
        optimizer.step()
        losses.append(loss.item())
        num_updates += 1
        optimizer.zero_grad()
        task.update_ema(step=num_updates)  # timm.utils.ModelEmaV3
    return num_updates, losses


def validate(model, loader, args):
    """timm train.py's validate: eval mode, inference_mode, top-1."""
    model.eval()
    outs = []
    with torch.inference_mode():
        for input, target in loader:
            outs.append(model(input.to(dtype=args.model_dtype)))
    return torch.cat(outs)


def _timm_setup(monkeypatch, env, *, num_classes, criterion, labels_from_model=False, ema=True, n=20, seed=0):
    """train.py's order: model, task(criterion), optimizer, EMA, task.compile(backend), compile_ema.
    ``num_classes`` differs per test: two modules of one class compiled with backend="capskip" in one
    process share Dynamo's cache entry (see test_bug_two_modules_of_one_class_share_a_backend)."""
    timm = pytest.importorskip("timm")
    from timm.optim import create_optimizer_v2
    from timm.task import ClassificationTask

    _env(monkeypatch, **env)
    torch.manual_seed(seed)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=1,
                              num_classes=num_classes).double()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g, dtype=torch.float64)
    if labels_from_model:  # a data set the model already fits: CAPSkip's candidates are the correct rows
        with torch.no_grad():
            y = model(x).argmax(1)
    else:
        y = torch.randint(0, num_classes, (n,), generator=g)
    ds = torch.utils.data.TensorDataset(x, y)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, drop_last=True,  # static batch
                                         generator=torch.Generator().manual_seed(seed))
    eval_loader = torch.utils.data.DataLoader(ds, batch_size=10)
    task = ClassificationTask(model, criterion=criterion, device=torch.device("cpu"), dtype=torch.float64,
                              verbose=False)
    optimizer = create_optimizer_v2(task.get_trainable_module(), opt="adamw", lr=1e-3, weight_decay=0.05)
    if ema:
        task.setup_ema(decay=0.9)
    task.compile(backend="capskip")  # what --torchcompile capskip does
    if ema:
        task.compile_ema(backend="capskip")
    args = types.SimpleNamespace(clip_grad=1.0, clip_mode="norm", mixup_off_epoch=0, model_dtype=torch.float64)
    return model, task, optimizer, loader, eval_loader, args


def test_timm_train_loop_label_smoothing_forced_rule_is_exact(monkeypatch):
    """train.py defaults (LabelSmoothingCrossEntropy(0.1)), AdamW, grad clipping, ModelEmaV3, validate of the
    compiled model and of the compiled EMA between epochs; rule forced keep=0.5 (label-free)."""
    pytest.importorskip("timm")
    from timm.loss import LabelSmoothingCrossEntropy

    model, task, optimizer, loader, eval_loader, args = _timm_setup(
        monkeypatch, {"CAPSKIP_RULE": "forced", "CAPSKIP_OPTIONS": "keep=0.5,backend=aot_eager"},
        num_classes=10, criterion=LabelSmoothingCrossEntropy(smoothing=0.1))
    compiled = task.get_trainable_module()
    check = StepCheck(compiled)
    updates, losses = train_one_epoch(0, task, loader, optimizer, args, check=check)
    out = validate(task.get_eval_model(), eval_loader, args)
    out_ema = validate(task.get_eval_model(ema=True), eval_loader, args)
    ema_module = task.get_trainable_module(ema=True).module
    with torch.no_grad():
        eager = (model.eval()(eval_loader.dataset.tensors[0]), ema_module.eval()(eval_loader.dataset.tensors[0]))
    updates, more = train_one_epoch(1, task, loader, optimizer, args, check=check, num_updates=updates)

    st = capskip_fx.stats(compiled)
    assert (st.n, st.kept, st.rows, st.fallback) == (8, 4, 4, None), (
        "in the timm loop, forced keep=0.5 should keep 4 of 8 rows, run the backward on those 4 and not fall back; "
        f"(n, kept, rows, fallback) = {(st.n, st.kept, st.rows, st.fallback)}")
    # the first batch is static (timm's loader drops the last): that step runs dense and marks the batch dynamic
    first = check.seen[0] if check.seen else None
    assert first is not None and ((first.n, first.kept) == (8, 4) or (first.fallback, first.note) == (None, STATIC_FIRST)), (
        f"timm's first step should select or be the documented static first step: {first}")
    assert all((s.n, s.kept) == (8, 4) for s in check.seen[1:]), (
        f"every later timm step should keep 4 of 8 rows, (n, kept) per step: {[(s.n, s.kept) for s in check.seen]}")
    assert len(check.seen) == 4, (
        f"two epochs of 20 examples in static batches of 8 are 4 steps, the check saw {len(check.seen)}")
    assert st.step == 3, (
        "the trained module's backend should count only its own 4 steps (last step 3), not the EMA's, "
        f"got step {st.step}")  # this module's own backend: its 4 steps, nobody else's
    assert capskip_fx.stats(model).kept == 4, (
        "stats() of the original (uncompiled) module should reach the compiled one's backend and show 4 kept, "
        f"got kept {capskip_fx.stats(model).kept}")  # the original module works too
    rep = capskip_fx.report(compiled)
    assert _head_selected(rep), rep
    assert "selected rows" in str(rep), f"the report should show a graph whose backward ran on the selected rows: {rep}"
    assert all(torch.isfinite(torch.tensor(losses + more))), (
        f"the timm training loss should stay finite over both epochs: {losses + more}")
    # validate ran the compiled model and the compiled EMA in eval mode: the eager numbers
    assert torch.allclose(out, eager[0], atol=1e-10), (
        "validate() of the compiled model in eval mode should give the eager model's outputs, max abs diff "
        f"{(out - eager[0]).abs().max().item():.2e}")
    assert torch.allclose(out_ema, eager[1], atol=1e-10), (
        "validate() of the compiled EMA in eval mode should give the eager EMA's outputs, max abs diff "
        f"{(out_ema - eager[1]).abs().max().item():.2e}")
    # EMA follows the (selected-row-trained) weights
    assert any(not torch.equal(p, q) for p, q in zip(ema_module.parameters(), model.parameters())), (
        "the EMA (decay 0.9) should lag the selected-row-trained weights, yet every parameter equals the model's")

    d = check.done
    assert d is not None, (
        "no timm step kept some but not all rows, so there is no step to check; (kept, n) per step: "
        f"{[(s.kept, s.n) for s in check.seen]}")
    assert d.weight.tolist() == [1.0] * 4 + [0.0] * 4, (
        f"forced keep=0.5 should keep the first 4 of 8 rows, weight {d.weight.tolist()}")
    ref = _reference_grads(d.ref, lambda m: m(d.input),
                           lambda z: per_row_label_smoothing(z, d.target, 0.1), d.weight)
    assert grad_err(d.grads, ref) < 1e-10, (
        "the timm step's gradients (before clipping) differ from the float64 reference of the weighted "
        f"label-smoothed loss: err {grad_err(d.grads, ref):.2e}")


def test_timm_train_loop_mixup_soft_target_forced_rule_is_exact(monkeypatch):
    """--mixup 0.8 --cutmix 1.0 (DeiT's recipe): Mixup + SoftTargetCrossEntropy, rule forced keep=0.5."""
    pytest.importorskip("timm")
    from timm.data import Mixup
    from timm.loss import SoftTargetCrossEntropy

    model, task, optimizer, loader, _, args = _timm_setup(
        monkeypatch, {"CAPSKIP_RULE": "forced", "CAPSKIP_OPTIONS": "keep=0.5,backend=aot_eager"},
        num_classes=8, criterion=SoftTargetCrossEntropy(), seed=1)
    mixup_fn = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=8)
    compiled = task.get_trainable_module()
    check = StepCheck(compiled)
    updates, _ = train_one_epoch(0, task, loader, optimizer, args, mixup_fn=mixup_fn, check=check)
    train_one_epoch(1, task, loader, optimizer, args, mixup_fn=mixup_fn, check=check, num_updates=updates)

    st = capskip_fx.stats(compiled)
    assert (st.n, st.kept, st.rows, st.fallback, st.step) == (8, 4, 4, None, 3), (
        "under Mixup/CutMix, forced keep=0.5 should keep 4 of 8 rows, run on those 4, not fall back, and the "
        "module's backend should count its own 4 steps (last step 3); (n, kept, rows, fallback, step) = "
        f"{(st.n, st.kept, st.rows, st.fallback, st.step)}")
    assert _head_selected(capskip_fx.report(compiled)), (
        "under Mixup/CutMix the head graph's backward should run on the selected rows: "
        f"{capskip_fx.report(compiled)}")
    d = check.done
    assert d is not None, (
        "no Mixup step kept some but not all rows, so there is no step to check; (kept, n) per step: "
        f"{[(s.kept, s.n) for s in check.seen]}")
    assert d.target.is_floating_point(), (
        f"Mixup should hand the step soft (floating-point) targets, got dtype {d.target.dtype}")
    assert d.target.shape == (8, 8), (
        f"soft targets should be one 8-class distribution per row, got shape {tuple(d.target.shape)}")  # soft targets
    ref = _reference_grads(d.ref, lambda m: m(d.input), lambda z: per_row_soft_target(z, d.target), d.weight)
    assert grad_err(d.grads, ref) < 1e-10, (
        "the Mixup step's gradients differ from the float64 reference of the weighted soft-target loss: "
        f"err {grad_err(d.grads, ref):.2e}")


def test_timm_train_loop_capskip_rule_with_mixup_then_smoothing(monkeypatch):
    """Rule capskip (label-inferring) with soft targets: the string backend has no capskip_targets, so the
    labels come from dL/dz (its most negative entry).  Mixup's soft targets (and, after --mixup-off-epoch,
    its smoothed one-hot targets == label smoothing 0.1) still give softmax-family gradients: no fallback,
    rows are skipped, the bound holds and the step is exact for the rule's weights."""
    pytest.importorskip("timm")
    from timm.data import Mixup
    from timm.loss import SoftTargetCrossEntropy

    model, task, optimizer, loader, _, args = _timm_setup(
        monkeypatch, {"CAPSKIP_RULE": "capskip", "CAPSKIP_BUDGET": "0.5", "CAPSKIP_OPTIONS": "backend=aot_eager"},
        num_classes=6, criterion=SoftTargetCrossEntropy(), labels_from_model=True, ema=False, n=32, seed=2)
    mixup_fn = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=6)
    args.mixup_off_epoch = 1
    compiled = task.get_trainable_module()
    checks = []
    updates = 0
    for epoch in range(2):  # epoch 0: mixup/cutmix; epoch 1: mixup off -> smoothed one-hot targets
        check = StepCheck(compiled)
        updates, _ = train_one_epoch(epoch, task, loader, optimizer, args, mixup_fn=mixup_fn, check=check,
                                     num_updates=updates)
        checks.append(check)
    assert capskip_fx.stats(compiled).step == 7, (
        "two epochs of 4 steps should bring the backend to step 7 (one rule step per training step), "
        f"got {capskip_fx.stats(compiled).step}")
    assert len(checks[0].seen) + len(checks[1].seen) == 8, (
        "the checks should have seen 8 steps over the two epochs, got "
        f"{len(checks[0].seen) + len(checks[1].seen)}")
    assert backend_of(compiled).state.rule.name == "capskip", (
        "CAPSKIP_RULE=capskip should give the backend the capskip rule, got "
        f"{backend_of(compiled).state.rule.name!r}")
    for check in checks:
        assert all(s.fallback is None for s in check.seen), [s.fallback for s in check.seen]
        d = check.done
        assert d is not None, f"no step skipped rows: {[(s.kept, s.n) for s in check.seen]}"
        assert d.stats.bound <= 0.5 + 1e-9, (
            f"CAPSkip's bound ||S_k|| / ||G|| must stay within the budget 0.5, got {d.stats.bound}")
        ref = _reference_grads(d.ref, lambda m: m(d.input), lambda z: per_row_soft_target(z, d.target), d.weight)
        assert grad_err(d.grads, ref) < 1e-10, (
            "CAPSkip's step with soft targets (labels from dL/dz) differs from the float64 reference for its "
            f"weights: err {grad_err(d.grads, ref):.2e}")
    assert checks[0].done.target.max() < 0.95, (
        "epoch 0's checked targets should be Mixup/CutMix soft targets (no class near certain), max "
        f"{checks[0].done.target.max().item():.3f}")
    assert checks[1].done.target.max() == pytest.approx(1 - 0.1 + 0.1 / 6), (
        "after mixup-off-epoch the targets should be one-hot smoothed by 0.1 over 6 classes (max 1 - 0.1 + 0.1/6), "
        f"got max {checks[1].done.target.max().item():.4f}")


# ==========================================================================================================
# (b) Hugging Face Trainer
# ==========================================================================================================
def _bert(num_labels=3):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=num_labels,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # exact reference
    return transformers.BertForSequenceClassification(cfg).double()


def _vit():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(image_size=16, patch_size=8, num_channels=1, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32, num_labels=3)
    return transformers.ViTForImageClassification(cfg).double()


class _Data(torch.utils.data.Dataset):
    """20 examples of dicts, as a tokenizer / image processor would give them (default_data_collator)."""

    def __init__(self, kind: str, n: int = 20, num_labels: int = 3):
        g = torch.Generator().manual_seed(0)
        self.kind = kind
        self.ids = torch.randint(1, 50, (n, 8), generator=g)
        self.px = torch.randn(n, 1, 16, 16, generator=g, dtype=torch.float64)
        self.y = torch.randint(0, num_labels, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if self.kind == "vit":
            return {"pixel_values": self.px[i], "labels": self.y[i]}
        d = {"input_ids": self.ids[i], "labels": self.y[i]}
        if self.kind == "bert_mask":
            # padded like a tokenizer's batch: row i has its last i % 4 tokens masked
            d["attention_mask"] = (torch.arange(8) < 8 - i % 4).long()
        return d


def _args(tmp_path, **kw):
    transformers = pytest.importorskip("transformers")
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", dataloader_drop_last=True,
                per_device_train_batch_size=8, max_steps=3, logging_strategy="no", disable_tqdm=True)
    return transformers.TrainingArguments(**{**base, **kw})


def test_hf_torch_compile_backend_capskip_is_rejected_by_accelerate(monkeypatch, tmp_path):
    """TrainingArguments(torch_compile_backend="capskip") and ACCELERATE_DYNAMO_BACKEND=capskip both go through
    accelerate's DynamoBackend enum (fixed names): rejected when the Trainer builds its Accelerator."""
    transformers = pytest.importorskip("transformers")
    _env(monkeypatch)
    with pytest.raises(ValueError, match="'CAPSKIP' is not a valid DynamoBackend"):
        transformers.Trainer(model=_bert(), args=_args(tmp_path, torch_compile=True, torch_compile_backend="capskip"),
                             train_dataset=_Data("bert"))
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "capskip")
    with pytest.raises(ValueError, match="'CAPSKIP' is not a valid DynamoBackend"):
        transformers.Trainer(model=_bert(), args=_args(tmp_path), train_dataset=_Data("bert"))


def test_hf_compiled_model_needs_remove_unused_columns_false(monkeypatch, tmp_path):
    """The compiled module's forward is (*args, **kwargs): Trainer's column filter (remove_unused_columns=True,
    the default) then keeps only the label columns.  With False the batch reaches the model whole."""
    transformers = pytest.importorskip("transformers")
    _env(monkeypatch)
    compiled = torch.compile(_bert(), backend="capskip")  # nothing is traced here
    batch = next(iter(transformers.Trainer(model=compiled, args=_args(tmp_path),
                                           train_dataset=_Data("bert")).get_train_dataloader()))
    assert "input_ids" not in batch, (
        "with remove_unused_columns=True the Trainer should drop input_ids (the compiled forward takes "
        f"*args, **kwargs), batch keys: {sorted(batch)}")  # every column is dropped (labels too: label_names come from the signature)
    batch = next(iter(transformers.Trainer(model=compiled, args=_args(tmp_path, remove_unused_columns=False),
                                           train_dataset=_Data("bert")).get_train_dataloader()))
    assert set(batch) == {"input_ids", "labels"}, (
        f"with remove_unused_columns=False the batch should reach the compiled model whole, keys: {sorted(batch)}")


def _run_trainer(monkeypatch, tmp_path, kind: str, loss: str):
    """The recipe: Trainer(model=torch.compile(model, backend="capskip"), args=...(remove_unused_columns=False)),
    settings from CAPSKIP_*.  Records the inputs, gradients (before Trainer's clipping) and weight of step 2."""
    transformers = pytest.importorskip("transformers")
    _env(monkeypatch, CAPSKIP_RULE="forced", CAPSKIP_OPTIONS="keep=0.5,backend=aot_eager")
    torch.manual_seed(0)
    model = _vit() if kind == "vit" else _bert()
    compiled = torch.compile(model, backend="capskip")
    snap = {}

    class CheckingTrainer(transformers.Trainer):
        def training_step(self, model_, inputs, num_items_in_batch=None):
            if self.state.global_step == 1:
                snap["inputs"] = {k: v.clone() for k, v in inputs.items()}
                snap["ref"] = copy.deepcopy(model)  # the weights this step's forward uses
            out = super().training_step(model_, inputs, num_items_in_batch)
            if self.state.global_step == 1:
                snap["grads"], snap["stats"] = _grads(model), capskip_fx.stats(model_)
                snap["weight"] = snap["stats"].weight.clone() if snap["stats"].weight is not None else None
            return out

    kw = {}
    if loss == "outside":  # Trainer pops labels and calls this on the model's outputs
        kw["compute_loss_func"] = lambda outputs, labels, num_items_in_batch=None: F.cross_entropy(outputs.logits,
                                                                                                  labels)
    trainer = CheckingTrainer(model=compiled, args=_args(tmp_path, remove_unused_columns=False),
                              train_dataset=_Data(kind), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return model, compiled, trainer, snap


def _assert_hf_step(model, compiled, trainer, snap):
    assert trainer.model is compiled, (
        f"the Trainer should train the compiled module it was given, it holds a {type(trainer.model).__name__}")
    st = capskip_fx.stats(trainer.model)
    rep = capskip_fx.report(trainer.model)
    assert st.n == 8, f"no rows skipped; stats {st}; refusals: {_reasons(rep)}"
    assert st.kept < st.n, f"no rows skipped; stats {st}; refusals: {_reasons(rep)}"
    assert (st.kept, st.rows, st.fallback) == (4, 4, None), (
        "in the Trainer, forced keep=0.5 should keep 4 rows, run the backward on those 4 and not fall back; "
        f"(kept, rows, fallback) = {(st.kept, st.rows, st.fallback)}")
    assert capskip_fx.stats(model).kept == 4, (
        "stats() of the original (uncompiled) model should reach the compiled one's backend and show 4 kept, "
        f"got kept {capskip_fx.stats(model).kept}")
    assert _head_selected(rep), rep
    inputs = dict(snap["inputs"])
    labels = inputs.pop("labels")
    ref = _reference_grads(snap["ref"], lambda m: m(**inputs).logits,
                           lambda z: F.cross_entropy(z, labels, reduction="none"), snap["weight"])
    assert grad_err(snap["grads"], ref) < 1e-10, (
        "the Trainer step's gradients (before clipping) differ from the float64 reference of the weighted "
        f"cross-entropy: err {grad_err(snap['grads'], ref):.2e}")


@pytest.mark.parametrize("kind", ["bert", "vit"])
def test_hf_trainer_in_model_loss(kind, monkeypatch, tmp_path):
    """Trainer's default: labels go into the model, the loss is computed inside (in-graph loss)."""
    _assert_hf_step(*_run_trainer(monkeypatch, tmp_path, kind, "in_model"))


@pytest.mark.parametrize("kind", ["bert", "vit"])
def test_hf_trainer_loss_outside_the_model(kind, monkeypatch, tmp_path):
    """Trainer(compute_loss_func=...): labels are popped, F.cross_entropy on outputs.logits."""
    _assert_hf_step(*_run_trainer(monkeypatch, tmp_path, kind, "outside"))


def test_hf_trainer_bert_with_attention_mask(monkeypatch, tmp_path):
    """What a tokenizer hands the Trainer: input_ids + attention_mask (loss outside the model)."""
    _assert_hf_step(*_run_trainer(monkeypatch, tmp_path, "bert_mask", "outside"))


# ==========================================================================================================
# (c) PyTorch Lightning
# ==========================================================================================================
class _LitNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(F.gelu(self.body(x)))


def test_lightning_training_step_calls_a_compiled_inner_model(monkeypatch):
    L = pytest.importorskip("lightning")
    _env(monkeypatch, CAPSKIP_RULE="forced", CAPSKIP_OPTIONS="keep=0.5,backend=aot_eager")
    snap = {}

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = _LitNet().double()
            self.inner = torch.compile(self.net, backend="capskip")

        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx == 1:
                snap.update(ref=copy.deepcopy(self.net), x=x.clone(), y=y.clone())
            return F.cross_entropy(self.inner(x), y)

        def on_after_backward(self):  # before Lightning's gradient clipping and the optimizer step
            if "ref" in snap and "grads" not in snap:
                snap.update(grads=_grads(self.net), weight=capskip_fx.stats(self.inner).weight.clone())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(20, 6, dtype=torch.float64, generator=g),
                                        torch.randint(0, 3, (20,), generator=g))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, drop_last=True)
    lit = Lit()
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(lit, loader)
    assert trainer.global_step == 3, (
        f"Lightning should run max_steps=3 optimizer steps, global_step is {trainer.global_step}")
    for m in (lit.inner, lit.net, lit):  # the compiled module, the original, the LightningModule holding it
        st = capskip_fx.stats(m)
        assert (st.n, st.kept, st.rows, st.fallback) == (8, 4, 4, None), (
            f"stats() of {type(m).__name__} should show 4 of 8 rows kept, the backward run on those 4 and no "
            f"fallback; (n, kept, rows, fallback) = {(st.n, st.kept, st.rows, st.fallback)}")
    assert _head_selected(capskip_fx.report(lit.inner)), (
        "the inner compiled model's head graph should run its backward on the selected rows: "
        f"{capskip_fx.report(lit.inner)}")
    assert (sorted(dict(lit.named_parameters())) == ["net.body.bias", "net.body.weight", "net.head.bias",
                                                    "net.head.weight"]), (
        "the LightningModule should hold each weight once (the compiled wrapper adds no parameters), got "
        f"{sorted(dict(lit.named_parameters()))}")
    ref = _reference_grads(snap["ref"], lambda m: m(snap["x"]), lambda z: F.cross_entropy(z, snap["y"],
                                                                                          reduction="none"),
                           snap["weight"])
    assert grad_err(snap["grads"], ref) < 1e-10, (
        "the Lightning step's gradients (before clipping) differ from the float64 reference of the weighted "
        f"cross-entropy: err {grad_err(snap['grads'], ref):.2e}")


# ==========================================================================================================
# library bugs found while writing the clients (fail until fixed)
# ==========================================================================================================
class _Twin(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.body(x).relu())


def test_two_modules_of_one_class_get_their_own_backend(monkeypatch):
    """A second module of the same class compiled with backend="capskip" in one process (a re-created model in
    a notebook, an EMA/teacher copy, consecutive runs) gets its own graphs, backend, settings and stats.
    Dynamo would otherwise serve it from the first module's cache entry (same code, equal backend wrappers,
    parameters as inputs): the first's rule and settings, its steps in the first's stats."""
    _env(monkeypatch, CAPSKIP_RULE="forced", CAPSKIP_OPTIONS="keep=0.5,backend=aot_eager")
    x = torch.randn(8, 6, dtype=torch.float64)
    torch._dynamo.maybe_mark_dynamic(x, 0)  # each module's first step selects (no static first batch)
    y = torch.randint(0, 3, (8,))
    torch.manual_seed(0)
    a = torch.compile(_Twin().double(), backend="capskip")
    F.cross_entropy(a(x), y).backward()
    assert capskip_fx.stats(a).kept == 4, (
        f"a, compiled with keep=0.5, should keep 4 of 8 rows, kept {capskip_fx.stats(a).kept}")
    monkeypatch.setenv("CAPSKIP_OPTIONS", "keep=0.25,backend=aot_eager")
    b = torch.compile(_Twin().double(), backend="capskip")
    F.cross_entropy(b(x), y).backward()
    assert backend_of(b) is not None, "b was served from a's cache entry"
    assert backend_of(b) is not backend_of(a), "b was served from a's cache entry"
    assert capskip_fx.stats(a).step == 0, "b's step was counted in a's stats"
    assert (capskip_fx.stats(b).step, capskip_fx.stats(b).kept) == (0, 2), (
        "b, compiled with keep=0.25, should have its own first step (step 0) keeping 2 of 8 rows; (step, kept) = "
        f"{(capskip_fx.stats(b).step, capskip_fx.stats(b).kept)}")
    # same settings as a: still its own state; and a keeps its own after the others compiled
    monkeypatch.setenv("CAPSKIP_OPTIONS", "keep=0.5,backend=aot_eager")
    c = torch.compile(_Twin().double(), backend="capskip")
    F.cross_entropy(c(x), y).backward()
    assert backend_of(c) is not backend_of(a), (
        "c, compiled with a's settings, should still get its own backend, not a's")
    assert capskip_fx.stats(c).step == 0, (
        f"c's first backward should be its own step 0, got step {capskip_fx.stats(c).step}")
    F.cross_entropy(a(x), y).backward()
    assert (capskip_fx.stats(a).step, capskip_fx.stats(a).kept) == (1, 4), (
        "a's second backward should be its step 1 with its own keep=0.5 (4 rows) after b and c compiled; "
        f"(step, kept) = {(capskip_fx.stats(a).step, capskip_fx.stats(a).kept)}")
    assert capskip_fx.stats(b).step == 0, (
        f"a's step should not be counted in b's stats, b is at step {capskip_fx.stats(b).step}")
    assert capskip_fx.stats(c).step == 0, (
        f"a's step should not be counted in c's stats, c is at step {capskip_fx.stats(c).step}")


class _RowMix(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.body(x).relu()
        return self.head(h - h.mean(0))  # mixes rows: refused, dense


def test_string_backend_stats_of_a_refused_graph(monkeypatch):
    """A refused graph's step runs dense with one warning and the reason in stats().fallback and report(),
    with the string backend as with capskip_fx.compile (the refused graph's backward records the step)."""
    _env(monkeypatch, CAPSKIP_RULE="forced", CAPSKIP_OPTIONS="keep=0.5,backend=aot_eager")
    torch.manual_seed(0)
    m = torch.compile(_RowMix().double(), backend="capskip")
    x = torch.randn(8, 6, dtype=torch.float64)
    torch._dynamo.maybe_mark_dynamic(x, 0)  # traced dynamic from the first step (no static first batch)
    with pytest.warns(UserWarning, match="cross-example op"):
        F.cross_entropy(m(x), torch.randint(0, 3, (8,))).backward()
    assert "cross-example op" in capskip_fx.report(m)[0]["reason"], (
        "the report should give the refused graph's reason (a cross-example op), got "
        f"{capskip_fx.report(m)[0]['reason']!r}")
    st = capskip_fx.stats(m)
    assert (st.n, st.kept) == (8, 8), st
    assert st.fallback, st
    assert "cross-example op" in st.fallback, st
    F.cross_entropy(m(x[:6]), torch.randint(0, 3, (6,))).backward()
    assert (capskip_fx.stats(m).step, capskip_fx.stats(m).n) == (1, 6), (
        "the refused graph's second backward (6 rows) should be recorded as step 1 with n=6; (step, n) = "
        f"{(capskip_fx.stats(m).step, capskip_fx.stats(m).n)}")


def test_lightning_in_place_compile_with_the_callback(monkeypatch, tmp_path):
    """The recipe: ``self.net.compile(backend="capskip")``, the run summary logged by CapskipCallback, each
    weight once in the checkpoint, and the rule's state resumable with capskip_fx.state_dict."""
    L = pytest.importorskip("lightning")
    from capskip_fx.integrations.lightning import CapskipCallback

    _env(monkeypatch, CAPSKIP_RULE="random", CAPSKIP_OPTIONS="keep=0.5,backend=aot_eager")
    logged = []

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = _LitNet().double()
            self.net.compile(backend="capskip")

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def log_dict(self, fields, *args, **kwargs):
            logged.append(dict(fields))
            super().log_dict(fields, *args, **kwargs)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(24, 6, dtype=torch.float64, generator=g),
                                        torch.randint(0, 3, (24,), generator=g))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, drop_last=True)
    lit = Lit()
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=L.pytorch.loggers.CSVLogger(tmp_path),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[CapskipCallback()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(lit, loader)
    st = capskip_fx.stats(lit)
    assert (st.mode, st.n, st.kept, st.rows) == ("selected", 8, 4, 4), st
    assert logged, logged[-1:]
    assert logged[-1]["capskip/kept_pct"] == 50.0, logged[-1:]
    assert logged[-1]["capskip/steps_selected"] == 3, logged[-1:]
    from capskip_fx.runtime.stats import RunSummary

    assert all(set(f) == set(RunSummary.LOG_KEYS) for f in logged), logged  # the HF callback's key set, always
    ckpt = tmp_path / "lit.ckpt"
    trainer.save_checkpoint(ckpt)
    keys = sorted(torch.load(ckpt, weights_only=False)["state_dict"])
    assert keys == ["net.body.bias", "net.body.weight", "net.head.bias", "net.head.weight"], keys
    assert capskip_fx.state_dict(lit)["step"] == 3, (
        "capskip_fx.state_dict should carry the run's step count (3 steps) so the rule resumes, got "
        f"{capskip_fx.state_dict(lit)['step']}")
    # Trainer(logger=False): nothing to log to, so the callback logs nothing (Lightning would warn at each call)
    before = len(logged)
    quiet = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[CapskipCallback()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.fit(lit, loader)
    assert len(logged) == before, f"with logger=False the callback should log nothing, it logged {logged[before:]}"
    assert not [w for w in caught if "logger" in str(w.message) and "self.log" in str(w.message)], (
        [str(w.message) for w in caught])

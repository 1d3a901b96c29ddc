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
from capskip_fx.records import BackwardMode

transformers = pytest.importorskip("transformers")
# conftest: every test compiles its own model, and HF models share their forward wrapper's code
pytestmark = [pytest.mark.usefixtures("many_compiles"), pytest.mark.heavy]


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


def _gpt2():
    return _decoder("gpt2"), lambda g: {"input_ids": torch.randint(0, 50, (8,), generator=g)}


@pytest.mark.parametrize("make", [_bert, _vit, _gpt2], ids=["bert", "vit", "gpt2"])
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
    assert st.n == 8, f"Trainer's batch should reach the graph whole (8 rows), stats saw {st.n}"
    assert st.kept == 4, f"keep=0.5 of 8 rows should keep 4, kept {st.kept}"
    assert st.rows == 4, f"the backward should run on the 4 kept rows only, ran on {st.rows}"
    rep = capskip_fx.report(opt)
    assert any(r["role"] == "head" and r["backward"] == "selected rows" for r in rep), (
        f"the in-model loss's head graph should run its backward on selected rows; report: {rep}")
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
    assert err < 1e-4, f"the Trainer model's gradients should match the eager kept-row reference, rel. error {err:.2e}"


def _in_place_trainer(monkeypatch, tmp_path, max_steps):
    """A tiny BERT compiled in place (rule forced, keep 0.5, aot_eager) in a Trainer with the callback added."""
    from capskip_fx.integrations.hf import add_callback

    monkeypatch.setenv("CAPSKIP_RULE", "forced")
    monkeypatch.setenv("CAPSKIP_OPTIONS", "keep=0.5,backend=aot_eager")
    torch.manual_seed(0)
    model, sample = _bert()
    model.compile(backend="capskip")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=max_steps,
                                          logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                                          dataloader_drop_last=True, disable_tqdm=True,
                                          per_device_eval_batch_size=8)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data(sample), eval_dataset=_Data(sample))
    add_callback(trainer)
    return model, trainer


def test_trainer_with_the_model_compiled_in_place(monkeypatch, tmp_path):
    """The README recipe: ``model.compile(backend="capskip")`` keeps the model's class and signature, so
    Trainer finds ``labels`` (eval_loss without label_names), saves clean keys, and the callback logs the
    run summary."""
    model, trainer = _in_place_trainer(monkeypatch, tmp_path, max_steps=3)
    trainer.train()
    st = capskip_fx.stats(model)
    assert st.mode == "selected", f"the model compiled in place should run selected rows, not {st.mode}: {st}"
    assert st.n == 8, f"Trainer's batch should reach the graph whole (8 rows): {st}"
    assert st.kept == 4, f"keep=0.5 of 8 rows should keep 4: {st}"
    assert st.rows == 4, f"the backward should run on the 4 kept rows only: {st}"
    logged = [h for h in trainer.state.log_history if "capskip/kept_pct" in h]
    assert logged, f"no capskip fields in the logs: {trainer.state.log_history}"
    assert logged[-1]["capskip/kept_pct"] == 50.0, f"the callback should log keep=0.5 as 50%: {logged[-1]}"
    assert logged[-1]["capskip/steps_selected"] == 3, f"the callback should count the 3 training steps: {logged[-1]}"
    assert "eval_loss" in trainer.evaluate(), "no eval_loss: Trainer did not find the labels (model signature lost)"
    trainer.save_model(str(tmp_path / "saved"))
    fresh = type(model).from_pretrained(str(tmp_path / "saved"))
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), f"{k} did not reload as saved"


def test_callback_logs_a_fixed_key_set_on_training_logs_only(monkeypatch, tmp_path):
    """Training logs carry exactly the fixed capskip/* keys (every mode, also one that never ran); the
    metrics dict evaluate() returns carries none."""
    from capskip_fx.runtime.stats import RunSummary

    model, trainer = _in_place_trainer(monkeypatch, tmp_path, max_steps=2)
    trainer.train()
    metrics = trainer.evaluate()
    assert not [k for k in metrics if k.startswith("capskip/")], f"evaluate() must return no capskip fields: {metrics}"
    keys = {k for h in trainer.state.log_history for k in h if k.startswith("capskip/")}
    assert keys == set(RunSummary.LOG_KEYS), keys
    assert RunSummary.LOG_KEYS == ("capskip/kept_pct", "capskip/rows_pct", "capskip/steps_selected",
                                   "capskip/steps_dense_masked", "capskip/steps_dense", "capskip/fallbacks")
    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert train_logs and all(set(RunSummary.LOG_KEYS) <= set(h) for h in train_logs), trainer.state.log_history
    assert train_logs[-1]["capskip/steps_dense"] == 0 and train_logs[-1]["capskip/fallbacks"] == 0, train_logs[-1]
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert evals and not any(k.startswith("capskip/") for h in evals for k in h), evals


def test_add_callback_warns_on_a_torch_compile_wrapper(monkeypatch, tmp_path):
    """A wrapper's saved keys reload as random weights: add_callback (and the callback passed to Trainer)
    says so at construction, naming the in-place compile."""
    from capskip_fx.integrations.hf import CapskipCallback, add_callback

    monkeypatch.setenv("CAPSKIP_OPTIONS", "backend=aot_eager")
    model, sample = _bert()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                          remove_unused_columns=False)
    trainer = transformers.Trainer(model=torch.compile(model, backend="capskip"), args=args,
                                   train_dataset=_Data(sample))
    with pytest.warns(UserWarning, match=r"model\.compile\(backend=\"capskip\"\)"):
        add_callback(trainer)
    with pytest.warns(UserWarning, match="random weights"):
        transformers.Trainer(model=torch.compile(model, backend="capskip"), args=args, train_dataset=_Data(sample),
                             callbacks=[CapskipCallback()])
    model.compile(backend="capskip")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        add_callback(transformers.Trainer(model=model, args=args, train_dataset=_Data(sample)))


def test_add_callback_keeps_gpt2s_loss_in_one_graph(monkeypatch, tmp_path):
    """GPT2LMHeadModel looks its unrecognised loss_type up through a logged warning (a graph break before
    the loss, which capskip warns about as a graph with no head). add_callback sets the loss transformers
    falls back to anyway: one graph, selected rows, no capskip warning."""
    import warnings

    from capskip_fx.integrations.hf import add_callback

    monkeypatch.setenv("CAPSKIP_RULE", "forced")
    monkeypatch.setenv("CAPSKIP_OPTIONS", "keep=0.5,backend=aot_eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16,
                                                                 n_layer=1, n_head=2))
    assert model.loss_type is None, "GPT-2's loss_type is no longer unset: this test checks nothing"
    model.compile(backend="capskip")
    data = [{"input_ids": torch.randint(0, 50, (8,)), "labels": torch.randint(0, 50, (8,))} for _ in range(16)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=2,
                                          report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    add_callback(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    ours = [str(w.message) for w in caught if str(w.message).startswith("capskip_fx")]
    assert not ours, ours
    # graphs that compiled (after other GPT-2 tests in the process, Dynamo may hand over a first trace it then
    # discards for a retrace: its record never compiles and never runs)
    rep = [r for r in capskip_fx.report(model) if r["backward"] != BackwardMode.NOT_COMPILED]
    assert [(r["role"], r["steps"]) for r in rep] == [("head", {"selected": 2})], str(rep)
    assert model.loss_type == "ForCausalLM"


# ------------------------------------------------------------------------------------------
# decoder classifiers: the logits are logits[arange(N), last_non_pad_token], a per-row gather


def _decoder(kind: str):
    common = dict(vocab_size=50, num_labels=3, pad_token_id=0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=1, eos_token_id=1, **common)
        return transformers.GPT2ForSequenceClassification(cfg)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification)}[kind]
    cfg = cls[0](hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 max_position_embeddings=16, bos_token_id=1, eos_token_id=1, **common)
    return cls[1](cfg)


def _padded_batch(n: int, t: int, side: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (n, t), generator=g)
    lens = torch.randint(2, t + 1, (n,), generator=g)
    lens[0] = t  # one full row: the last token is the sequence's last
    mask = torch.arange(t)[None] < lens[:, None]
    if side == "left":
        mask = mask.flip(1)
    return ids.masked_fill(~mask, 0), mask.long()


def _grads(model) -> dict:
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _rel_err(grads: dict, refs: dict) -> float:
    total = torch.sqrt(sum(r.pow(2).sum() for r in refs.values())).item()
    return max((grads[k].double() - r).norm().item() / max(r.norm().item(), 1e-6 * total) for k, r in refs.items())


def _assert_reference_grads(model, ref, what: str) -> None:
    """``model``'s gradients equal the float64 reference's (``ref`` back-propagated with the step's weights)."""
    grads = _grads(model)
    refs = {k: p.grad for k, p in ref.named_parameters() if k in grads}
    assert refs.keys() == grads.keys(), (
        f"{what}: the compiled model should give gradients to the reference's parameters, differs in "
        f"{refs.keys() ^ grads.keys()}")
    err = _rel_err(grads, refs)
    assert err < 1e-4, f"{what} gradients differ from the weighted reference: rel. error {err:.2e}"


@pytest.mark.parametrize("kind,side", [(k, s) for k in ("gpt2", "llama", "qwen2") for s in ("right", "left")])
def test_decoder_classifier_selects_rows_exactly(kind, side):
    torch.manual_seed(0)
    model = _decoder(kind)
    ref = copy.deepcopy(model).double()
    ids, mask = _padded_batch(8, 6, side)
    y = torch.arange(8) % 3
    cm = capskip_fx.compile(model, rule="random", keep=0.5, backend="aot_eager")
    F.cross_entropy(cm(input_ids=ids, attention_mask=mask).logits, y).backward()
    st = capskip_fx.stats(cm)
    assert st.mode == "selected", f"a {kind} classifier ({side} padding) should run selected rows: {st}"
    assert st.n == 8, f"the batch should reach the graph whole (8 rows): {st}"
    assert st.kept == 4, f"keep=0.5 of 8 rows should keep 4: {st}"
    rep = capskip_fx.report(cm)
    assert any(r["role"] == "head" and r["backward"] == "selected rows" for r in rep), (
        f"the last-token gather should leave a head graph with a selected backward; report: {rep}")
    (F.cross_entropy(ref(input_ids=ids, attention_mask=mask).logits, y, reduction="none") * st.weight.double()).mean().backward()
    _assert_reference_grads(model, ref, f"{kind} ({side})")


@pytest.mark.parametrize("side", ["right", "left"])
def test_decoder_classifier_capskip_bound_from_per_example_gradients(side):
    """CAPSkip with the loss inside the model (labels=): the bound it reports is ||S_k|| / ||G|| of the
    head's per-example gradients (score.weight), computed here one example at a time."""
    torch.manual_seed(0)
    model = _decoder("gpt2")
    ref = copy.deepcopy(model).double()
    ids, mask = _padded_batch(8, 6, side, seed=1)
    with torch.no_grad():
        y = ref(input_ids=ids, attention_mask=mask).logits.argmax(1)  # every row correct: CAPSkip may skip any
    cm = capskip_fx.compile(model, rule="capskip", budget=0.5, backend="aot_eager")
    cm(input_ids=ids, attention_mask=mask, labels=y).loss.backward()
    st = capskip_fx.stats(cm)
    assert st.mode == "selected", f"CAPSkip with labels= should run selected rows: {st}"
    assert 0 < st.kept < 8, f"with every row correct and budget 0.5, CAPSkip should skip some rows and keep some: {st}"
    per = []
    for i in range(8):
        ref.zero_grad()
        out = ref(input_ids=ids[i:i + 1], attention_mask=mask[i:i + 1]).logits
        (F.cross_entropy(out, y[i:i + 1]) / 8).backward()
        per.append(ref.score.weight.grad.flatten().clone())
    per = torch.stack(per)
    skipped = st.weight.double() == 0
    bound = per[skipped].sum(0).norm() / per.sum(0).norm()
    assert abs(float(st.bound) - bound.item()) < 1e-4, (
        f"the reported bound {float(st.bound):.6f} should be ||S_k||/||G|| of the per-example gradients, {bound.item():.6f}")
    assert float(st.bound) <= 0.5, f"the skipped rows' bound {float(st.bound)} exceeds the budget 0.5"
    # and no longer prefix of the increasing-norm order fits the budget
    order = [i for i in per.norm(dim=1).argsort().tolist()]
    k = int(skipped.sum())
    assert set(order[:k]) == set(torch.nonzero(skipped).flatten().tolist()), (
        f"CAPSkip should skip the {k} rows of smallest gradient norm {sorted(order[:k])}, "
        f"skipped {torch.nonzero(skipped).flatten().tolist()}")
    for kk in range(k + 1, 9):
        assert per[order[:kk]].sum(0).norm() > 0.5 * per.sum(0).norm(), (
            f"skipping {kk} rows would also fit the budget: CAPSkip should have skipped the longest prefix, not {k}")


def _distilbert():
    cfg = transformers.DistilBertConfig(vocab_size=50, dim=16, n_layers=1, n_heads=2, hidden_dim=32,
                                        max_position_embeddings=16, num_labels=3, dropout=0.0, attention_dropout=0.0,
                                        seq_classif_dropout=0.0)
    return transformers.DistilBertForSequenceClassification(cfg)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_distilbert_with_labels_selects_rows(backend):
    torch.manual_seed(0)
    model = _distilbert()
    ref = copy.deepcopy(model).double()
    ids, mask = _padded_batch(8, 6, "right")
    y = torch.arange(8) % 3
    cm = torch.compile(model, backend="capskip", options={"rule": "random", "keep": 0.5, "backend": backend})
    capskip_fx.api.mark_compiled_batches(cm)  # as the Trainer callback does: step 0 traces a dynamic batch
    cm(input_ids=ids, attention_mask=mask, labels=y).loss.backward()
    st = capskip_fx.stats(cm)
    assert st.mode == "selected", f"DistilBERT with labels= ({backend}) should run selected rows: {st}"
    assert st.n == 8, f"the batch should reach the graph whole (8 rows): {st}"
    assert st.kept == 4, f"keep=0.5 of 8 rows should keep 4: {st}"
    (F.cross_entropy(ref(input_ids=ids, attention_mask=mask).logits, y, reduction="none") * st.weight.double()).mean().backward()
    _assert_reference_grads(model, ref, f"DistilBERT ({backend})")


# ------------------------------------------------------------------------------------------
# token-shaped logits (N, T, C): causal LMs with labels= (shifted, -100 ignored) and token classification
# select sequences (tests/test_seq_heads.py has the rules' side)


def _causal_lm(kind: str):
    if kind == "gpt2":  # tied embeddings: lm_head.weight is wte.weight
        cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1, pad_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[kind]
    cfg = cls[0](vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=16, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    return cls[1](cfg)


def _weighted_token_loss(logits, labels, w, shift: bool):
    """Hugging Face's token loss (mean over the batch's counted tokens) with sequence i's tokens weighted w_i."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    per = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                          reduction="none").view(labels.shape)
    return (per * w[:, None]).sum() / (labels != -100).sum()


@pytest.mark.parametrize("kind,rule,backend", [("gpt2", "random", "aot_eager"), ("llama", "random", "aot_eager"),
                                               ("qwen2", "random", "aot_eager"), ("llama", "capskip", "aot_eager"),
                                               ("llama", "capskip+derived", "aot_eager"), ("llama", "random", "inductor")])
def test_causal_lm_with_labels_selects_sequences_exactly(kind, rule, backend):
    """labels= with padding: the loss inside the model, in one graph (GPT-2 too: capskip_fx.compile sets the
    loss_type its lookup would otherwise break the graph for); the backward runs the kept sequences, exactly.
    Inductor's decomposed cross-entropy saves a one-hot scatter of the labels for the loss's backward."""
    torch._dynamo.reset()  # a model's forward code is shared: other tests' sequence lengths would make T dynamic
    torch.manual_seed(0)
    model = _causal_lm(kind)
    ref = copy.deepcopy(model).double()
    ids, mask = _padded_batch(8, 6, "right")
    labels = ids.masked_fill(mask == 0, -100)
    opts = {"keep": 0.5} if rule == "random" else {"budget": 0.6}
    derived = rule.endswith("+derived")
    if derived:
        opts["loss_grad"] = "derived"
    cm = capskip_fx.compile(model, rule=rule.split("+")[0], backend=backend, **opts)
    cm(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    st = capskip_fx.stats(cm)
    assert st.mode == "selected", f"{kind}: the step should select sequences: {st}"
    assert 0 < st.kept < 8, f"{kind}: the rule should keep some but not all of 8 sequences: {st}"
    assert st.rows < 8, f"{kind}: the backward should run on fewer than 8 sequences: {st}"
    heads = [r for r in capskip_fx.report(cm) if r["role"] == "head"]
    assert heads, f"{kind}: no head graph in {capskip_fx.report(cm)}"
    assert heads[0]["backward"] == "selected rows", f"{kind}: the head graph's backward: {heads[0]}"
    head = next(r for r in cm.backend.records if r.head)
    assert head.in_graph_loss, f"{kind}: in-graph loss {head.in_graph_loss}"
    assert head.verified, "the gathered backward was not checked against the dense-masked one"
    # random reads no dL/dz, and with loss_grad="derived" capskip reads the dL/dz derived from Hugging Face's
    # cross-entropy (passes/loss_grad.py): the loss's backward runs on the kept sequences only; by default
    # capskip reads the dL/dz of that backward run on every sequence
    kept_rows = rule != "capskip"
    assert (head.prefix_rows, head.loss_rows) == ((1, st.rows) if kept_rows else (0, 8)), (
        f"{kind} ({rule}): the in-graph loss's backward ran on the kept rows {head.prefix_rows} times, last on "
        f"{head.loss_rows} rows; {capskip_fx.report(cm)[0]['loss_backward']}")
    assert head.derived_grads == derived, f"{kind} ({rule}): dL/dz derived {head.derived_grads} times"
    _weighted_token_loss(ref(input_ids=ids, attention_mask=mask).logits, labels, st.weight.double(), True).backward()
    _assert_reference_grads(model, ref, f"{kind} ({rule}, {backend})")


def test_token_classification_with_labels_selects_sequences_exactly():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=5,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    model = transformers.BertForTokenClassification(cfg)
    ref = copy.deepcopy(model).double()
    ids, mask = _padded_batch(8, 6, "right")
    labels = (ids % 5).masked_fill(mask == 0, -100)
    cm = capskip_fx.compile(model, rule="random", keep=0.5, backend="aot_eager")
    cm(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    st = capskip_fx.stats(cm)
    assert st.mode == "selected", f"token classification should select sequences: {st}"
    assert (st.kept, st.rows) == (4, 4), f"keep=0.5 of 8 sequences should keep and run 4: {st}"
    _weighted_token_loss(ref(input_ids=ids, attention_mask=mask).logits, labels, st.weight.double(), False).backward()
    _assert_reference_grads(model, ref, "token classification")


# ------------------------------------------------------------------------------------------
# GPT2LMHeadModel without add_callback: its loss lookup breaks the graph before the loss

def _gpt2_lm():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1,
                                                                n_head=2, bos_token_id=1, eos_token_id=1,
                                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _lm_steps(model, steps=3):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = []
        for s in range(steps):
            x = torch.randint(0, 50, (8, 12), generator=torch.Generator().manual_seed(s))
            model(input_ids=x, labels=x).loss.backward()
            out.append(capskip_fx.stats(model))
    return out, [str(w.message) for w in caught if str(w.message).startswith("capskip_fx")]


def test_plain_gpt2_compiled_in_place_warns_with_the_fix_and_selects_rows():
    """model.compile(backend="capskip") alone: the loss lands in a graph of its own. The one warning says
    rows are still selected and names the fix, not "no classifier head ... dense backward"."""
    from capskip_fx.records import RefusalKind

    torch._dynamo.reset()  # GPT-2's forward code is shared: sequence lengths seen before would make T dynamic
    model = _gpt2_lm()
    assert model.loss_type is None, "GPT-2's loss_type is no longer unset: this test checks nothing"
    model.compile(backend="capskip", options={"rule": "forced", "keep": 0.5, "backend": "aot_eager"})
    stats, ours = _lm_steps(model)
    assert len(ours) == 1, ours
    assert 'model.loss_type = "ForCausalLM"' in ours[0] and "Rows are still selected" in ours[0], ours
    assert "no classifier head" not in ours[0], ours
    assert stats[0].fallback is None or stats[0].fallback.kind is not RefusalKind.NO_HEAD, (
        f"step 0's reason must be the cause, not the loss graph's missing head: {stats[0]!r}")
    assert [(s.mode, s.kept, s.rows) for s in stats[1:]] == [("selected", 4, 4)] * 2, stats
    assert model.loss_type is None, "the string backend leaves the model's attributes alone"


def test_capskip_compile_keeps_gpt2s_loss_in_one_graph():
    """capskip_fx.compile sets the loss transformers falls back to anyway: one graph, no warning, the same loss."""
    torch._dynamo.reset()  # as above
    model = _gpt2_lm()
    ref = copy.deepcopy(model)
    cm = capskip_fx.compile(model, rule="forced", keep=0.5, backend="aot_eager")
    assert model.loss_type == "ForCausalLM"
    x = torch.randint(0, 50, (8, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(cm(input_ids=x, labels=x).loss, ref(input_ids=x, labels=x).loss)
    stats, ours = _lm_steps(cm)
    assert not ours, ours
    assert [(s.mode, s.kept, s.rows) for s in stats] == [("selected", 4, 4)] * 3, stats
    assert [(r["role"], r["steps"]) for r in capskip_fx.report(cm)] == [("head", {"selected": 3})], capskip_fx.report(cm)

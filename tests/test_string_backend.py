"""``torch.compile(model, backend="capskip")`` as users turn it on with one flag (timm's
``--torchcompile capskip``, HF's ``torch_compile_backend="capskip"``): the entry point in a fresh
process, settings from CAPSKIP_* variables, a static (drop_last) batch, one state per module."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import capskip_fx
from capskip_fx import compat
from capskip_fx.config import options_from_env

from conftest import max_rel_err
from helpers.models import GraphBreak
from helpers.torch_features import needs_batch_marking

FRESH = textwrap.dedent("""
    import copy, json, sys, torch, torch.nn as nn, torch.nn.functional as F
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3)).double()
    ref = copy.deepcopy(model)
    opt = torch.compile(model, backend="capskip")  # no capskip_fx import: the entry point
    assert "capskip_fx" in sys.modules
    modes = []
    for step in range(3):  # static batch of 8, nothing marked dynamic (a drop_last loader)
        x = torch.randn(8, 6, dtype=torch.float64); y = torch.randint(0, 3, (8,))
        model.zero_grad(); F.cross_entropy(opt(x), y).backward()
        import capskip_fx
        modes.append(capskip_fx.stats(opt).mode)
    st = capskip_fx.stats(opt)
    w = st.weight if st.weight is not None else torch.ones(8, dtype=torch.float64)  # a dense step: all rows
    ref.zero_grad(); (F.cross_entropy(ref(x), y, reduction="none") * w).mean().backward()
    err = max(((p.grad - q.grad).norm() / q.grad.norm()).item() for p, q in zip(model.parameters(), ref.parameters()))
    print(json.dumps({"n": st.n, "kept": st.kept, "rows": st.rows, "err": err, "modes": modes,
                      "dynamic_sources": torch.compiler.config.dynamic_sources,
                      "backward": capskip_fx.report(opt)[-1]["backward"]}))
""")


def _fresh(env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPSKIP_")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", FRESH], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.subprocess
def test_entry_point_in_a_fresh_process_static_batch_env_settings():
    out = _fresh({"CAPSKIP_RULE": "forced", "CAPSKIP_OPTIONS": "keep=0.5,backend=aot_eager"})
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["dynamic_sources"] == "", f"capskip must leave Dynamo's process-wide settings alone; got {res!r}"
    assert res["err"] < 1e-10, f"the fresh process's gradients differ from the kept-row reference: rel. error {res['err']!r}"
    if compat.weak_marks_recompile():
        assert res["modes"] == ["dense", "selected", "selected"], (
            f"a static batch should run step 0 dense, then recompile with the batch marked dynamic on the model's "
            f"inputs and select from step 1; modes {res['modes']!r}")
        assert res == {**res, "n": 8, "kept": 4, "rows": 4, "backward": "selected rows"}, (
            f"the entry point should select 4 of 8 rows from the env settings; got {res!r}")
        assert "Warning" not in out.stderr and "mark_dynamic" not in out.stderr, (
            f"the static first batch is handled (summary only), not warned about; stderr: {out.stderr!r}")
    else:  # torch 2.11: a mark does not recompile, so a static batch runs the documented dense fallback
        assert res["modes"] == ["dense"] * 3, f"a static batch on this torch should run dense; modes {res['modes']!r}"
        assert "the batch dim of the logits is static (8)" in out.stderr, (
            f"the fallback warning should say the logits' batch dim is static (8); stderr: {out.stderr!r}")
        assert "mark_dynamic(x, 0)" in out.stderr, (
            f"the fallback warning should name the fix, mark_dynamic(x, 0); stderr: {out.stderr!r}")


def test_other_models_trace_as_without_capskip():
    """Creating (and running) a capskip-compiled model changes nothing for a model compiled beside it with
    another backend: its first batch is traced static, as it would be in a process without capskip."""
    seen = []

    def counting(gm, example_inputs):
        seen.append([type(t.shape[0]).__name__ for t in example_inputs if isinstance(t, torch.Tensor) and t.dim()])
        return gm.forward

    torch._dynamo.reset()
    student = torch.nn.Linear(6, 3)
    opt = torch.compile(student, backend="capskip", options={"rule": "forced", "keep": 0.5, "backend": "aot_eager"})
    F.cross_entropy(opt(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
    teacher = torch.compile(torch.nn.Linear(6, 3), backend=counting)
    with torch.no_grad():
        teacher(torch.randn(8, 6))
    assert torch.compiler.config.dynamic_sources == "", (
        f"capskip must not set Dynamo's process-wide dynamic_sources; it is {torch.compiler.config.dynamic_sources!r}")
    assert seen and "int" in seen[0] and "SymInt" not in seen[0], (
        f"the teacher's first batch should be traced static (dim 0 an int), as without capskip; dim-0 types {seen!r}")


@pytest.mark.subprocess
def test_bad_environment_setting_raises_naming_the_variable():
    out = _fresh({"CAPSKIP_OPTIONS": "gather_below=2,backend=aot_eager"})
    assert out.returncode != 0, f"a bad CAPSKIP_OPTIONS value should stop the process, it exited {out.returncode!r}"
    assert "CAPSKIP_OPTIONS" in out.stderr, f"the error should name the variable to fix, CAPSKIP_OPTIONS; stderr: {out.stderr!r}"
    assert "gather_below must be in [0, 1]" in out.stderr, (
        f"the error should say gather_below's valid range; stderr: {out.stderr!r}")


@pytest.mark.parametrize("env, match", [
    ({"CAPSKIP_RULE": "capskp"}, "CAPSKIP_RULE='capskp': unknown rule"),
    ({"CAPSKIP_BUDGET": "lots"}, "CAPSKIP_BUDGET='lots'"),
    ({"CAPSKIP_OPTIONS": "kep=0.5"}, "CAPSKIP_OPTIONS: 'kep=0.5' is not key=value with a known key"),
    ({"CAPSKIP_OPTIONS": "keep"}, "CAPSKIP_OPTIONS: 'keep' is not key=value"),
])
def test_environment_parsing_errors(env, match):
    with pytest.raises(ValueError, match=match.replace("[", r"\[").replace("(", r"\(")):
        options_from_env(env)


def test_environment_parsing_types():
    got = options_from_env({"CAPSKIP_RULE": "random", "CAPSKIP_BUDGET": "0.3",
                            "CAPSKIP_OPTIONS": "keep=0.25, backend=aot_eager, verify=False, verify_every=None"})
    assert (got == {"rule": "random", "budget": 0.3, "keep": 0.25, "backend": "aot_eager", "verify": False,
                   "verify_every": None}), f"CAPSKIP_* strings should parse to typed options (float, bool, None; spaces ignored), got {got!r}"


def test_graph_breaks_share_one_backend_and_skip_rows(monkeypatch):
    """With no options every graph of the module joins one backend (one rule state, one report)."""
    monkeypatch.setenv("CAPSKIP_RULE", "forced")
    monkeypatch.setenv("CAPSKIP_OPTIONS", "keep=0.25,backend=aot_eager")
    torch.manual_seed(0)
    model = GraphBreak().double()
    opt = torch.compile(model, backend="capskip")
    for step in range(2):
        x = torch.randn(8, 6, dtype=torch.float64)
        torch._dynamo.mark_dynamic(x, 0)
        y = torch.randint(0, 3, (8,))
        model.zero_grad()
        F.cross_entropy(opt(x), y).backward()
    rep = capskip_fx.report(opt)
    assert [r["role"] for r in rep] == ["body", "head"], (
        f"both graphs of the module should join one backend, body then head; roles {[r['role'] for r in rep]!r}")
    assert all(r["row_counts"] == [2] for r in rep), f"keep=0.25 of 8: both graphs should run the backward on 2 rows; row counts {[r['row_counts'] for r in rep]}"
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    ref = copy.deepcopy(model)
    ref.zero_grad()
    (F.cross_entropy(ref(x), y, reduction="none") * capskip_fx.stats(opt).weight).mean().backward()
    assert max_rel_err(grads, {k: p.grad for k, p in ref.named_parameters()}) < 1e-10, (
        f"gradients across the graph break differ from the kept-row reference: rel. error "
        f"{max_rel_err(grads, {k: p.grad for k, p in ref.named_parameters()})!r}")


def test_torch_compile_mode_reaches_the_backend(monkeypatch):
    """``torch.compile(model, backend="capskip", mode=...)`` (timm's ``--torchcompile-mode``): torch passes the
    mode to the backend, which applies it to its graphs (reduce-overhead: CUDA graphs and 8 row buckets)."""
    monkeypatch.setenv("CAPSKIP_RULE", "forced")
    monkeypatch.setenv("CAPSKIP_OPTIONS", "keep=0.1875,backend=aot_eager")
    torch.manual_seed(0)
    model = GraphBreak().double()
    opt = torch.compile(model, backend="capskip", mode="reduce-overhead")
    x = torch.randn(16, 6, dtype=torch.float64)
    torch._dynamo.mark_dynamic(x, 0)
    F.cross_entropy(opt(x), torch.randint(0, 3, (16,))).backward()
    from capskip_fx.dynamo_entry import backend_of

    cfg = backend_of(opt).config
    assert cfg.mode == "reduce-overhead", f"torch.compile's mode should reach the backend's config, got {cfg.mode!r}"
    assert cfg.buckets == 8, f"reduce-overhead should pad row counts to 8 buckets (fewer CUDA graphs), got {cfg.buckets!r}"
    assert all(r["row_counts"] == [4] for r in capskip_fx.report(opt)), (
        f"3 kept rows of 16 should be padded to the bucket size 4; row counts "
        f"{[r['row_counts'] for r in capskip_fx.report(opt)]}")  # 3 kept rows, padded to a multiple of 16 / 8


class _WithLoss(torch.nn.Module):
    """The loss computed in a wrapper that holds the model (Lightning's training_step, a loss module): the
    outermost module being called is not the model."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return F.cross_entropy(self.model(x), y)


def _stack_reads() -> int:
    from capskip_fx.records import counters

    return counters()["owner from the call stack"]


@needs_batch_marking  # 2.11: a static first batch stays dense, and nn.Linear compiled in place is not traced
@pytest.mark.parametrize("idiom", ["regions", "marked"])
def test_bound_model_owns_its_graphs_without_reading_the_call_stack(idiom):
    """compile_regions and mark_compiled_batches (the trainer callbacks) bind the model they are given: every
    graph belongs to it (not to the wrapper the loss is computed in), no graph reads the call stack, and the
    kept rows' gradients are exact."""
    torch.manual_seed(0)
    model = GraphBreak().double()
    opts = {"rule": "forced", "keep": 0.5, "backend": "aot_eager", "verify": False}
    if idiom == "regions":
        compiled = capskip_fx.compile_regions(model, blocks=[model.a, model.b], head=model.head, **opts)
    else:
        compiled = torch.compile(model, backend="capskip", options=opts)
        capskip_fx.mark_compiled_batches(compiled)
    outer = _WithLoss(compiled)
    before = _stack_reads()
    for step in range(3):
        x, y = torch.randn(8 + step, 6, dtype=torch.float64), torch.randint(0, 3, (8 + step,))
        model.zero_grad()
        outer(x, y).backward()
        st = capskip_fx.stats(compiled)
        assert st.mode == "selected" and st.kept == (8 + step) // 2, (
            f"step {step}: a bound model's step should select half its rows; mode {st.mode!r}, kept {st.kept}")
    assert _stack_reads() == before, (
        f"a bound model's graphs should find it without the call stack; {_stack_reads() - before} read it")
    from capskip_fx.dynamo_entry import backend_of

    owner = backend_of(compiled).state.published.owner()
    assert owner is compiled, f"the bound model should own its graphs, not {type(owner).__name__}"
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    ref = copy.deepcopy(model)
    ref.zero_grad()
    (F.cross_entropy(ref(x), y, reduction="none") * st.weight).mean().backward()
    err = max_rel_err(grads, {k: p.grad for k, p in ref.named_parameters()})
    assert err < 1e-10, f"gradients of a bound model differ from the kept-row reference: rel. error {err!r}"


def test_unbound_model_reads_the_call_stack_once(monkeypatch):
    """A raw ``torch.compile(model, backend="capskip")`` is bound at its first graph: the graphs after it (the
    other side of a graph break, recompiles for new batch sizes) find it without the call stack."""
    torch.manual_seed(0)
    model = GraphBreak().double()
    compiled = torch.compile(model, backend="capskip", options={"rule": "forced", "keep": 0.5,
                                                              "backend": "aot_eager", "verify": False})
    before = _stack_reads()
    for n in (8, 8, 9, 10):
        x = torch.randn(n, 6, dtype=torch.float64)
        F.cross_entropy(compiled(x), torch.randint(0, 3, (n,))).backward()
    graphs = len(capskip_fx.report(compiled))
    assert graphs >= 2, f"expected the graph break's two graphs at least, got {graphs}"
    assert _stack_reads() - before == 1, (
        f"only the first of {graphs} graphs should read the call stack; {_stack_reads() - before} did")
    assert capskip_fx.stats(compiled).mode == "selected"


def test_dynamic_batch_option_refused_naming_the_variable():
    """``dynamic_batch`` is capskip_fx.compile's option; the string backend marks batches unless
    CAPSKIP_DYNAMIC_BATCH=0, so the option there would be silently ignored: refused at the first forward."""
    torch._dynamo.reset()
    model = torch.compile(torch.nn.Linear(6, 3), backend="capskip",
                          options={"dynamic_batch": False, "backend": "aot_eager"})
    with pytest.raises(Exception, match="CAPSKIP_DYNAMIC_BATCH=0") as e:
        model(torch.randn(8, 6))
    assert "torch.compile(options=...)" in str(e.value), f"the error should say where the option was given: {e.value}"


@needs_batch_marking  # 2.11: the static first batch is a documented dense fallback, not run eagerly
@pytest.mark.parametrize("entry", ["string", "in_place"])
def test_two_backwards_through_the_static_first_step(entry):
    """The unmarked first batch runs eagerly (dense by design) and a hook on its output claims the step: a
    second backward through the same output (retain_graph=True) passes its gradient unchanged (the hook
    returned False once, which autograd took for a replacement gradient), both steps give eager's
    gradients, and each backward is a step of its own (as through a compiled graph)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3)).double()
    ref = copy.deepcopy(model)
    opts = {"rule": "forced", "keep": 0.5, "backend": "aot_eager"}
    if entry == "string":
        cm = torch.compile(model, backend="capskip", options=opts)
    else:
        model.compile(backend="capskip", options=opts)
        cm = model
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    z = cm(x)
    F.cross_entropy(z, y).backward(retain_graph=True)
    assert capskip_fx.stats(cm).step == 0
    z.pow(2).mean().backward()
    st = capskip_fx.stats(cm)
    assert st.mode == "dense" and st.fallback is None and st.step == 1, st
    assert capskip_fx.summary(cm).steps == 2, capskip_fx.summary(cm)
    zr = ref(x)
    (F.cross_entropy(zr, y) + zr.pow(2).mean()).backward()
    got = {k: p.grad for k, p in model.named_parameters()}
    want = {k: p.grad for k, p in ref.named_parameters()}
    assert max_rel_err(got, want) < 1e-12, "the first step's two backwards should give eager's gradients"


def _odd(n):
    return torch.arange(n) % 2 == 1


def _even(n):
    return torch.arange(n) % 2 == 0


@needs_batch_marking
@pytest.mark.parametrize("case", ["eval_wrapper_first", "rewrapped_with_other_options", "two_marked_alternating"])
def test_a_second_wrapper_of_one_module_is_a_model_of_its_own(case):
    """Two ``torch.compile(model, backend="capskip")`` wrappers of one module: the one being called owns its
    graphs (its binding, batch marking and stats), not the first one bound.  Before, the second's steps ran
    the first's static-batch graph eagerly forever (dense, no warning, stats frozen), or stats read the
    other wrapper's record.  Gradients are each wrapper's rule-weighted float64 reference's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3)).double()
    ref = copy.deepcopy(model)

    def wrap(keep):
        cm = torch.compile(model, backend="capskip", options={"rule": "forced", "keep": keep,
                                                              "backend": "aot_eager", "verify": False})
        if case == "two_marked_alternating":
            capskip_fx.mark_compiled_batches(cm)
        return cm

    a = wrap(_odd)
    if case == "eval_wrapper_first":
        ev = wrap(_odd)
        with torch.no_grad():
            ev(torch.randn(8, 6, dtype=torch.float64))
    b = wrap(_even if case != "eval_wrapper_first" else _odd)
    plan = {"eval_wrapper_first": [(b, _odd)] * 4,
            "rewrapped_with_other_options": [(a, _odd)] * 2 + [(b, _even)] * 4,
            "two_marked_alternating": [(a, _odd), (b, _even)] * 2}[case]
    seen = {}
    for step, (cm, keep) in enumerate(plan):
        x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            F.cross_entropy(cm(x), y).backward()
        st = capskip_fx.stats(cm)
        first = id(cm) not in seen and case != "two_marked_alternating"  # an unmarked wrapper's static first batch
        seen[id(cm)] = True
        if first:
            assert st.mode == "dense" and st.fallback is None, f"step {step}: {st}"
            w = torch.ones(8, dtype=torch.float64)
        else:
            assert st.mode == "selected" and torch.equal(st.weight != 0, keep(8)), f"step {step}: {st}"
            w = st.weight.double()
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        (F.cross_entropy(ref(x), y, reduction="none") * w).sum().div(8).backward()
        got = {k: p.grad for k, p in model.named_parameters()}
        want = {k: p.grad for k, p in ref.named_parameters()}
        assert max_rel_err(got, want) < 1e-10, f"step {step}: gradients off the wrapper's own reference ({st})"

"""What a user sees: stats() and report() as printed, the INFO line, counters, structured-trace artifacts."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx
from capskip_fx.dynamo_entry import STATIC_FIRST
from capskip_fx.records import EVERY_ROW_KEPT
from capskip_fx.runtime import stats as stats_mod
from helpers.torch_features import needs_batch_marking


def _step(cm, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    F.cross_entropy(cm(torch.randn(n, 6, generator=g)), torch.randint(0, 3, (n,), generator=g)).backward()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))


def test_stats_repr_and_report_table():
    cm = capskip_fx.compile(_model(), rule="capskip", budget=0.3, backend="aot_eager")
    _step(cm)
    text = repr(capskip_fx.stats(cm))
    for field in ("n=8", "kept=", "rows=", "bound=", "fallback=None", "variants=1"):
        assert field in text, f"the stats repr should show {field!r} (a step's summary at a glance), got {text!r}"
    assert "tensor" not in text, f"the stats repr should elide the weight tensor, got {text!r}"  # the weight is elided
    rep = capskip_fx.report(cm)
    assert rep[0]["role"] == "head", f"the MLP's one graph is its head graph, report says role {rep[0]['role']!r}"
    assert rep.rows == list(rep), f"a report should iterate over its rows: rows {rep.rows!r}, iterated {list(rep)!r}"
    lines = str(rep).splitlines()
    assert lines[0].split()[:3] == ["graph", "role", "backward"], (
        f"the report table should start with its header (graph, role, backward), got {lines[0]!r}")
    assert lines[1].split()[:2] == ["0", "head"], (
        f"the table's first row should be graph 0, the head, got {lines[1]!r}")


def test_report_says_never_verified_in_words_and_explains_its_columns():
    """A gathered graph no informative step has checked says why in words, not as a failure; "yes" once
    one has; the table ends with what its columns mean."""
    cm = capskip_fx.compile(_model(), rule="forced", keep=1.0, backend="aot_eager")
    _step(cm)  # every row kept: nothing to compare, so never verified
    rep = capskip_fx.report(cm)
    assert rep[0]["backward"] == "selected rows", rep.rows
    assert rep[0]["verified"] is False, rep.rows
    text = str(rep)
    assert "never (no informative step)" in text.splitlines()[1], text
    assert "verified: yes = a gathered step matched" in text, text
    assert "dense-masked (all rows" in text, text
    cm2 = capskip_fx.compile(_model(), rule="forced", keep=0.5, backend="aot_eager")
    _step(cm2)
    line = str(capskip_fx.report(cm2)).splitlines()[1]
    assert " yes " in line, line
    assert "never" not in line, line


def test_info_line_rate_limited(caplog, monkeypatch):
    monkeypatch.setattr(stats_mod, "LOG_EVERY_S", 3600.0)
    cm = capskip_fx.compile(_model(), rule="forced", keep=0.5, backend="aot_eager")
    with caplog.at_level(logging.INFO, logger="capskip_fx"):
        for s in range(4):
            _step(cm, seed=s)
    lines = [r.getMessage() for r in caplog.records if r.name == "capskip_fx"]
    assert lines == ["capskip_fx step 0 (selected): kept 4/8 rows, backward ran on 4; run: kept 50.0%, ran 50.0% "
                     "of rows over 1 step"], lines


@pytest.mark.subprocess
def test_structured_trace_has_the_rewritten_backward(tmp_path):
    code = textwrap.dedent("""
        import torch, torch.nn as nn, torch.nn.functional as F, capskip_fx
        m = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
        cm = capskip_fx.compile(m, rule="forced", keep=0.5, backend="aot_eager")
        F.cross_entropy(cm(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
    """)
    env = dict(os.environ, TORCH_TRACE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    text = "".join(p.read_text() for p in tmp_path.iterdir())
    assert "capskip_backward_graph_0" in text, f"TORCH_TRACE should hold the rewritten backward as an artifact named capskip_backward_graph_0; trace {text[:2000]!r}"
    assert "capskip_w" in text, f"the traced backward should read the selection weight capskip_w; trace {text[:2000]!r}"


class _CentredMLP(nn.Module):
    """Row mixing in the user's own line (h - h.mean(0)), then a library module that mixes rows."""

    def __init__(self, bn: bool):
        super().__init__()
        self.fc, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.bn = nn.BatchNorm1d(8) if bn else None

    def forward(self, x):
        h = self.fc(x)
        if self.bn is not None:
            h = self.bn(h)
        else:
            h = h - h.mean(0)
        return self.head(h)


def _refused_steps(cm, sizes, where=False):
    """Train steps at the given batch sizes; the capskip_fx warnings they raised (``where``: with the file
    each points at)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s, n in enumerate(sizes):
            _step(cm, n=n, seed=s)
    ours = [w for w in caught if str(w.message).startswith("capskip_fx:")]
    return [(str(w.message), w.filename) for w in ours] if where else [str(w.message) for w in ours]


def test_refusal_names_the_op_and_the_users_source_line():
    """A refusal at a node in the user's code carries the aten op and the user's line, and report() and
    the warning show them."""
    torch.manual_seed(0)
    cm = capskip_fx.compile(_CentredMLP(bn=False), rule="random", keep=0.5, backend="aot_eager")
    warned = _refused_steps(cm, [8])
    refusal = cm.backend.records[0].refusal
    assert refusal is not None, "h - h.mean(0) mixes rows: the graph must be refused"
    assert refusal.op == "aten.mean.dim", f"the refused op: {refusal.op!r}"
    assert refusal.source_line is not None, "the user's line is in Dynamo's stack trace"
    assert refusal.source_line.startswith("test_observability.py:"), refusal.source_line
    assert refusal.source_line.endswith("h = h - h.mean(0)"), refusal.source_line
    assert refusal.module is None or "Linear" not in refusal.module, f"the mean is in no submodule: {refusal.module}"
    text = str(capskip_fx.report(cm))
    assert "graph 0 refused at: op aten.mean.dim" in text, text
    assert refusal.source_line in text, text
    assert len(warned) == 1, warned
    assert refusal.source_line in warned[0], warned


def test_refusal_inside_batchnorm_names_the_module_path():
    """Inside a library module the innermost frames are torch's: the refusal names the module path and
    class, and the user's line that called it (not torch/nn/functional.py)."""
    torch.manual_seed(0)
    cm = capskip_fx.compile(_CentredMLP(bn=True), rule="random", keep=0.5, backend="aot_eager")
    warned = _refused_steps(cm, [8])
    refusal = cm.backend.records[0].refusal
    assert refusal is not None, "BatchNorm in train mode mixes rows: the graph must be refused"
    assert refusal.op is not None, f"the refused op: {refusal.op!r}"
    assert "var_mean" in refusal.op, f"the refused op: {refusal.op!r}"
    assert refusal.module == "bn (BatchNorm1d)", f"the module path: {refusal.module!r}"
    assert refusal.source_line is not None, "the line that called self.bn is the user's"
    assert refusal.source_line.endswith("h = self.bn(h)"), refusal.source_line
    assert "functional.py" not in refusal.source_line, refusal.source_line
    assert len(warned) == 1, warned
    assert "in bn (BatchNorm1d)" in warned[0], warned


def test_a_warning_without_a_graph_location_points_at_the_users_code():
    """A warning that has no user line of its own (here: the string backend's refusal, settled where Dynamo
    compiles) points at the innermost frame outside capskip_fx, torch and the standard library: this file."""
    torch.manual_seed(0)
    cm = torch.compile(_CentredMLP(bn=True), backend="capskip", options={"rule": "random", "keep": 0.5,
                                                                          "backend": "aot_eager"})
    warned = _refused_steps(cm, [8, 8], where=True)
    assert warned and all(f == __file__ for _, f in warned), warned


def test_refusal_warns_once_per_graph():
    """A refused graph warns once, however many steps and recompiles (new batch sizes) follow; a second
    refused graph (after a graph break) warns once too, naming its own module."""
    torch.manual_seed(0)
    cm = capskip_fx.compile(_CentredMLP(bn=True), rule="random", keep=0.5, backend="aot_eager")
    warned = _refused_steps(cm, [8, 9, 10, 8])
    assert len(warned) == 1, f"one refused graph, warned {len(warned)} times: {warned}"

    class TwoParts(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8))
            self.b = nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 3))

        def forward(self, x):
            h = self.a(x)
            torch._dynamo.graph_break()
            return self.b(h)

    torch.manual_seed(0)
    cm2 = capskip_fx.compile(TwoParts(), rule="random", keep=0.5, backend="aot_eager")
    warned = _refused_steps(cm2, [8, 9, 10])
    refused = [r for r in cm2.backend.records if r.refusal is not None]
    assert len(refused) == 2, f"two refused graphs expected: {capskip_fx.report(cm2)}"
    assert len(warned) == 2, f"two refused graphs, {len(warned)} warnings: {warned}"
    assert "in a.1 (BatchNorm1d)" in warned[0], warned
    assert "in b.0 (BatchNorm1d)" in warned[1], warned


# -- one vocabulary: a step's mode, and a fallback (with its kind) only when something prevented the rule


def test_kept_share_above_gather_below_is_a_mode_not_a_fallback():
    """A healthy step that keeps 95 % of the rows runs all rows by design: mode dense-masked, no fallback,
    the note says why; summary() says so in one line; report() counts the graph's steps by mode."""
    cm = capskip_fx.compile(_model(), rule="forced", keep=0.95, backend="aot_eager")
    for s in range(3):
        _step(cm, n=20, seed=s)
    st = capskip_fx.stats(cm)
    assert (st.mode, st.kept, st.rows) == ("dense-masked", 19, 20), st
    assert st.fallback is None, f"running all rows above gather_below is by design, not a fallback: {st.fallback!r}"
    assert st.note and "gather_below=0.9" in st.note, st.note
    run = capskip_fx.summary(cm)
    assert dict(run.modes) == {"dense-masked": 3} and not run.fallbacks, run
    text = str(run)
    assert len(text.splitlines()) == 2 and "by design (no fallback)" in text.splitlines()[1], text
    rep = capskip_fx.report(cm)
    assert rep[0]["steps"] == {"dense-masked": 3} and rep[0]["last"] == "dense-masked", rep.rows
    line = str(rep).splitlines()[1]
    assert "dense-masked 3" in line and "gather_below" in line, line


def test_a_step_that_keeps_every_row_says_so():
    """A rule that keeps every row runs all rows (dense-masked, weight 1 everywhere): no fallback, a note that
    says why, and its own summary line, so the summary's lines account for every dense-masked step."""
    cm = capskip_fx.compile(_model(), rule="forced", keep=0.95, backend="aot_eager")
    _step(cm, n=20, seed=0)  # 19 of 20 kept: above gather_below
    cm.rule = capskip_fx.make_rule("forced", keep=1.0)
    for s in range(2):
        _step(cm, n=20, seed=1 + s)
    st = capskip_fx.stats(cm)
    assert (st.mode, st.kept, st.rows, st.fallback) == ("dense-masked", 20, 20, None), st
    assert st.note == EVERY_ROW_KEPT, st.note
    run = capskip_fx.summary(cm)
    assert dict(run.modes) == {"dense-masked": 3} and (run.every_row_kept, run.all_rows_by_design) == (2, 1), run
    lines = str(run).splitlines()
    assert lines[1] == "  2 steps kept every row: all rows ran, nothing to skip (no fallback)", lines
    assert lines[2].startswith("  1 step kept more than gather_below"), lines


def test_report_counts_each_mode_a_graph_ran_in():
    """report() says what ran: 2 selected steps then 3 above gather_below, per graph, with the last mode."""
    cm = capskip_fx.compile(_model(), rule="forced", keep=0.5, backend="aot_eager")
    for s in range(2):
        _step(cm, n=20, seed=s)
    cm.rule = capskip_fx.make_rule("forced", keep=0.95)
    for s in range(3):
        _step(cm, n=20, seed=10 + s)
    row = capskip_fx.report(cm)[0]
    assert row["steps"] == {"selected": 2, "dense-masked": 3}, row
    assert row["last"] == "dense-masked", row
    assert "selected 2, dense-masked 3" in str(capskip_fx.report(cm)).splitlines()[1]
    assert dict(capskip_fx.summary(cm).modes) == {"selected": 2, "dense-masked": 3}


def test_one_cause_is_one_summary_line_with_its_kind():
    """Non-finite steps with different kept counts are one cause: one line, counted by kind."""
    cm = capskip_fx.compile(_model(), rule="capskip", budget=0.3, backend="aot_eager")
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s, n in enumerate((8, 9, 10)):
            g = torch.Generator().manual_seed(s)
            x = torch.randn(n, 6, generator=g)
            x[0, 0] = float("nan")
            F.cross_entropy(cm(x), torch.randint(0, 3, (n,), generator=g)).backward()
    st = capskip_fx.stats(cm)
    assert st.mode == "dense" and st.fallback.kind.value == "non-finite", st
    assert isinstance(st.fallback, str) and st.fallback.startswith("non-finite"), st
    run = capskip_fx.summary(cm)
    assert dict(run.fallbacks) == {"non-finite": 3}, run.fallbacks
    fell = [ln for ln in str(run).splitlines() if "fell back" in ln]
    assert len(fell) == 1 and fell[0].startswith("  3 steps fell back (non-finite)"), str(run)
    assert len([w for w in caught if "non-finite" in str(w.message)]) == 1, [str(w.message) for w in caught]


def test_every_runtime_reason_has_a_kind():
    """The reasons the runtime writes map to a kind, never to "other"."""
    from capskip_fx.api import _NO_GRAPH_REASON
    from capskip_fx.records import fallback_kind
    from capskip_fx.runtime.executors import VERIFY
    from capskip_fx.runtime.checks import fallback_reason
    from capskip_fx.runtime.forwards import NO_HEAD_REASON, UNBOUND_REASON

    reasons = {_NO_GRAPH_REASON: "no graph", VERIFY: "verify", NO_HEAD_REASON: "no head",
               UNBOUND_REASON: "eager logits"}
    for deferred in (False, True):
        reasons[fallback_reason({"finite": 0}, deferred)] = "non-finite"
        reasons[fallback_reason({"finite": 1, "zero": 1}, deferred)] = "unused logits"
        reasons[fallback_reason({"finite": 1, "not_softmax": 1}, deferred)] = "not a softmax loss"
    got = {r: fallback_kind(r).value for r in reasons}
    assert got == reasons, got


def test_summary_prints_once_at_exit(tmp_path):
    """A script that prints its summary does not get a second copy at exit; one that never reads it gets
    one."""
    code = textwrap.dedent("""
        import sys, torch, torch.nn as nn, torch.nn.functional as F, capskip_fx
        m = torch.compile(nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3)), backend="capskip",
                          options={"rule": "forced", "keep": 0.5, "backend": "aot_eager"})
        for _ in range(2):
            F.cross_entropy(m(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
        if sys.argv[1] == "print":
            print(capskip_fx.summary(m), file=sys.stderr)
    """)
    for arg in ("print", "silent"):
        out = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stderr.count("capskip_fx: 2 steps") == 1, (arg, out.stderr[-2000:])


test_summary_prints_once_at_exit = pytest.mark.subprocess(test_summary_prints_once_at_exit)


@pytest.mark.subprocess
def test_summaries_at_exit_name_their_model_when_there_are_several():
    code = textwrap.dedent("""
        import torch, torch.nn as nn, torch.nn.functional as F, capskip_fx
        class Tiny(nn.Sequential):
            pass
        opts = {"rule": "forced", "keep": 0.5, "backend": "aot_eager"}
        a = torch.compile(nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3)), backend="capskip", options=opts)
        b = torch.compile(Tiny(nn.Linear(6, 3)), backend="capskip", options=opts)
        for m, steps in ((a, 2), (b, 3)):
            for _ in range(steps):
                F.cross_entropy(m(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.count("capskip_fx (Sequential): 2 steps") == 1, out.stderr[-2000:]
    assert out.stderr.count("capskip_fx (Tiny): 3 steps") == 1, out.stderr[-2000:]


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = nn.Sequential(nn.Linear(6, 16), nn.GELU()), nn.Linear(16, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.block, x, use_reentrant=True))


def test_reentrant_checkpoint_backward_folds_into_the_training_step(monkeypatch):
    """checkpoint(use_reentrant=True) runs a nested backward inside the step's: 3 steps count as 3, and
    stats() after backward() describes the training step (its head's selection)."""
    monkeypatch.setenv("CAPSKIP_RULE", "forced")
    monkeypatch.setenv("CAPSKIP_OPTIONS", "keep=0.5,backend=aot_eager")
    torch.manual_seed(0)
    m = _Checkpointed()
    m.block.compile(backend="capskip")
    m.head.compile(backend="capskip")
    for s in range(4):
        g = torch.Generator().manual_seed(s)
        x = torch.randn(8, 6, generator=g, requires_grad=True)
        F.cross_entropy(m(x), torch.randint(0, 3, (8,), generator=g)).backward()
        st = capskip_fx.stats(m)
        if s == 0 and st.mode == "dense":  # the head's input leaves the checkpoint unmarked: static first step
            assert (st.step, st.fallback, st.note) == (0, None, STATIC_FIRST), st
            continue
        assert (st.step, st.mode, st.n, st.kept, st.rows, st.fallback) == (s, "selected", 8, 4, 4, None), st
    run = capskip_fx.summary(m)
    assert run.steps == 4 and run.modes["selected"] >= 3 and not run.fallbacks, run


def test_report_says_a_graph_no_backward_ran_through_in_words():
    """A graph whose backward never compiled, so never ran (Dynamo discarded the trace for a retrace: its
    compile did not finish; seen with GPT-2 in a Trainer), is not "not compiled yet" in a report read after
    training."""
    from capskip_fx.records import GraphRecord, Report

    rep = Report([GraphRecord(index=0, nodes=12).as_dict()])
    assert rep[0]["backward"] == "no backward ran" and rep[0]["steps"] == {}, rep.rows
    line = str(rep).splitlines()[1]
    assert "no backward ran" in line and "never back-propagated" in line and "discarded" in line, line
    assert "not compiled" not in str(rep), str(rep)


def test_summary_says_one_step_not_one_steps():
    cm = capskip_fx.compile(_model(), rule="forced", keep=0.5, backend="aot_eager")
    assert str(capskip_fx.summary(cm)) == "capskip_fx: no training step yet (no backward of a forward with grad enabled)", (
        f"before any step the summary should say so, not print nan%: {capskip_fx.summary(cm)}")
    _step(cm)
    assert str(capskip_fx.summary(cm)).startswith("capskip_fx: 1 step, kept 50.0%"), str(capskip_fx.summary(cm))


@needs_batch_marking
@pytest.mark.parametrize("marked", [True, False], ids=["dynamic_from_step_0", "static_first_batch"])
def test_blocks_compiled_with_the_head_left_eager_say_so_on_every_step(marked):
    """Blocks compiled in place, head eager: every step says its logits come from eager code, step 0 too
    (before the model's forward hook binds it used to read "no classifier head", a block's output taken for
    logits); one cause, one warning.  Marked as compile_regions marks them, the batch is dynamic from step 0
    and the three reasons are one; unmarked, step 0 runs eagerly for its static batch (its own reason)."""
    import warnings

    from capskip_fx.dynamo_entry import install_batch_marking
    from helpers.models import Tokens

    torch.manual_seed(3)
    model = Tokens().double()
    for b in model.blocks:
        b.compile(backend="capskip", options={"rule": "random", "keep": 0.5, "backend": "aot_eager"})
        if marked:
            install_batch_marking(b)
    stats = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            F.cross_entropy(model(torch.randn(8, 5, 4, dtype=torch.float64)), torch.randint(0, 3, (8,))).backward()
            stats.append(capskip_fx.stats(model))
    kinds = [s.fallback.kind.value if s.fallback else None for s in stats]
    assert [s.mode for s in stats] == ["dense"] * 3 and "no head" not in kinds, stats
    if not marked:  # the static first batch: dense by design, a note and no fallback (or already dynamic)
        assert kinds[0] == "eager logits" or (kinds[0], stats[0].note) == (None, STATIC_FIRST), stats[0]
    assert kinds[1:] == ["eager logits"] * 2, kinds
    if marked:
        assert len({str(s.fallback) for s in stats}) == 1 and kinds[0] == "eager logits", stats
        assert dict(capskip_fx.summary(model).fallbacks) == {"eager logits": 3}, capskip_fx.summary(model)
    ours = [str(w.message) for w in caught if str(w.message).startswith("capskip_fx")]
    assert len(ours) == 1 and "not the output of a compiled graph" in ours[0], ours


def test_report_counts_a_refused_graphs_dense_backwards():
    """A refused graph's backwards are steps in report() too ("steps -" read as if it never ran)."""
    class RowMix(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.head = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)

        def forward(self, x):
            h = self.a(x)
            return self.head(h - h.mean(0, keepdim=True))  # mixes rows: refused

    cm = capskip_fx.compile(RowMix(), rule="forced", keep=0.5, backend="aot_eager")
    with pytest.warns(UserWarning, match="cross-example"):
        for s in range(3):
            _step(cm, seed=s)
    rep = capskip_fx.report(cm)
    assert [(r["backward"], r["steps"], r["last"]) for r in rep] == [("dense", {"dense": 3}, "dense")], rep.rows


class _Holder(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_stats_of_the_original_module_or_a_holder_of_a_capskip_compile_module():
    """stats/summary/report take the module capskip_fx.compile returned, the original module, or a module
    holding either (DDP(cm), a container); a module holding two compiled ones is an error naming the fix."""
    def step(m):
        F.cross_entropy(m(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()

    models = [nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3)) for _ in range(2)]
    cms = [capskip_fx.compile(m, rule="forced", keep=0.5, backend="aot_eager") for m in models]
    for _ in range(2):
        step(cms[0])
    want = capskip_fx.stats(cms[0])
    assert want.mode == "selected" and want.kept == 4, want
    for label, m in (("original", models[0]), ("holder of the compiled", _Holder(cms[0])),
                     ("holder of the original", _Holder(models[0]))):
        assert capskip_fx.stats(m) is want, f"stats({label}) should be the compiled module's"
        assert capskip_fx.summary(m).steps == 2 and len(capskip_fx.report(m).rows) >= 1, label
    both = nn.ModuleList(cms)
    with pytest.raises(TypeError, match="holds 2 modules compiled by capskip_fx.compile"):
        capskip_fx.stats(both)
    with pytest.raises(TypeError, match="expect the module returned by capskip_fx.compile"):
        capskip_fx.stats(nn.Linear(2, 2))

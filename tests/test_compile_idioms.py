"""The promise under every compile idiom: whole-model, in place (``m.compile()``), per layer and per block
(regional compile).  Each case checks the gradients against a float64 dense reference weighted by the
step's own selection, and the stats of every step (mode, rows, reason)."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import capskip_fx
from capskip_fx.dynamo_entry import STATIC_FIRST, install_batch_marking
from capskip_fx.records import counters
from helpers.models import Tokens
from helpers.torch_features import needs_batch_marking

pytestmark = pytest.mark.usefixtures("many_compiles")  # conftest: every test compiles its own model

OPTS = {"rule": "random", "keep": 0.5, "backend": "aot_eager"}
N = 8


def _mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _compile_linears(model):
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.compile(backend="capskip", options=OPTS)
    return model


def _compile_regions(model, head=True):
    """Blocks (and the head) compiled in place, their batch marked dynamic before the first call, as
    capskip_fx.compile_regions does (a hand-written loop without the marking: tests/test_forwards_bound.py)."""
    for m in list(model.blocks) + ([model.head] if head else []):
        m.compile(backend="capskip", options=OPTS)
        install_batch_marking(m)
    return model


def _steps(model, make_x, steps=3, static_first=False):
    """Run ``steps`` steps; per step, the largest relative gradient error against the float64 dense
    reference weighted by that step's selection, and its stats.  ``static_first``: the string backend's
    first batch is static (nothing marked before the first call): one more step first, checked here to be
    exact and the documented dense step that marks the model's inputs dynamic for the next."""
    if not static_first:
        return _all_steps(model, make_x, steps)
    notes = []
    out = _all_steps(model, make_x, steps + 1, notes)
    (err, mode, *_, fallback, _), note = out[0], notes[0]
    assert err < 1e-12, f"the first step's gradient differs from its dense reference by {err:.3g}"
    # dense unless Dynamo already saw this code with another batch size in the process (automatic dynamic)
    assert mode == "selected" or (mode, fallback, note) == ("dense", None, STATIC_FIRST), f"first step: {mode}, {fallback!r}, {note!r}"
    return out[1:]


def _all_steps(model, make_x, steps, notes=None):
    ref = copy.deepcopy(model)
    out = []
    for step in range(steps):
        x, y = make_x(), torch.randint(0, 3, (N,))
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            F.cross_entropy(model(x), y).backward()
        s = capskip_fx.stats(model)
        w = s.weight if s.weight is not None else torch.ones(N, dtype=torch.float64)
        for a, b in zip(ref.parameters(), model.parameters()):
            a.data.copy_(b.data)
        ref.zero_grad()
        ((F.cross_entropy(ref(x), y, reduction="none") * w).sum() / N).backward()
        err = max(float((a.grad - b.grad).norm() / a.grad.norm().clamp_min(1e-30))
                  for a, b in zip(ref.parameters(), model.parameters()))
        out.append((err, s.mode, s.n, s.kept, s.rows, s.fallback, s.step))
        if notes is not None:
            notes.append(s.note)
    return out


@needs_batch_marking
def test_each_linear_compiled_in_place_runs_the_rule_once_per_backward():
    """Regression: ``layer.compile()`` on every Linear of an MLP made every graph a head, each drawing
    its own rows in one backward (rel. error 0.4-0.9, stats kept 24/16)."""
    torch.manual_seed(0)
    model = _compile_linears(_mlp().double())
    for err, mode, n, kept, rows, fallback, _ in _steps(model, lambda: torch.randn(N, 6, dtype=torch.float64), static_first=True):
        assert n == N, f"one forward per step, {n} rows counted"
        assert kept == N // 2, (mode, kept, rows, fallback)
        assert rows == N // 2, (mode, kept, rows, fallback)
        assert mode == "selected", (mode, kept, rows, fallback)
        assert err < 1e-12, f"gradient differs from the selection's dense reference by {err:.3g}"
    roles = [r["role"] for r in capskip_fx.report(model)]
    assert roles.count("head") == 1, f"exactly one head graph (the logits'), got roles {roles}"


class _InplaceAfterLinear(nn.Module):
    """torchvision's VGG classifier pattern: Linear -> ReLU(inplace=True), here on rows or on tokens."""

    def __init__(self, tokens: bool):
        super().__init__()
        self.tokens = tokens
        self.fc, self.act, self.head = nn.Linear(6, 16), nn.ReLU(inplace=True), nn.Linear(16, 3)

    def forward(self, x):
        h = self.act(self.fc(x))
        return self.head(h.mean(1) if self.tokens else h)


@needs_batch_marking
@pytest.mark.parametrize("tokens", [False, True], ids=["rows", "tokens"])
def test_per_layer_compile_then_an_inplace_activation(tokens):
    """Regression: every per-layer Linear graph is a candidate head and saved its output for the selection;
    the eager in-place ReLU after it then failed autograd's version check ("modified by an inplace
    operation") where dense saves nothing of it.  The graph now returns a copy of what it saves."""
    torch.manual_seed(2)
    model = _compile_linears(_InplaceAfterLinear(tokens).double())
    shape = (N, 4, 6) if tokens else (N, 6)
    for err, mode, n, kept, rows, fallback, _ in _steps(model, lambda: torch.randn(*shape, dtype=torch.float64),
                                                      static_first=True):
        assert (mode, kept, rows) == ("selected", N // 2, N // 2), f"{mode}, kept {kept}, rows {rows}: {fallback}"
        assert err < 1e-12, f"gradient differs from the selection's dense reference by {err:.3g}"


@needs_batch_marking
def test_root_module_compiled_in_place():
    torch.manual_seed(1)
    model = _mlp().double()
    model.compile(backend="capskip", options=OPTS)
    # static_first: run alone (no earlier test traced _mlp at another batch size), the first batch is static
    for err, mode, n, kept, rows, _, _ in _steps(model, lambda: torch.randn(N, 6, dtype=torch.float64),
                                                 static_first=True):
        assert (mode, n, kept, rows) == ("selected", N, N // 2, N // 2), (
            f"in-place compile of the root must select half the rows; mode {mode}, n {n}, kept {kept}, rows {rows}")
        assert err < 1e-12, f"gradient error {err:.3g}"
    assert not any(k.startswith("_orig_mod") for k in model.state_dict()), "in-place compile keeps clean keys"


@needs_batch_marking
def test_regional_compile_skips_rows_in_every_block():
    torch.manual_seed(2)
    model = _compile_regions(Tokens().double())
    for err, mode, n, kept, rows, _, _ in _steps(model, lambda: torch.randn(N, 5, 4, dtype=torch.float64)):
        assert (mode, n, kept, rows) == ("selected", N, N // 2, N // 2), (
            f"regional compile must select half the rows every step; got mode {mode}, n {n}, kept {kept}, rows {rows}")
        assert err < 1e-12, f"gradient error {err:.3g}"
    rep = capskip_fx.report(model)
    assert [r["role"] for r in rep] == ["body", "body", "head"], rep
    for r in rep:
        assert r["backward"] == "selected rows", f"graph ran all rows: {r}"
        assert r["row_counts"] == [N // 2], f"graph ran all rows: {r}"
    # blocks[0] is fed by blocks[1]'s gathered backward directly: its rows, no host read; blocks[1] is fed
    # through the eager mean before the head: it finds its own rows (one read per step)
    assert (rep[0]["rows_reused"], rep[0]["host_reads"]) == (3, 0), f"blocks[0] did not reuse blocks[1]'s rows: {rep[0]}"
    assert (rep[1]["rows_reused"], rep[1]["host_reads"]) == (0, 3), f"blocks[1] reused rows across eager code: {rep[1]}"


class _TokensAux(Tokens):
    """``Tokens`` whose first block's output also feeds a loss term on every row (``self.aux``)."""

    def forward(self, x):
        h0 = self.blocks[0](self.embed(x))
        self.aux = h0.pow(2).mean()
        return self.head(self.blocks[1](h0).mean(1))


@needs_batch_marking
def test_regional_compile_does_not_reuse_rows_when_a_second_consumer_adds_gradient():
    """blocks[0]'s output reaches blocks[1] (gathered, zero outside its rows) and an all-row loss term:
    autograd sums the two into a new tensor, so blocks[0] must not take blocks[1]'s rows (it would
    drop the term's gradient on the skipped rows)."""
    torch.manual_seed(6)
    model = _compile_regions(_TokensAux().double())
    ref = copy.deepcopy(model)
    for _ in range(2):
        x, y = torch.randn(N, 5, 4, dtype=torch.float64), torch.randint(0, 3, (N,))
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (F.cross_entropy(model(x), y) + model.aux).backward()
        s = capskip_fx.stats(model)
        assert (s.mode, s.kept) == ("selected", N // 2), f"{s.mode}, kept {s.kept}: {s.fallback}"
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        ((F.cross_entropy(ref(x), y, reduction="none") * s.weight).sum() / N + ref.aux).backward()
        for (name, a), b in zip(ref.named_parameters(), model.parameters()):
            err = float((a.grad - b.grad).norm() / a.grad.norm().clamp_min(1e-30))
            assert err < 1e-12, f"{name}: gradient differs from the selection's reference by {err:.3g}"
    rep = capskip_fx.report(model)
    assert rep[0]["rows_reused"] == 0, f"blocks[0] took blocks[1]'s rows though the aux term feeds it too: {rep[0]}"
    assert rep[0]["host_reads"] == 2, f"blocks[0] should find its own rows each step: {rep[0]}"


@needs_batch_marking
def test_regional_compile_with_the_head_left_eager_is_dense_with_a_reason():
    """Regression: blocks compiled, head eager: stats showed n=0 and no reason."""
    torch.manual_seed(3)
    model = _compile_regions(Tokens().double(), head=False)
    results = _steps(model, lambda: torch.randn(N, 5, 4, dtype=torch.float64))
    assert [r[6] for r in results] == [0, 1, 2], "one step counted per backward"
    for err, mode, n, kept, rows, fallback, _ in results:
        assert (mode, n, kept, rows) == ("dense", N, N, N), (mode, n, kept, rows)
        assert fallback, f"a dense step says why: {fallback!r}"
        assert "dense backward" in fallback, f"a dense step says why: {fallback!r}"
        assert err < 1e-12, f"gradient error {err:.3g}"
    assert "not the output of a compiled graph" in results[-1][5], (
        f"with the head eager, a dense step must say its logits are no compiled graph's output; {results[-1][5]!r}")


@needs_batch_marking
@pytest.mark.parametrize("compiled", [(0, 2), (2, 4)], ids=["head_eager", "first_layer_eager"])
def test_layers_assigned_as_torch_compile_modules_belong_to_the_model(compiled):
    """``model[i] = torch.compile(model[i], backend="capskip")``, the model training parameters of its own
    outside them: the model owns the wrappers' graphs, as it owns layers compiled in place.  Regression: with
    the head left eager, the last wrapper selected rows of its own output (it took it for the logits) while the
    eager head got the unweighted gradient (rel. error 0.1-0.3, stats "selected", no warning); now that step is
    dense with the reason.  With the head compiled and an eager first layer, the rows are selected and exact."""
    torch.manual_seed(0)
    before = counters()["model holding the wrapper"]
    model = _mlp().double()
    for i in compiled:
        model[i] = torch.compile(model[i], backend="capskip", options=OPTS)
    results = _steps(model, lambda: torch.randn(N, 6, dtype=torch.float64), static_first=True)
    for err, mode, n, kept, rows, fallback, _ in results:
        assert err < 1e-12, f"gradient differs from the step's dense reference by {err:.3g}"
        if compiled == (0, 2):
            assert (mode, n, kept, rows) == ("dense", N, N, N), (mode, n, kept, rows, fallback)
            assert "not the output of a compiled graph" in fallback, fallback
        else:
            assert (mode, n, kept, rows, fallback) == ("selected", N, N // 2, N // 2, None), (mode, kept, fallback)
    assert counters()["model holding the wrapper"] > before, "the model was found holding the wrappers"


@needs_batch_marking
def test_two_models_compiled_in_place_keep_their_own_state():
    torch.manual_seed(4)
    a, b = _mlp().double(), _mlp().double()
    a.compile(backend="capskip", options=OPTS)
    b.compile(backend="capskip", options=dict(OPTS, keep=0.25))
    x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
    for _ in range(2):
        F.cross_entropy(a(x), y).backward()
        F.cross_entropy(b(x), y).backward()
    assert capskip_fx.stats(a).kept == N // 2, (
        f"model a (keep=0.5) must keep its own half, not b's quarter; kept {capskip_fx.stats(a).kept} of {N}")
    assert capskip_fx.stats(b).kept == N // 4, (
        f"model b (keep=0.25) must keep its own quarter, not a's half; kept {capskip_fx.stats(b).kept} of {N}")
    assert capskip_fx.stats(a).n == N, (
        f"model a's stats must count its own batch of {N} rows; n = {capskip_fx.stats(a).n}")
    assert capskip_fx.stats(b).n == N, (
        f"model b's stats must count its own batch of {N} rows; n = {capskip_fx.stats(b).n}")


@needs_batch_marking
@pytest.mark.parametrize("idiom", ["whole", "in_place"])
def test_step_reason_is_its_own(idiom):
    """Regression: a reason from an earlier dense step stayed in stats().fallback on later selected steps."""
    torch.manual_seed(5)
    model = _mlp().double()
    if idiom == "whole":
        model = torch.compile(model, backend="capskip", options=OPTS)
    else:
        model.compile(backend="capskip", options=OPTS)
    x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        F.cross_entropy(model(x), y).backward()  # the static first batch: marks the batch dynamic
        F.cross_entropy(model(x * float("nan")), y).backward()
    assert "non-finite" in (capskip_fx.stats(model).fallback or ""), capskip_fx.stats(model)
    F.cross_entropy(model(x), y).backward()
    s = capskip_fx.stats(model)
    assert (s.mode, s.fallback, s.kept) == ("selected", None, N // 2), s


# -- the proof's blind spots, named regressions ----------------------------------------------------------

class RowIndexAsValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.a(x).relu()
        return self.head(h * (1 + 0.05 * torch.arange(x.shape[0], dtype=x.dtype)[:, None]))


class Center(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g - g.mean(0)  # mixes rows: the forward-only proof can't see it


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return g * 2.0


class WithFunction(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn, self.a, self.head = fn, nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.fn.apply(self.a(x).relu()))


class MultipleChoice(nn.Module):
    """BertForMultipleChoice's pattern: the head scores (N*T, D) rows, viewed as (N, T) logits."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(6, 8), nn.Linear(8, 1)

    def forward(self, x):
        n, t, _ = x.shape
        return self.head(self.a(x).relu().reshape(n * t, -1)).view(n, -1)


def _capskip_module_steps(model, make_x, classes=3, steps=3, opts=OPTS, **more):
    cm = capskip_fx.compile(model, **dict(opts, **more))
    out = []
    for _ in range(steps):
        x, y = make_x(), torch.randint(0, classes, (N,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cm.zero_grad()
            F.cross_entropy(cm(x), y).backward()
            s = capskip_fx.stats(cm)
            w = s.weight if s.weight is not None else torch.ones(N, dtype=torch.float64)
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            ((F.cross_entropy(model(x), y, reduction="none") * w).sum() / N).backward()
        err = max(float((g - p.grad).norm() / p.grad.norm().clamp_min(1e-30)) for g, p in zip(grads, model.parameters()))
        out.append((err, s))
    return out


@pytest.mark.parametrize("verify", [True, False])
def test_row_index_used_as_a_value_is_refused(verify):
    """Regression: ``h * (1 + 0.05 * arange(N)[:, None])`` was proven per-row; the gathered backward
    recomputed ``arange`` at the kept count (5-18 % wrong on every step after a prefix-kept first one)."""
    torch.manual_seed(6)
    for err, s in _capskip_module_steps(RowIndexAsValue().double(), lambda: torch.randn(N, 6, dtype=torch.float64),
                                        verify=verify):
        assert s.mode == "dense", s
        assert "row index arange(N) is used as a value" in s.fallback, s
        assert err < 1e-12, f"gradient error {err:.3g}"


def test_undeclared_autograd_function_runs_dense_and_a_declared_one_selects():
    torch.manual_seed(7)
    make_x = lambda: torch.randn(N, 6, dtype=torch.float64)  # noqa: E731
    for err, s in _capskip_module_steps(WithFunction(Center).double(), make_x, verify=False):
        assert s.mode == "dense", s
        assert "custom torch.autograd.Function" in s.fallback, s
        assert "self.fn.apply(" in s.fallback, f"the refusal names the source line: {s.fallback}"
        assert err < 1e-12, f"gradient error {err:.3g}"
    capskip_fx.rowwise(Scale)
    for err, s in _capskip_module_steps(WithFunction(Scale).double(), make_x, verify=False):
        assert (s.mode, s.kept, s.rows) == ("selected", N // 2, N // 2), s
        assert err < 1e-12, f"gradient error {err:.3g}"
    with pytest.raises(TypeError, match="autograd.Function"):
        capskip_fx.rowwise(nn.Linear)


def test_head_over_reshaped_rows_is_no_head_not_a_crash():
    """Regression: ``head(h.reshape(n * t, -1)).view(n, -1)`` crashed in rules/capskip.py (size mismatch)."""
    torch.manual_seed(8)
    model = MultipleChoice().double()
    results = _capskip_module_steps(model, lambda: torch.randn(N, 4, 6, dtype=torch.float64), classes=4,
                                    opts={"backend": "aot_eager"})
    for err, s in results:
        assert s.mode == "dense", s
        assert "the head's input has" in s.fallback, s
        assert err < 1e-12, f"gradient error {err:.3g}"


def test_split_prefix_keeps_export_order():
    """Regression: the in-graph loss's exported values became inputs in reverse order (two of equal shape
    would be swapped silently)."""
    from torch import fx

    from capskip_fx.passes.selected_rows import _split_prefix  # noqa: PLC2701  (the unit under test)

    g = fx.Graph()
    a, b, t = g.placeholder("a"), g.placeholder("b"), g.placeholder("tangents_1")
    x1 = g.call_function(torch.ops.aten.mul.Tensor, (t, a))
    x2 = g.call_function(torch.ops.aten.mul.Tensor, (t, b))
    grad = g.call_function(torch.ops.aten.add.Tensor, (x1, x2))
    sel = g.call_function(torch.ops.aten.neg.default, (grad,))
    g.output([g.call_function(torch.ops.aten.sub.Tensor, (x1, x2)), g.call_function(torch.ops.aten.mul.Tensor, (sel, x1))])
    vals = [torch.randn(4, 3) for _ in range(3)]
    for node, v in zip((a, b, t), vals):
        node.meta["val"] = v
    for node in (x1, x2, grad, sel):
        node.meta["val"] = torch.empty(4, 3)
    gm = fx.GraphModule(torch.nn.Module(), g)
    expected = [f"{n.name}_from_loss" for n in (grad, x1, x2)]  # dL/dz first, then in graph order
    prefix, examples = _split_prefix(gm, vals, grad, sel)
    new = [n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name.endswith("_from_loss")]
    assert new == expected, f"inputs not in export order: {new}"
    outs = prefix.gm(*[vals[i] for i in prefix.args])
    a_, b_, t_ = vals
    got = gm(*[vals[i] for i in prefix.keep], *outs)
    assert torch.equal(got[0], t_ * a_ - t_ * b_), "the exported values reached the wrong inputs"


# -- regional compile of a real architecture, the run summary, the rule's state through every idiom ------

def _vit():
    timm = pytest.importorskip("timm")
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=5)


@needs_batch_marking
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
@pytest.mark.heavy
def test_compile_regions_on_timm_vit_selects_in_every_graph(backend):
    """Regression: timm ViT with blocks and head compiled in place ran every graph dense-masked (the pooled
    ``x[:, 0]`` reaches the head with a stride symbol of its own)."""
    torch.manual_seed(9)
    dtype = torch.float64 if backend == "aot_eager" else torch.float32
    model = _vit().to(dtype)
    ref = copy.deepcopy(model)
    assert capskip_fx.compile_regions(model, rule="random", keep=0.5, backend=backend) is model, (
        "compile_regions compiles in place and must return the model itself, not a wrapper")
    assert list(model.state_dict()) == list(ref.state_dict()), "in-place compile keeps the model's keys"
    for _ in range(2):
        x, y = torch.randn(N, 3, 32, 32, dtype=dtype), torch.randint(0, 5, (N,))
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            F.cross_entropy(model(x), y).backward()
        s = capskip_fx.stats(model)
        assert (s.mode, s.kept, s.rows) == ("selected", N // 2, N // 2), s
        for a, b in zip(ref.parameters(), model.parameters()):
            a.data.copy_(b.data)
        ref.zero_grad()
        ((F.cross_entropy(ref(x), y, reduction="none") * s.weight).sum() / N).backward()
        tol = 1e-10 if dtype == torch.float64 else 1e-4
        for (name, a), b in zip(ref.named_parameters(), model.parameters()):
            err = float((a.grad - b.grad).norm() / a.grad.norm().clamp_min(1e-30))
            assert err < tol, f"{name}: gradient error {err:.3g}"
    rep = capskip_fx.report(model)
    assert [r["role"] for r in rep] == ["body", "body", "head"], rep
    assert all(r["backward"] == "selected rows" and r["row_counts"] == [N // 2] for r in rep), rep
    run = capskip_fx.summary(model)
    assert (run.steps, run.n, run.kept, run.rows) == (2, 2 * N, N, N), run
    assert run.modes == {"selected": 2}, run
    assert not run.fallbacks, run
    assert "kept 50.0%" in str(run), f"the run summary's text must report the half of the rows kept; got {str(run)!r}"
    assert run.as_dict()["capskip/rows_pct"] == 50.0, (
        f"the logged metrics must say 50% of the rows ran the backward; got {run.as_dict()['capskip/rows_pct']}")


def test_compile_regions_refuses_a_model_without_repeated_blocks():
    with pytest.raises(ValueError, match="blocks=\\[...\\]"):
        capskip_fx.compile_regions(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))


def test_summary_counts_dense_steps_by_reason():
    torch.manual_seed(10)
    model = _compile_regions(Tokens().double(), head=False)
    for _ in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            F.cross_entropy(model(torch.randn(N, 5, 4, dtype=torch.float64)), torch.randint(0, 3, (N,))).backward()
    run = capskip_fx.summary(model)
    assert (run.steps, run.kept_pct, run.rows_pct) == (3, 100.0, 100.0), run
    assert run.modes == {"dense": 3}, run
    # the first step's graphs run before any forward is bound: its reason is the block graph's (no head)
    assert sum(run.fallbacks.values()) == 3 and run.fallbacks["eager logits"] >= 2, (
        f"the 3 dense steps must be counted by kind, eager logits from the second on; fallbacks {run.fallbacks}")
    assert "not the output of a compiled graph" in run.details["eager logits"], (
        f"the kind's detail must say the logits are no compiled graph's output; {run.details}")


def _stateful_idiom(idiom, seed):
    torch.manual_seed(seed)
    model = Tokens().double()
    opts = dict(OPTS, rule="random", keep=0.5)
    if idiom == "capskip_module":
        return capskip_fx.compile(model, **opts)
    if idiom == "whole":
        return torch.compile(model, backend="capskip", options=opts)
    if idiom == "in_place":
        model.compile(backend="capskip", options=opts)
        return model
    return capskip_fx.compile_regions(model, blocks=model.blocks, head=model.head, **opts)


@pytest.mark.parametrize("idiom", ["capskip_module"] + [pytest.param(i, marks=needs_batch_marking)
                                                     for i in ("whole", "in_place", "regional")])
@pytest.mark.heavy
def test_rule_state_resumes_through_every_idiom(idiom):
    """The rule's state (here the generator the random rule draws from) saved with capskip_fx.state_dict
    and loaded before the first step of a fresh model continues the same draws."""
    xs = [torch.randn(N, 5, 4, dtype=torch.float64) for _ in range(4)]
    for x in xs:  # the string backend's first batch would be static (a dense step, no draw): marked here
        torch._dynamo.maybe_mark_dynamic(x, 0)
    y = torch.randint(0, 3, (N,))

    def run(model, batches):
        kept = []
        for x in batches:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                F.cross_entropy(model(x), y).backward()
            kept.append(capskip_fx.stats(model).weight.clone())
        return kept

    whole = _stateful_idiom(idiom, 0)
    expected = run(whole, xs)
    first = _stateful_idiom(idiom, 0)
    run(first, xs[:2])
    saved = capskip_fx.state_dict(first)
    assert saved["step"] == 2, saved.keys()
    assert saved["generator"] is not None, saved.keys()
    resumed = _stateful_idiom(idiom, 0)
    capskip_fx.load_state_dict(resumed, saved)
    got = run(resumed, xs[2:])
    for i, (a, b) in enumerate(zip(got, expected[2:])):
        assert torch.equal(a, b), f"step {i + 2}: resumed selection {a.tolist()} != uninterrupted {b.tolist()}"


def test_verify_runs_again_when_the_first_checked_step_kept_a_prefix():
    """Regression: verify checked only the first informative step; one that keeps the first k rows hides a
    backward that is wrong on other rows."""
    from capskip_fx.rules import Forced

    keeps = iter([torch.arange(4), torch.tensor([1, 3, 5, 6]), torch.tensor([0, 2, 4, 7])])
    torch.manual_seed(11)
    cm = capskip_fx.compile(_mlp().double(), rule=Forced(keep=lambda n: next(keeps)), backend="aot_eager")
    for _ in range(3):
        F.cross_entropy(cm(torch.randn(N, 6, dtype=torch.float64)), torch.randint(0, 3, (N,))).backward()
    head = next(r for r in cm.backend.records if r.head)
    assert head.checks == 2, (head.checks, head.verified_unordered)
    assert head.verified, (head.checks, head.verified_unordered)
    assert head.verified_unordered, (head.checks, head.verified_unordered)


def test_a_capskip_module_deep_copied_after_a_step_trains_on_its_own():
    """Regression: ``copy.deepcopy`` of a capskip_fx.compile module after a training step (an EMA, a best-model
    snapshot) raised autograd's "Only Tensors created explicitly by the user support the deepcopy protocol":
    the runtime held the last step's outputs.  The copy now holds none of that step, and it and the original
    each select their own rows, exactly."""
    torch.manual_seed(13)
    cm = capskip_fx.compile(_mlp().double(), rule="forced", keep=0.5, backend="aot_eager")
    for _ in range(2):
        F.cross_entropy(cm(torch.randn(N, 6, dtype=torch.float64)), torch.randint(0, 3, (N,))).backward()
    twin = copy.deepcopy(cm)
    assert twin.model is not cm.model
    for run in (twin, cm, twin):
        run.zero_grad()
        x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
        F.cross_entropy(run(x), y).backward()
        st = capskip_fx.stats(run)
        assert (st.mode, st.kept, st.rows) == ("selected", N // 2, N // 2), st
        ref = copy.deepcopy(run.model)
        ref.zero_grad()
        (F.cross_entropy(ref(x), y, reduction="none")[: N // 2].sum() / N).backward()
        for a, b in zip(ref.parameters(), run.model.parameters()):
            assert torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-14), (a.grad - b.grad).abs().max()


def test_a_deep_copy_of_the_model_under_the_eager_backend_copies_its_head_hook():
    """The eager backend hooks the model's head with a method of the CapskipModule: a deep copy of the model (a
    float64 reference) reaches the module through that hook while the model is half-built; it is copied member by
    member then (compiling afresh needs the finished model)."""
    torch.manual_seed(15)
    model = _mlp()
    cm = capskip_fx.compile(model, rule="forced", keep=0.5, backend="eager")
    F.cross_entropy(cm(torch.randn(N, 6)), torch.randint(0, 3, (N,))).backward()
    ref = copy.deepcopy(model).double()
    x = torch.randn(N, 6, dtype=torch.float64)
    assert torch.allclose(ref(x), model.double()(x))


def test_capskip_compile_of_a_capskip_module_names_the_fix():
    """Regression: capskip_fx.compile over a capskip_fx.compile module ran the inner one's rule while the outer
    one reported every step dense (with a recompile-limit hint) and its own options went unused."""
    cm = capskip_fx.compile(_mlp(), rule="forced", keep=0.5, backend="aot_eager")
    for outer in (cm, nn.Sequential(cm)):
        with pytest.raises(ValueError, match=r"holds a capskip_fx.compile module already.*CapskipModule's .model"):
            capskip_fx.compile(outer, rule="forced", keep=0.25)


@needs_batch_marking
def test_layers_compiled_then_the_model_again_say_why_no_graph_reached_capskip():
    """Layers compiled in place, then the model holding them by another torch.compile: Dynamo inlines the
    inner compiles and only the outer backend runs (dense, exact).  stats() says that, not only the
    recompile limit."""
    torch.manual_seed(14)
    model = _mlp().double()
    for i in (2, 4):
        model[i].compile(backend="capskip", options=OPTS)
    outer = torch.compile(model, backend="aot_eager")
    F.cross_entropy(outer(torch.randn(N, 6, dtype=torch.float64)), torch.randint(0, 3, (N,))).backward()
    with pytest.raises(TypeError, match="compiled .* and the whole model again by this torch.compile"):
        capskip_fx.stats(outer)
    with pytest.raises(TypeError, match="a model holding it was compiled again by torch.compile"):
        capskip_fx.stats(model)


@needs_batch_marking
def test_a_deep_copy_of_an_in_place_compiled_model_leaves_its_stats_alone():
    """Regression: the logits hook travels with ``copy.deepcopy`` (an EMA, a reference model); the copy's
    forwards recorded dense steps into the original's stats."""
    torch.manual_seed(12)
    model = _mlp().double()
    model.compile(backend="capskip", options=OPTS)
    x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
    F.cross_entropy(model(x), y).backward()
    copy_ = copy.deepcopy(model)
    for m in copy_.modules():
        m._compiled_call_impl = None  # torch shares the original's compiled call with a deep copy
    F.cross_entropy(copy_(x), y).backward()
    F.cross_entropy(model(x), y).backward()
    s = capskip_fx.stats(model)
    assert (s.step, s.mode, s.kept) == (1, "selected", N // 2), s


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn, self.head = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.bn(self.a(x)))


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.LSTM(6, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def test_a_refusal_names_the_library_module_and_warns_once():
    """Regression: BatchNorm's refusal named only the aten op, and it was warned twice (graph and step)."""
    cm = capskip_fx.compile(WithBatchNorm().double(), backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.cross_entropy(cm(torch.randn(N, 6, dtype=torch.float64)), torch.randint(0, 3, (N,))).backward()
    reason = capskip_fx.stats(cm).fallback
    assert "in bn (BatchNorm1d)" in reason, reason
    assert "at: return self.head(self.bn(self.a(x)))" in reason, reason
    ours = [str(w.message) for w in caught if "capskip_fx" in str(w.message)]
    assert len(ours) == 1, f"warned {len(ours)} times: {ours}"


def test_an_rnn_gets_its_true_reason():
    """Regression: an LSTM model read "no graph (recompile_limit reached?)"; Dynamo does not trace RNNs."""
    cm = capskip_fx.compile(Recurrent().double(), backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        F.cross_entropy(cm(torch.randn(N, 5, 6, dtype=torch.float64)), torch.randint(0, 3, (N,))).backward()
    s = capskip_fx.stats(cm)
    if s.mode == "dense":  # <= 2.14: no graph; 2.15: the head's graph after the break, if its batch is static
        assert "does not trace LSTM" in s.fallback, s
    else:  # 2.15, the graph after the break with a dynamic batch (automatic dynamic): the rule ran
        assert torch.__version__ >= "2.15", s
        assert s.mode in ("selected", "dense-masked"), s
    model = Recurrent().double()
    torch.compile(model, backend="capskip", options=OPTS)(torch.randn(N, 5, 6, dtype=torch.float64)).sum().backward()
    try:  # torch <= 2.14 skips the frame (no graph); 2.15 breaks the graph at the LSTM and compiles the rest
        s = capskip_fx.stats(model)
    except TypeError as e:
        assert "does not trace LSTM" in str(e), e
    else:  # 2.15: the head's graph after the break; its input comes from the eager LSTM, so its batch is static:
        # the documented static first step (dense, its note), or selected where it came dynamic
        assert s.mode == "selected" and s.rows < s.n or (s.mode, s.fallback, s.note) == ("dense", None, STATIC_FIRST), s



@needs_batch_marking
def test_published_gradients_do_not_outlive_their_backward():
    """The gradients a gathered backward returns are held (their identity proves the next graph's rows)
    only while the backward runs: nothing of a step's backward is kept after it."""
    from capskip_fx.dynamo_entry import backend_of

    torch.manual_seed(7)
    model = _compile_regions(Tokens().double())
    for _ in range(3):
        x, y = torch.randn(N, 5, 4, dtype=torch.float64), torch.randint(0, 3, (N,))
        loss = F.cross_entropy(model(x), y)
        published = backend_of(model.head).state.published
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss.backward()
        assert len(published) == 0, f"{len(published)} published gradients outlived their backward"
    rep = capskip_fx.report(model)
    assert rep[0]["rows_reused"] == 3, f"blocks[0] should take blocks[1]'s rows each step: {rep[0]}"


@pytest.mark.parametrize("outer", ["module", "train_step"])
def test_a_capskip_module_inside_another_torch_compile_still_selects(outer):
    """A trainer that compiles the model it is given (``torch.compile(cm)``), or a compiled training step
    calling it: the outer compile steps around the module's call (its own compiled graph runs as is), the
    head selects, and every gradient is the rule-weighted float64 reference's.  Before, Dynamo traced into
    the module and failed on its batch marking (``maybe_mark_dynamic``: a forbidden callable)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3)).double()
    ref = copy.deepcopy(model)
    cm = capskip_fx.compile(model, rule="forced", keep=lambda n: torch.tensor([1, 4, 6]), backend="aot_eager")
    wrapped = torch.compile(cm, backend="aot_eager")

    @torch.compile(backend="aot_eager")
    def train_step(x, y):
        return F.cross_entropy(cm(x), y)

    for step in range(2):
        x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
        model.zero_grad()
        (train_step(x, y) if outer == "train_step" else F.cross_entropy(wrapped(x), y)).backward()
        st = capskip_fx.stats(cm)
        assert st.mode == "selected" and st.kept == 3 and st.fallback is None, f"step {step}: {st}"
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        (F.cross_entropy(ref(x), y, reduction="none") * st.weight.double()).sum().div(8).backward()
        for (name, a), b in zip(ref.named_parameters(), model.parameters()):
            err = float((a.grad - b.grad).norm() / a.grad.norm())
            assert err < 1e-10, f"step {step}, {name}: off by {err:.3g} from the rule-weighted reference"


@needs_batch_marking
def test_eager_steps_of_a_model_compiled_in_place_are_counted_once():
    """Under ``torch.compiler.set_stance("force_eager")`` a model compiled in place (and bound by
    mark_compiled_batches) runs eagerly: each such step is one dense step with the reason, not two (both of
    its binding hooks saw the eager logits)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3)).double()
    model.compile(backend="capskip", options={"rule": "forced", "keep": 0.5, "backend": "aot_eager", "verify": False})
    capskip_fx.mark_compiled_batches(model)
    for step in range(4):
        x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if step >= 2:
                with torch.compiler.set_stance("force_eager"):
                    F.cross_entropy(model(x), y).backward()
            else:
                F.cross_entropy(model(x), y).backward()
        st = capskip_fx.stats(model)
        assert st.step == step, f"loop step {step}: stats count step {st.step}"
        if step >= 2:
            assert st.mode == "dense" and st.fallback.kind.value == "eager logits", f"step {step}: {st}"
    run = capskip_fx.summary(model)
    assert run.steps == 4 and run.modes == {"selected": 2, "dense": 2}, run

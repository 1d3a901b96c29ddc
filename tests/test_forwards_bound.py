"""Every forward bound, under every idiom: several forwards before one backward (two augmented views, a
siamese or consistency loss) and several compiled heads (an auxiliary classifier) each get their own
selection, from the first step on (after the string backend's static first batch, which runs dense), with
``verify=False`` (nothing but the binding keeps them exact).

Idioms: ``capskip_fx.compile``, ``torch.compile(backend="capskip")``, in-place ``m.compile()`` of an
``nn.Sequential`` and of a custom module (Dynamo traces an in-place module's hooks into its frame and does
not guard on hooks added later: the binding wraps the compiled call instead), per-layer and regional compile.
Each step is checked against a float64 reference of the summed losses, each forward weighted by its own
selection, and ``stats()`` must count every forward.
"""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import capskip_fx
from helpers.models import Tokens
from helpers.torch_features import needs_batch_marking

N = 8
OPTS = {"rule": "random", "keep": 0.5, "backend": "aot_eager", "verify": False}


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.a(x).relu())


def _seq():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _in_place(make):
    def build():
        m = make().double()
        m.compile(backend="capskip", options=OPTS)
        return m, m
    return build


def _string():
    m = _Custom().double()
    return m, torch.compile(m, backend="capskip", options=OPTS)


def _capskip_compile():
    m = _Custom().double()
    return m, capskip_fx.compile(m, **OPTS)


def _per_layer():
    m = _seq().double()
    for layer in m:
        if isinstance(layer, nn.Linear):
            layer.compile(backend="capskip", options=OPTS)
    return m, m


def _regional():
    m = Tokens().double()
    for b in m.blocks:
        b.compile(backend="capskip", options=OPTS)
    m.head.compile(backend="capskip", options=OPTS)
    return m, m


IDIOMS = {"capskip_compile": (_capskip_compile, (N, 6)), "string": (_string, (N, 6)),
          "in_place_sequential": (_in_place(_seq), (N, 6)), "in_place_custom": (_in_place(_Custom), (N, 6)),
          "per_layer": (_per_layer, (N, 6)), "regional": (_regional, (N, 5, 4))}


def _check(model, cm, losses_of, n_forwards, steps=3, backward_order=True):
    """``losses_of(module, x1, x2) -> per-forward per-row losses``; each step against the reference.
    ``st.forwards`` lists the heads in the order their backwards ran: autograd runs the later-created node
    first, so the last forward first (``backward_order``), or as listed when one forward's heads are
    created in the order of the losses' list reversed (the aux head before the main one)."""
    ref = copy.deepcopy(model)
    # the string backend traces a first batch that nothing marked with a static size and runs it dense,
    # marking the model's inputs dynamic for the next (dynamo_entry.py): the checked steps start after it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(100)
        xs = [torch.randn(*SHAPE[0], dtype=torch.float64) for _ in range(2)]
        sum(l.mean() for l in losses_of(cm, *xs, torch.randint(0, 3, (N,)))).backward()
    for step in range(steps):
        torch.manual_seed(step)
        xs = [torch.randn(*SHAPE[0], dtype=torch.float64) for _ in range(2)]
        y = torch.randint(0, 3, (N,))
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sum(l.mean() for l in losses_of(cm, *xs, y)).backward()
        st = capskip_fx.stats(cm)
        assert len(st.forwards) == n_forwards and st.n == n_forwards * N, \
            f"step {step}: stats count {len(st.forwards)} forwards of {st.n} rows, expected {n_forwards} of {N}: {st}"
        assert all(f.mode == "selected" and f.kept == N // 2 for f in st.forwards), [f for f in st.forwards]
        ws = [f.weight.double() for f in (reversed(st.forwards) if backward_order else st.forwards)]
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        sum((l * w).sum() / N for l, w in zip(losses_of(ref, *xs, y), ws)).backward()
        for (name, a), b in zip(ref.named_parameters(), model.parameters()):
            err = float((a.grad - b.grad).norm() / a.grad.norm().clamp_min(1e-30))
            assert err < 1e-10, f"step {step}, {name}: off by {err:.3g} ({st})"


SHAPE = [None]


@needs_batch_marking
@pytest.mark.parametrize("idiom", sorted(IDIOMS))
def test_two_forwards_one_backward_each_selected(idiom):
    make, shape = IDIOMS[idiom]
    SHAPE[0] = shape
    torch._dynamo.reset()  # Dynamo's caches of earlier tests' modules (one shared Module._call_impl) stay out
    torch.manual_seed(0)
    model, cm = make()
    _check(model, cm, lambda m, x1, x2, y: [F.cross_entropy(m(x), y, reduction="none") for x in (x1, x2)], 2)


class _TokensAux(Tokens):
    """Tokens with an auxiliary classifier on the first block's pooled output."""

    def __init__(self):
        super().__init__()
        self.aux_head = nn.Linear(8, 3)

    def forward(self, x):
        h0 = self.blocks[0](self.embed(x))
        self.aux = self.aux_head(h0.mean(1))
        return self.head(self.blocks[1](h0).mean(1))


@needs_batch_marking
def test_an_auxiliary_head_compiled_beside_the_main_one_gets_its_own_selection():
    torch._dynamo.reset()
    torch.manual_seed(0)
    SHAPE[0] = (N, 5, 4)
    model = _TokensAux().double()
    capskip_fx.compile_regions(model, rule="random", keep=0.5, backend="aot_eager", verify=False, head=model.head)
    model.aux_head.compile(backend="capskip", options=dict(OPTS, budget=0.1))  # compile_regions's settings

    def losses(m, x1, x2, y):  # one forward, two heads: the main logits, then the aux ones (set in forward)
        main = F.cross_entropy(m(x1), y, reduction="none")
        return [main, F.cross_entropy(m.aux, y, reduction="none")]
    _check(model, model, losses, 2, backward_order=False)


def _forced_rows(model, entry: str, **opts):
    """``model`` compiled by ``entry`` with the forced rows 1, 4, 6 of every batch, verify off, batches marked."""
    opts = {"rule": "forced", "keep": lambda n: torch.tensor([1, 4, 6]), "backend": "aot_eager", "verify": False,
            **opts}
    if entry == "in_place":
        model.compile(backend="capskip", options=opts)
        cm = model
    else:
        cm = capskip_fx.compile(model, **opts) if entry == "capskip_compile" else \
            torch.compile(model, backend="capskip", options=opts)
    capskip_fx.mark_compiled_batches(cm)
    return cm


def _assert_reference_grads(ref, model, what: str, st) -> None:
    """Every parameter's gradient as the reference's (none where it has none)."""
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        if a.grad is None:
            assert b.grad is None or not b.grad.any(), f"{what}, {name}: a gradient where none is due"
            continue
        err = float((a.grad - b.grad).norm() / a.grad.norm().clamp_min(1e-30))
        assert err < 1e-10, f"{what}, {name}: off by {err:.3g} from the rule-weighted reference ({st})"


def _steps_against_reference(model, cm, ref, rows, steps: int, dense_kind=None) -> None:
    """``steps`` steps of ``rows(outputs, y).sum() / N`` back-propagated through ``cm``: each selects the forced
    rows (``dense_kind`` None) or runs dense with a reason of kind ``dense_kind``, and every gradient is the
    float64 reference's with the step's row weights (all ones when dense)."""
    for step in range(steps):
        x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows(cm(x), y).sum().div(N).backward()
        st = capskip_fx.stats(cm)
        if dense_kind is None:
            assert st.mode == "selected" and st.kept == 3 and st.fallback is None, f"step {step}: {st}"
            w = st.weight.double()
        else:
            assert st.mode == "dense" and st.kept == N, f"step {step}: {st}"
            assert st.fallback.kind.value == dense_kind, f"step {step}: {st}"
            w = torch.ones(N, dtype=torch.float64)
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        (rows(ref(x), y) * w).sum().div(N).backward()
        _assert_reference_grads(ref, model, f"step {step}", st)


@torch._dynamo.disable
def _scale_eagerly(z, s):
    return z * s


class _ScaledAfterHead(nn.Module):
    """Logits scaled after the head's graph: past a graph break or in eager code; by a learnable scale (whose
    gradient the head's row weights cannot reach) or by a number (they can)."""

    def __init__(self, where: str, learnable: bool):
        super().__init__()
        self.where = where
        self.a, self.head = nn.Linear(6, 16), nn.Linear(16, 3)
        self.scale = nn.Parameter(torch.tensor(1.5)) if learnable else 1.5

    def forward(self, x):
        z = self.head(F.gelu(self.a(x)))
        if self.where == "eager":
            return _scale_eagerly(z, self.scale)
        torch._dynamo.graph_break()
        return z * self.scale


@needs_batch_marking
@pytest.mark.parametrize("entry", ["capskip_compile", "string"])
@pytest.mark.parametrize("where,learnable", [("break", True), ("eager", True), ("break", False)])
def test_logits_scaled_after_the_head_are_weighted_or_run_dense(entry, where, learnable):
    """Every parameter's gradient is the rule-weighted one, or the step runs dense with the reason: a learnable
    scale after the head's graph gets its gradient before the head selects, so such a step runs dense; a
    scale by a number passes the weights on, and the head still selects."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _ScaledAfterHead(where, learnable).double()
    cm = _forced_rows(model, entry)
    ref = copy.deepcopy(model)
    for step in range(2):
        x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
        model.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            F.cross_entropy(cm(x), y).backward()
        st = capskip_fx.stats(cm)
        if learnable:
            assert st.mode == "dense" and st.kept == N, f"step {step}: {st}"
            kind = "eager logits" if where == "eager" else "after the head"
            assert st.fallback.kind.value == kind, f"step {step}: the reason should be of kind {kind!r}: {st}"
            said = [str(w.message) for w in caught if str(st.fallback) in str(w.message)]
            assert len(said) == (step == 0), f"step {step}: the reason is warned once, at the first step: {said}"
            w = torch.ones(N, dtype=torch.float64)
        else:
            assert st.mode == "selected" and st.kept == 3 and st.fallback is None, f"step {step}: {st}"
            w = st.weight.double()
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        (F.cross_entropy(ref(x), y, reduction="none") * w).sum().div(N).backward()
        _assert_reference_grads(ref, model, f"step {step}", st)
    assert len(capskip_fx.summary(cm).modes) == 1 and capskip_fx.summary(cm).steps == 2, capskip_fx.summary(cm)


@torch._dynamo.disable
def _shift_eagerly(z, b):
    return z + b


class _SecondOutput(nn.Module):
    """Logits returned beside a second output computed from them after the head's graph (past a graph break or
    in eager code): with a parameter (a bias, a LayerNorm, a Linear: a head of its own) or without (softmax)."""

    def __init__(self, where: str, what: str):
        super().__init__()
        self.where, self.what = where, what
        self.a, self.head = nn.Linear(6, 16), nn.Linear(16, 3)
        self.bias, self.ln, self.post = nn.Parameter(torch.randn(3)), nn.LayerNorm(3), nn.Linear(3, 3)

    def forward(self, x):
        z = self.head(F.gelu(self.a(x)))
        if self.where == "eager":
            return z, (_shift_eagerly(z, self.bias) if self.what == "bias" else z.softmax(-1).log())
        torch._dynamo.graph_break()
        return z, {"bias": lambda: z + self.bias, "layernorm": lambda: self.ln(z), "linear": lambda: self.post(z),
                   "none": lambda: z.softmax(-1).log()}[self.what]()


@needs_batch_marking
@pytest.mark.parametrize("entry", ["capskip_compile", "string"])
@pytest.mark.parametrize("where,what", [("break", "bias"), ("break", "layernorm"), ("break", "linear"),
                                        ("eager", "bias"), ("break", "none"), ("eager", "none")])
def test_a_second_output_computed_from_the_logits_is_weighted_or_runs_dense(entry, where, what):
    """A loss on both outputs: every parameter's gradient is the rule-weighted one (kept rows weighted N/k, so a
    weight applied twice would show), or the step runs dense with the reason, from the first step on."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _SecondOutput(where, what).double()
    cm = _forced_rows(model, entry, normalize="kept")
    ref = copy.deepcopy(model)
    for step in range(2):
        x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            z, z2 = cm(x)
            (F.cross_entropy(z, y) + F.cross_entropy(z2, y)).backward()
        st = capskip_fx.stats(cm)
        if what != "none":
            assert st.mode == "dense" and st.kept == N, f"step {step}: {st}"
            assert st.fallback.kind.value == "after the head", f"step {step}: {st}"
            w = torch.ones(N, dtype=torch.float64)
        else:
            assert st.mode == "selected" and st.kept == 3 and st.fallback is None, f"step {step}: {st}"
            w = st.weight.double()
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        z, z2 = ref(x)
        ((F.cross_entropy(z, y, reduction="none") + F.cross_entropy(z2, y, reduction="none")) * w).sum().div(N).backward()
        _assert_reference_grads(ref, model, f"step {step}", st)


class _EagerBiasAfterHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.head = nn.Linear(6, 3)
        self.bias = nn.Parameter(torch.randn(3) * 0.3)

    def forward(self, x):
        for b in self.blocks:
            x = x + F.gelu(b(x))
        return self.head(x) + self.bias  # eager code after the compiled head


@needs_batch_marking
@pytest.mark.parametrize("idiom", ["regions", "per_layer"])
def test_regional_compile_binds_from_the_first_step(idiom):
    """compile_regions / mark_compiled_batches bind the model's forward before its first step: a learnable bias
    the model adds in eager code after the compiled head makes step 0 dense too (it selected, the bias's
    gradient unweighted), with the reason, and every step matches the reference."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = _EagerBiasAfterHead().double()
    ref = copy.deepcopy(m)
    opts = dict(rule="forced", keep=0.5, backend="aot_eager", verify=False)
    if idiom == "regions":
        capskip_fx.compile_regions(m, blocks=list(m.blocks), head=m.head, **opts)
    else:
        for mod in (*m.blocks, m.head):
            mod.compile(backend="capskip", options=opts)
        capskip_fx.mark_compiled_batches(m)
    for step in range(2):
        x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
        m.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            F.cross_entropy(m(x), y).backward()
        st = capskip_fx.stats(m)
        assert st.mode == "dense" and st.fallback.kind.value == "eager logits", f"{idiom} step {step}: {st}"
        ref.load_state_dict(m.state_dict())
        ref.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        for (name, a), b in zip(ref.named_parameters(), m.parameters()):
            err = float((a.grad - b.grad).norm() / a.grad.norm())
            assert err < 1e-10, f"{idiom} step {step}, {name}: off by {err:.3g} from the dense gradient"


@needs_batch_marking
def test_marking_before_an_in_place_compile_leaves_the_binding_to_the_compile():
    """mark_compiled_batches before the module itself is compiled in place: no early forward hook (the in-place
    compile would trace it); the first compile binds as usual: one static first step, then selected steps,
    and no eager-logits fallback."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = _seq().double()
    capskip_fx.mark_compiled_batches(m)
    m.compile(backend="capskip", options={"rule": "forced", "keep": 0.5, "backend": "aot_eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            F.cross_entropy(m(torch.randn(N, 6, dtype=torch.float64)), torch.randint(0, 3, (N,))).backward()
    run = capskip_fx.summary(m)
    assert run.steps == 3 and run.modes["selected"] == 2 and not run.fallbacks, str(run)


# eager code after the head (a helper Dynamo does not trace): each row's gradient stays in its row, or not
_EAGER_POST = {
    "scale": (lambda z: z * 2.0, True), "cast": (lambda z: z.float().double(), True),
    "softmax_classes": (lambda z: torch.log_softmax(z, dim=1), True), "columns_view": (lambda z: z[:, :2], True),
    "gelu_then_scale": (lambda z: F.gelu(z) / 3.0, True),
    "flip_rows": (lambda z: z.flip(0), False), "cumsum_rows": (lambda z: z.cumsum(0), False),
    "sort_rows": (lambda z: z.sort(0).values, False), "softmax_rows": (lambda z: torch.log_softmax(z, dim=0), False),
    "roll_rows": (lambda z: z.roll(1, 0), False), "rows_view": (lambda z: torch.cat([z[1:], z[:1]]), False),
    "shifted_rows_view": (lambda z: z.view(-1)[3:].view(N - 1, 3), False),
}


class _EagerPost(nn.Module):
    def __init__(self, what: str):
        super().__init__()
        self.a, self.head = nn.Linear(6, 16), nn.Linear(16, 3)
        self.post = torch._dynamo.disable(_EAGER_POST[what][0])

    def forward(self, x):
        return self.post(self.head(torch.tanh(self.a(x))))


@needs_batch_marking
@pytest.mark.parametrize("entry", ["capskip_compile", "string"])
@pytest.mark.parametrize("what", sorted(_EAGER_POST))
def test_eager_code_after_the_head_selects_only_where_it_keeps_the_rows(entry, what):
    """Eager ops between the head's graph and the returned logits: where each keeps a row's gradient in its
    row (pointwise ops, casts, a softmax over the classes, a view of whole rows), the head selects and the
    gradients are the rule-weighted ones; where one moves or mixes rows (flip, cumsum, sort or softmax over the
    batch, a shift), the head would weight other rows than the loss's: the step runs dense, with the reason."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _EagerPost(what).double()
    cm = _forced_rows(model, entry)
    ref = copy.deepcopy(model)
    rowwise = _EAGER_POST[what][1]
    for step in range(2):
        x = torch.randn(N, 6, dtype=torch.float64)
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            z = cm(x)
            y = torch.randint(0, z.shape[1], (z.shape[0],))
            F.cross_entropy(z, y, reduction="none").sum().div(N).backward()
        st = capskip_fx.stats(cm)
        if rowwise:
            assert st.mode == "selected" and st.kept == 3 and st.fallback is None, f"step {step}: {st}"
            w = st.weight.double()
        else:
            assert st.mode == "dense" and st.kept == st.n, f"step {step}: {st}"
            assert st.fallback.kind.value == "eager logits", f"step {step}: {st}"
            w = torch.ones(z.shape[0], dtype=torch.float64)
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        (F.cross_entropy(ref(x), y, reduction="none") * w).sum().div(N).backward()
        _assert_reference_grads(ref, model, f"step {step}", st)


class _ParameterOutput(nn.Module):
    """Logits beside a per-row view of a parameter (a learned loss weight, Kendall-style), returned as a view
    (AOTAutograd regenerates it outside the graph) or computed in the graph."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.a, self.head = nn.Linear(6, 16), nn.Linear(16, 3)
        self.log_var = nn.Parameter(torch.tensor(0.3))

    def forward(self, x):
        z = self.head(torch.tanh(self.a(x)))
        lv = {"view": lambda: self.log_var.expand(x.shape[0]), "in_graph": lambda: self.log_var.expand(x.shape[0]) * 1,
              "parameter": lambda: self.log_var}[self.how]()
        return z, lv


@needs_batch_marking
@pytest.mark.parametrize("entry", ["capskip_compile", "string"])
@pytest.mark.parametrize("how", ["view", "parameter", "in_graph"])
def test_an_output_returned_from_outside_the_graph_runs_dense(entry, how):
    """A parameter (or a view of one) among the outputs is returned from outside the compiled graph, whose row
    weights then never reach it: a per-row loss on it would give the parameter every row's gradient. Such a
    step runs dense, with the reason; computed in the graph, the output's tangent is weighted and rows are
    selected."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _ParameterOutput(how).double()
    cm = _forced_rows(model, entry)
    ref = copy.deepcopy(model)

    def rows(out, y):
        z, lv = out
        return torch.exp(-lv) * F.cross_entropy(z, y, reduction="none") + lv

    _steps_against_reference(model, cm, ref, rows, 2, None if how == "in_graph" else "output outside the graph")


class _Scheduled(nn.Module):
    """Logits over a temperature the training loop changes every step (a Python float): Dynamo recompiles
    with it as a graph input, and the recompiled graph's logits are no longer a Linear scaled by a number."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(6, 16), nn.Linear(16, 3)
        self.temp = 1.0

    def forward(self, x):
        return self.head(torch.relu(self.a(x))) / self.temp


@needs_batch_marking
@pytest.mark.parametrize("entry", ["capskip_compile", "string"])
def test_a_recompile_that_loses_the_head_records_its_dense_steps(entry):
    """Every step is recorded (stats() moves on), and is either selected with the rule-weighted gradients or
    dense with its reason and the dense gradients: never the dense gradients under an old step's selection."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Scheduled().double()
    cm = _forced_rows(model, entry)
    ref = copy.deepcopy(model)
    modes = []
    for step in range(4):
        model.temp = ref.temp = 1.0 + 0.1 * step
        x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            F.cross_entropy(cm(x), y).backward()
        st = capskip_fx.stats(cm)
        assert capskip_fx.summary(cm).steps == step + 1, f"step {step} not recorded: {capskip_fx.summary(cm)}"
        if st.mode == "selected":
            assert st.kept == 3 and st.fallback is None, f"step {step}: {st}"
            w = st.weight.double()
        else:
            assert st.kept == N and st.fallback is not None, f"step {step}: a dense step without its reason: {st}"
            w = torch.ones(N, dtype=torch.float64)
        modes.append(st.mode)
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        (F.cross_entropy(ref(x), y, reduction="none") * w).sum().div(N).backward()
        _assert_reference_grads(ref, model, f"step {step}", st)
    assert "dense" in modes, f"the recompiled graph no longer holds a recognised head, yet no step ran dense: {modes}"


@needs_batch_marking
@pytest.mark.parametrize("mark", [False, True], ids=["unmarked", "marked"])
def test_compiling_in_place_again_with_other_options_takes_over(mark):
    """``m.compile(backend="capskip", options=...)`` a second time (other options mid-training): stats() and
    the gradients follow the new options (after the new compile's static first batch, unless its batch is
    marked), never the dense gradients under the old compile's last selection."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = _seq().double()
    ref = copy.deepcopy(m)

    def compile_keeping(rows):
        m.compile(backend="capskip", options={**OPTS, "rule": "forced", "keep": lambda n: torch.tensor(rows)})
        if mark:
            capskip_fx.mark_compiled_batches(m)

    def step():
        x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
        m.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            F.cross_entropy(m(x), y).backward()
        st = capskip_fx.stats(m)
        w = st.weight.double() if st.mode == "selected" else torch.ones(N, dtype=torch.float64)
        ref.load_state_dict(m.state_dict())
        ref.zero_grad()
        (F.cross_entropy(ref(x), y, reduction="none") * w).sum().div(N).backward()
        _assert_reference_grads(ref, m, f"step {st.step}", st)
        return st

    compile_keeping([1, 4, 6])
    for _ in range(2):
        step()
    compile_keeping([0, 2])
    sts = [step() for _ in range(3)]
    assert [s.step for s in sts] == [0, 1, 2], f"stats() should read the new compile's steps: {sts}"
    assert all(s.mode == "selected" and s.weight.nonzero().flatten().tolist() == [0, 2] for s in sts[1:]), sts
    assert sts[0].mode == ("selected" if mark else "dense"), f"the new compile's first step: {sts[0]}"


@torch._dynamo.disable
def _features_eagerly(a, x):
    return torch.tanh(a(x))


class _FeaturesOut(nn.Module):
    """Logits beside the features the head reads, used by the loss too (a feature-norm term): from the head's
    graph, from a graph ahead of a break before the head, from eager code, or detached."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where
        self.a, self.head = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = _features_eagerly(self.a, x) if self.where == "eager" else torch.tanh(self.a(x))
        if self.where == "break":
            torch._dynamo.graph_break()
        return self.head(h), (h.detach() if self.where == "detached" else h)


@needs_batch_marking
@pytest.mark.parametrize("entry", ["capskip_compile", "string"])
@pytest.mark.parametrize("where", ["head_graph", "break", "eager", "detached"])
def test_an_output_from_before_the_head_is_weighted_or_runs_dense(entry, where):
    """A per-row loss term on an output that holds the batch's rows: from the head's graph its tangent is
    weighted with the logits'; from a graph before the head's (or eager code) nothing weights it, so the
    step runs dense, with the reason."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _FeaturesOut(where).double()
    cm = _forced_rows(model, entry, normalize="kept")
    ref = copy.deepcopy(model)

    def rows(out, y):
        z, h = out
        return F.cross_entropy(z, y, reduction="none") + h.pow(2).sum(1)

    for step in range(2):
        x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows(cm(x), y).sum().div(N).backward()
        st = capskip_fx.stats(cm)
        if where in ("head_graph", "detached"):
            assert st.mode == "selected" and st.kept == 3 and st.fallback is None, f"step {step}: {st}"
            w = st.weight.double()
        else:
            assert st.mode == "dense" and st.kept == N, f"step {step}: {st}"
            # eager features reach the head's graph unmarked under capskip_fx.compile: a static batch first
            kinds = ("output before the head", "static batch") if where == "eager" else ("output before the head",)
            assert st.fallback.kind.value in kinds, f"step {step}: {st}"
            w = torch.ones(N, dtype=torch.float64)
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        out = ref(x)
        if where == "detached":
            out = (out[0], out[1].detach())
        (rows(out, y) * w).sum().div(N).backward()
        _assert_reference_grads(ref, model, f"step {step}", st)


@needs_batch_marking
@pytest.mark.parametrize("body", ["other_rows", "random"])
def test_layers_compiled_with_other_options_than_the_head_are_its_body(body):
    """A per-layer compile whose body Linears got other options than the head (another backend, another rule
    state): they lie upstream of the head that selected, so they run as its body, on its rows; they never
    select rows of their own (which would zero the body's gradients where the two sets differ)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3)).double()
    ref = copy.deepcopy(m)
    body_opts = {**OPTS, "rule": "forced", "keep": lambda n: torch.tensor([0, 2])} if body == "other_rows" else OPTS
    for layer in (m[0], m[2]):
        layer.compile(backend="capskip", options=body_opts)
    m[4].compile(backend="capskip", options={**OPTS, "rule": "forced", "keep": lambda n: torch.tensor([1, 4, 6])})
    capskip_fx.mark_compiled_batches(m)
    for step in range(3):
        x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
        m.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            F.cross_entropy(m(x), y).backward()
        st = capskip_fx.stats(m)
        assert st.mode == "selected" and st.weight.nonzero().flatten().tolist() == [1, 4, 6], f"step {step}: {st}"
        ref.load_state_dict(m.state_dict())
        ref.zero_grad()
        (F.cross_entropy(ref(x), y, reduction="none") * st.weight.double()).sum().div(N).backward()
        _assert_reference_grads(ref, m, f"step {step}", st)


class _FeaturesAfterEager(nn.Module):
    """Logits beside the head graph's features passed through eager code or through a graph of their own past a
    graph break: row-wise (a scale) or moving rows (flip over the batch)."""

    def __init__(self, what: str, where: str = "eager"):
        super().__init__()
        self.a, self.head = nn.Linear(6, 16), nn.Linear(16, 3)
        post = {"scale": lambda t: t * 2.0, "flip": lambda t: t.flip(0), "centre": lambda t: t - t.mean(0),
                "flip_view": lambda t: t.flip(0)[:, :4]}[what]  # a view: AOTAutograd regenerates it outside
        self.where = where
        self.post = torch._dynamo.disable(post) if where == "eager" else post

    def forward(self, x):
        h = torch.tanh(self.a(x))
        z = self.head(h)
        if self.where == "break":  # the next graph (refused for flip: its rows are not proven to stay rows)
            torch._dynamo.graph_break()
        return z, self.post(h)


@needs_batch_marking
@pytest.mark.parametrize("entry", ["capskip_compile", "string", "in_place"])
@pytest.mark.parametrize("where", ["eager", "break"])
@pytest.mark.parametrize("what", ["scale", "flip", "centre", "flip_view"])
def test_another_output_through_eager_code_keeps_its_rows_or_runs_dense(entry, where, what):
    """Another output of the head's graph passed through eager code or a later graph before the loss: row-wise
    code keeps the head's row weights on the loss's rows; code that moves or mixes rows (refused past a break:
    its backward, which runs before the head's, makes the head's forward dense) would put them on other rows,
    so that step runs dense, with the reason, on every step (an in-place compile binds each forward twice)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _FeaturesAfterEager(what, where).double()
    ref = copy.deepcopy(model)  # before an in-place compile
    cm = _forced_rows(model, entry)
    scale = torch.arange(1.0, N + 1, dtype=torch.float64)  # row-dependent, so moved rows would show

    def rows(out, y):
        z, f = out
        return F.cross_entropy(z, y, reduction="none") + f.pow(2).sum(1) * scale

    _steps_against_reference(model, cm, ref, rows, 3, None if what == "scale" else "after the head")


@needs_batch_marking
@pytest.mark.parametrize("entry", ["capskip_compile", "string"])
@pytest.mark.parametrize("order", ["full_first", "one_first"])
def test_a_batch_of_one_beside_another_forward_is_one_forward_of_the_step(entry, order):
    """A forward of one row (dense by design) and a full batch's, back-propagated together: one step whose
    forwards are both (n = N + 1, the full batch's rows selected, the row of one kept), one step per backward
    in the summary, and gradients as the reference's with the full batch's weights and the one row's 1."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Custom().double()
    cm = _forced_rows(model, entry)
    ref = copy.deepcopy(model)
    sizes = (N, 1) if order == "full_first" else (1, N)
    for step in range(3):
        xs = [torch.randn(n, 6, dtype=torch.float64) for n in sizes]
        ys = [torch.randint(0, 3, (n,)) for n in sizes]
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sum(F.cross_entropy(cm(x), y, reduction="sum") for x, y in zip(xs, ys)).backward()
        st = capskip_fx.stats(cm)
        assert st.n == N + 1 and st.kept == 4 and st.mode == "selected" and len(st.forwards) == 2, f"step {step}: {st}"
        one = next(f for f in st.forwards if f.n == 1)
        assert one.mode == "dense" and one.fallback is None and one.note, f"step {step}: {one}"
        w = next(f for f in st.forwards if f.n == N).weight.double()
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        sum((F.cross_entropy(ref(x), y, reduction="none") * (w if x.shape[0] == N else 1.0)).sum()
            for x, y in zip(xs, ys)).backward()
        _assert_reference_grads(ref, model, f"step {step}", st)
    run = capskip_fx.summary(cm)
    assert run.steps == 3 and not run.fallbacks, run


@needs_batch_marking
@pytest.mark.parametrize("entry", ["capskip_compile", "string"])
@pytest.mark.parametrize("hook", ["tensor_flip", "tensor_scale", "torch_softmax", "module_flip", "wrapper_flip"])
def test_a_backward_hook_on_the_logits_gradient_runs_dense(entry, hook):
    """A hook on the returned logits' gradient (a tensor hook, a full backward pre-hook on the model) runs before
    the head's graph weights its rows: it could move them (flip(0)) or see every row's gradient, so the step runs
    dense with the reason, its gradients the dense reference's with the same hook."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Custom().double()
    ref = copy.deepcopy(model)
    edit = (lambda g: g.flip(0)) if hook.endswith("flip") else (lambda g: g * 3.0)
    if hook == "torch_softmax":  # a torch function as the hook: the user's all the same
        edit = functools.partial(torch.softmax, dim=0)
    if hook == "module_flip":
        for m in (model, ref):
            m.register_full_backward_pre_hook(lambda m, go: (edit(go[0]),))
    cm = _forced_rows(model, entry)
    if hook == "wrapper_flip":  # on the module capskip_fx.compile returns (or torch.compile's wrapper)
        cm.register_full_backward_pre_hook(lambda m, go: (edit(go[0]),))
        ref.register_full_backward_pre_hook(lambda m, go: (edit(go[0]),))
    for step in range(3):
        x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
        model.zero_grad()
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        for m in (cm, ref):
            z = m(x)
            if hook.startswith("tensor") or hook == "torch_softmax":
                z.register_hook(edit)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                F.cross_entropy(z, y).backward()
        st = capskip_fx.stats(cm)
        assert st.mode == "dense" and st.kept == N, f"step {step}: {st}"
        assert st.fallback.kind.value == "backward hook", f"step {step}: {st}"
        _assert_reference_grads(ref, model, f"step {step}", st)


@needs_batch_marking
@pytest.mark.parametrize("entry", ["capskip_compile", "string"])
@pytest.mark.parametrize("view", ["every_other", "split_pairs"])
def test_logits_viewed_at_every_other_row_run_dense(entry, view):
    """Eager code returning every other row of the head's logits (z[::2], or z.view(N // 2, 2, C)[:, 0]): row b
    of the returned logits is the head's row 2b, so the head's rows are not the loss's: dense, with the reason."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    pick = (lambda z: z[::2]) if view == "every_other" else (lambda z: z.view(z.shape[0] // 2, 2, z.shape[1])[:, 0])

    class Picked(_Custom):
        def forward(self, x):
            return torch._dynamo.disable(pick)(super().forward(x))

    model = Picked().double()
    ref = copy.deepcopy(model)
    cm = _forced_rows(model, entry)
    for step in range(2):
        x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N // 2,))
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            F.cross_entropy(cm(x), y).backward()
        st = capskip_fx.stats(cm)
        assert st.mode == "dense", f"step {step}: {st}"
        assert st.fallback.kind.value == "eager logits", f"step {step}: {st}"
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        _assert_reference_grads(ref, model, f"step {step}", st)


class _Ident(torch.autograd.Function):  # not declared row-wise (capskip_fx.rowwise): its graph is refused
    @staticmethod
    def forward(ctx, t):
        return t * 1.0

    @staticmethod
    def backward(ctx, g):
        return g


_POSTS = {  # the head graph's features on their way to the loss, each moving rows somewhere after the head
    "undeclared_function_then_flip": lambda h: (torch._dynamo.graph_break(), _Ident.apply(h).flip(0))[1],
    "eager_then_flip_graph": lambda h: torch._dynamo.disable(lambda t: t * 1.0)(h).flip(0),
    "eager_flip_then_graph": lambda h: torch._dynamo.disable(lambda t: t.flip(0))(h) * 2.0,
}


class _Posted(nn.Module):
    def __init__(self, post: str):
        super().__init__()
        self.a, self.head, self.post = nn.Linear(6, 16), nn.Linear(16, 3), post

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.head(h), _POSTS[self.post](h)


@needs_batch_marking
@pytest.mark.parametrize("entry", ["capskip_compile", "string"])
@pytest.mark.parametrize("post", sorted(_POSTS))
def test_features_moved_by_a_graph_no_proof_covers_run_dense(entry, post):
    """Features moved after the head by a graph refused for another reason than row mixing (an undeclared
    autograd.Function first, a static batch behind eager code) or by eager code before a later graph: no proof
    says their rows stay rows, so the step runs dense (`after the head`), exact."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Posted(post).double()
    ref = copy.deepcopy(model)
    cm = _forced_rows(model, entry)
    scale = torch.arange(1.0, N + 1, dtype=torch.float64)

    def rows(out, y):
        return F.cross_entropy(out[0], y, reduction="none") + out[1].pow(2).sum(1) * scale

    _steps_against_reference(model, cm, ref, rows, 2, "after the head")


class _LossPastBreak(_Custom):
    """A Hugging Face-like model: the loss computed in the forward, in a graph of its own past a break."""

    def forward(self, x, labels):
        z = super().forward(x)
        torch._dynamo.graph_break()
        return F.cross_entropy(z, labels), z


@needs_batch_marking
@pytest.mark.parametrize("entry", ["capskip_compile", "string"])
def test_a_loss_computed_past_a_break_still_selects(entry):
    """The loss's own graph past a break is refused (no head: a scalar), but it holds no rows to move: the head
    upstream keeps selecting, its gradients the rule-weighted reference's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _LossPastBreak().double()
    ref = copy.deepcopy(model)
    cm = _forced_rows(model, entry)
    for step in range(2):
        x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cm(x, y)[0].backward()
        st = capskip_fx.stats(cm)
        assert st.mode == "selected" and st.kept == 3 and st.fallback is None, f"step {step}: {st}"
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        (F.cross_entropy(ref(x, y)[1], y, reduction="none") * st.weight.double()).sum().div(N).backward()
        _assert_reference_grads(ref, model, f"step {step}", st)


@needs_batch_marking
@pytest.mark.parametrize("entry", ["capskip_compile", "string"])
@pytest.mark.parametrize("flipped_first", [True, False])
def test_two_forwards_one_moved_after_the_head_are_two_forwards_of_the_step(entry, flipped_first):
    """Two forwards, one back-propagated through features flipped past a break: that one runs dense (`after the
    head`), the other selects; the step lists both (n = 2N), and gradients are the reference's with each
    forward's weights."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _FeaturesAfterEager("flip", "break").double()
    ref = copy.deepcopy(model)
    cm = _forced_rows(model, entry)
    scale = torch.arange(1.0, N + 1, dtype=torch.float64)
    flips = (True, False) if flipped_first else (False, True)

    def rows(m, x, y, flip):
        out = m(x)
        return F.cross_entropy(out[0], y, reduction="none") + (out[1].pow(2).sum(1) * scale if flip else 0.0)

    _two_forwards_one_after_the_head(model, cm, ref, rows, flips)


def _two_forwards_one_after_the_head(model, cm, ref, rows, dense_first) -> None:
    """Two steps of two forwards in one backward, ``rows(m, x, y, dense)`` each forward's per-row losses
    through module ``m``, ``dense`` True for the one that runs dense (`after the head`): the step lists both
    forwards (n = 2N, kept N + 3: the forced rows of the other) and every gradient is the float64 reference's
    with each forward's weights."""
    for step in range(2):
        xs = [torch.randn(N, 6, dtype=torch.float64) for _ in dense_first]
        y = torch.randint(0, 3, (N,))
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sum(rows(cm, x, y, d).sum() for x, d in zip(xs, dense_first)).div(N).backward()
        st = capskip_fx.stats(cm)
        assert st.n == 2 * N and len(st.forwards) == 2 and st.kept == N + 3, f"step {step}: {st}"
        dense = [f for f in st.forwards if f.mode == "dense"]
        assert len(dense) == 1 and dense[0].fallback.kind.value == "after the head", f"step {step}: {st.forwards}"
        w = next(f for f in st.forwards if f.mode == "selected").weight.double()
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        sum((rows(ref, x, y, d) * (1.0 if d else w)).sum() for x, d in zip(xs, dense_first)).div(N).backward()
        _assert_reference_grads(ref, model, f"step {step}", st)


class _MaybeScaled(nn.Module):
    """The head's logits returned as they are, or times a learnable scale past a graph break."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(6, 16), nn.Linear(16, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x, scaled: bool):
        z = self.head(F.gelu(self.a(x)))
        if not scaled:
            return z
        torch._dynamo.graph_break()
        return z * self.scale


@needs_batch_marking
@pytest.mark.parametrize("entry", ["capskip_compile", "string"])
@pytest.mark.parametrize("scaled_first", [True, False])
def test_two_forwards_one_scaled_after_the_head_are_two_forwards_of_the_step(entry, scaled_first):
    """Two forwards in one backward, one through a learnable scale past a break: that forward runs dense
    (`after the head`), the other selects; the step lists both (n = 2N, kept N + 3) and gradients are the
    reference's with each forward's weights."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _MaybeScaled().double()
    ref = copy.deepcopy(model)
    cm = _forced_rows(model, entry)
    order = (True, False) if scaled_first else (False, True)
    _two_forwards_one_after_the_head(model, cm, ref, lambda m, x, y, s: F.cross_entropy(m(x, s), y, reduction="none"),
                                     order)


@needs_batch_marking
@pytest.mark.parametrize("entry", ["capskip_compile", "string"])
def test_each_backward_through_a_scaled_forward_is_a_dense_step(entry):
    """Two backwards through one forward whose logits pass a learnable scale past a break
    (retain_graph=True): each is a step of its own, dense with the reason (the second was not recorded)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _ScaledAfterHead("break", True).double()
    cm = _forced_rows(model, entry)
    steps = []
    for _ in range(2):
        x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = F.cross_entropy(cm(x), y)
            for retain in (True, False):
                loss.backward(retain_graph=retain)
                st = capskip_fx.stats(cm)
                assert st.mode == "dense" and st.fallback.kind.value == "after the head", st
                steps.append(st.step)
    assert steps == sorted(set(steps)) and len(steps) == 4, f"each backward should be a step of its own: {steps}"

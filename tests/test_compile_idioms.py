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

@pytest.fixture(autouse=True)
def _many_compiles():
    # every test compiles its own Linears / blocks (one cache entry per instance): past recompile_limit
    # Dynamo would run them eagerly
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


OPTS = {"rule": "random", "keep": 0.5, "backend": "aot_eager"}
N = 8


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(x)).relu()


class Tokens(nn.Module):
    """Embedding, two pre-norm blocks on (N, T, D) tokens, mean pool, Linear head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(8) for _ in range(2)])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h.mean(1))


def _mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _compile_linears(model):
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.compile(backend="capskip", options=OPTS)
    return model


def _compile_regions(model, head=True):
    for b in model.blocks:
        b.compile(backend="capskip", options=OPTS)
    if head:
        model.head.compile(backend="capskip", options=OPTS)
    return model


def _steps(model, make_x, steps=3):
    """Run ``steps`` steps; per step, the largest relative gradient error against the float64 dense
    reference weighted by that step's selection, and its stats."""
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
    return out


def test_each_linear_compiled_in_place_runs_the_rule_once_per_backward():
    """Regression: ``layer.compile()`` on every Linear of an MLP made every graph a head, each drawing
    its own rows in one backward (rel. error 0.4-0.9, stats kept 24/16)."""
    torch.manual_seed(0)
    model = _compile_linears(_mlp().double())
    for err, mode, n, kept, rows, fallback, _ in _steps(model, lambda: torch.randn(N, 6, dtype=torch.float64)):
        assert n == N, f"one forward per step, {n} rows counted"
        assert kept == N // 2 and rows == N // 2 and mode == "selected", (mode, kept, rows, fallback)
        assert err < 1e-12, f"gradient differs from the selection's dense reference by {err:.3g}"
    roles = [r["role"] for r in capskip_fx.report(model)]
    assert roles.count("head") == 1, f"exactly one head graph (the logits'), got roles {roles}"


def test_root_module_compiled_in_place():
    torch.manual_seed(1)
    model = _mlp().double()
    model.compile(backend="capskip", options=OPTS)
    for err, mode, n, kept, rows, _, _ in _steps(model, lambda: torch.randn(N, 6, dtype=torch.float64)):
        assert (mode, n, kept, rows) == ("selected", N, N // 2, N // 2)
        assert err < 1e-12, f"gradient error {err:.3g}"
    assert not any(k.startswith("_orig_mod") for k in model.state_dict()), "in-place compile keeps clean keys"


def test_regional_compile_skips_rows_in_every_block():
    torch.manual_seed(2)
    model = _compile_regions(Tokens().double())
    for err, mode, n, kept, rows, _, _ in _steps(model, lambda: torch.randn(N, 5, 4, dtype=torch.float64)):
        assert (mode, n, kept, rows) == ("selected", N, N // 2, N // 2)
        assert err < 1e-12, f"gradient error {err:.3g}"
    rep = capskip_fx.report(model)
    assert [r["role"] for r in rep] == ["body", "body", "head"], rep
    for r in rep:
        assert r["backward"] == "selected rows" and r["row_counts"] == [N // 2], f"graph ran all rows: {r}"


def test_regional_compile_with_the_head_left_eager_is_dense_with_a_reason():
    """Regression: blocks compiled, head eager: stats showed n=0 and no reason."""
    torch.manual_seed(3)
    model = _compile_regions(Tokens().double(), head=False)
    results = _steps(model, lambda: torch.randn(N, 5, 4, dtype=torch.float64))
    assert [r[6] for r in results] == [0, 1, 2], "one step counted per backward"
    for err, mode, n, kept, rows, fallback, _ in results:
        assert (mode, n, kept, rows) == ("dense", N, N, N), (mode, n, kept, rows)
        assert fallback and "dense backward" in fallback, f"a dense step says why: {fallback!r}"
        assert err < 1e-12, f"gradient error {err:.3g}"
    assert "not the output of a compiled graph" in results[-1][5]


def test_two_models_compiled_in_place_keep_their_own_state():
    torch.manual_seed(4)
    a, b = _mlp().double(), _mlp().double()
    a.compile(backend="capskip", options=OPTS)
    b.compile(backend="capskip", options=dict(OPTS, keep=0.25))
    x, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 3, (N,))
    for _ in range(2):
        F.cross_entropy(a(x), y).backward()
        F.cross_entropy(b(x), y).backward()
    assert capskip_fx.stats(a).kept == N // 2 and capskip_fx.stats(b).kept == N // 4
    assert capskip_fx.stats(a).n == N and capskip_fx.stats(b).n == N


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
        F.cross_entropy(model(x * float("nan")), y).backward()
    assert "non-finite" in (capskip_fx.stats(model).fallback or ""), capskip_fx.stats(model)
    F.cross_entropy(model(x), y).backward()
    s = capskip_fx.stats(model)
    assert (s.mode, s.fallback, s.kept) == ("selected", None, N // 2), s

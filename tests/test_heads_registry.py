"""The head-form registry (capskip_fx/passes/heads/): per form, a hand-traced joint graph the registry finds
with that entry, its Gram features checked against the per-example gradients of the head's parameters, and
a near miss refused with its reason.  No torch.compile: the graphs are make_fx traces over fake inputs with a
dynamic batch, named as AOTAutograd names a joint graph's inputs (primals_*, tangents_*)."""
from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from capskip_fx.passes.find_head import find_head
from capskip_fx.passes.heads import HEAD_FORMS, form_of, head_forms_markdown, outputs_and_tangents
from capskip_fx.passes.heads.analysis import analyse
from capskip_fx.records import Refused
from capskip_fx.rules.base import head_gram

N, T, D, C = 6, 3, 4, 5


@dataclass
class Case:
    fn: Callable  # (*inputs) -> tuple of outputs; output 0 is the logits
    inputs: tuple  # ("p", shape): a parameter (static shape); ("x", shape): batch in dim 0; ("j", shape, high)
    form: Optional[str]  # the entry that decides output 0 (None: no entry matches)
    reason: Optional[str] = None  # a refusal: a part of its text; None: a head is found


def _linear(x, w, b=None):
    return F.linear(x, w, b)


def _cos(x, w, s=3.0):
    return s * (x @ F.normalize(w).T)


def _at_last(L, j):
    return L[torch.arange(L.shape[0]), j]


P, X = "p", "x"
FOUND = {
    "linear": Case(lambda x, w, b: (_linear(x, w, b),), ((X, (N, D)), (P, (C, D)), (P, (C,))), "linear"),
    "linear_no_bias": Case(lambda x, w: (_linear(x, w),), ((X, (N, D)), (P, (C, D))), "linear"),
    "mm_plus_bias": Case(lambda x, w, b: (x @ w.T + b,), ((X, (N, D)), (P, (C, D)), (P, (C,))), "linear"),
    "times_number": Case(lambda x, w, b: (_linear(x, w, b) * 2.0,), ((X, (N, D)), (P, (C, D)), (P, (C,))),
                         "scaled_linear"),
    "over_number": Case(lambda x, w: (_linear(x, w) / 4.0,), ((X, (N, D)), (P, (C, D))), "scaled_linear"),
    "sum_one_input": Case(lambda x, w1, b1, w2, b2: (_linear(x, w1, b1) + _linear(x, w2, b2),),
                          ((X, (N, D)), (P, (C, D)), (P, (C,)), (P, (C, D)), (P, (C,))), "sum_of_linears"),
    "sum_uniform": Case(lambda x1, x2, w1, b1, w2, b2: (_linear(x1, w1, b1) - _linear(x2, w2, b2),),
                        ((X, (N, D)), (X, (N, D + 1)), (P, (C, D)), (P, (C,)), (P, (C, D + 1)), (P, (C,))),
                        "sum_of_linears"),
    "sum_weighted": Case(lambda x1, x2, w1, b1, w2: (_linear(x1, w1, b1) + 0.5 * _linear(x2, w2),),
                         ((X, (N, D)), (X, (N, D + 1)), (P, (C, D)), (P, (C,)), (P, (C, D + 1))), "sum_of_linears"),
    "sum_input_after_first_head": Case(lambda f, w1, w2: (_linear(f[:, 0], w1) + _linear(f[:, 1], w2),),
                                       ((X, (N, 2, D)), (P, (C, D)), (P, (C, D))), "sum_of_linears"),
    "cosine": Case(lambda x, w: (_cos(x, w),), ((X, (N, D)), (P, (C, D))), "cosine"),
    "cosine_unit_scale": Case(lambda x, w: (_cos(F.normalize(x), w, 1.0),), ((X, (N, D)), (P, (C, D))), "cosine"),
    "arange_indexed": Case(lambda H, j, w, b: (_at_last(_linear(H, w, b), j),),
                           ((X, (N, T, D)), ("j", (N,), T), (P, (C, D)), (P, (C,))), "arange_indexed"),
    "token_logits": Case(lambda H, w, b: (_linear(H, w, b),), ((X, (N, T, D)), (P, (C, D)), (P, (C,))),
                         "token_logits"),
    "token_logits_scaled": Case(lambda H, w: (0.5 * _linear(H, w),), ((X, (N, T, D)), (P, (C, D))), "token_logits"),
}

# one near miss per form (its own obligations refuse it), then the analysis' refusals no form matches
REFUSED = {
    "linear_over_reshaped_rows": Case(lambda x, w: (_linear(x, w).view(-1, 4),), ((X, (4 * N, D)), (P, (1, D))),
                                      "linear", "a Linear over reshaped rows, e.g. multiple choice"),
    "scaled_linear_over_reshaped_rows": Case(lambda x, w: ((_linear(x, w) * 2.0).view(-1, 4),),
                                             ((X, (4 * N, D)), (P, (1, D))), "scaled_linear",
                                             "a Linear over reshaped rows"),
    "sum_over_other_rows": Case(lambda x, y, w1, w2: (_linear(x, w1) + _linear(y, w2),),
                                ((X, (N, D)), (P, (1, D)), (P, (C, D)), (P, (C, D))), "sum_of_linears",
                                "a sum of Linear heads over inputs not of the logits' rows"),
    "cosine_in_sum": Case(lambda x, w1, w2: (_cos(x, w1) + _linear(x, w2),), ((X, (N, D)), (P, (C, D)), (P, (C, D))),
                          "cosine", "a cosine head in a sum of heads (its Gram is followed for one cosine head"),
    "cosine_at_last_token": Case(lambda H, j, w: (_at_last(_cos(H.reshape(-1, D), w).view(H.shape[0], T, C), j),),
                                 ((X, (N, T, D)), ("j", (N,), T), (P, (C, D))), "cosine",
                                 "a cosine head read at L[arange(N), j]"),
    "cosine_over_reshaped_rows": Case(lambda x, w: (_cos(x, w).view(-1, 2 * C),), ((X, (2 * N, D)), (P, (C, D))),
                                      "cosine", "a cosine head whose input is not (N, d) of the logits' rows"),
    "arange_indexed_sum": Case(lambda H, j, w1, w2: (_at_last(_linear(H, w1) + _linear(H, w2), j),),
                               ((X, (N, T, D)), ("j", (N,), T), (P, (C, D)), (P, (C, D))), "arange_indexed",
                               "L[arange(N), j] of a sum of Linear heads"),
    "arange_indexed_flat_input": Case(
        lambda H, j, w: (_at_last(_linear(H.reshape(-1, D), w).view(H.shape[0], T, C), j),),
        ((X, (N, T * D)), ("j", (N,), T), (P, (C, D))), "arange_indexed",
        "L[arange(N), j] of a Linear whose input is not (N, T, d)"),
    "token_sum": Case(lambda H, w1, w2: (_linear(H, w1) + _linear(H, w2),), ((X, (N, T, D)), (P, (C, D)), (P, (C, D))),
                      "token_logits", "not produced by one Linear per token (a sum of Linear heads)"),
    "token_not_linear": Case(lambda H, w: (torch.relu(_linear(H, w)),), ((X, (N, T, D)), (P, (C, D))),
                             "token_logits", "token-shaped logits (N, T, C) not produced by one Linear per token"),
    "token_cosine": Case(lambda H, w: (_cos(H.reshape(-1, D), w).view(H.shape[0], T, C),),
                         ((X, (N, T, D)), (P, (C, D))), "token_logits",
                         "token-shaped logits (N, T, C) of a cosine head"),
    "token_flat_input": Case(lambda H, w: (_linear(H.reshape(-1, D), w).view(H.shape[0], T, C),),
                             ((X, (N, T * D)), (P, (C, D))), "token_logits",
                             "token-shaped logits from a Linear whose input is not a view of (N, T, d)"),
    "token_computed_weight": Case(lambda H, w: (_linear(H, w * 2),), ((X, (N, T, D)), (P, (C, D))), "token_logits",
                                  "is computed, not a parameter nor normalize(W)"),
    # the analysis' refusals (no form matches)
    "computed_weight": Case(lambda x, w: (_linear(x, w * 2),), ((X, (N, D)), (P, (C, D))), None,
                            "is computed, not a parameter nor normalize(W) of one over its rows"),
    "tensor_scale": Case(lambda x, w, s: (_linear(x, w) * s,), ((X, (N, D)), (P, (C, D)), (P, ())), None,
                         "the head's logits are scaled by a tensor"),
    "cosine_with_bias": Case(lambda x, w, b: (_linear(x, F.normalize(w), b),), ((X, (N, D)), (P, (C, D)), (P, (C,))),
                             None, "a cosine head with a bias"),
    "not_a_linear": Case(lambda x, w: (torch.relu(_linear(x, w)),), ((X, (N, D)), (P, (C, D))), None,
                         "not produced by a Linear (addmm/mm), a sum of Linears or a Linear scaled by a number"),
    "not_logits": Case(lambda x, w: (_linear(x, w).sum(1),), ((X, (N, D)), (P, (C, D))), None,
                       "not a 2-D (N, C) or token-shaped (N, T, C) differentiable tensor"),
}


def _inputs(case: Case, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, spec[2], spec[1], generator=g) if spec[0] == "j" else
            torch.randn(spec[1], generator=g, dtype=torch.float64) for spec in case.inputs]


def _trace(case: Case, real: list[torch.Tensor]) -> fx.GraphModule:
    """The forward of a joint graph: make_fx over fakes whose batch dims (dim 0 of "x", "j" inputs and of the
    tangents) are dynamic, duck-sized (equal batches share one symbol), parameters static."""
    mode = FakeTensorMode(shape_env=ShapeEnv())

    def fake(t: torch.Tensor, batch: bool) -> torch.Tensor:
        dims = [DimDynamic.DUCK if batch and i == 0 else DimDynamic.STATIC for i in range(t.dim())]
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))

    outs = case.fn(*real)
    primals = [fake(t, spec[0] != P) for t, spec in zip(real, case.inputs)]
    tangents = [fake(torch.zeros_like(o), True) for o in outs]
    names = [f"primals_{i + 1}" for i in range(len(primals))] + [f"tangents_{i + 1}" for i in range(len(outs))]
    scope = {"fn": case.fn}
    exec(f"def joint({', '.join(names)}):\n    return fn({', '.join(names[:len(primals)])})", scope)
    return make_fx(scope["joint"], tracing_mode="fake")(*primals, *tangents)


def _run(gm: fx.GraphModule, args: list) -> dict:
    """Every node's value on real inputs (the graph as find_head left it)."""
    values = {}

    class Record(fx.Interpreter):
        def run_node(self, n):
            values[n] = super().run_node(n)
            return values[n]

    gm.recompile()
    Record(gm).run(*args)
    return values


def _per_example_gram(case: Case, real: list, delta: torch.Tensor) -> torch.Tensor:
    """<G_i, G_j>: G_i the gradient of (z_i * delta_i).sum() in every parameter, by autograd per row."""
    params = [t.requires_grad_() for t, spec in zip(real, case.inputs) if spec[0] == P]
    rows = []
    for i in range(delta.shape[0]):
        z = case.fn(*real)[0]
        grads = torch.autograd.grad((z[i] * delta[i]).sum(), params, allow_unused=True)
        rows.append(torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)]))
    for p in params:
        p.requires_grad_(False)
    G = torch.stack(rows)
    return G @ G.T


@pytest.mark.parametrize("name", list(FOUND))
def test_the_registry_finds_each_form_with_its_entry_and_its_gram(name):
    """The Head carries the deciding entry's name; the rule's Gram over the Head's features equals the Gram of
    the per-example gradients of every head parameter (up to a positive factor: a uniform scale cancels in
    the relative bound), in float64; the logits after the graph surgery are the same (to rounding: a head
reading its input back as a slice of the features may take another BLAS path)."""
    case = FOUND[name]
    real = _inputs(case)
    gm = _trace(case, real)
    before = _run(gm, real + [torch.zeros_like(o) for o in case.fn(*real)])
    z_before = before[[n for n in gm.graph.nodes if n.op == "output"][0].args[0][0]]
    head = find_head(gm.graph)
    gm.graph.lint()
    assert head.form == case.form, f"{name}: found by {head.form!r}, expected {case.form!r}"
    values = _run(gm, real + [torch.zeros_like(o) for o in case.fn(*real)])
    z, h = values[head.z], values[head.h]
    assert torch.allclose(z, z_before, rtol=1e-13, atol=0), f"{name}: the graph surgery changed the logits"
    delta = torch.randn(z.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    K = head_gram(delta, h, bias=head.bias, sketch=0)[0]
    ref = _per_example_gram(case, real, delta)
    scale = ref.norm() / K.norm()
    assert scale > 0 and torch.allclose(K * scale, ref, rtol=1e-9, atol=1e-9 * ref.abs().max()), (
        f"{name}: the Gram of the head's features is not the per-example gradients' Gram:\n{K * scale}\n{ref}")


@pytest.mark.parametrize("name", list(REFUSED))
def test_near_misses_are_refused_by_their_entry_with_its_reason(name):
    case = REFUSED[name]
    gm = _trace(case, _inputs(case))
    (idx, z, g), *_ = outputs_and_tangents(gm.graph)
    c = analyse(idx, z, g)
    form = form_of(c) if c is not None else None
    assert (form.name if form else None) == case.form, f"{name}: decided by {form}, expected {case.form!r}"
    before = str(gm.graph)
    with pytest.raises(Refused) as e:
        find_head(gm.graph)
    assert "output 0: " in str(e.value) and case.reason in str(e.value), f"{name}: {e.value}"
    assert str(gm.graph) == before, f"{name}: a refused head left nodes in the graph"


@pytest.mark.parametrize("name", list(FOUND) + list(REFUSED))
def test_at_most_one_form_matches(name):
    """The matches are disjoint, so the registry's order decides nothing."""
    case = {**FOUND, **REFUSED}[name]
    gm = _trace(case, _inputs(case))
    for idx, z, g in outputs_and_tangents(gm.graph):
        c = analyse(idx, z, g)
        matched = [f.name for f in HEAD_FORMS if c is not None and f.match(c)]
        assert len(matched) <= 1, f"{name}: output {idx} matches {matched}"


def test_registry_order_and_entries_are_as_documented():
    assert [f.name for f in HEAD_FORMS] == ["linear", "scaled_linear", "sum_of_linears", "cosine", "arange_indexed",
                                            "token_logits"]
    assert {c.form for c in FOUND.values()} == {f.name for f in HEAD_FORMS}, "a form without a positive case"
    assert {c.form for c in REFUSED.values()} - {None} == {f.name for f in HEAD_FORMS}, "a form without a near miss"
    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    listed = doc.split("<!-- head-forms: generated -->\n", 1)[1].split("   <!-- /head-forms -->", 1)[0]
    assert listed == head_forms_markdown(), "docs/design.md's head forms are stale: regenerate them from the registry"


def test_logits_index_and_every_outputs_reason():
    """``logits_index`` picks its output; without it the first output a form proves is the head, and a
    refusal lists every output's reason in order."""
    case = Case(lambda x, w, v: (torch.relu(_linear(x, w)), _linear(x, v)), ((X, (N, D)), (P, (C, D)), (P, (C, D))),
                "linear")
    gm = _trace(case, _inputs(case))
    head = find_head(gm.graph)
    assert (head.output_index, head.form) == (1, "linear")
    with pytest.raises(Refused) as e:
        find_head(_trace(case, _inputs(case)).graph, logits_index=0)
    assert "(output 0: not produced by a Linear" in str(e.value) and "output 1" not in str(e.value), str(e.value)
    two = Case(lambda x, w: (torch.relu(_linear(x, w)), _linear(x, w * 2)), ((X, (N, D)), (P, (C, D))), None)
    with pytest.raises(Refused) as e:
        find_head(_trace(two, _inputs(two)).graph)
    assert "(output 0: not produced by a Linear" in str(e.value) and "; output 1: the head's weight" in str(e.value)

"""runtime/published.py: a body graph reuses the rows of the gathered backward that fed it only when
nothing between the two graphs can have written its skipped rows.

Regional compile of ``Tokens``: blocks[1]'s gathered backward returns the gradient of blocks[0]'s output,
zero outside its rows; blocks[0] takes those rows without a host read.  Code that edits that gradient on
the way (a tensor hook through ``.data``, an in-place node pre-hook, a module backward hook) must make
blocks[0] find its own rows instead.  ``verify=False``: the reuse check alone keeps the gradients exact.
"""
from __future__ import annotations

import copy
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F

import capskip_fx
from capskip_fx.dynamo_entry import install_batch_marking
from capskip_fx.runtime.published import PublishedRows
from helpers.models import Tokens
from helpers.torch_features import needs_batch_marking

N = 8
OPTS = {"rule": "random", "keep": 0.5, "backend": "aot_eager", "verify": False}


class _Hooked(Tokens):
    """``Tokens`` whose first block's output passes ``edit`` (installed by the test) before blocks[1]."""

    edit = None

    def forward(self, x):
        h0 = self.blocks[0](self.embed(x))
        if self.edit is not None and torch.is_grad_enabled():
            self.edit(h0)
        return self.head(self.blocks[1](h0).mean(1))


def _data_hook(h0):  # gradient noise written through .data: no new tensor, no version bump
    h0.register_hook(lambda g: g.data.add_(0.25))


def _node_prehook(h0):  # an in-place edit on the autograd node itself: only the version counter shows it
    h0.grad_fn.register_prehook(lambda go: (go[0].add_(0.25), None)[1])


def _module_hook(model):
    model.blocks[1].register_full_backward_hook(lambda m, gi, go: (gi[0].data.add_(0.25), None)[1])


def _run(model, edit_grad, steps=2):
    """Per step: the largest relative error against a float64 reference with the same edit."""
    ref = copy.deepcopy(model)
    errs = []
    for step in range(steps):
        torch.manual_seed(step)
        x, y = torch.randn(N, 5, 4, dtype=torch.float64), torch.randint(0, 3, (N,))
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            F.cross_entropy(model(x), y).backward()
        s = capskip_fx.stats(model)
        assert (s.mode, s.kept) == ("selected", N // 2), s
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        ((F.cross_entropy(ref(x), y, reduction="none") * s.weight).sum() / N).backward()
        errs.append(max(float((a.grad - b.grad).norm() / a.grad.norm().clamp_min(1e-30))
                        for a, b in zip(ref.parameters(), model.parameters())))
    return errs


def _regional(edit=None, module_hook=False):
    torch.manual_seed(1)
    model = _Hooked().double()
    model.edit = edit
    if module_hook:
        _module_hook(model)
    for m in list(model.blocks) + [model.head]:
        m.compile(backend="capskip", options=OPTS)
        install_batch_marking(m)  # as compile_regions does: step 0 selects too
    return model


@needs_batch_marking
def test_rows_are_reused_when_nothing_edits_the_gradient():
    model = _regional()
    assert max(_run(model, None)) < 1e-12
    rep = capskip_fx.report(model)
    assert rep[0]["rows_reused"] == 2 and rep[0]["host_reads"] == 0, rep[0]


@needs_batch_marking
@pytest.mark.parametrize("edit", [_data_hook, _node_prehook], ids=["tensor_hook_data", "node_prehook_inplace"])
def test_an_edit_between_the_graphs_makes_the_block_find_its_rows(edit):
    model = _regional(edit)
    errs = _run(model, edit)
    assert max(errs) < 1e-12, f"blocks[0] dropped what the edit put on the skipped rows: {errs}"
    rep = capskip_fx.report(model)
    assert rep[0]["rows_reused"] == 0 and rep[0]["host_reads"] == 2, rep[0]


@needs_batch_marking
def test_a_module_backward_hook_makes_the_block_find_its_rows():
    model = _regional(module_hook=True)
    errs = _run(model, None)
    assert max(errs) < 1e-12, errs
    assert capskip_fx.report(model)[0]["rows_reused"] == 0


def _in_backward(fn):
    """Run ``fn`` inside a backward (publish queues an engine callback for the backward's end)."""
    a = torch.ones(1, requires_grad=True)
    b = a * 1
    b.register_hook(lambda g: fn())
    b.sum().backward()


def test_rows_of_unit():
    """The checks one by one, on tensors: identity, version, n, one index, a hook-free output, module hooks."""
    plain, hooked = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    hooked.register_full_backward_hook(lambda m, gi, go: None)
    x = torch.randn(4, 3, requires_grad=True)
    y, y2 = x * 2, x * 3  # outputs of two "body graphs"
    y.register_hook(lambda t: None)
    idx = torch.tensor([0, 2])
    spec = type("S", (), {"kind": "batch"})()

    def checks():
        pub = PublishedRows()
        pub.watch(0, [y])
        pub.watch(1, [y2])
        g = torch.zeros(4, 3)
        pub.publish([g], [spec], idx, 4)
        assert pub.rows_of([g], 4, y2.grad_fn) is None, "no model known: its module hooks can't be shown absent"
        pub.owner = weakref.ref(plain)
        assert pub.rows_of([g], 4, None) is None, "no node: the outputs can't be checked"
        assert pub.rows_of([torch.zeros(4, 3)], 4, y2.grad_fn) is None, "another tensor"
        assert pub.rows_of([g], 5, y2.grad_fn) is None, "another batch size"
        assert pub.rows_of([g], 4, y.grad_fn) is None, "a tensor hook on the output"
        assert pub.rows_of([g], 4, (x * 4).grad_fn) is None, "an output not watched (replaced or never seen)"
        hook_pub = PublishedRows()  # (the hooks are looked up once per backward)
        hook_pub.owner = weakref.ref(hooked)
        hook_pub.watch(1, [y2])
        hook_pub.publish([g], [spec], idx, 4)
        assert hook_pub.rows_of([g], 4, y2.grad_fn) is None, "a module backward hook"
        g.add_(0)  # an in-place edit
        assert pub.rows_of([g], 4, y2.grad_fn) is None, "a newer version"
        g2 = torch.zeros(4, 3)
        pub.publish([g2], [spec], idx, 4)
        assert pub.rows_of([g2], 4, y2.grad_fn) is idx
        assert pub.rows_of([g2], 4, y2.grad_fn) is None, "a match is consumed"

    _in_backward(checks)

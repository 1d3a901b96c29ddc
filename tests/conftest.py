"""Tiny in-file models and compiled models shared across tests (Inductor compiles are slow on CPU)."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import settings

import capskip_fx
from helpers.examples import PROFILE, examples


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def _inductor_param(item) -> bool:
    """A parametrized case whose parameters include the backend "inductor" (alone or in a tuple)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(v == "inductor" or (isinstance(v, tuple) and "inductor" in v) for v in params.values())


def pytest_collection_modifyitems(config, items):
    for item in items:  # the fast tier (-m "not slow and not inductor and not subprocess and not heavy") leaves these out
        if _inductor_param(item) and item.get_closest_marker("inductor") is None:
            item.add_marker(pytest.mark.inductor)
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# two intra-op threads, or the cores' share of each pytest-xdist worker (``-n auto``): no oversubscription
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 2) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))

# Hypothesis: HYPOTHESIS_PROFILE=ci (default; fewer, derandomised examples) or thorough (every test's full
# count, a fresh draw each run).  Tests scale their own counts with helpers.examples.examples(n).
settings.register_profile("ci", max_examples=examples(100), deadline=None, derandomize=True)
settings.register_profile("thorough", max_examples=100, deadline=None)
settings.load_profile(PROFILE)


@pytest.fixture(autouse=True)
def many_compiles():
    """Every test: each compiled model gets its own cache entry (capskip guards a graph on its module),
    and past Dynamo's per-code recompile_limit (8) a later compile of the same forward code (nn.Sequential's,
    a test file's shared class) would run eagerly, so a test's outcome would depend on which ran before it.
    Tests of the limit itself patch it lower inside.  A string-backend module whose first batch is static
    holds two entries (the static first step's and the dynamic one), and every module compiled in place adds
    to one shared code object's (``Module._call_impl``) accumulated entries: hence the headroom."""
    with torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096):
        yield


def make_mlp():
    return nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 5))


def make_deit(depth=1):
    import timm
    return timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4,
                             num_classes=10, depth=depth)


def make_mixer():
    from timm.models.mlp_mixer import MlpMixer
    return MlpMixer(num_classes=7, img_size=32, patch_size=8, num_blocks=1, embed_dim=32)


MODELS = {
    "mlp": (make_mlp, lambda n: torch.randn(n, 12)),
    "deit": (make_deit, lambda n: torch.randn(n, 3, 32, 32)),
    "mixer": (make_mixer, lambda n: torch.randn(n, 3, 32, 32)),
}

_CACHE: dict = {}


def compiled(name: str, dtype: torch.dtype, backend: str):
    """(eager model, capskip model) compiled once per session for (name, dtype, backend), handed to each
    test as built: weights, rule ("dense"), step, epoch and the rules' random stream restored, so a test's
    verdict does not depend on which test stepped or re-ruled the model before it.  ``verify=False``: the
    verify schedule is per-graph history (a test after the one that used it up would run unverified, one
    before it falls back to dense-masked and hides a wrong gathered backward), so the proof alone decides."""
    key = (name, dtype, backend)
    if key not in _CACHE:
        torch.manual_seed(0)
        model = MODELS[name][0]().to(dtype)
        cm = capskip_fx.compile(model, rule="dense", backend=backend, verify=False)
        built = copy.deepcopy(cm.state_dict())
        # the stream compile(seed=0) draws from, as it is before its first draw
        built["_capskip"].update(generator=torch.Generator().manual_seed(0).get_state(), generator_device="cpu")
        _CACHE[key] = (model, cm, built)
    model, cm, built = _CACHE[key]
    cm.rule = "dense"
    cm.load_state_dict(dict(built))  # (its hook pops the rule's entry: a copy)
    return model, cm


def make_input(name, n, dtype, seed=0):
    torch.manual_seed(seed)
    return MODELS[name][1](n).to(dtype)


def selected_step(cm, x, y):
    """One capskip step; returns {name: grad} and the weights the rule used."""
    cm.model.zero_grad(set_to_none=True)
    F.cross_entropy(cm(x), y).backward()
    grads = {k: p.grad.detach().clone() for k, p in cm.model.named_parameters()}
    return grads, capskip_fx.stats(cm).weight.detach().clone()


def reference_grads(model, x, y, weight):
    """Dense eager gradient of sum_i w_i * l_i / N in float64."""
    ref = copy.deepcopy(model).double()
    ref.zero_grad(set_to_none=True)
    losses = F.cross_entropy(ref(x.double()), y, reduction="none")
    (losses * weight.double()).sum().div(x.shape[0]).backward()
    return {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in ref.named_parameters()}


def max_rel_err(grads, ref):
    errs = []
    for k, g in grads.items():
        r = ref[k]
        scale = r.norm().item()
        errs.append((g.double() - r).norm().item() / max(scale, 1e-300) if scale > 0 else g.abs().max().item())
    return max(errs)

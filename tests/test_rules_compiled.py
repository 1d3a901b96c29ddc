"""Every rule through the compiled model, and rule state surviving a checkpoint."""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx
from capskip_fx.rules import RULES, make_rule

from conftest import compiled, make_input, max_rel_err, reference_grads

N = 16
RULE_OPTS = {"capskip": {"budget": 0.5}, "forced": {"keep": 0.25}, "random": {"keep": 0.5},
             "sb": {"beta": 1.0}, "stale_sb": {}, "kabena": {"tau": 0.5}, "ub": {"b": 6, "tau_th": 0}}


def _step(cm, x, y, index):
    cm.model.zero_grad(set_to_none=True)
    F.cross_entropy(cm(x, capskip_index=index), y).backward()
    return ({k: p.grad.detach().clone() for k, p in cm.model.named_parameters()},
            capskip_fx.stats(cm).weight.clone())


@pytest.mark.parametrize("name", sorted(RULES))
def test_rule_gradients_match_weighted_dense(name):
    """The gradient is the weighted dense one for the weights the rule reported, on the kept rows' backward
    (the shared model comes unverified and reset: a wrong gathered weight fails here whatever ran before)."""
    model, cm = compiled("mlp", torch.float64, "aot_eager")
    cm.rule = make_rule(name, **RULE_OPTS.get(name, {}))
    cm.set_epoch(1)  # past SB's primed epoch 0, where SB and Stale-SB keep every row
    modes = set()
    for step in range(3):
        x = make_input("mlp", N, torch.float64, seed=100 + step)
        with torch.no_grad():
            y = model(x).argmax(1)
        y[::3] = (y[::3] + 1) % 5
        grads, w = _step(cm, x, y, torch.arange(N) + N * step)
        st = capskip_fx.stats(cm)
        assert torch.isfinite(w).all(), f"{name}, step {step}: a weight is not finite: {w.tolist()}"
        assert (w >= 0).all(), f"{name}, step {step}: a weight is negative: {w.tolist()}"
        assert st.fallback is None, f"{name}, step {step}: no step should fall back: {st.fallback}"
        err = max_rel_err(grads, reference_grads(model, x, y, w))
        assert err < 1e-10, f"{name}, step {step} ({st}): gradients differ from the weighted reference by {err:.2e}"
        modes.add(st.mode)
    want = {"dense-masked"} if name == "dense" else {"selected"}
    assert want <= modes, f"{name}: some step should have run {want} (the path under test), ran {modes}"


@pytest.mark.parametrize("name", ["sb", "random", "kabena", "ub", "stale_sb"])
def test_state_dict_roundtrip_gives_identical_decisions(name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 5)).double()
    cm = capskip_fx.compile(model, rule=make_rule(name, **RULE_OPTS.get(name, {})), backend="eager", seed=3)
    batches = [(make_input("mlp", N, torch.float64, seed=s), torch.randint(0, 5, (N,)), torch.arange(N) + N * (s % 2))
               for s in range(6)]
    for s, (x, y, i) in enumerate(batches[:3]):
        cm.set_epoch(s // 2)
        _step(cm, x, y, i)
    buf = io.BytesIO()
    torch.save(cm.state_dict(), buf)
    after = [_step(cm, x, y, i)[1] for x, y, i in batches[3:]]
    # a fresh process: new model object, new compiled wrapper, state loaded from disk
    model2 = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 5)).double()
    cm2 = capskip_fx.compile(model2, rule=make_rule(name, **RULE_OPTS.get(name, {})), backend="eager", seed=99)
    buf.seek(0)
    cm2.load_state_dict(torch.load(buf, weights_only=False))
    cm2.set_epoch(1)
    resumed = [_step(cm2, x, y, i)[1] for x, y, i in batches[3:]]
    for a, b in zip(after, resumed):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("name", ["sb", "random", "kabena", "ub", "stale_sb"])
def test_loading_a_state_saved_before_the_first_step_starts_over(name):
    """A state saved before any step (no generator drawn yet), loaded into the same model after steps: the
    next steps select as the first ones did (the generator reseeds, as a fresh run's)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 5)).double()
    cm = capskip_fx.compile(model, rule=make_rule(name, **RULE_OPTS.get(name, {})), backend="eager", seed=3)
    batches = [(make_input("mlp", N, torch.float64, seed=s), torch.randint(0, 5, (N,)), torch.arange(N) + N * s)
               for s in range(3)]
    initial = copy.deepcopy(capskip_fx.state_dict(cm))
    first = [_step(cm, x, y, i)[1] for x, y, i in batches]
    capskip_fx.load_state_dict(cm, initial)
    again = [_step(cm, x, y, i)[1] for x, y, i in batches]
    for s, (a, b) in enumerate(zip(first, again)):
        assert torch.equal(a, b), f"{name}, step {s}: {a.tolist()} after the reload, {b.tolist()} at first"


def test_checkpoint_keys_are_the_models_and_nest():
    """state_dict keys = the original model's + the rule's state, also inside a parent module."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 5))
    cm = capskip_fx.compile(model, rule="sb", backend="aot_eager")
    sd = cm.state_dict()
    assert set(sd) == set(model.state_dict()) | {"_capskip"}, (
        f"the compiled model's checkpoint should hold the model's own keys plus _capskip (the rule's state), got {sorted(sd)!r}")
    parent = nn.ModuleDict({"net": cm})
    psd = parent.state_dict()
    assert set(psd) == {f"net.{k}" for k in sd}, f"inside a parent module the keys should nest under net., got {sorted(psd)!r}"
    cm.set_epoch(1)  # past SB's primed epoch 0 (its loss history is not touched while priming)
    F.cross_entropy(cm(torch.randn(N, 12)), torch.randint(0, 5, (N,))).backward()  # the rule gains state
    psd = parent.state_dict()
    parent.load_state_dict(psd)  # strict
    fresh = nn.ModuleDict({"net": capskip_fx.compile(
        nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 5)), rule="sb", backend="aot_eager")})
    fresh.load_state_dict(psd)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh["net"].model.state_dict()[k], v), (
            f"{k} did not reload into a fresh compiled model as saved")
    a, b = fresh["net"].state_dict()["_capskip"], cm.state_dict()["_capskip"]
    assert a["step"] == b["step"] == 1, f"the step clock should reload with the checkpoint (1 step): fresh {a['step']!r}, saved {b['step']!r}"
    torch.testing.assert_close(a["rule"]["history"], b["rule"]["history"], rtol=0, atol=0, equal_nan=True)
    assert a["rule"]["hist_pos"] == b["rule"]["hist_pos"] == N, (
        f"SB's history position should reload (one batch of {N}): fresh {a['rule']['hist_pos']!r}, saved "
        f"{b['rule']['hist_pos']!r}")

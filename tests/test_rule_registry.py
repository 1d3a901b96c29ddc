"""The rule registry: every name compile() takes is registered once; a name that also sets compile options
(``"vcas"``) works only where they are set, and raises where a Rule object alone would run without them."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import capskip_fx
from capskip_fx import VCAS
from capskip_fx.config import options_from_env
from capskip_fx.rules import RULES, Dense, Forced, build_rule, make_rule, register_rule, registry, rule_names, rule_spec

AT_COMPILE = "at compile time"  # the refusal's words for a name whose options a Rule object cannot carry


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))


@pytest.mark.parametrize("name", rule_names())
def test_every_name_builds_alone_exactly_when_it_sets_no_compile_option(name):
    spec = rule_spec(name)
    assert (name in RULES) == spec.standalone, f"{name}: RULES lists the standalone names only"
    if spec.standalone:
        assert isinstance(make_rule(name), spec.factory), f"make_rule({name!r}) did not build its factory's rule"
    else:
        with pytest.raises(ValueError, match=AT_COMPILE):
            make_rule(name)


def test_vcas_is_a_registered_name_that_turns_vcas_on():
    spec = rule_spec("vcas")
    assert spec.factory is Dense, spec
    assert dict(spec.compile_options) == {"vcas": True}, spec
    cm = capskip_fx.compile(_mlp(), rule="vcas", backend="aot_eager")
    assert cm.config.vcas == VCAS(), f"rule='vcas' left vcas at {cm.config.vcas!r}"
    assert cm.rule.name == "dense", cm.rule
    cm = capskip_fx.compile(_mlp(), rule="vcas", vcas={"freq": 5}, backend="aot_eager")
    assert cm.config.vcas == VCAS(freq=5), "rule='vcas' overrode the user's VCAS options"


@pytest.mark.parametrize("build", [
    lambda: make_rule("vcas"),
    lambda: build_rule("vcas"),
    lambda: capskip_fx.compile(_mlp(), rule="random", match="vcas"),
], ids=["make_rule", "build_rule", "match"])
def test_vcas_without_its_compile_option_raises(build):
    with pytest.raises(ValueError, match=AT_COMPILE):
        build()


def test_swapping_in_vcas_later_raises():
    cm = capskip_fx.compile(_mlp(), rule="dense", backend="aot_eager")
    with pytest.raises(ValueError, match=AT_COMPILE):
        cm.rule = "vcas"
    assert cm.rule.name == "dense", "a refused swap changed the rule"


def test_vcas_false_contradicts_rule_vcas():
    with pytest.raises(ValueError, match="drop vcas=False"):
        capskip_fx.compile(_mlp(), rule="vcas", vcas=False)


def test_string_backend_and_environment_take_registered_names():
    assert options_from_env({"CAPSKIP_RULE": "vcas"}) == {"rule": "vcas"}, (
        "CAPSKIP_RULE=vcas should be accepted as a registered rule name")
    with pytest.raises(ValueError, match="valid names: .*ub, vcas"):
        options_from_env({"CAPSKIP_RULE": "vcass"})
    with pytest.raises(ValueError, match="valid keys"):
        options_from_env({"CAPSKIP_RULE": "vcas", "CAPSKIP_OPTIONS": "keep=0.5"})  # dense takes no keep


def test_a_registered_rule_is_a_name_everywhere(monkeypatch):
    """register_rule is the one step: compile(rule=...), the environment and the option check see it."""
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    monkeypatch.setattr(registry, "RULES", dict(RULES))

    def half(keep: float = 0.5, budget: float = 0.1):  # a factory function, not a class; takes the budget
        return Forced(keep=keep)

    register_rule("half", half)
    assert "half" in rule_names(), f"a registered rule should be listed by rule_names(), got {rule_names()}"
    assert "half" in registry.RULES, f"a registered rule should be in the RULES table, got {sorted(registry.RULES)}"
    with pytest.raises(ValueError, match="registered already"):
        register_rule("half", half)
    assert options_from_env({"CAPSKIP_RULE": "half", "CAPSKIP_OPTIONS": "keep=0.25"}) == {"rule": "half", "keep": 0.25}, (
        "the environment should accept the registered rule and its keep option")
    model = _mlp()
    cm = capskip_fx.compile(model, rule="half", keep=0.25, backend="aot_eager")
    F.cross_entropy(cm(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
    st = capskip_fx.stats(cm)
    assert (st.n, st.kept) == (8, 2), f"the registered factory's rule did not run: {st}"


def test_register_rule_refuses_bad_input():
    with pytest.raises(ValueError, match="registered already"):
        register_rule("capskip", Dense)
    with pytest.raises(TypeError, match="callable"):
        register_rule("not_a_factory", 3)
    assert "not_a_factory" not in rule_names(), f"a refused registration must leave no name behind, got {rule_names()}"

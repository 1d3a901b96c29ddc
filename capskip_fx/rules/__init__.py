"""Selection rules: one file per rule, all behind :class:`~capskip_fx.rules.base.Rule`, and the names
compile() takes, registered below (:func:`~capskip_fx.rules.registry.register_rule`)."""
from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Optional, Union

from .base import HeadView, Rule, SeededRule, Selection
from .capskip import CAPSkip
from .dense import Dense
from .forced import Forced
from .kabena import KABENA
from .random_skip import RandomSkip
from .registry import RULES, RuleSpec, register_rule, rule_names, rule_spec
from .selective_backprop import SelectiveBackprop
from .stale_sb import StaleSB
from .ub import UpperBoundIS

# every name compile() takes, in one list (a new rule: its file, one line here, its row in docs/rules.md)
register_rule("capskip", CAPSkip)
register_rule("dense", Dense)
register_rule("forced", Forced)
register_rule("random", RandomSkip)
register_rule("sb", SelectiveBackprop)
register_rule("stale_sb", StaleSB)
register_rule("kabena", KABENA)
register_rule("ub", UpperBoundIS)
# all rows reach the backward, VCAS samples inside it (capskip_fx/vcas/); ``vcas=`` adds it to any rule
register_rule("vcas", Dense, compile_options={"vcas": True})


def make_rule(rule: Union[str, Rule], **options: Any) -> Rule:
    """Build a rule from its name and keyword options, or pass a Rule object through."""
    if isinstance(rule, Rule):
        if options:
            raise TypeError(f"options {sorted(options)} given with a Rule object; set them on the object")
        return rule
    return rule_spec(rule, standalone=True).factory(**options)


def rule_class(name: str) -> Callable[..., Rule]:
    """The factory (a Rule class) registered under ``name``; the error lists the valid names."""
    return rule_spec(name).factory


def build_rule(rule: Union[str, Rule, RuleSpec], budget: Optional[float] = 0.1,
               options: Optional[dict] = None) -> Rule:
    """A Rule from a name + options; ``budget`` goes to rules that take one (also a ``match=`` rule).
    A :class:`RuleSpec` is a name whose compile options the caller has set (``config.split_options``)."""
    options = dict(options or {})
    if isinstance(rule, Rule):
        return make_rule(rule, **options)
    cls = (rule if isinstance(rule, RuleSpec) else rule_spec(rule, standalone=True)).factory
    if isinstance(options.get("match"), str):
        options["match"] = build_rule(options["match"], budget, {})
    if "budget" in inspect.signature(cls).parameters:
        if budget is None or isinstance(budget, bool) or not isinstance(budget, (int, float)) \
                or math.isnan(budget) or not 0 <= budget <= 1:
            raise ValueError(f"budget must be a number in [0, 1], got {budget!r}")
        options["budget"] = budget
    return cls(**options)


def rule_options(name: str) -> dict[str, inspect.Parameter]:
    """The keyword options a named rule takes (for checking user-supplied option names)."""
    return {k: p for k, p in inspect.signature(rule_class(name)).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


__all__ = ["build_rule", "rule_options", "HeadView", "Rule", "SeededRule", "Selection", "RULES", "RuleSpec", "make_rule",
           "register_rule", "rule_class", "rule_names", "rule_spec", "CAPSkip", "Dense", "Forced",
           "KABENA", "RandomSkip", "SelectiveBackprop", "StaleSB", "UpperBoundIS"]

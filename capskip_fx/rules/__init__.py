"""Selection rules: one file per rule, all behind :class:`~capskip_fx.rules.base.Rule`."""
from __future__ import annotations

import inspect
import math
from typing import Any, Optional, Union

from .base import HeadView, Rule, SeededRule, Selection
from .capskip import CAPSkip
from .dense import Dense
from .forced import Forced
from .kabena import KABENA
from .random_skip import RandomSkip
from .selective_backprop import SelectiveBackprop
from .stale_sb import StaleSB
from .ub import UpperBoundIS

#: name -> factory(**options).  ``budget`` is passed only to rules that take it.
RULES: dict[str, type] = {
    "capskip": CAPSkip,
    "dense": Dense,
    "forced": Forced,
    "random": RandomSkip,
    "sb": SelectiveBackprop,
    "stale_sb": StaleSB,
    "kabena": KABENA,
    "ub": UpperBoundIS,
}


def make_rule(rule: Union[str, Rule], **options: Any) -> Rule:
    """Build a rule from its name and keyword options, or pass a Rule object through."""
    if isinstance(rule, Rule):
        if options:
            raise TypeError(f"options {sorted(options)} given with a Rule object; set them on the object")
        return rule
    return rule_class(rule)(**options)


def rule_class(name: str) -> type:
    """The Rule class registered under ``name``; the error lists the valid names."""
    if not isinstance(name, str) or name not in RULES:
        raise ValueError(f"unknown rule {name!r}; valid names: {', '.join(sorted(RULES))}")
    return RULES[name]


def build_rule(rule: Union[str, Rule], budget: Optional[float] = 0.1, options: Optional[dict] = None) -> Rule:
    """A Rule from a name + options; ``budget`` goes to rules that take one (also a ``match=`` rule)."""
    options = dict(options or {})
    if isinstance(rule, Rule):
        return make_rule(rule, **options)
    cls = rule_class(rule)
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


__all__ = ["build_rule", "rule_options", "HeadView", "Rule", "SeededRule", "Selection", "RULES", "make_rule", "rule_class", "CAPSkip", "Dense", "Forced",
           "KABENA", "RandomSkip", "SelectiveBackprop", "StaleSB", "UpperBoundIS"]

"""Selection rules: one file per rule, all behind :class:`~capskip_fx.rules.base.Rule`."""
from __future__ import annotations

from typing import Any, Union

from .base import HeadView, Rule, Selection
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


__all__ = ["HeadView", "Rule", "Selection", "RULES", "make_rule", "rule_class", "CAPSkip", "Dense", "Forced",
           "KABENA", "RandomSkip", "SelectiveBackprop", "StaleSB", "UpperBoundIS"]

"""Rule names: what builds each rule, and what a name also turns on in the compiled backward.

Every name ``capskip_fx.compile(rule=...)``, ``torch.compile(..., options={"rule": ...})`` and
``CAPSKIP_RULE`` accept is registered here through :func:`register_rule`, one call per name, in
``rules/__init__.py``.  Most names are a row rule alone (``RULES``: a Rule object carries all they do).
A name can also set compile options (``compile_options``): ``"vcas"`` is the dense rule with
``vcas=True`` (VCAS samples inside the compiled backward).  Such a name exists only where the
options are set, at compile time; building its Rule alone (``make_rule("vcas")``) raises, since
that rule would run dense with nothing sampled.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .base import Rule


@dataclass(frozen=True)
class RuleSpec:
    """A registered name: its Rule factory (keyword options) and the compile options the name also sets."""

    name: str
    factory: Callable[..., Rule]
    compile_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def standalone(self) -> bool:
        """A Rule object does all the name does (no compile option to set)."""
        return not self.compile_options


_SPECS: dict[str, RuleSpec] = {}
#: name -> factory(**options) of the standalone rules (every name but those with compile options)
RULES: dict[str, Callable[..., Rule]] = {}


def register_rule(name: str, factory: Callable[..., Rule], *, compile_options: Mapping[str, Any] = None) -> RuleSpec:
    """Register ``name``: ``factory(**options)`` builds its Rule (``budget`` is passed if the factory takes
    it); ``compile_options``: CapskipConfig fields the name also sets where a user leaves them unset."""
    if not isinstance(name, str) or not name or name in _SPECS:
        raise ValueError(f"rule name {name!r} is empty, not a string or registered already")
    if not callable(factory):
        raise TypeError(f"rule {name!r}: factory must be callable (a Rule class), got {factory!r}")
    spec = RuleSpec(name, factory, dict(compile_options or {}))
    _SPECS[name] = spec
    if spec.standalone:
        RULES[name] = factory
    return spec


def rule_names() -> list[str]:
    """Every registered name, sorted."""
    return sorted(_SPECS)


def rule_spec(name: str, standalone: bool = False) -> RuleSpec:
    """The spec registered under ``name`` (the error lists the valid names).  ``standalone``: the caller
    builds a Rule object only, so a name that also sets compile options is refused, saying where it works."""
    if not isinstance(name, str) or name not in _SPECS:
        raise ValueError(f"unknown rule {name!r}; valid names: {', '.join(rule_names())}")
    spec = _SPECS[name]
    if standalone and not spec.standalone:
        opts = ", ".join(f"{k}={v!r}" for k, v in spec.compile_options.items())
        raise ValueError(
            f"rule {name!r} also sets {opts} at compile time, which a Rule object cannot carry (alone it would "
            f"run without it): give rule={name!r} to capskip_fx.compile, to torch.compile's options with "
            f"backend='capskip' or as CAPSKIP_RULE; a model compiled with it keeps it under any rule")
    return spec

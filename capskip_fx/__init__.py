"""capskip_fx: selective backpropagation as a torch.compile graph transformation.

    model = capskip_fx.compile(model, budget=0.1)
    loss = F.cross_entropy(model(x), y); loss.backward()   # backward on the selected rows only
    capskip_fx.stats(model)                                 # mode, n, kept, rows, bound, fallback

Names load on first use (PEP 562): importing the package imports no torch, so ``capskip-train --help``
(whose harness lives in this package) answers at once.  The library's entry points (api.py,
dynamo_entry.py) run ``compat.check()`` when they load: a moved torch internal fails loudly there.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    **{n: "api" for n in ("compile", "compile_regions", "mark_compiled_batches", "stats", "report", "summary",
                          "state_dict", "load_state_dict", "CapskipModule")},
    "CapskipConfig": "config",
    "rowwise": "functions",
    **{n: "rules" for n in ("RULES", "Rule", "HeadView", "Selection", "make_rule")},
    "VCAS": "vcas.controller",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    try:  # submodules as attributes (capskip_fx.cpu, capskip_fx.debug, ...)
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError:
        raise AttributeError(f"module 'capskip_fx' has no attribute {name!r}") from None


def __dir__() -> list:
    return sorted(list(globals()) + __all__)

"""capskip_fx: selective backpropagation as a torch.compile graph transformation.

    model = capskip_fx.compile(model, budget=0.1)
    loss = F.cross_entropy(model(x), y); loss.backward()   # backward on the selected rows only
    capskip_fx.stats(model)                                 # n, kept, bound, fallback, variants
"""
from . import compat, cpu, debug  # noqa: F401  (capskip_fx.cpu / capskip_fx.debug: host-side helpers)

compat.check()  # a moved torch internal fails here, loudly, never as a silently dense step

from .api import (CapskipModule, compile, compile_regions, load_state_dict, report, state_dict, stats,  # noqa: E402
                  summary)
from .config import CapskipConfig  # noqa: E402
from .rowwise import rowwise  # noqa: E402
from .rules import RULES, HeadView, Rule, Selection, make_rule  # noqa: E402
from .vcas.controller import VCAS  # noqa: E402

__all__ = ["compile", "compile_regions", "stats", "report", "summary", "state_dict", "load_state_dict", "CapskipModule", "CapskipConfig", "RULES", "Rule", "HeadView",
           "Selection", "make_rule", "VCAS", "rowwise"]
__version__ = "0.1.0"

"""capskip_fx: selective backpropagation as a torch.compile graph transformation.

    model = capskip_fx.compile(model, budget=0.1)
    loss = F.cross_entropy(model(x), y); loss.backward()   # backward on the selected rows only
    capskip_fx.stats(model)                                 # n, kept, bound, fallback, variants
"""
from .api import CapskipModule, compile, report, stats
from .config import CapskipConfig
from .rules import RULES, HeadView, Rule, Selection, make_rule
from .rules.vcas import VCAS

__all__ = ["compile", "stats", "report", "CapskipModule", "CapskipConfig", "RULES", "Rule", "HeadView",
           "Selection", "make_rule", "VCAS"]
__version__ = "0.1.0"

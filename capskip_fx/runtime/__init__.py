"""Runtime side: what runs at step time.  ``state.py`` composes the parts (forwards, clock, view,
checks, stats); ``backward.py`` is the selected-row backward AOTAutograd calls."""
from .state import RuntimeState
from .stats import RunSummary, StepStats

__all__ = ["RuntimeState", "RunSummary", "StepStats"]

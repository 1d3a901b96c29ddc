"""Runtime side: per-model selection state and step statistics."""
from .state import RuntimeState, StepStats

__all__ = ["RuntimeState", "StepStats"]

"""How many Hypothesis examples a property test draws, by profile (registered in tests/conftest.py).

``HYPOTHESIS_PROFILE=ci`` (the default): derandomised, and each test's example count scaled down to
``CI_SHARE`` of its thorough count (at least ``CI_MIN``): the same examples on every run, the suite in
minutes.  ``HYPOTHESIS_PROFILE=thorough``: every test's full count, randomised (a fresh draw each run).
Write ``@settings(max_examples=examples(N), ...)`` with N the thorough count."""
from __future__ import annotations

import math
import os

PROFILES = ("ci", "thorough")
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in PROFILES:
    raise ValueError(f"HYPOTHESIS_PROFILE must be one of {PROFILES}, got {PROFILE!r}")
CI_SHARE = 0.25
CI_MIN = 5


def examples(n: int) -> int:
    """``n`` examples in the thorough profile; a share of them (at least CI_MIN, at most n) in ci."""
    return n if PROFILE == "thorough" else min(n, max(CI_MIN, math.ceil(n * CI_SHARE)))


def derandomize() -> bool:
    """ci draws the same examples every run (a stable CI); thorough a fresh draw."""
    return PROFILE != "thorough"


def draws(n: int) -> int:
    """Monte-Carlo draws of an unbiasedness test: ``n`` in thorough, a quarter in ci.  The tests' bounds
    scale with the standard error, so fewer draws keep them valid (they detect a larger bias only)."""
    return n if PROFILE == "thorough" else max(CI_MIN, math.ceil(n * CI_SHARE))

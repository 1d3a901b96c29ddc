"""The head forms, tried in order, and ``find_head``.

Each user output with a tangent is analysed once (``analysis.analyse``); the first form whose match holds
decides it: its obligations refuse it with the reason, or its features make the ``Head``.  The matches are
disjoint (tests/test_heads_registry.py checks), so the order is for reading, not a priority.  An output
no form matches is refused with the analysis's reason.  A new head form is one module with one
``HeadForm`` and a line in ``HEAD_FORMS``."""
from __future__ import annotations

from typing import Optional

from torch import fx

from ...records import RefusalKind, Refused
from .analysis import analyse
from .base import Head, HeadForm, Logits, outputs_and_tangents
from .cosine import COSINE
from .indexed import ARANGE_INDEXED
from .linear import LINEAR, SCALED_LINEAR
from .linear_sum import SUM_OF_LINEARS
from .tokens import TOKEN_LOGITS

HEAD_FORMS: tuple[HeadForm, ...] = (LINEAR, SCALED_LINEAR, SUM_OF_LINEARS, COSINE, ARANGE_INDEXED, TOKEN_LOGITS)


def form_of(c: Logits) -> Optional[HeadForm]:
    """The form that decides ``c``, or None."""
    return next((f for f in HEAD_FORMS if f.match(c)), None)


def find_head(graph: fx.Graph, logits_index: Optional[int] = None) -> Head:
    """The first user output (``logits_index``: that one only) some head form proves; else Refused with
    every output's reason."""
    reasons = []
    for idx, z, g in outputs_and_tangents(graph):
        if logits_index is not None and idx != logits_index:
            continue
        c = analyse(idx, z, g)
        if c is None:
            reasons.append(f"output {idx}: not a 2-D (N, C) or token-shaped (N, T, C) differentiable tensor")
            continue
        form = form_of(c)
        if form is None:
            reasons.append(f"output {idx}: " + (c.unsupported or "not produced by a Linear (addmm/mm), a sum of "
                                                "Linears or a Linear scaled by a number"))
            continue
        why = form.obligations(c)
        if why is not None:
            reasons.append(f"output {idx}: {why}")
            continue
        return form.features(graph, c)
    raise Refused("no classifier head: the model output must be logits (N, C) or (N, T, C) from a final Linear"
                  + (f" ({'; '.join(reasons)})" if reasons else ""), RefusalKind.NO_HEAD)


def head_forms_markdown() -> str:
    """docs/design.md's list of head forms, one line per entry, in registry order (generated:
    ``python -c "from capskip_fx.passes.heads import head_forms_markdown; print(head_forms_markdown())"``)."""
    return "".join(f"   - `{f.name}`: {f.gram}\n" for f in HEAD_FORMS)

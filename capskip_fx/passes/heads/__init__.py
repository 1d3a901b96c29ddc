"""Head forms: how the classifier head is found in the joint graph, one registry entry per form.

The logits ``z`` are a user output with a tangent ``g``, of shape (N, C) (batch in dim 0) or (N, T, C);
``Head.h`` holds the rows the rule's Gram is built from, ``K = (D D^T) * (H H^T [+ 1 if bias])``, equal to
the Gram of the per-example gradients of every head parameter.  Each form (``base.HeadForm``, one module
each) has its match, its proof obligations and its Gram features; ``registry.HEAD_FORMS`` lists them in
order:

  linear.py       one Linear (``LINEAR``), and one times a number (``SCALED_LINEAR``)
  linear_sum.py   a sum of Linears with numeric weights (``SUM_OF_LINEARS``)
  cosine.py       ``s * mm(x, normalize(W).T)`` (``COSINE``)
  indexed.py      ``L[arange(N), j]`` of per-token logits (``ARANGE_INDEXED``)
  tokens.py       token-shaped logits (N, T, C) (``TOKEN_LOGITS``)

analysis.py reads an output once for all of them (the Linears in it and their weights; weights.py).  A
weight that is not a parameter (nor ``normalize(W)`` of one, in a single cosine head of (N, C) logits) or a
scale that is a tensor (learnable) is refused with the reason.  The logits output is found from AOT output
descriptors when available (the first plain user output that qualifies), else from the joint graph's
output/tangent order.
"""
from .base import Head, HeadForm, Logits, outputs_and_tangents
from .registry import HEAD_FORMS, find_head, form_of, head_forms_markdown
from .weights import CosineWeight

__all__ = ["HEAD_FORMS", "CosineWeight", "Head", "HeadForm", "Logits", "find_head", "form_of", "head_forms_markdown",
           "outputs_and_tangents"]

"""Joint-graph pass: find the classifier head (the logits output, its tangent, the head input ``h``).

The head forms are a registry, one entry each (match, proof obligations, Gram features): ``passes/heads/``.
This module is the pass's entry point; callers import ``find_head``, ``Head`` and ``outputs_and_tangents``
from here.
"""
from __future__ import annotations

from .heads import CosineWeight, Head, find_head, outputs_and_tangents

__all__ = ["CosineWeight", "Head", "find_head", "outputs_and_tangents"]

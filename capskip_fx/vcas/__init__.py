"""VCAS (variance-controlled activation and weight-gradient sampling) in one place.

  controller.py        options (``VCAS``) and the controller (s, rho, nu; probes; FLOPs)
  sampling.py          soft-top-k, the samplers, Horvitz-Thompson weights, closed-form variance
  segment_backward.py  pass, SampleA: the backward cut at residual forks into segments
  sample_wgrad.py      pass, SampleW: weight-gradient matmuls -> ``capskip::sampled_wgrad``
  runtime.py           ``VcasBackward``: runs the segments, samples between them, probes
  build.py             ``build_backward``: the backend's one entry point

The core data path (api -> backend -> passes -> runtime) knows VCAS only as a compiled backward with
state (``RuntimeState.add_runner``) that subclasses ``runtime.executors.SampledBackward`` (told the rows that
carry gradient, with an exact twin, ``exact``, for verification).
"""
from .build import build_backward
from .controller import VCAS

__all__ = ["VCAS", "build_backward"]

"""AOTAutogradCache for capskip graphs: what the backend built around each compiled graph, kept beside
Inductor's cache and built again when AOTAutograd serves that graph from its cache.

A hit returns the compiled forward and backward without calling the backend's inner compile, so without
the wrappers it builds there (the selected-row backward, the forward's batch tag).  The backend stores a
picklable description of them (backend.Built) under the compiled graph's FX graph cache key; Inductor
calls ``CUDAGraphPolicy.wrap_output`` on every graph it post-compiles, a hit included, and there
:class:`RebuildPolicy` builds the wrappers again around the served graph, for the compiling model's state.
"""
from __future__ import annotations

import os
import pickle
from typing import Any, Callable, Optional

from . import compat

_HOOK = compat.aot_cache_hook()
_MEMORY: dict[str, Any] = {}  # by file path (the cache dir may change between compiles)


#: what AOTAutograd reads of a compiled graph to store it (graph_compile.py _should_save_cache, autograd_cache.py
#: make_entry), through the wrappers it puts around ours, which copy instance attributes only
_STORED_ATTRS = ("_fx_graph_cache_key", "_fx_graph_cache_debug_lines", "guards_expr", "_time_taken_ns")


def carry_cache_attrs(wrapper: Any, compiled: Any) -> Any:
    """``wrapper`` (around ``compiled``) with the attributes AOTAutogradCache stores ``compiled`` by."""
    for a in _STORED_ATTRS:
        if hasattr(compiled, a):
            setattr(wrapper, a, getattr(compiled, a))
    return wrapper


class NotStored(Exception):
    """A served graph with no stored description: AOTAutograd bypasses its cache and compiles afresh."""


def available() -> bool:
    return _HOOK is not None


def installed() -> bool:
    """Whether a RebuildPolicy is the current cudagraph policy (the backend turned the cache on)."""
    from torch._inductor import config

    return available() and isinstance(config.cudagraph_policy, RebuildPolicy)


def _path(key: str) -> str:
    return os.path.join(_HOOK[1](), "capskip", key)


def save(key: str, description: Any) -> None:
    path = _path(key)
    _MEMORY[path] = description
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(description, f)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one


def load(key: str) -> Optional[Any]:
    path = _path(key)
    if path not in _MEMORY:
        try:
            with open(path, "rb") as f:
                _MEMORY[path] = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
            return None
    return _MEMORY[path]


if _HOOK is not None:
    class RebuildPolicy(_HOOK[0]):
        """``torch._inductor.config.cudagraph_policy`` of one backend call (CUDA graph behaviour unchanged:
        the base class's).  ``rebuild(description, graph)`` wraps a served graph; ``skip()`` is true while
        the backend's own inner compile runs (it wraps what it compiles itself)."""

        def __init__(self, rebuild: Callable[[Any, Any], Any], skip: Callable[[], bool]):
            self.rebuild, self.skip = rebuild, skip

        def wrap_output(self, output_code):
            if self.skip():
                return output_code
            key = getattr(output_code, "_fx_graph_cache_key", None)
            description = load(key) if key else None
            if description is None:
                raise NotStored(f"capskip_fx: no description stored for served graph {key}")
            return self.rebuild(description, output_code)

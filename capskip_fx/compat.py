"""The torch internals capskip_fx relies on, checked once when the library loads (api.py and
dynamo_entry.py, its two entry points; the package itself loads lazily).

The pass hooks into private Inductor / AOTAutograd / Dynamo / autograd APIs.  If one has moved in the
installed torch, loading capskip_fx fails here with the torch version and what is missing: it must
never degrade into a silently dense (or wrong) step.  Optional internals (the code has a documented
fallback when they are absent) are not checked.
"""
from __future__ import annotations

import functools
import importlib
import inspect

import torch

#: the torch releases CI tests (pyproject's range)
TESTED = ("2.11", "2.14", "2.15")

# the required internals: module, attribute path, and why it is needed (one a line)
_TABLE = """
torch._C                            _current_autograd_node      binds each selection to the forward that made it
torch._C                            _current_graph_task_id      one step per backward
torch._inductor.compile_fx          compile_fx                  the backend compiles through Inductor
torch._inductor.compile_fx          compile_fx_inner            the backward's inner compile
torch._inductor.config              joint_custom_pre_pass       the selection pass runs on the joint graph
torch._inductor.custom_graph_pass   CustomGraphPass             the selection pass's base class
torch._functorch.config             enable_autograd_cache       the cache must not serve a dense backward
torch._guards                       TracingContext.try_get      the forward metadata and the module guard
torch._dynamo.guards                GuardBuilder.ID_MATCH       each compiled module its own cache entry
torch._dynamo.eval_frame            OptimizedModule             the string backend finds its module
torch._dynamo.backends.registry     register_backend            torch.compile(backend="capskip")
torch._dynamo.utils                 counters                    capskip's counters
torch._dynamo                       maybe_mark_dynamic          the batch dim is made symbolic
"""
REQUIRED = tuple(tuple(line.split(None, 2)) for line in _TABLE.strip().splitlines())


def missing() -> list[str]:
    """The required internals this torch lacks, one line each."""
    out = []
    for mod, path, why in REQUIRED:
        try:
            obj = importlib.import_module(mod)
            for part in path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            out.append(f"{mod}.{path} ({why}): {type(e).__name__}: {e}")
    try:
        from torch._inductor.compile_fx import compile_fx

        params = inspect.signature(compile_fx).parameters
        for p in ("inner_compile", "config_patches"):
            if p not in params:
                out.append(f"torch._inductor.compile_fx.compile_fx has no {p!r} parameter")
    except (ImportError, ValueError, TypeError):
        pass  # reported above
    return out


def check() -> None:
    """Raise ImportError naming the torch version and every missing internal."""
    gone = missing()
    if gone:
        raise ImportError(
            f"capskip_fx cannot run on torch {torch.__version__}: internals it relies on have moved or are "
            f"missing:\n  - " + "\n  - ".join(gone) + f"\nTested with torch {', '.join(TESTED)}; install one "
            "of those (pip install 'torch>=2.11,<2.16') or report this torch version.")


def aot_cache_hook():
    """``(CUDAGraphPolicy, cache_dir)`` if this torch has them, else None.  Inductor calls the policy's
    ``wrap_output`` on every OutputCode it post-compiles, also when AOTAutogradCache serves a graph
    (aot_autograd_result.py, ``FxGraphCacheLoadable.post_compile``): where the backend rebuilds its wrappers
    on a hit (aot_cache.py).  None: the backend keeps AOTAutogradCache off for its graphs (slower, not wrong)."""
    try:
        from torch._inductor import config
        from torch._inductor.cudagraph_utils import CUDAGraphPolicy
        from torch._inductor.runtime.runtime_utils import cache_dir
    except ImportError:
        return None
    if not (hasattr(config, "cudagraph_policy") and hasattr(CUDAGraphPolicy, "wrap_output")):
        return None
    return CUDAGraphPolicy, cache_dir


@functools.lru_cache(maxsize=None)
def weak_marks_recompile() -> bool:
    """Whether Dynamo guards on ``maybe_mark_dynamic``'s mark (torch >= 2.12): a frame traced with a static
    batch then recompiles once its inputs arrive marked, which is how the string backend makes a model's
    batch dynamic without a process-wide setting (dynamo_entry.py).  Read from the guard builder's source:
    the mark is an attribute name there, nothing exposes it otherwise."""
    from torch._dynamo import guards

    try:
        return "_dynamo_weak_dynamic_indices" in inspect.getsource(guards)
    except (OSError, TypeError):  # no source (a frozen install): assume the older behaviour
        return False


def traced_module():
    """The module whose call Dynamo is tracing now: the original of a ``torch.compile``'d module or a module
    compiled in place (the callable Dynamo wraps, ``fn``, or the traced method's ``self``); None for a
    function, outside tracing, or where this torch keeps its translator elsewhere (optional: the string
    backend then reads the call stack, dynamo_entry.py)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        local = tx.output.root_tx.f_locals
    except (ImportError, AttributeError, AssertionError, IndexError):
        return None
    for name in ("fn", "self"):
        obj = local.get(name)
        obj = getattr(obj, "__self__", obj)  # m.compile(): Dynamo traces the bound method m._call_impl
        if isinstance(obj, torch.nn.Module):
            return obj
    return None

"""What the installed torch can do, as skip marks for tests that need it."""
import pytest

from capskip_fx import compat

#: torch.compile(backend="capskip") and in-place compile make a static batch dynamic by marking the model's
#: inputs, which recompiles the frame where Dynamo guards on the mark (torch >= 2.12): step 0 runs dense,
#: later steps select (compile_regions marks before the first call: it selects from step 0).  On 2.11 the
#: batch stays static and those idioms run the documented dense fallback (exact; tests/test_string_backend.py
#: checks it), and nn.Module.compile() on torch.nn built-ins (nn.Linear, nn.Sequential) is not traced at all.
needs_batch_marking = pytest.mark.skipif(
    not compat.weak_marks_recompile(),
    reason="this torch does not recompile on maybe_mark_dynamic: the string backend's batch stays static (dense fallback)")

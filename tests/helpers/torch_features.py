"""What the installed torch can do, as skip marks for tests that need it."""
import pytest
from torch._dynamo.variables import builder

#: torch.compile(backend="capskip") and in-place / regional compile select rows from the first batch only
#: where Dynamo has per-dim dynamic sources (torch >= 2.12 has them, 2.11 none): on 2.11 the first batch is
#: static and those idioms run the documented dense fallback (exact; tests/test_string_backend.py checks it),
#: and nn.Module.compile() on torch.nn built-ins (nn.Linear, nn.Sequential) is not traced at all.
needs_dynamic_sources = pytest.mark.skipif(
    not hasattr(builder, "_parse_source_entry"),
    reason="this torch has no per-dim dynamic sources: the string backend's first batch is static (dense fallback)")

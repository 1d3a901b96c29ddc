"""What ``torch.compile(model, backend="capskip")`` loads: the ``torch_dynamo_backends`` entry point
(pyproject.toml), so the name works in a fresh process without ``import capskip_fx``.

Loading it (at ``torch.compile``, before the first frame is traced) also makes dim 0 of compiled
frames' tensor arguments dynamic (``backend.make_batch_dynamic``), so that a static batch (a drop_last
loader, no ``mark_dynamic``) still gets the selected-row backward.
"""
from . import compat

compat.check()  # a moved torch internal fails here, loudly

from .backend import capskip_backend, make_batch_dynamic  # noqa: E402

make_batch_dynamic()

backend = capskip_backend

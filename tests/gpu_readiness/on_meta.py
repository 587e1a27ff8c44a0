"""A trace on ``meta`` tensors that also fails where torch's ``meta`` kernels let another device
through (a matmul with a CPU weight returns a ``meta`` tensor): the GPU-readiness suite's
capture-region and tensor-parallel traces run under :class:`OnMeta`."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class OnMeta(TorchDispatchMode):
    """Fail an op given tensors on ``meta`` and on another device (a 0-d tensor, a scalar, may
    stay on the host, as CUDA allows), except a copy between them (a transfer): torch's ``meta``
    kernels of some ops (``mm``, ``index``) do not check it."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),  # noqa: ANN401
                           kwargs: Any = None) -> Any:  # noqa: ANN401
        kwargs = kwargs or {}
        devices = {t.device for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and t.dim() > 0}
        if len(devices) > 1 and func is not torch.ops.aten.copy_.default:
            raise RuntimeError(f"{func} was given tensors on several devices: "
                               f"{', '.join(sorted(map(str, devices)))}")
        return func(*args, **kwargs)

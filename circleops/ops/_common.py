"""Helpers shared by the op modules: argument errors, compute dtypes, autocast rules."""
from __future__ import annotations

from typing import Any

import torch

from circleops.errors import CircleOpsError


class OpArgumentError(CircleOpsError, ValueError):
    """A circle::* op was called with arguments outside its contract (shape, dtype, attribute)."""


def check(cond: Any, message: Any) -> None:
    """``torch._check`` raising OpArgumentError; works on SymBools under export.

    ``message`` is a string or a zero-argument callable (built only on failure).
    """
    if cond is True:  # eager: a plain bool, skip torch._check's symbolic machinery
        return
    torch._check_with(OpArgumentError, cond, message if callable(message) else (lambda: message))


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """The dtype an "upcast to fp32" computes in: fp32, or fp64 for fp64 input (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _cast_floating(value: Any, device_type: str, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.device.type == device_type and value.dtype is not torch.float64:
            return value.to(dtype)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floating(v, device_type, dtype) for v in value)
    return value


# Registrations made here must outlive the call that made them.
_AUTOCAST_LIB = torch.library.Library("circle", "FRAGMENT")


def register_autocast_lower_precision(qualname: str, device_types: tuple[str, ...] = ("cpu", "cuda")) -> None:
    """Under autocast, cast the floating inputs of ``qualname`` to the *active* autocast dtype.

    ``torch.library.register_autocast`` takes one fixed dtype; an op that behaves like
    ``linear`` or ``scaled_dot_product_attention`` must follow whichever lower-precision
    dtype the enclosing ``torch.autocast`` chose (bf16 or fp16).
    """
    name = qualname.split("::")[1]
    overload = getattr(getattr(torch.ops.circle, name), "default")
    for device_type in device_types:
        if not torch._C._is_autocast_available(device_type):
            continue
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(*args: Any, _device_type: str = device_type, _keyset: Any = keyset) -> Any:
            dtype = torch.get_autocast_dtype(_device_type)
            with torch._C._ExcludeDispatchKeyGuard(_keyset):
                return overload(*_cast_floating(args, _device_type, dtype))

        _AUTOCAST_LIB.impl(name, kernel, key)


def register_autocast_fp32(op: Any, device_types: tuple[str, ...] = ("cpu", "cuda")) -> None:
    """Under autocast, run ``op`` on fp32 inputs (and so return fp32), as CUDA autocast does for norms."""
    for device_type in device_types:
        if torch._C._is_autocast_available(device_type):
            torch.library.register_autocast(op, device_type, torch.float32)

"""Helpers shared by the op modules and the registry (circleops.ops.registry): argument
errors, compute dtypes, binding a call to its schema, autograd through the reference kernel
and the autocast rules.
"""
from __future__ import annotations

from typing import Any, Callable

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


# Registrations made here must outlive the call that made them: one library per namespace.
_AUTOCAST_LIBS: dict[str, Any] = {}


def _register_autocast_lower_precision(op: Any, device_types: tuple[str, ...]) -> None:
    """Under autocast, cast the floating inputs of ``op`` to the *active* autocast dtype.

    ``torch.library.register_autocast`` takes one fixed dtype; an op that behaves like
    ``linear`` or ``scaled_dot_product_attention`` must follow whichever lower-precision
    dtype the enclosing ``torch.autocast`` chose (bf16 or fp16).
    """
    namespace, name = op._qualname.split("::")
    overload = getattr(getattr(getattr(torch.ops, namespace), name), "default")
    lib = _AUTOCAST_LIBS.get(namespace)
    if lib is None:
        lib = _AUTOCAST_LIBS[namespace] = torch.library.Library(namespace, "FRAGMENT")
    for device_type in device_types:
        if not torch._C._is_autocast_available(device_type):
            continue
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(*args: Any, _device_type: str = device_type, _keyset: Any = keyset) -> Any:
            dtype = torch.get_autocast_dtype(_device_type)
            with torch._C._ExcludeDispatchKeyGuard(_keyset):
                return overload(*_cast_floating(args, _device_type, dtype))

        lib.impl(name, kernel, key)


def register_autocast(op: Any, rule: str, device_types: tuple[str, ...] = ("cpu", "cuda")) -> None:
    """What ``op`` does under torch.autocast, by its ops.yaml ``autocast`` rule:
    "fp32" (inputs cast to fp32, fp32 out, as CUDA autocast treats norms), "lower_precision"
    (inputs cast to the active autocast dtype, as linear), or "none" (no rule)."""
    if rule == "fp32":
        for device_type in device_types:
            if torch._C._is_autocast_available(device_type):
                torch.library.register_autocast(op, device_type, torch.float32)
    elif rule == "lower_precision":
        _register_autocast_lower_precision(op, device_types)
    elif rule != "none":
        raise ValueError(f"{op._qualname}: unknown autocast rule {rule!r} (fp32, lower_precision, none)")


def bind(schema: torch.FunctionSchema, args: tuple, kwargs: dict) -> list[Any]:
    """Every argument of ``schema`` in order, given ones from args/kwargs, the rest the
    schema's defaults (the dispatcher hands kernels only the arguments the caller gave)."""
    out = list(args)
    for arg in schema.arguments[len(args):]:
        if arg.name in kwargs:
            out.append(kwargs[arg.name])
        elif arg.has_default_value():
            out.append(arg.default_value)
        else:
            raise TypeError(f"{schema.name}() missing required argument {arg.name!r}")
    return out


def with_defaults(fn: Callable[..., Any], schema: torch.FunctionSchema) -> Callable[..., Any]:
    """``fn`` (which takes every schema argument) callable with the schema's defaults;
    keyword arguments outside the schema pass through."""
    names = {a.name for a in schema.arguments}

    def call(*args: Any, **kwargs: Any) -> Any:
        extra = {k: v for k, v in kwargs.items() if k not in names}
        return fn(*bind(schema, args, kwargs), **extra)

    call.__name__ = call.__qualname__ = getattr(fn, "__name__", "call")
    call.__doc__ = fn.__doc__
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


def contiguous(out: Any) -> Any:
    if isinstance(out, tuple):
        return tuple(t.contiguous() for t in out)
    return out.contiguous()


def register_autograd_from_reference(op: Any, reference: Callable[..., Any]) -> None:
    """The gradient of ``op`` is that of its reference kernel, recomputed in backward: the
    gradient of exactly the computation the forward ran (every variant and policy)."""

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.slots = [i for i, v in enumerate(inputs) if isinstance(v, torch.Tensor)]
        ctx.save_for_backward(*(inputs[i] for i in ctx.slots))
        ctx.others = [None if isinstance(v, torch.Tensor) else v for v in inputs]

    def backward(ctx: Any, *grads: Any) -> tuple:
        args = list(ctx.others)
        wrt: dict[int, torch.Tensor] = {}
        with torch.enable_grad():
            for i, t in zip(ctx.slots, ctx.saved_tensors):
                args[i] = t.detach().requires_grad_(bool(ctx.needs_input_grad[i]) and t.is_floating_point())
                if args[i].requires_grad:
                    wrt[i] = args[i]
            outs = reference(*args)
            outs = outs if isinstance(outs, tuple) else (outs,)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], list(wrt.values()), [g for _, g in pairs],
                                      allow_unused=True) if wrt and pairs else [None] * len(wrt)
        result: list[Any] = [None] * len(args)
        for i, g in zip(wrt, got):
            result[i] = g
        return tuple(result)

    op.register_autograd(backward, setup_context=setup_context)

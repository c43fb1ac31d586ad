"""The one check every runtime's Session makes on its inputs before running.

A runtime given an input of another shape or dtype than its file declares does something
worse than refuse: LiteRT resizes the tensor and fails deep in XNNPACK (or returns outputs
of another shape), onert reads past the array. So each Session checks the count, then each
input's dtype and shape against the file's, and says which input is wrong and what to pass.
Works on numpy arrays and torch tensors alike (anything with ``.shape`` and ``.dtype``).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from circleops.errors import RuntimeRunError
from circleops.runtime import TensorSpec


def dtype_name(dtype: Any) -> str:
    """"float32" for np.float32, np.dtype("float32") and torch.float32 alike."""
    name = getattr(dtype, "name", None)
    if isinstance(name, str):
        return name
    text = str(dtype)
    return text[len("torch."):] if text.startswith("torch.") else text


def in_order(specs: Sequence[TensorSpec], inputs: Sequence[Any] | Mapping[str, Any], where: str) -> list[Any]:
    """``inputs`` as a list in ``specs`` order (a dict is taken by input name)."""
    names = [s.name for s in specs]
    if isinstance(inputs, Mapping):
        missing = [n for n in names if n not in inputs]
        unknown = [n for n in inputs if n not in names]
        if missing or unknown:
            raise RuntimeRunError(
                f"{where}: inputs given by name lack {missing} and have unknown {unknown}; its inputs are "
                f"{names}: pass one array per name")
        return [inputs[n] for n in names]
    return list(inputs)


def check_inputs(specs: Sequence[TensorSpec], inputs: Sequence[Any], where: str,
                 trusted: Sequence[Any] = ()) -> None:
    """RuntimeRunError unless ``inputs`` match ``specs`` in count, dtype and shape.

    A dimension below 0 in a spec (a dynamic one) takes any size, and a 0-d input passes for
    shape [1] (target onert writes a scalar input as [1]: onert takes no rank-0 inputs).
    ``where`` names the file (and signature) in the message. ``trusted``: per input, an array
    known to fit (the runtime's own input memory, made from the specs); an input that is that
    very array is not checked again (a LiteRT decode step's 60 caches: 0.45 ms of its CPU).
    """
    if len(inputs) != len(specs):
        listing = ", ".join(_describe(s) for s in specs)
        raise RuntimeRunError(f"{where} takes {len(specs)} input(s) ({listing}), {len(inputs)} given; "
                              "pass one array per input, in this order")
    for i, (spec, value) in enumerate(zip(specs, inputs)):
        if trusted and value is trusted[i]:
            continue
        check_one(spec, value, i, where)


def check_one(spec: TensorSpec, value: Any, i: int, where: str) -> None:
    """RuntimeRunError unless input #``i`` ``value`` matches ``spec`` (:func:`check_inputs`)."""
    shape = tuple(int(d) for d in value.shape)
    dtype = dtype_name(value.dtype)
    label = f"input #{i} {spec.name!r}" if spec.name else f"input #{i}"
    if dtype != spec.dtype:
        raise RuntimeRunError(
            f"{where}: {label} is {dtype}, the file expects {spec.dtype}{list(spec.shape)}; cast it "
            f"(e.g. array.astype(np.{spec.dtype})) before running")
    if shape == () and spec.shape == (1,):
        return
    if len(shape) != len(spec.shape) or any(w >= 0 and w != g for w, g in zip(spec.shape, shape)):
        raise RuntimeRunError(
            f"{where}: {label} has shape {list(shape)}, the file expects {list(spec.shape)} ({spec.dtype}); "
            "the file was converted for that shape: pass an array of that shape, or convert again "
            "with example inputs of the shape you need")


def _describe(spec: TensorSpec) -> str:
    return f"{spec.name or '?'} {spec.dtype}{list(spec.shape)}"


__all__ = ["check_inputs", "check_one", "dtype_name", "in_order"]

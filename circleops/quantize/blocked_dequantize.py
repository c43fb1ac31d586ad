"""torch's runs of PT2E's converted modules with each integer weight dequantized in float32
by blocks of rows, not through int64.

``quantized_decomposed.dequantize_per_channel`` computes ``(q - zero_point) * scale`` with an
int64 zero point: the difference is an int64 tensor as large as the weight twice over. The
converted module runs it on every call, for every weight: on the Llama-3.2-1B shape's
128256 x 2048 int16 embedding and int8 lm_head that is a 2.1 GB int64 temporary beside each
1.05 GB float result, the peak of verify's torch references on the quantized model and of
its quality against fp32 (bench/results/64-npu-1b-verify.yaml, issue 32). Integers of at
most 16 bits, their zero points and their differences are exact in float32 (below 2^24), so
``(float(q) - float(zp)) * scale`` in float32 is the same float32 as through int64 when the
scales are float32 (int64 * float32 promotes to float32: one rounding, of the same product).

    with float32_dequantize(converted.values()):
        logits = converted["prefill"](...)
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch

# elements dequantized at a time: a block's float32 temporaries stay ~2 x 16 MB
DEQUANTIZE_BLOCK = 1 << 22
_NARROW = (torch.int8, torch.uint8, torch.int16)  # exact in float32 with their zero points


def _dequantize_per_channel() -> Any:
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the quantized_decomposed ops)

    return torch.ops.quantized_decomposed.dequantize_per_channel.default


def dequantize_per_channel(*args: Any, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``quantized_decomposed.dequantize_per_channel`` (the same arguments, as its schema lists
    them: input, scales, zero_points, axis, quant_min, quant_max, dtype; the same float32
    result) computed in float32 a block of rows at a time where that is exact (see the
    module's docstring), for channels along axis 0 (a weight's rows); anything else (wider
    integers, float64 scales, another axis or output dtype, a zero point of 2^16 or more) by
    the op itself."""
    input, scales, zero_points, axis, _, _, dtype = args
    if not _exact_in_float32(input, scales, zero_points, axis, dtype, out_dtype):
        return _dequantize_per_channel()(*args, out_dtype=out_dtype)
    shape = [-1] + [1] * (input.dim() - 1)  # axis 0: the scales follow the blocks' rows
    s = scales.reshape(shape)
    z = zero_points.to(torch.float32).reshape(shape) if zero_points is not None else None
    out = torch.empty(input.shape, dtype=torch.float32)
    rows = max(1, DEQUANTIZE_BLOCK // max(1, input[0].numel()))
    for i in range(0, input.shape[0], rows):
        r = slice(i, i + rows)
        block = input[r].to(torch.float32)
        if z is not None:
            block -= z[r]
        torch.mul(block, s[r], out=out[r])
    return out


def _exact_in_float32(input: Any, scales: Any, zero_points: Any, axis: Any, dtype: Any, out_dtype: Any) -> bool:
    if not (isinstance(input, torch.Tensor) and input.dtype in _NARROW and input.dtype == dtype
            and input.dim() >= 1 and input.device.type == "cpu" and input.is_contiguous()
            and axis in (0, -input.dim()) and out_dtype in (None, torch.float32)):
        # another axis: the op returns a permuted (strided) view, kept as it is
        return False
    if not (isinstance(scales, torch.Tensor) and scales.dtype == torch.float32 and scales.dim() == 1
            and scales.numel() == input.shape[0]):
        return False
    if zero_points is None:
        return True
    return isinstance(zero_points, torch.Tensor) and zero_points.numel() == scales.numel() and \
        not zero_points.is_floating_point() and (zero_points.numel() == 0 or int(zero_points.abs().max()) < 1 << 16)


@contextlib.contextmanager
def float32_dequantize(modules: Iterable[Any]) -> Iterator[None]:
    """Within the block, every ``dequantize_per_channel`` node of the converted modules
    (torch.fx GraphModules) runs :func:`dequantize_per_channel`, where it is used (a table at
    the rows gathered, a large linear's weight by blocks of rows, anything else made just
    before its first user: circleops.quantize.dequantize_at_use); the graphs are restored on
    exit (torch.export of them must still see the op)."""
    from circleops.quantize.dequantize_at_use import dequantized_at_use

    op = _dequantize_per_channel()
    modules = list(modules)
    changed, touched = [], []
    for module in modules:
        nodes = [n for n in module.graph.nodes if n.op == "call_function" and n.target is op]
        for node in nodes:
            node.target = dequantize_per_channel
        if nodes:
            changed += nodes
            touched.append(module)
            module.recompile()
    try:
        per_tensor = torch.ops.quantized_decomposed.dequantize_per_tensor.default
        with dequantized_at_use(modules, {dequantize_per_channel: True, per_tensor: False}):
            yield
    finally:
        for node in changed:
            node.target = op
        for module in touched:
            module.recompile()

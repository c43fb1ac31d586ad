"""Q/DQ folding, before lowering: the quantize/dequantize pairs that torchao's
``convert_pt2e`` leaves in a program become two markers the lowering understands.

* ``dequantize(quantize(x, s, zp))`` (an activation) -> ``quantized(x, spec)``: lowered to
  a QUANTIZE whose output tensor carries ``spec`` (circleops.quantize.integer.markers); the
  integer pass (circleops.quantize.integer.lower) folds it into the op that produces x, so
  the file holds one integer tensor with QuantizationParameters, not a float pair.
* ``dequantize(w_int)`` of a constant (weights, biases: convert_pt2e has already
  quantized them) -> ``dequantized(w_int, spec)``: lowered to the float constant
  ``scale · (w_int - zp)``, remembered in the :class:`QuantPlan`, so that the integer pass
  writes back exactly ``w_int`` with its parameters wherever the lowering put that
  constant (transposed to OHWI, reshaped into a 1x1 filter ...).

The markers are plain Python functions, not torch ops, so constant folding leaves them
alone; the program this pass returns is for lowering only (:class:`LoweringProgram`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch
import torch.fx
from torch.export.graph_signature import InputKind

from circleops import ir
from circleops.errors import UnsupportedOpError
from circleops.lowering.linalg import QUANTIZE_MARKERS

_DTYPES = {torch.uint8: "UINT8", torch.int8: "INT8", torch.int16: "INT16", torch.int32: "INT32"}
_CONST_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
_NARROW = (torch.int8, torch.uint8, torch.int16)  # integers float32 holds exactly, with their differences
DEQUANTIZE_BLOCK = 1 << 22  # elements dequantized at a time (QSpec.dequantize)


def _qd():
    """torch.ops.quantized_decomposed (registered by torchao's pt2e import)."""
    if not hasattr(torch.ops, "quantized_decomposed") or not hasattr(torch.ops.quantized_decomposed,
                                                                     "quantize_per_tensor"):
        from circleops.quantize.quantizer import torchao_pt2e

        torchao_pt2e()
    return torch.ops.quantized_decomposed


@dataclass(eq=False)
class QSpec:
    """One tensor's affine quantization: real = scale · (q - zero_point)."""

    dtype: str  # schema TensorType name: UINT8, INT8, INT16, INT32, INT4
    scale: np.ndarray  # float32 [1] or [C]
    zero_point: np.ndarray  # int64 [1] or [C]
    axis: int  # quantized dimension of the torch tensor (per channel), 0 per tensor
    qmin: int
    qmax: int
    plan: "QuantPlan" = field(repr=False, default=None)  # type: ignore[assignment]

    @property
    def per_channel(self) -> bool:
        return self.scale.size > 1

    def params(self, axis: int | None = None) -> ir.QuantParams:
        return ir.QuantParams(self.scale.astype(np.float32), self.zero_point.astype(np.int64),
                              self.axis if axis is None else axis)

    def _shaped(self, values: np.ndarray, rank: int) -> torch.Tensor:
        t = torch.from_numpy(values)
        if self.per_channel:
            shape = [1] * rank
            shape[self.axis] = -1
            t = t.reshape(shape)
        return t

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        """dequantize(quantize(x)) in float32, as torch's quantized_decomposed ops compute it."""
        s = self._shaped(self.scale.astype(np.float32), x.dim())
        z = self._shaped(self.zero_point.astype(np.int64), x.dim()).to(torch.float32)
        q = torch.clamp(torch.round(x.to(torch.float32) * (1.0 / s)) + z, self.qmin, self.qmax)
        return ((q - z) * s).to(x.dtype)

    def dequantize(self, q: torch.Tensor) -> torch.Tensor:
        """scale · (q - zero_point) in float32. Integers of at most 16 bits a block of rows at
        a time in float32: q and zero_point are exact there, so is their difference (below
        2^24), and the product is the same float32 as through int64; the int64 temporaries of a
        whole 128256 x 2048 table (two of 2.1 GB each, for a 1.05 GB result) were most of the
        16a4w lowering's peak at the Llama-3.2-1B shape (issue 32)."""
        out = None
        for r, block in self.dequantize_blocks(q):
            if r is None:
                return block
            if out is None:
                out = torch.empty(q.shape, dtype=torch.float32)
            out[r] = block
        return out if out is not None else torch.empty(q.shape, dtype=torch.float32)

    def dequantize_blocks(self, q: torch.Tensor) -> Iterator[tuple[slice | None, torch.Tensor]]:
        """:meth:`dequantize` a block of rows at a time: (rows, their float32 values); one
        (None, the whole result) where it is computed whole (wider integers, a scalar)."""
        s = self._shaped(self.scale.astype(np.float32), q.dim())
        if q.dtype not in _NARROW or q.dim() == 0 or self.zero_point.size and \
                np.abs(self.zero_point).max() >= 1 << 16:
            z = self._shaped(self.zero_point.astype(np.int64), q.dim())
            yield None, ((q.to(torch.int64) - z).to(torch.float32) * s)
            return
        z = self._shaped(self.zero_point.astype(np.float32), q.dim())
        rows = max(1, DEQUANTIZE_BLOCK // max(1, q[0].numel()))
        by_row = self.per_channel and self.axis == 0
        for i in range(0, q.shape[0], rows):
            r = slice(i, i + rows)
            yield r, torch.mul(q[r].to(torch.float32) - (z[r] if by_row else z), s[r] if by_row else s)


def quantized(x: torch.Tensor, spec: QSpec) -> torch.Tensor:
    """Marker: ``x`` is stored quantized with ``spec`` (evaluates the fake quantization)."""
    return spec.fake_quant(x)


QUANTIZE_MARKERS.add(quantized)  # the lowering writes a decode step's own products as BATCH_MATMUL here


def dequantized(q: torch.Tensor, spec: QSpec) -> torch.Tensor:
    """Marker: the constant integer tensor ``q`` with ``spec``, as its float value."""
    return spec.dequantize(q)


@dataclass(eq=False)
class QuantPlan:
    """What the lowering learns about quantized constants, for the integer pass: the float
    tensors it created from integer constants, by storage, with their specs."""

    consts: dict[int, tuple[torch.Tensor, QSpec]] = field(default_factory=dict)
    integer_io: bool = False
    # float constant's storage -> the integer tensor it was dequantized from (QSpec.dequantize)
    sources: dict[int, torch.Tensor] = field(default_factory=dict)

    def remember(self, t: torch.Tensor, spec: QSpec, source: torch.Tensor | None = None) -> None:
        """``t`` is a float constant stored as ``spec``; ``source``: the integers it was
        dequantized from (the integer pass writes them as they are, no new copy)."""
        self.consts[t.untyped_storage().data_ptr()] = (t, spec)
        if source is not None:
            self.sources[t.untyped_storage().data_ptr()] = source

    def integers(self, data: Any) -> np.ndarray | None:
        """The integers a float constant was dequantized from, read-only and sharing their
        storage with the converted program's tensor, when ``data`` is that constant itself
        (same shape and layout, not a transposed or reshaped view of it); else None. Each
        graph's own quantize_array of its embedding and lm_head was a second copy of PT2E's
        integer tables per graph (0.79 GB at the Llama-3.2-1B shape, issue 32)."""
        if not isinstance(data, torch.Tensor):
            return None
        ptr = data.untyped_storage().data_ptr()
        source, hit = self.sources.get(ptr), self.consts.get(ptr)
        if source is None or hit is None:
            return None
        base = hit[0]
        if data.shape != base.shape or data.stride() != base.stride() or data.storage_offset() != 0 \
                or not source.is_contiguous() or source.shape != base.shape:
            return None
        values = source.detach().numpy()
        values.flags.writeable = False  # the converted module's own integers: no pass may write them
        return values

    def lookup(self, data: Any) -> tuple[QSpec, int] | None:
        """(spec, quantized dimension in ``data``) for a constant the lowering derived from a
        remembered tensor by a view (transpose, reshape), else None."""
        if not isinstance(data, torch.Tensor):
            return None
        hit = self.consts.get(data.untyped_storage().data_ptr())
        if hit is None:
            return None
        base, spec = hit
        if not spec.per_channel:
            return spec, 0
        if data.numel() != base.numel():
            return None
        stride, size = base.stride(spec.axis), base.shape[spec.axis]
        dims = [d for d in range(data.dim()) if data.stride(d) == stride and data.shape[d] == size]
        return (spec, dims[0]) if len(dims) == 1 else None


@dataclass
class LoweringProgram:
    """The parts of an ExportedProgram that lowering reads, with the markers in its graph."""

    graph_module: torch.fx.GraphModule
    graph_signature: Any
    state_dict: dict[str, Any]
    constants: dict[str, Any]

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph


def has_qdq(ep: Any) -> bool:
    """Whether the program holds quantized_decomposed ops (a converted PT2E model)."""
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
               and n.target.namespace == "quantized_decomposed" for n in ep.graph.nodes)


def _value(ep: Any, consts: dict[torch.fx.Node, torch.Tensor], a: Any) -> Any:
    if isinstance(a, torch.fx.Node):
        if a not in consts:
            raise UnsupportedOpError(
                f"quantization parameter {a.name!r} is computed at run time (dynamic quantization); "
                "circleops writes static quantization only: use CircleQuantizer (static PTQ)")
        return consts[a]
    return a


def _spec(ep, consts, args, per_channel: bool, plan: QuantPlan) -> QSpec:
    if per_channel:
        _, scale, zp, axis, qmin, qmax, dtype = args[:7]
        scale, zp = _value(ep, consts, scale), _value(ep, consts, zp)
    else:
        _, scale, zp, qmin, qmax, dtype = args[:6]
        scale, zp, axis = _value(ep, consts, scale), _value(ep, consts, zp), 0
    if dtype not in _DTYPES:
        raise UnsupportedOpError(f"quantized dtype {dtype} is not supported: use uint8, int8, int16 or int32")
    scale = np.asarray(scale.detach().numpy() if isinstance(scale, torch.Tensor) else scale,
                       dtype=np.float32).reshape(-1)
    zp = np.asarray(zp.detach().numpy() if isinstance(zp, torch.Tensor) else zp, dtype=np.int64).reshape(-1)
    name = _DTYPES[dtype]
    if name == "INT8" and int(qmin) >= -8 and int(qmax) <= 7:  # 4-bit values in int8 storage (int4 weights)
        name = "INT4"
    return QSpec(name, scale, zp, int(axis), int(qmin), int(qmax), plan)


def fold_qdq(ep: Any, *, integer_io: bool = False) -> tuple[Any, QuantPlan | None]:
    """(program for lowering, plan) with the Q/DQ pairs replaced by markers; ``(ep, None)``
    when ``ep`` holds no quantized_decomposed ops. ``ep`` itself is not modified."""
    if not has_qdq(ep):
        return ep, None
    qd = _qd()
    q_ops = {qd.quantize_per_tensor.default: False, qd.quantize_per_channel.default: True}
    dq_ops = {qd.dequantize_per_tensor.default: False, qd.dequantize_per_channel.default: True}
    plan = QuantPlan(integer_io=integer_io)
    gm = torch.fx.GraphModule(ep.graph_module, copy.deepcopy(ep.graph))
    graph = gm.graph
    consts: dict[torch.fx.Node, torch.Tensor] = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for spec, node in zip(ep.graph_signature.input_specs, placeholders):
        if spec.kind in _CONST_KINDS:
            consts[node] = ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in q_ops:
            spec = _spec(ep, consts, node.args, q_ops[node.target], plan)
            with graph.inserting_before(node):
                marker = graph.call_function(quantized, (node.args[0], spec))
            marker.meta = {k: v for k, v in node.args[0].meta.items() if k in ("val", "stack_trace")} \
                if isinstance(node.args[0], torch.fx.Node) else {}
            marker.name = f"{node.name}_marker"
            for user in list(node.users):
                if user.op == "call_function" and user.target in dq_ops:
                    user.replace_all_uses_with(marker)
                    graph.erase_node(user)
            if not node.users:
                graph.erase_node(node)
        elif node.target in dq_ops and isinstance(node.args[0], torch.fx.Node) and node.args[0] in consts:
            spec = _spec(ep, consts, node.args, dq_ops[node.target], plan)
            node.target = dequantized
            node.args = (node.args[0], spec)
            node.kwargs = {}
    leftover = [n.name for n in graph.nodes if n.op == "call_function" and (n.target in q_ops or n.target in dq_ops)]
    if leftover:
        raise UnsupportedOpError(
            f"quantize/dequantize nodes {leftover[:5]} do not form pairs around an op (an integer tensor "
            "flows between ops): circleops folds convert_pt2e's quantize -> dequantize pairs; convert the "
            "model with torchao's convert_pt2e and export the result")
    graph.lint()
    return LoweringProgram(gm, ep.graph_signature, ep.state_dict, ep.constants), plan

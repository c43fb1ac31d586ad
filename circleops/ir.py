"""The in-memory graph between lowering and the flatbuffer writers.

Format-neutral: the same IR is written as Circle or TFLite by circleops.serialize and read
back from either by circleops.serialize.reader (for inspect and the reference interpreter).
Names follow the flatbuffer schemas (opcode = BuiltinOperator name, options = the object
API's field names) so the writers need no per-op code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import torch

# GGML block formats (name -> elements, bytes per block), defined with the dtype names
from circleops.dtypes import GGML_BLOCKS

# Schema TensorType name <-> torch dtype. bf16 has no numpy dtype: its data is stored as
# the raw 16-bit pattern.
TORCH_TO_TYPE: dict[torch.dtype, str] = {
    torch.float32: "FLOAT32",
    torch.float16: "FLOAT16",
    torch.bfloat16: "BFLOAT16",
    torch.float64: "FLOAT64",
    torch.int64: "INT64",
    torch.int32: "INT32",
    torch.int16: "INT16",
    torch.int8: "INT8",
    torch.uint8: "UINT8",
    torch.bool: "BOOL",
}
TYPE_TO_TORCH: dict[str, torch.dtype] = {v: k for k, v in TORCH_TO_TYPE.items()}

# 4-bit integer types (Circle INT4 = 17, UINT4 = -1): in the IR a constant's data is one
# int8 / uint8 value per element; the writer packs two per byte as ONE's luci exporter does
# (element 2i in the low nibble, 2i+1 in the high nibble, over the flattened tensor; an odd
# count leaves the last high nibble 0) and the reader unpacks them (circleops.serialize.buffers).
PACKED_4BIT: dict[str, tuple[int, int]] = {"INT4": (-8, 7), "UINT4": (0, 15)}
TYPE_TO_TORCH.update({"INT4": torch.int8, "UINT4": torch.uint8})

ConstData = Union[np.ndarray, torch.Tensor]


@dataclass
class QuantParams:
    """Affine quantization of a tensor (the schema's QuantizationParameters):
    real = scale * (q - zero_point), per tensor (one scale) or per channel along
    ``quantized_dimension``."""

    scale: np.ndarray  # float32 [1] or [C]
    zero_point: np.ndarray  # int64 [1] or [C]
    quantized_dimension: int = 0
    blockwise: "Blockwise | None" = None  # per-group scales (the schema's BlockwiseQuantization)

    @property
    def per_channel(self) -> bool:
        return len(self.scale) > 1


@dataclass(eq=False)
class Blockwise:
    """Per-group scales of a weight [rows, cols] (Circle's QuantizationDetails
    BlockwiseQuantization: ``scales`` names a tensor, ``block_size`` columns share a scale):
    real[r, c] = scales[r, c // block_size] · q[r, c], zero point 0.

    ``scales`` is a constant tensor [rows, cols / block_size]; circleops writes it UINT8 with
    per-row QuantizationParameters (scale s_r, zero point 0), so each group's scale is
    s_r · m[r, g] with an integer m in [1, 255]: an NPU accumulates every group in integers,
    weights the group sums by m and requantizes once per row (circleops.quantize.grouped).
    The weight's own QuantParams.scale holds s_r (the writer leaves the table's scale empty:
    the schema ignores it when details are set)."""

    block_size: int
    scales: "Tensor"


@dataclass
class Tensor:
    """A tensor of a subgraph. ``data`` set means a constant (weights, folded tables).

    ``data`` may stay a torch.Tensor (e.g. a model parameter) so that no copy is made
    before the writer streams it to the file.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str  # schema TensorType name, e.g. "FLOAT32", "INT8", "GGML_Q4_0"
    data: ConstData | None = None
    quant: QuantParams | None = None  # integer tensors of a quantized graph

    @property
    def torch_dtype(self) -> torch.dtype:
        return TYPE_TO_TORCH[self.dtype]

    @property
    def is_block_quantized(self) -> bool:
        return self.dtype in GGML_BLOCKS

    @property
    def is_const(self) -> bool:
        return self.data is not None

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        if self.dtype in GGML_BLOCKS:
            per_block, block_bytes = GGML_BLOCKS[self.dtype]
            return n // per_block * block_bytes
        if self.dtype in PACKED_4BIT:
            return (n + 1) // 2
        return n * torch.empty((), dtype=self.torch_dtype).element_size()


@dataclass
class Operator:
    """One operator. ``inputs``/``outputs`` index the subgraph's tensors; -1 = omitted.

    ``options_type`` is the schema's options table name (e.g. "FullyConnectedOptions",
    "StableHLOCompositeOptions") and ``options`` its fields by object-API name.
    """

    opcode: str
    inputs: list[int]
    outputs: list[int]
    options_type: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    version: int = 1


@dataclass
class Subgraph:
    name: str
    tensors: list[Tensor] = field(default_factory=list)
    operators: list[Operator] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)

    def add_tensor(self, tensor: Tensor) -> int:
        self.tensors.append(tensor)
        return len(self.tensors) - 1


@dataclass
class Signature:
    """A named entry point: input/output names mapped to tensor indices of one subgraph."""

    key: str
    subgraph_index: int
    inputs: dict[str, int]
    outputs: dict[str, int]


@dataclass
class Model:
    subgraphs: list[Subgraph] = field(default_factory=list)
    signatures: list[Signature] = field(default_factory=list)
    description: str = "circleops"
    metadata: dict[str, bytes] = field(default_factory=dict)


def prune(sg: Subgraph) -> dict[int, int]:
    """Drop operators whose outputs nothing uses (e.g. a transpose that a composed
    transpose bypassed) and tensors no operator or boundary refers to; returns the
    old -> new tensor index map."""
    needed = set(sg.outputs)
    kept = []
    for op in reversed(sg.operators):
        if any(o in needed for o in op.outputs):
            kept.append(op)
            needed.update(i for i in op.inputs if i >= 0)
    kept.reverse()
    used = needed | set(sg.inputs) | {o for op in kept for o in op.outputs}
    remap = {old: new for new, old in enumerate(sorted(used))}
    sg.tensors = [sg.tensors[i] for i in sorted(used)]
    for op in kept:
        op.inputs = [remap[i] if i >= 0 else -1 for i in op.inputs]
        op.outputs = [remap[i] for i in op.outputs]
    sg.operators = kept
    sg.inputs = [remap[i] for i in sg.inputs]
    sg.outputs = [remap[i] for i in sg.outputs]
    return remap


def prune_subgraph(model: Model, index: int) -> dict[int, int]:
    """``prune`` subgraph ``index`` of ``model`` and renumber the signatures that point into
    it (after a pass replaced tensors: the replaced ones go); the old -> new index map."""
    remap = prune(model.subgraphs[index])
    for sig in model.signatures:
        if sig.subgraph_index == index:
            sig.inputs = {k: remap[i] for k, i in sig.inputs.items()}
            sig.outputs = {k: remap[i] for k, i in sig.outputs.items()}
    return remap

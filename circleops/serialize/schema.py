"""The two flatbuffer schemas behind one small interface.

Circle (circle_schema, one module per table) and TFLite (ai_edge_litert's single generated
module) have the same object API; ``Schema`` hides where the classes live so the writer
and reader need no per-format code beyond the rules in circle.py / tflite.py.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

# Enum-valued option fields: a lowering may give the enum member's name instead of its
# value (e.g. fusedActivationFunction="RELU"). Keyed by field, or (options_type, field).
ENUM_FIELDS: dict[Any, str] = {
    "fusedActivationFunction": "ActivationFunctionType",
    "padding": "Padding",
    "weightsFormat": "FullyConnectedOptionsWeightsFormat",
    "inDataType": "TensorType",
    "outDataType": "TensorType",
    "outType": "TensorType",
    "outputType": "TensorType",
    "idxOutType": "TensorType",
    "combiner": "CombinerType",
    "type": "LSHProjectionType",
    "compositeAttributesFormat": "CustomOptionsFormat",
    ("RoPEOptions", "mode"): "RoPEMode",
    ("MirrorPadOptions", "mode"): "MirrorPadMode",
}


# Ops whose options table is not named after the op (the rest match by name: MUL -> MulOptions).
OPTIONS_OF: dict[str, str] = {
    **{op: "ReducerOptions" for op in ("MEAN", "SUM", "REDUCE_PROD", "REDUCE_MAX", "REDUCE_MIN",
                                       "REDUCE_ANY", "REDUCE_ALL")},
    "MAXIMUM": "MaximumMinimumOptions",
    "MINIMUM": "MaximumMinimumOptions",
    "AVERAGE_POOL_2D": "Pool2DOptions",
    "MAX_POOL_2D": "Pool2DOptions",
    "L2_POOL_2D": "Pool2DOptions",
    "L2_NORMALIZATION": "L2NormOptions",
    "LSTM": "LSTMOptions",
    "RNN": "RNNOptions",
    "UNIDIRECTIONAL_SEQUENCE_RNN": "SequenceRNNOptions",
}


@dataclass
class Schema:
    """Access to one generated schema package."""

    name: str  # "circle" or "tflite"
    identifier: bytes  # file identifier
    version: int  # Model.version
    _module: Any = field(repr=False, default=None)
    _per_table_modules: bool = False

    def module_for(self, table: str) -> Any:
        if self._per_table_modules:
            try:
                return importlib.import_module(f"{self._module.__name__}.{table}")
            except ImportError:
                return None
        return self._module

    def cls(self, table: str) -> Any:
        """The object-API class of ``table`` (e.g. "Model" -> ModelT), or None."""
        mod = self.module_for(table)
        return getattr(mod, table + "T", None) if mod is not None else None

    def reader_cls(self, table: str) -> Any:
        """The raw (zero-copy) table accessor class, e.g. "Model" -> Model."""
        mod = self.module_for(table)
        return getattr(mod, table, None) if mod is not None else None

    def enum(self, name: str) -> Any:
        mod = self.module_for(name)
        return getattr(mod, name, None) if mod is not None else None

    @functools.cached_property
    def opcodes(self) -> dict[str, int]:
        """BuiltinOperator name -> code."""
        return self.enum_members("BuiltinOperator")

    @functools.cached_property
    def opnames(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for k, v in self.opcodes.items():
            names.setdefault(v, k)
        return names

    @functools.cached_property
    def tensor_types(self) -> dict[str, int]:
        return self.enum_members("TensorType")

    @functools.cached_property
    def tensor_type_names(self) -> dict[int, str]:
        return {v: k for k, v in self.tensor_types.items()}

    def enum_members(self, enum_name: str) -> dict[str, int]:
        e = self.enum(enum_name)
        if e is None:
            return {}
        return {k: v for k, v in vars(e).items() if not k.startswith("_") and isinstance(v, int)}

    def enum_for_field(self, options_type: str, fieldname: str) -> str | None:
        return ENUM_FIELDS.get((options_type, fieldname)) or ENUM_FIELDS.get(fieldname)

    def union_of(self, options_type: str) -> tuple[str, int]:
        """("builtinOptions" | "builtinOptions2", union tag) holding ``options_type``."""
        for attr, union in (("builtinOptions", "BuiltinOptions"), ("builtinOptions2", "BuiltinOptions2")):
            tag = getattr(self.enum(union), options_type, None)
            if isinstance(tag, int):
                return attr, tag
        raise KeyError(options_type)

    @functools.cached_property
    def _options_by_key(self) -> dict[str, str]:
        out = {}
        for union in ("BuiltinOptions2", "BuiltinOptions"):  # BuiltinOptions wins on clashes
            for name in self.enum_members(union):
                if name != "NONE":
                    out[name.lower().removesuffix("options")] = name
        return out

    def default_options_type(self, opcode: str) -> str | None:
        """The options table an op carries (e.g. MUL -> MulOptions, MEAN -> ReducerOptions).

        Runtimes may dereference an op's options without a null check (onert crashes on a
        MUL without MulOptions), so the writer emits a default table when the IR gives none.
        """
        if opcode in OPTIONS_OF:
            return OPTIONS_OF[opcode]
        return self._options_by_key.get(opcode.replace("_", "").lower())

    def union_names(self, union: str) -> dict[int, str]:
        return {v: k for k, v in self.enum_members(union).items()}


@functools.cache
def get_schema(fmt: str) -> Schema:
    """The Schema for "circle" or "tflite"."""
    if fmt == "circle":
        from circle_schema import circle

        return Schema("circle", b"CIR0", 0, circle, True)
    if fmt == "tflite":
        from ai_edge_litert import schema_py_generated

        return Schema("tflite", b"TFL3", 3, schema_py_generated, False)
    raise ValueError(fmt)


@dataclass(frozen=True)
class FormatRules:
    """What differs between writing Circle and TFLite."""

    schema_name: str
    # (opcode name, IR version) -> the version written in OperatorCode.
    op_version: Callable[[str, int], int]
    # BuiltinOperator code -> deprecated_builtin_code (int8 field).
    deprecated_code: Callable[[int], int]
    # Whether the runtimes of this format read Buffer.offset/size (weights after the
    # flatbuffer); if not, write_model refuses files that need that layout.
    reads_offset_buffers: bool
    offset_refusal: str = ""

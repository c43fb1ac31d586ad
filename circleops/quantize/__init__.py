"""Quantized weights and graphs.

Every format is one entry of the registry in circleops.quantize.formats (name, tensor type,
codec, the linears it applies to, targets, runtimes, host requirements); ``WEIGHT_FORMATS``
(what ``convert(..., quantize=...)`` and ``--quantize`` accept), ``INTEGER_FORMATS`` and
``WEIGHT_ONLY_FORMATS`` are views of it for the CLI.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator

from circleops.quantize import formats as _formats


class _View(Mapping):
    """A read-only view of the format registry (circleops.quantize.formats): name -> one
    field, for the formats ``keep`` selects; a format registered later shows up too."""

    def __init__(self, keep: Callable[[Any], bool], value: Callable[[Any], Any]):
        self._keep, self._value = keep, value

    def _selected(self) -> dict[str, Any]:
        return {n: self._value(f) for n, f in _formats.FORMATS.items() if self._keep(f)}

    def __getitem__(self, name: str) -> Any:
        return self._selected()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._selected())

    def __len__(self) -> int:
        return len(self._selected())

    def __repr__(self) -> str:
        return repr(self._selected())


# choice -> what it stores (shown by --help and in errors): every format
WEIGHT_FORMATS: Mapping[str, str] = _View(lambda f: True, lambda f: f.summary)
# PT2E integer graphs (circleops.quantize.integer): choice -> activation scheme
INTEGER_FORMATS: Mapping[str, str] = _View(lambda f: f.kind == _formats.INTEGER, lambda f: f.activations)
# weight-only formats (float activations; circleops.quantize.weights.quantize_weights) -> stored type
WEIGHT_ONLY_FORMATS: Mapping[str, str] = _View(lambda f: f.kind == _formats.WEIGHTS, lambda f: f.tensor_type)
# the former tables, as views (code should ask the entry: formats.get(name).form / .tensor_type)
GGML_FORMATS: Mapping[str, str] = _View(lambda f: f.kind == _formats.WEIGHTS and f.form == _formats.BLOCKS,
                                        lambda f: f.tensor_type)
HYBRID_FORMATS: Mapping[str, str] = _View(lambda f: f.form == _formats.HYBRID and f.kind == _formats.WEIGHTS,
                                          lambda f: f.tensor_type)

# --int16 PART[,PART...] (convert(..., int16=[...])): the parts of a uint8 integer graph whose
# activations are int16 instead (CircleQuantizer.set_operator_type / set_module_name).
# A PART that is not a key here is a module name or glob ("*.mlp.down_proj").
INT16_PARTS: dict[str, str] = {
    "norms": "every norm (circle.rms_norm, circle.instance_norm, layer_norm): input, gamma, output",
    "residual": "every float add (in an LLM with the fused ops: the residual adds)",
    "embedding": "the embedding table (stored int16) and its output, the start of the residual stream",
    "attention": "circle.attention: its input, cos/sin and output (projections stay int8)",
    "mlp": "every MLP (modules *.mlp): gate/up/down projections, activation and product",
    "mlp_out": "the MLP down projections (modules *.mlp.down_proj): its input and output",
    "lm_head": "the output projection (module *lm_head)",
}
# named sets of INT16_PARTS (bench/README.md, "SmolLM2-135M" table: what each costs and buys)
INT16_PRESETS: dict[str, tuple[str, ...]] = {
    "llm": ("norms", "residual", "mlp"),
}

__all__ = ["WEIGHT_FORMATS", "WEIGHT_ONLY_FORMATS", "INTEGER_FORMATS", "GGML_FORMATS", "HYBRID_FORMATS", "INT16_PARTS",
           "INT16_PRESETS"]

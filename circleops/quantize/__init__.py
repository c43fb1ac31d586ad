"""Quantized weights and graphs.

``WEIGHT_FORMATS`` lists what ``convert(..., quantize=...)`` and ``--quantize`` accept, once
for the library and the CLI: each quantization path adds its choices here.
"""
from __future__ import annotations

# choice -> what it stores (shown by --help and in errors)
WEIGHT_FORMATS: dict[str, str] = {
    "q4_0": "GGML_Q4_0 linear weights and embedding table, the output head (lm_head) GGML_Q8_0 "
            "(targets onert, circle)",
    "q4_0-pure": "GGML_Q4_0 linear weights and embedding table, a tied lm_head sharing the table "
                 "(4.5 bits/weight; targets onert, circle)",
    "q8_0": "GGML_Q8_0 linear weights (8.5 bits/weight; targets onert, circle)",
    "w8": "int8 per-channel linear weights, fp32 activations (onert's hybrid FULLY_CONNECTED + MUL: runs on "
          "any x86-64 onert, no AVX-512 needed; targets onert, circle)",
}

# PT2E integer graphs (circleops.quantize.pt2e): choice -> activation scheme
INTEGER_FORMATS: dict[str, str] = {"uint8": "uint8", "int16": "int16"}
WEIGHT_FORMATS.update({
    "uint8": "integer graph: uint8 asymmetric activations, int8 per-channel weights, int32 bias (PT2E; target circle)",
    "int16": "integer graph: int16 symmetric activations, int8 per-channel weights, int32 bias (PT2E; target circle)",
})

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

# GGML choices -> the Circle TensorType their weights are stored as
GGML_FORMATS: dict[str, str] = {"q4_0": "GGML_Q4_0", "q4_0-pure": "GGML_Q4_0", "q8_0": "GGML_Q8_0"}
# int8 weights of onert's hybrid FULLY_CONNECTED (float input and output; circleops.quantize.int8)
HYBRID_FORMATS: dict[str, str] = {"w8": "INT8"}
# weight-only formats (float activations; circleops.quantize.weights.quantize_weights) -> stored type
WEIGHT_ONLY_FORMATS: dict[str, str] = {**GGML_FORMATS, **HYBRID_FORMATS}

__all__ = ["WEIGHT_FORMATS", "GGML_FORMATS", "HYBRID_FORMATS", "WEIGHT_ONLY_FORMATS", "INTEGER_FORMATS", "INT16_PARTS", "INT16_PRESETS"]

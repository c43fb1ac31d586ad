"""The SQNR a format's rounding leaves in a model's logits, predicted from the format's
definition and the model's own values (docs/testing.md, "Tolerances from the format and the
depth"): every rounding adds noise of its quantum (uniform rounding: quantum^2 / 12 in power),
relative to the power of the value it rounds; passed on at unit gain, the relative noise
powers of all roundings add up at the logits. The quanta come from the format's definition
applied to the values (a block's or a row's absmax, a tensor's range), never from the scales
a file holds: a quantizer that wastes a bit is predicted the format's noise and measured 6 dB
worse.

Every rounding point of the graph is counted, parallel branches included (q, k and v; gate
and up): the prediction is an upper bound of the noise on any one path, so the SQNR it gives
is a floor, and test_format_accuracy allows FLOOR_MARGIN_DB below it for what the additive
model leaves out (gains that are not one, values on few levels).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from circleops import ir

FP16_ROUNDING = 2.0 ** -22 / 3  # a round-to-nearest fp16 result: relative error uniform within 2^-11


def db(relative_noise: float) -> float:
    return float(-10 * math.log10(max(relative_noise, 1e-30)))


def block_noise(x: np.ndarray, block: int, levels: float) -> float:
    """Relative noise power of ``x`` rounded in blocks of ``block`` along its last axis, each
    block on the grid absmax / ``levels`` (GGML Q8_0: 32, 127; Q4_0: 32, 8; a row: K, 127)."""
    x = np.asarray(x, np.float64)
    blocks = x.reshape(-1, block)
    step = np.abs(blocks).max(axis=1) / levels
    return float((step ** 2 / 12).mean() / max((blocks ** 2).mean(), 1e-300))


def _linear_inputs(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, np.ndarray]:
    seen: dict[str, np.ndarray] = {}

    def keep(name: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:  # returns None: the input is unchanged
            seen.setdefault(name, args[0].detach().numpy().copy())
        return hook

    hooks = [m.register_forward_pre_hook(keep(name)) for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


# per format: (weight grid, input grid) of every linear, and the embedding table's grid;
# a grid is (block, levels), block None: a whole row. GGML kernels round each linear's input to
# Q8_0, w8's hybrid kernel each input row to int8; q4_0 keeps the head at Q8_0.
WEIGHT_FORMATS = {
    "q4_0": dict(weight=(32, 8), head=(32, 127), input=(32, 127), embedding=(32, 8)),
    "q8_0": dict(weight=(32, 127), head=(32, 127), input=(32, 127), embedding=None),
    "w8": dict(weight=(None, 127), head=(None, 127), input=(None, 127), embedding=None),
}


def weight_format_noise(model: torch.nn.Module, fmt: str, ids: torch.Tensor) -> float:
    """Relative noise power at the logits of ``fmt`` (q4_0, q8_0, w8) on ``model``: each
    linear's weight and input roundings, and the embedding table's."""
    spec = WEIGHT_FORMATS[fmt]
    inputs = _linear_inputs(model, ids)
    total = 0.0
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        w = m.weight.detach().numpy()
        wb, wl = spec["head"] if name.endswith("lm_head") else spec["weight"]
        xb, xl = spec["input"]
        total += block_noise(w, wb or w.shape[-1], wl) + block_noise(inputs[name], xb or w.shape[-1], xl)
    if spec["embedding"]:
        table = model.get_input_embeddings().weight.detach().numpy()
        total += block_noise(table, *spec["embedding"])
    return total


def fp16_noise(path: Any, native_fp16: bool) -> float:
    """Relative noise power at the outputs of an fp16 file: one fp16 rounding per op with an
    fp16 result and per fp16 constant; with native fp16 arithmetic a sum of n terms rounds
    each partial sum (about n / 2 roundings of the result's size)."""
    from circleops.serialize import read_model

    model = read_model(str(path))
    roundings = 0.0
    for sg in model.subgraphs:
        roundings += sum(1 for t in sg.tensors if t.data is not None and t.dtype == "FLOAT16")
        for op in sg.operators:
            if not any(sg.tensors[o].dtype == "FLOAT16" for o in op.outputs):
                continue
            n = int(sg.tensors[op.inputs[0]].shape[-1]) if op.inputs and sg.tensors[op.inputs[0]].shape else 1
            reduces = op.opcode in ("FULLY_CONNECTED", "BATCH_MATMUL", "MEAN", "SUM", "SOFTMAX", "RMS_NORM",
                                    "ATTENTION")
            roundings += n / 2 if native_fp16 and reduces else 1
    return roundings * FP16_ROUNDING


def integer_noise(path: Any, ids: torch.Tensor, fmt: str) -> float:
    """Relative noise power at the outputs of an integer (PT2E) file: every quantized
    activation and weight tensor, on the grid the format defines for its values: uint8
    activations (max - min) / 255 over the tensor's values in this run, int16 ones absmax /
    32767, int8 weights per output channel absmax / 127 (the file's dequantized weights)."""
    from circleops.runtime import reference
    from circleops.serialize import read_model

    model = read_model(str(path))
    sg = model.subgraphs[0]
    acts = [i for i, t in enumerate(sg.tensors) if t.quant is not None and t.data is None
            and t.dtype in ("UINT8", "INT8", "INT16") and i not in sg.inputs]
    total = 0.0
    for i, t in enumerate(sg.tensors):
        if t.quant is not None and t.data is not None and t.dtype == "INT8" and len(t.shape) >= 2:
            q = np.asarray(t.data, np.float64).reshape(t.shape[0], -1)
            scale = np.asarray(t.quant.scale, np.float64).reshape(-1, 1)
            total += block_noise(q * scale, q.shape[1], 127)
    probe = ir.Model(subgraphs=[ir.Subgraph(sg.name, sg.tensors, sg.operators, sg.inputs, acts)] + model.subgraphs[1:],
                     signatures=[], description=model.description, metadata=model.metadata)
    values = reference.Session(probe).run([ids.numpy()])
    for i, v in zip(acts, values):
        t = sg.tensors[i]
        x = (np.asarray(v, np.float64) - np.asarray(t.quant.zero_point, np.float64).reshape(-1)[0]) \
            * float(np.asarray(t.quant.scale).reshape(-1)[0])
        power = max(float((x ** 2).mean()), 1e-300)
        step = (x.max() - x.min()) / 255 if fmt == "uint8" else np.abs(x).max() / 32767
        total += float(step ** 2 / 12) / power
    return total


# --------------------------------------------------------------------------- emulation

def round_ggml(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` through llama.cpp's reference codec (the gguf package: quantize, dequantize)."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    a = x.detach().reshape(-1, x.shape[-1]).to(torch.float32).numpy()
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)).reshape(x.shape).to(x.dtype)


def round_blocks(x: torch.Tensor, block: int | None, levels: int, lowest: int, fp16_scale: bool) -> torch.Tensor:
    """``x`` rounded as a block format defines it (GGML's reference codec, written anew):
    blocks of ``block`` along the last axis (None: a whole row), d = the block's value of
    largest magnitude / -``lowest`` (Q4_0: -8, so that value is exactly -8 steps) or its
    magnitude / ``levels`` (symmetric), stored in fp16 when ``fp16_scale``; q = round(x / d)
    clamped to [lowest, levels]."""
    shape = x.shape
    b = x.reshape(-1, block or shape[-1]).double()
    if lowest == -levels:
        d = b.abs().amax(dim=1, keepdim=True) / levels
    else:  # GGML Q4_0: d = max / -8 where max is the signed value of largest magnitude
        idx = b.abs().argmax(dim=1, keepdim=True)
        d = b.gather(1, idx) / lowest
    if fp16_scale:
        d = d.half().double()
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.clamp(torch.sign(b * inv) * torch.floor((b * inv).abs() + 0.5), lowest, levels)
    return (q * d).reshape(shape).to(x.dtype)


# a weight's storage type in the file -> (its codec, the codec its kernel rounds the input with);
# a codec is (block, levels, lowest, fp16 scale)
_ROW8 = (None, 127, -127, False)
CODECS = {"GGML_Q4_0": ("Q4_0", "Q8_0"), "GGML_Q8_0": ("Q8_0", "Q8_0"), "INT8": (_ROW8, _ROW8)}


def _round(x: torch.Tensor, codec: Any) -> torch.Tensor:
    return round_ggml(x, codec) if isinstance(codec, str) else round_blocks(x, *codec)


def stored_formats(path: Any) -> dict[str, str]:
    """Constant name -> storage type of the file's weights in a block or int8 format: which
    weights the format was applied to is the recipe's choice (the file says it); how each is
    rounded is the format's definition (CODECS, emulated here)."""
    from circleops.serialize import read_model

    return {t.name: t.dtype for sg in read_model(str(path)).subgraphs for t in sg.tensors
            if t.data is not None and t.dtype in CODECS and len(t.shape) == 2}


def _stored(formats: dict[str, str], module: str) -> str | None:
    return next((dtype for name, dtype in formats.items() if name.endswith(module + ".weight")), None)


def emulated_logits(model: torch.nn.Module, fmt: str, ids: torch.Tensor, path: Any = None) -> np.ndarray:
    """``model``'s logits on ``ids`` with every rounding the format ``fmt`` defines done in
    torch by this module's codec (not circleops'): fp16: the model in torch fp16; q4_0 / q8_0
    / w8: each weight the file at ``path`` stores in a block or int8 format on that format's
    grid, and each such linear's input rounded as its kernel rounds it at run time."""
    import copy

    m = copy.deepcopy(model).eval()
    if fmt == "fp16":
        with torch.no_grad():
            return m.half()(ids).logits.float().numpy()
    formats = stored_formats(path)
    hooks = []
    with torch.no_grad():
        for name, mod in m.named_modules():
            dtype = _stored(formats, name)
            if dtype is None or not hasattr(mod, "weight"):
                continue
            weight, inputs = CODECS[dtype]
            mod.weight.copy_(_round(mod.weight, weight))
            if isinstance(mod, torch.nn.Linear):
                hooks.append(mod.register_forward_pre_hook(lambda _, args, c=inputs: (_round(args[0], c),)))
        try:
            return m(ids).logits.numpy()
        finally:
            for h in hooks:
                h.remove()

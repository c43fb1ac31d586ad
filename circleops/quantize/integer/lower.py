"""The integer pass: a lowered PT2E graph (float ops + QUANTIZE markers, see
circleops.quantize.integer.markers) becomes an integer graph.

1. Each QUANTIZE marker folds into the op producing its input: that op writes the
   integer tensor directly (a constant is quantized in place).
2. Parameters flow through ops that only move data (RESHAPE, TRANSPOSE, slices, GATHER,
   padding, max-pool): the lowering's own intermediates (an FC's 2-D output before its
   reshape, a conv's NHWC output before its transpose) get their neighbour's parameters.
   LOGISTIC / TANH / SOFTMAX outputs the torch graph did not observe (the sigmoid inside
   silu) get TFLite's fixed parameters (1/256, 1/32768 ...).
3. An op whose float tensors are all quantized now becomes an integer op; its constant
   inputs are quantized (weights with their PT2E parameters, FC/conv biases as int32 with
   scale s_in · s_w). Any other op stays float, with DEQUANTIZE / QUANTIZE at its edges.
4. The graph's float inputs get a QUANTIZE and its quantized outputs a DEQUANTIZE
   (or, with ``integer_io``, the file's inputs and outputs are the integer tensors).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from circleops import ir
from circleops.quantize.integer import markers as _markers  # noqa: F401  (registers the marker lowerings)
from circleops.quantize.grouped import blockwise_params
from circleops.quantize.grouped import lookup as grouped_lookup
from circleops.quantize.integer.qdq import QuantPlan
from circleops.targets import TargetProfile, profile

FLOAT = "FLOAT32"
INTEGER = ("UINT8", "INT8", "INT16", "INT32", "INT64")
_RANGE = {"UINT8": (0, 255), "INT8": (-128, 127), "INT16": (-32768, 32767), "INT32": (-(2 ** 31), 2 ** 31 - 1),
          "INT64": (-(2 ** 63), 2 ** 63 - 1),
          "INT4": (-8, 7)}
_NP = {"UINT8": np.uint8, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "INT4": np.int8}

# ops that only move (or select) values: in and out share parameters; input 0 is the data
PASS_THROUGH = frozenset({
    "RESHAPE", "TRANSPOSE", "SQUEEZE", "EXPAND_DIMS", "STRIDED_SLICE", "SLICE", "GATHER", "PAD", "MIRROR_PAD",
    "MAX_POOL_2D", "SPLIT", "TILE", "BROADCAST_TO", "RESIZE_NEAREST_NEIGHBOR", "REVERSE_V2",
})
# outputs with a known range get TFLite's fixed parameters: dtype -> (scale, zero point)
FIXED_OUTPUT = {
    "LOGISTIC": {"UINT8": (1 / 256, 0), "INT16": (1 / 32768, 0), "INT8": (1 / 256, -128)},
    "SOFTMAX": {"UINT8": (1 / 256, 0), "INT16": (1 / 32768, 0), "INT8": (1 / 256, -128)},
    "TANH": {"UINT8": (1 / 128, 128), "INT16": (1 / 32768, 0), "INT8": (1 / 128, 0)},
}
WEIGHTED = {"FULLY_CONNECTED": 3, "CONV_2D": 3, "DEPTHWISE_CONV_2D": 3}  # (input, filter, bias)
# Integer ops a target's runtime lacks stay float between a DEQUANTIZE and a QUANTIZE, and
# quantized dtypes it cannot load are refused: TargetProfile.quantized_* (onert 0.1.0 measured
# by bench/onert_quantized.py).

# fused ops: input positions that stay float in the integer op (schema/ops.yaml `quantized`)
FUSED_FLOAT_INPUTS = {"ATTENTION": {7, 8, 9, 10}}
FUSED_FLOAT_OUTPUTS = {"ATTENTION": {1, 2}}


def quantize_array(data: Any, dtype: str, q: ir.QuantParams) -> np.ndarray:
    """round(x / scale) + zero_point, clamped to ``dtype`` (TFLite rounds half away from zero)."""
    x = data.detach().to(torch.float64).numpy() if isinstance(data, torch.Tensor) else np.asarray(data, np.float64)
    scale = q.scale.astype(np.float64)
    zp = q.zero_point.astype(np.float64)
    if scale.size > 1:
        shape = [1] * x.ndim
        shape[q.quantized_dimension] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    v = x / scale
    r = np.sign(v) * np.floor(np.abs(v) + 0.5) + zp
    lo, hi = _RANGE[dtype]
    return np.clip(r, lo, hi).astype(_NP[dtype])


def _from_data(data: Any, dtype: str, per_channel_axis: int | None = None) -> ir.QuantParams:
    """Parameters from a constant's own range (a constant the plan does not know)."""
    x = data.detach().to(torch.float64).numpy() if isinstance(data, torch.Tensor) else np.asarray(data, np.float64)
    if per_channel_axis is not None and x.ndim:
        amax = np.abs(np.moveaxis(x, per_channel_axis, 0).reshape(x.shape[per_channel_axis], -1)).max(axis=1)
        scale = np.maximum(amax / 127.0, 1e-12).astype(np.float32)
        return ir.QuantParams(scale, np.zeros(scale.size, np.int64), per_channel_axis)
    lo, hi = min(float(x.min(initial=0.0)), 0.0), max(float(x.max(initial=0.0)), 0.0)
    if dtype == "UINT8":
        scale = max((hi - lo) / 255.0, 1e-12)
        zp = int(np.clip(round(-lo / scale), 0, 255))
    else:
        qmax = {"INT16": 32767, "INT8": 127}[dtype]
        scale, zp = max(max(-lo, hi) / qmax, 1e-12), 0
    return ir.QuantParams(np.array([scale], np.float32), np.array([zp], np.int64), 0)


def _same(a: ir.QuantParams | None, b: ir.QuantParams | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.scale.shape == b.scale.shape and np.array_equal(a.scale, b.scale)
            and np.array_equal(a.zero_point, b.zero_point) and a.quantized_dimension == b.quantized_dimension)


class _Graph:
    """Producer / consumer indices of one subgraph, rebuilt after each structural edit."""

    def __init__(self, sg: ir.Subgraph):
        self.sg = sg
        self.refresh()

    def refresh(self) -> None:
        self.producer: dict[int, int] = {}
        self.consumers: dict[int, list[tuple[int, int]]] = {}
        for k, op in enumerate(self.sg.operators):
            for o in op.outputs:
                self.producer[o] = k
            for pos, i in enumerate(op.inputs):
                if i >= 0:
                    self.consumers.setdefault(i, []).append((k, pos))

    def tensor(self, i: int) -> ir.Tensor:
        return self.sg.tensors[i]

    def quant(self, i: int) -> bool:
        return self.sg.tensors[i].quant is not None


def integerize(model: ir.Model, plan: QuantPlan, target: str | TargetProfile = "circle") -> None:
    """Turn the lowered PT2E graph ``model`` into an integer graph, in place (see module doc)."""

    sg = model.subgraphs[0]
    g = _Graph(sg)
    _fold_markers(g)
    _propagate(g)
    _fuse_activations(g)
    _integer_ops(g, plan, target)
    _drop_identity_requantize(g)
    p = profile(target)
    if p.quantized_fixed_outputs:
        _fixed_outputs(g)
    if p.quantized_same_params:
        _same_params(g, p.quantized_same_params)
    if p.quantized_neg_raw:
        _neg_as_sub(g)
    if p.quantized_mean_square_narrow > 1:
        _narrow_mean_squares(g, p.quantized_mean_square_narrow)
    if p.quantized_rsqrt_ranges > 1:
        _rsqrt_ranges(g, p.quantized_rsqrt_ranges)
    if p.quantized_uint8_as_int8:
        _uint8_as_int8(sg)
    _check_target(sg, target)
    _boundaries(model, sg, plan.integer_io)
    ir.prune(sg)  # the signature lists the subgraph's inputs and outputs, in order
    for sig in model.signatures:
        if sig.subgraph_index == 0:
            sig.inputs = dict(zip(sig.inputs, sg.inputs))
            sig.outputs = dict(zip(sig.outputs, sg.outputs))


def _is_marker(g: _Graph, op: ir.Operator) -> bool:
    return op.opcode == "QUANTIZE" and g.tensor(op.inputs[0]).dtype == FLOAT and g.quant(op.outputs[0])


def _fold_markers(g: _Graph) -> None:
    sg = g.sg
    drop: set[int] = set()
    for k, op in enumerate(sg.operators):
        if not _is_marker(g, op):
            continue
        i, o = op.inputs[0], op.outputs[0]
        src, dst = g.tensor(i), g.tensor(o)
        if src.data is not None:  # a constant: quantized in place
            dst.data = quantize_array(src.data, dst.dtype, dst.quant)
            drop.add(k)
            continue
        p = g.producer.get(i)
        users = g.consumers.get(i, [])
        if p is None or i in sg.outputs or i in sg.inputs or src.quant is not None:
            continue
        if not all(_is_marker(g, sg.operators[u]) for u, _ in users) or users[0][0] != k:
            continue
        # the producer writes the integer tensor; later markers of i requantize from it
        prod = sg.operators[p]
        prod.outputs = [o if t == i else t for t in prod.outputs]
        for u, pos in users[1:]:
            sg.operators[u].inputs[pos] = o
        drop.add(k)
    sg.operators = [op for k, op in enumerate(sg.operators) if k not in drop]
    g.refresh()


def _assign(t: ir.Tensor, like: ir.Tensor) -> None:
    t.quant, t.dtype = like.quant, like.dtype


def _propagate(g: _Graph) -> None:
    sg = g.sg
    changed = True
    while changed:
        changed = False
        for op in sg.operators:
            if op.opcode in PASS_THROUGH and op.inputs and op.inputs[0] >= 0:
                d = op.inputs[0]
                din = g.tensor(d)
                if din.data is not None or din.dtype not in (FLOAT,) + INTEGER:
                    continue
                for o in op.outputs:
                    out = g.tensor(o)
                    # (an onert output copy was made from the marker's tensor: same dtype, no params)
                    if g.quant(d) and not g.quant(o) and out.dtype in (FLOAT, din.dtype):
                        _assign(out, din)
                        changed = True
                    elif g.quant(o) and not g.quant(d) and din.dtype == FLOAT and d not in sg.inputs \
                            and d in g.producer and all(sg.operators[u].opcode in PASS_THROUGH and u_pos == 0
                                                        for u, u_pos in g.consumers.get(d, [])):
                        _assign(din, out)
                        changed = True
            elif op.opcode in FIXED_OUTPUT and g.quant(op.inputs[0]) and not g.quant(op.outputs[0]):
                dtype = g.tensor(op.inputs[0]).dtype
                if dtype in FIXED_OUTPUT[op.opcode]:
                    scale, zp = FIXED_OUTPUT[op.opcode][dtype]
                    out = g.tensor(op.outputs[0])
                    out.dtype = dtype
                    out.quant = ir.QuantParams(np.array([scale], np.float32), np.array([zp], np.int64), 0)
                    changed = True


def _float_only(op: ir.Operator, target: str | TargetProfile) -> bool:
    p = profile(target)
    if op.opcode in p.quantized_float_only:
        return True
    return op.opcode == "MEAN" and p.quantized_mean_needs_keep_dims and not op.options.get("keepDims", False)


def _check_target(sg: ir.Subgraph, target: str | TargetProfile) -> None:
    from circleops.errors import TargetError

    p = profile(target)
    for t in sg.tensors:
        if t.dtype in ("UINT8", "INT8", "INT16", "INT4") and t.quant is not None and t.dtype not in p.quantized_dtypes:
            raise TargetError(f"target {p.name}: its runtime loads no {t.dtype.lower()} graph (tensor {t.name!r} is "
                              f"{t.dtype}; onert 0.1.0: 'OperationValidator failed' for every op). Use --quantize uint8 "
                              "for onert, or --target circle for an int16 file for NPU compilers.")
        if t.dtype == "INT8" and t.quant is not None and t.quant.per_channel and not p.quantized_per_channel_int8:
            raise TargetError(f"target {p.name}: onert 0.1.0 computes int8 per-channel weights wrongly (tensor "
                              f"{t.name!r}; measured ~250 output steps off): quantize weights as uint8 per tensor "
                              "(CircleQuantizer(weight='uint8')) for onert, or use --target circle.")


def _integer_ops(g: _Graph, plan: QuantPlan, target: str | TargetProfile = "circle") -> None:
    sg = g.sg
    new_ops: list[ir.Operator] = []
    for op in sg.operators:
        if op.opcode in ("QUANTIZE", "DEQUANTIZE"):
            new_ops.append(op)
            continue
        float_in = FUSED_FLOAT_INPUTS.get(op.opcode, set())
        float_out = FUSED_FLOAT_OUTPUTS.get(op.opcode, set())
        ins = [(pos, i) for pos, i in enumerate(op.inputs) if i >= 0 and pos not in float_in]
        outs = [(pos, o) for pos, o in enumerate(op.outputs) if pos not in float_out]
        touched = [i for _, i in ins] + [o for _, o in outs]
        if not any(g.quant(t) for t in touched):
            new_ops.append(op)
            continue
        live_float = [i for _, i in ins if g.tensor(i).dtype == FLOAT and g.tensor(i).data is None]
        outs_ok = all(g.quant(o) for _, o in outs)
        if not live_float and outs_ok and not _float_only(op, target):
            _quantize_consts(g, op, ins, plan, profile(target).quantized_int16_bias)
            new_ops.append(op)
            new_ops.extend(_requantize_moved(g, op))
            continue
        # stays float: dequantize its integer inputs, quantize into its integer outputs
        _float_island_allowed(g, op, target)
        for pos, i in ins:
            if g.quant(i):
                f = sg.add_tensor(ir.Tensor(f"{g.tensor(i).name}_dequantized", g.tensor(i).shape, FLOAT))
                new_ops.append(ir.Operator("DEQUANTIZE", [i], [f]))
                op.inputs[pos] = f
        after = []
        for pos, o in outs:
            if g.quant(o):
                f = sg.add_tensor(ir.Tensor(f"{g.tensor(o).name}_float", g.tensor(o).shape, FLOAT))
                op.outputs[pos] = f
                after.append(ir.Operator("QUANTIZE", [f], [o]))
        new_ops.append(op)
        new_ops.extend(after)
    sg.operators = new_ops
    g.refresh()


def _float_island_allowed(g: _Graph, op: ir.Operator, target: str | TargetProfile) -> None:
    """A target whose files are full-integer (TargetProfile.quantized_float_islands False:
    tflite) refuses an op that would stay float between a DEQUANTIZE and a QUANTIZE, naming
    the op and the target whose runtime runs it integer."""
    from circleops.errors import TargetError

    p = profile(target)
    if p.quantized_float_islands:
        return
    if op.opcode == "STABLEHLO_COMPOSITE":
        what = f"the fused op {op.options.get('name', '?')} ({p.runtime} has no integer composite)"
        hint = ("quantize the unfused model (fuse='none', what circleops.convert does for this target), or use "
                "target 'circle' for integer RMS_NORM / ROPE / ATTENTION builtins (the reference interpreter runs them)")
    else:
        what = f"{op.opcode} (CircleQuantizer gives it no integer form, or {p.runtime} has no integer kernel for it)"
        hint = ("use target 'circle', whose files may keep such an op float between a DEQUANTIZE and a QUANTIZE "
                "(the reference interpreter runs them), or rewrite that part of the model with ops of integer form")
    name = g.tensor(op.outputs[0]).name if op.outputs else "?"
    raise TargetError(f"target {p.name}: {what} would compute in float (output {name!r}), and a {p.name} integer "
                      f"file is integer throughout: {hint}")


def _fixed_outputs(g: _Graph) -> None:
    """LOGISTIC / SOFTMAX / TANH outputs carry the kernels' fixed parameters (TFLite checks
    them at prepare); an output the calibration observed with other parameters is the
    fixed-parameter result requantized by a QUANTIZE (one more rounding, under a step)."""
    sg = g.sg
    new_ops = []
    for op in sg.operators:
        new_ops.append(op)
        if op.opcode not in FIXED_OUTPUT or not g.quant(op.outputs[0]):
            continue
        out = g.tensor(op.outputs[0])
        fixed = FIXED_OUTPUT[op.opcode].get(out.dtype)
        if fixed is None:
            continue
        qp = ir.QuantParams(np.array([fixed[0]], np.float32), np.array([fixed[1]], np.int64), 0)
        if _same(out.quant, qp):
            continue
        t = sg.add_tensor(ir.Tensor(f"{out.name}_fixed", out.shape, out.dtype, None, qp))
        new_ops.append(ir.Operator("QUANTIZE", [t], [op.outputs[0]]))
        op.outputs[0] = t
    sg.operators = new_ops
    g.refresh()


def _same_params(g: _Graph, opcodes: frozenset[str]) -> None:
    """Integer ``opcodes`` whose kernel takes only inputs with the output's parameters
    (TFLite's int8 CONCATENATION): an input with others is requantized by a QUANTIZE first,
    what the kernel would otherwise do itself (the fake-quantized module's cat rounds once,
    at its output: the same values)."""
    sg = g.sg
    new_ops = []
    for op in sg.operators:
        out = g.tensor(op.outputs[0]) if op.outputs else None
        if op.opcode in opcodes and out is not None and out.quant is not None:
            for pos, i in enumerate(op.inputs):
                t = g.tensor(i)
                if i < 0 or t.quant is None or (t.dtype == out.dtype and _same(t.quant, out.quant)):
                    continue
                r = sg.add_tensor(ir.Tensor(f"{t.name}_requantized", t.shape, out.dtype, None, out.quant))
                new_ops.append(ir.Operator("QUANTIZE", [i], [r]))
                op.inputs[pos] = r
        new_ops.append(op)
    sg.operators = new_ops
    g.refresh()


def _neg_as_sub(g: _Graph) -> None:
    """An integer NEG whose kernel negates the stored values (TFLite: -q, parameters
    ignored) becomes SUB(0, x), the zero stored with x's parameters: -q is wrong with a
    zero point, and even with mirrored parameters it wraps at the type's lowest value
    (-(-32768) is -32768 in int16), which LiteRT's kernels write whenever they saturate low
    (their range is [-32768, 32767], PT2E's symmetric [-32767, 32767]): on SmolLM2 the
    saturated keys of RoPE's rotate_half flipped sign (measured, 8.8 dB logits)."""
    sg = g.sg
    for op in sg.operators:
        if op.opcode != "NEG" or not g.quant(op.inputs[0]) or not g.quant(op.outputs[0]):
            continue
        x = g.tensor(op.inputs[0])
        zero = quantize_array(np.zeros([1], np.float32), x.dtype, x.quant)
        z = sg.add_tensor(ir.Tensor(f"{x.name}_zero", [1], x.dtype, zero, x.quant))
        op.opcode, op.options_type, op.options = "SUB", "SubOptions", {"fusedActivationFunction": 0}
        op.inputs = [z, op.inputs[0]]
    g.refresh()


def _producer(g: _Graph, i: int, opcode: str) -> ir.Operator | None:
    k = g.producer.get(i)
    return g.sg.operators[k] if k is not None and g.sg.operators[k].opcode == opcode else None


def _symmetric16(t: ir.Tensor) -> bool:
    return t.dtype == "INT16" and t.quant is not None and t.quant.scale.size == 1 and not t.quant.zero_point.any()


def _narrow_mean_squares(g: _Graph, factor: int) -> None:
    """RMSNorm op by op, int16: RSQRT(ADD(MEAN(MUL(x, x)), eps)). One massive token sets
    the mean square's range (SmolLM2: 8e5, a step of 25) and the other tokens' mean squares
    (10-100) get a few levels or none: their normalizer was off by up to 22 % in a one-norm
    file with such a token (tests/tflite/test_tflite_integer.py). The mean
    square is also computed at ``factor`` times finer scales (x², its mean: saturating
    above 1/factor of the range), r_f = RSQRT of that; the normalizer is
    r_f - RELU(c - r_c), c = rsqrt(the fine range's top): where the fine one did not
    saturate, r_c (the coarse one) is above c and r_f stands; where it did, r_f is c and
    the result r_c."""
    sg = g.sg
    new_ops = []
    for op in sg.operators:
        new_ops.append(op)
        if op.opcode != "RSQRT":
            continue
        add = _producer(g, op.inputs[0], "ADD")
        if add is None:
            continue
        live = [i for i in add.inputs if g.tensor(i).data is None]
        mean = _producer(g, live[0], "MEAN") if len(live) == 1 else None
        mul = _producer(g, mean.inputs[0], "MUL") if mean is not None else None
        if mul is None or mul.inputs[0] != mul.inputs[1] \
                or mul.options.get("fusedActivationFunction", 0) not in (0, "NONE"):
            continue
        sq, ms, r = (g.tensor(t) for t in (mul.outputs[0], mean.outputs[0], op.outputs[0]))
        if not all(_symmetric16(t) for t in (g.tensor(mul.inputs[0]), sq, ms, g.tensor(add.outputs[0]), r)):
            continue

        def finer(t: ir.Tensor, name: str) -> int:
            q = ir.QuantParams((t.quant.scale / factor).astype(np.float32), t.quant.zero_point.copy(), 0)
            return sg.add_tensor(ir.Tensor(f"{t.name}_{name}", t.shape, t.dtype, None, q))

        def like_r(name: str, data: Any = None) -> int:
            return sg.add_tensor(ir.Tensor(f"{r.name}_{name}", [1] if data is not None else r.shape, r.dtype, data,
                                           r.quant))

        sq_f, ms_f = finer(sq, "fine"), finer(ms, "fine")
        r_f, r_c, over = like_r("fine"), like_r("coarse"), like_r("over")
        top = 32767.0 * float(ms.quant.scale[0]) / factor  # where the fine mean square saturates
        c = like_r("fine_top", quantize_array(np.array([top ** -0.5]), "INT16", r.quant))
        out = op.outputs[0]
        op.outputs = [r_c]
        new_ops += [ir.Operator("MUL", [mul.inputs[0], mul.inputs[0]], [sq_f], mul.options_type, dict(mul.options)),
                    ir.Operator("MEAN", [sq_f] + mean.inputs[1:], [ms_f], mean.options_type, dict(mean.options)),
                    ir.Operator("RSQRT", [ms_f], [r_f]),
                    ir.Operator("SUB", [c, r_c], [over], "SubOptions", {"fusedActivationFunction": 1}),  # RELU
                    ir.Operator("SUB", [r_f, over], [out], "SubOptions", {"fusedActivationFunction": 0})]
    sg.operators = new_ops
    g.refresh()


RSQRT_RANGE_FACTOR = 16  # each further RSQRT reads a 16x narrower input range


def _rsqrt_ranges(g: _Graph, count: int) -> None:
    """An int16 RSQRT whose kernel interpolates a table over the input's whole quantized
    range (LiteRT: 512 segments) is far off in the lowest segments, where rsqrt is steep:
    with SmolLM2's norms (mean squares up to 8e5 for one massive token, 20-100 for the
    others) it returned ~1.0 for rsqrt(100) = 0.1 (measured). It becomes ``count`` RSQRTs,
    the k-th reading the input requantized (QUANTIZE, saturating) to a 16^k times narrower
    range, and their MINIMUM: rsqrt is convex and decreasing, so each table's interpolation
    and each saturated input err upwards, and the smallest is the one whose range fits the
    value (its segment at least 1/16 of the range from zero: within ~0.04 %)."""
    sg = g.sg
    new_ops = []
    for op in sg.operators:
        x = g.tensor(op.inputs[0]) if op.opcode == "RSQRT" and op.inputs else None
        out = g.tensor(op.outputs[0]) if op.outputs else None
        if x is None or x.dtype != "INT16" or x.quant is None or out is None or out.quant is None \
                or out.dtype != "INT16":
            new_ops.append(op)
            continue
        o = op.outputs[0]
        op.outputs = [sg.add_tensor(ir.Tensor(f"{out.name}_range0", out.shape, out.dtype, None, out.quant))]
        results = [op.outputs[0]]
        new_ops.append(op)
        for k in range(1, count):
            narrow = ir.QuantParams((x.quant.scale / RSQRT_RANGE_FACTOR ** k).astype(np.float32),
                                    x.quant.zero_point.copy(), x.quant.quantized_dimension)
            xk = sg.add_tensor(ir.Tensor(f"{x.name}_range{k}", x.shape, x.dtype, None, narrow))
            rk = sg.add_tensor(ir.Tensor(f"{out.name}_range{k}", out.shape, out.dtype, None, out.quant))
            new_ops += [ir.Operator("QUANTIZE", [op.inputs[0]], [xk]), ir.Operator("RSQRT", [xk], [rk])]
            results.append(rk)
        acc = results[0]
        for k, r in enumerate(results[1:], 1):
            dst = o if k == len(results) - 1 else \
                sg.add_tensor(ir.Tensor(f"{out.name}_min{k}", out.shape, out.dtype, None, out.quant))
            new_ops.append(ir.Operator("MINIMUM", [acc, r], [dst]))
            acc = dst
    sg.operators = new_ops
    g.refresh()


def _uint8_as_int8(sg: ir.Subgraph) -> None:
    """Every UINT8 tensor becomes INT8 with the zero point 128 lower: the same real values
    (scale · (q - zp)), in the int8 asymmetric activations TFLite's kernels take."""
    for t in sg.tensors:
        if t.dtype != "UINT8" or t.quant is None:
            continue
        t.dtype = "INT8"
        t.quant = ir.QuantParams(t.quant.scale, t.quant.zero_point - 128, t.quant.quantized_dimension)
        if t.data is not None:
            t.data = (np.asarray(t.data).astype(np.int16) - 128).astype(np.int8)


def _requantize_moved(g: _Graph, op: ir.Operator) -> list[ir.Operator]:
    """An op that only moves data keeps its input's parameters (TFLite requires it; onert
    copies the bytes): an output observed with other parameters gets a QUANTIZE after it."""
    if op.opcode not in PASS_THROUGH or not g.quant(op.inputs[0]):
        return []
    src = g.tensor(op.inputs[0])
    after = []
    for pos, o in enumerate(op.outputs):
        out = g.tensor(o)
        if out.quant is not None and (out.dtype != src.dtype or not _same(out.quant, src.quant)):
            moved = g.sg.add_tensor(ir.Tensor(f"{out.name}_moved", out.shape, src.dtype, None, src.quant))
            op.outputs[pos] = moved
            after.append(ir.Operator("QUANTIZE", [moved], [o]))
    return after


def _drop_identity_requantize(g: _Graph) -> None:
    """QUANTIZE int -> int with the same dtype and parameters is a copy: its readers read
    the source instead (two markers of one tensor leave one)."""
    sg = g.sg
    alias: dict[int, int] = {}
    kept = []
    for op in sg.operators:
        op.inputs = [alias.get(i, i) for i in op.inputs]
        if op.opcode == "QUANTIZE":
            src, dst = g.tensor(op.inputs[0]), g.tensor(op.outputs[0])
            if src.dtype == dst.dtype and src.dtype != FLOAT and _same(src.quant, dst.quant) \
                    and op.outputs[0] not in sg.outputs:
                alias[op.outputs[0]] = op.inputs[0]
                continue
        kept.append(op)
    sg.operators = kept
    g.refresh()


# integer ops that take a fusedActivationFunction; RELU / RELU6 after them fold into it
FUSES_ACTIVATION = frozenset({"CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "ADD", "SUB", "MUL"})
_ACTIVATION_CODE = {"RELU": 1, "RELU6": 3}


def _fuse_activations(g: _Graph) -> None:
    """An integer RELU / RELU6 whose input is the sole output of a conv / FC / ADD (same
    parameters) becomes that op's fusedActivationFunction: one op fewer, and onert has no
    integer RELU ("ElementwiseActivationLayer(ReLU): unsupported data type", measured)."""
    sg = g.sg
    drop = set()
    for k, op in enumerate(sg.operators):
        if op.opcode not in _ACTIVATION_CODE or not g.quant(op.inputs[0]):
            continue
        i, o = op.inputs[0], op.outputs[0]
        p = g.producer.get(i)
        if p is None or i in sg.outputs or len(g.consumers.get(i, [])) != 1:
            continue
        prod = sg.operators[p]
        if prod.opcode not in FUSES_ACTIVATION or prod.options.get("fusedActivationFunction", 0) not in (0, "NONE") \
                or not _same(g.tensor(i).quant, g.tensor(o).quant) or g.tensor(i).dtype != g.tensor(o).dtype:
            continue
        prod.options["fusedActivationFunction"] = _ACTIVATION_CODE[op.opcode]
        if prod.options_type is None:
            prod.options_type = {"ADD": "AddOptions", "SUB": "SubOptions", "MUL": "MulOptions"}.get(prod.opcode)
        prod.outputs = [o if t == i else t for t in prod.outputs]
        drop.add(k)
    sg.operators = [op for k, op in enumerate(sg.operators) if k not in drop]
    g.refresh()


def _quantize_consts(g: _Graph, op: ir.Operator, ins: list[tuple[int, int]], plan: QuantPlan,
                     int16_bias: str = "INT32") -> None:
    """Constant float inputs of an integer op become integer constants (the bias of an op
    on int16 activations as ``int16_bias``: TargetProfile.quantized_int16_bias)."""
    sg = g.sg
    act = next((g.tensor(i) for _, i in ins if g.quant(i) and g.tensor(i).data is None), None)
    act = act or g.tensor(op.outputs[0])
    for pos, i in ins:
        t = g.tensor(i)
        if t.data is None or t.dtype != FLOAT:
            continue
        if op.opcode in WEIGHTED and pos == 2:
            qp = _bias_params(g, op, t)
            dtype = int16_bias if g.tensor(op.inputs[0]).dtype == "INT16" else "INT32"
        else:
            hit = plan.lookup(t.data)
            grouped = grouped_lookup(t.data) if hit is None else None  # FC weights, ATTENTION's wq..wo
            if grouped is not None:  # per-group int4 rounded before PT2E: the integers as they are
                values, dtype, qp = blockwise_params(t.name, grouped)
                op.inputs[pos] = sg.add_tensor(ir.Tensor(t.name, t.shape, dtype, values, qp))
                continue
            if hit is not None:
                spec, axis = hit
                qp, dtype = spec.params(axis), spec.dtype
            elif op.opcode in WEIGHTED and pos == 1:
                axis = 3 if op.opcode == "DEPTHWISE_CONV_2D" else 0
                qp, dtype = _from_data(t.data, "INT8", axis), "INT8"
            else:
                dtype = act.dtype
                qp = _from_data(t.data, dtype)
        idx = sg.add_tensor(ir.Tensor(t.name, t.shape, dtype, quantize_array(t.data, dtype, qp), qp))
        op.inputs[pos] = idx


def _bias_params(g: _Graph, op: ir.Operator, bias: ir.Tensor) -> ir.QuantParams:
    """int32 bias: scale = s_input · s_weight (per channel), zero point 0."""
    x, w = g.tensor(op.inputs[0]).quant, g.tensor(op.inputs[1]).quant
    scale = (np.float32(x.scale[0]) * w.scale.astype(np.float32)).astype(np.float32)
    if scale.size == 1 and bias.shape and bias.shape[0] > 1:
        scale = np.full(bias.shape[0], scale[0], np.float32)
    return ir.QuantParams(scale, np.zeros(scale.size, np.int64), 0)


def _boundaries(model: ir.Model, sg: ir.Subgraph, integer_io: bool) -> None:
    g = _Graph(sg)
    ops = list(sg.operators)
    # inputs: a float input quantized by a QUANTIZE (kept as such, or made the input itself)
    if integer_io:
        for k, i in enumerate(list(sg.inputs)):
            users = g.consumers.get(i, [])
            if len(users) == 1 and sg.operators[users[0][0]].opcode == "QUANTIZE" \
                    and g.tensor(i).dtype == FLOAT:
                q = sg.operators[users[0][0]]
                sg.inputs[k] = q.outputs[0]
                ops.remove(q)
    for k, o in enumerate(list(sg.outputs)):
        t = sg.tensors[o]
        if t.quant is None or integer_io:
            continue
        f = sg.add_tensor(ir.Tensor(f"{t.name}_dequantized", t.shape, FLOAT))
        ops.append(ir.Operator("DEQUANTIZE", [o], [f]))
        sg.outputs[k] = f
    sg.operators = ops


def lower_quantized(ep: Any, target: str, *, dtype: Any = None, integer_io: bool = False) -> ir.Model | None:
    """Lower a converted PT2E program (quantize/dequantize pairs) to an integer ir.Model;
    None when ``ep`` holds no quantized_decomposed ops (lower it as a float program)."""
    from circleops.errors import TargetError
    from circleops.lowering.program import lower_program
    from circleops.quantize.integer.qdq import fold_qdq

    program, plan = fold_qdq(ep, integer_io=integer_io)
    if plan is None:
        return None
    if not profile(target).integer_graphs:
        raise TargetError(f"integer (PT2E) graphs are written for targets circle and onert; target "
                          f"{profile(target).name} writes composites with float decompositions. Use --target circle.")
    model = lower_program(program, target, dtype=dtype)
    integerize(model, plan, target)
    return model

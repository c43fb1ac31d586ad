"""The registered ops (circleops.ops.REGISTRY: the fused circle ops and users' own), written
as their OpSpec and the target profile say (``OpSpec.form(profile)``):

* builtin    -> the Circle builtin, when it can express the node's attributes exactly;
                otherwise the node is decomposed (numerics are never silently changed)
* custom     -> a CUSTOM op: the spec's custom_code, custom_options = a flexbuffer map of
                the schema's non-tensor arguments by name
* decomposed -> the op's reference kernel traced with make_fx, lowered inline
* composite  -> STABLEHLO_COMPOSITE whose decomposition subgraph holds the reference kernel

The four built-ins have an @lower of their own below (layouts, fp16 islands, onert's
limits); every other registered op is lowered by :func:`lower_registered` (a resolver of
the lowering table), from its spec alone.

A node whose ``meta[LOWERING_META]`` is ``"decomposed"`` is decomposed whatever its target
says (set by a pass before lowering, e.g. circleops.tools.precision, to write an fp16 graph's
fp32-policy RMSNorm as a CAST-ops-CAST island instead of the RMS_NORM builtin).

Semantics of the builtins as onert 0.1.0 runs them (probed with hand-built files; the
tests in tests/onert pin them):
* RMS_NORM(x, gamma): y = x / sqrt(mean(x², -1) + epsilon) · gamma, in the tensor dtype.
  fp32 only; x rank 3 or 4 (rank 2 and 5 fail at prepare: "ShapeValidator"), so other
  ranks are reshaped to [1, N, C] around it.
* ROPE(x, sin, cos): x [B, H, S, D]; sin/cos must be rank 4 [1, 1, S, D] (rank 2/3 fail
  at prepare); out = x·cos + rotate_half(x)·sin with HF's sign convention (GPT_NEOX).
  It reads only the first row (position) of sin/cos for every S, so it is exact only for
  S == 1: target onert uses it for decode steps only.
* INSTANCE_NORM, ATTENTION: not runnable on onert -> decomposed for target onert.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from circleops.lowering.context import Value, const_value
from circleops.lowering.registry import RESOLVERS, lower
from circleops.ops import REGISTRY, OpSpec, by_overload
from circleops.ops import at_least_fp32
from circleops.serialize.composite import encode_attributes
from circleops.targets import BUILTIN, COMPOSITE, CUSTOM, DECOMPOSED

_FLOAT32 = torch.float32
LOWERING_META = "circleops_lowering"  # node.meta key: "decomposed" forces the decomposition


def form(ctx, spec: OpSpec) -> str:
    """How ctx's target profile writes ``spec``: BUILTIN, CUSTOM, DECOMPOSED or COMPOSITE."""
    return spec.form(ctx.profile)


def fused(ctx, spec: OpSpec, bound: dict[str, Any], builtin: Callable[..., Any]) -> Any:
    """Write one registered op the way ctx's target profile wants it (see the module docstring)."""
    how = form(ctx, spec)
    if ctx.node is not None and ctx.node.meta.get(LOWERING_META) == DECOMPOSED:
        how = DECOMPOSED
    if how == COMPOSITE:
        return composite(ctx, spec, bound)
    if how == CUSTOM:
        return custom(ctx, spec, bound)
    if how == BUILTIN:
        result = builtin(ctx, spec, **bound)
        if result is not None:
            return result
    return ctx.call(spec.reference, **bound)


def _outs(ctx) -> list[tuple[tuple[int, ...], torch.dtype]]:
    vals = ctx.out if isinstance(ctx.out, (tuple, list)) else [ctx.out]
    return [(tuple(int(d) for d in v.shape), v.dtype) for v in vals]


def _attributes(ctx, spec: OpSpec, bound: dict[str, Any], names: Any) -> dict[str, Any]:
    """The non-tensor arguments named, as plain values (a tensor-valued one is an error)."""
    out = {}
    for name in names:
        value = bound[name]
        if isinstance(value, Value):
            if not value.is_const or value.const.numel() != 1:
                raise ctx.unsupported(
                    f"passes a computed value as {spec.qualname}'s non-tensor argument {name!r}",
                    "Its attributes are written into the file: pass a Python constant.")
            value = value.const.item()
        out[name] = value
    return out


def custom(ctx, spec: OpSpec, bound: dict[str, Any]) -> Any:
    """CUSTOM(tensor args in schema order; an absent optional one is -1), custom_code from
    the spec, custom_options = flexbuffer map of the non-tensor arguments by name."""
    how = spec.tflite if ctx.profile.fused_ops == COMPOSITE else spec.circle
    lists = [a.name for a in spec.arguments if isinstance(bound[a.name], (list, tuple))
             and any(isinstance(v, Value) for v in bound[a.name])]
    if lists:
        raise ctx.unsupported(f"passes a list of tensors ({', '.join(lists)}) to {spec.qualname}, which a CUSTOM "
                              "op cannot carry", f"Write the op with circle='decompose', or take the tensors one by one.")
    inputs = [bound[n] for n in spec.tensor_args]
    options = encode_attributes(_attributes(ctx, spec, bound, spec.attribute_args)).tobytes()
    ys = ctx.emit("CUSTOM", inputs, None, outs=_outs(ctx), customCode=how["custom_code"], customOptions=options)
    return ys if isinstance(ctx.out, (tuple, list)) else ys[0]


def _generic_builtin(ctx, spec: OpSpec, **bound: Any) -> Any:
    """A registered op's Circle builtin: the tensor args in ``circle.inputs`` order (default:
    the schema's), options from option_fields / option_values."""
    names = spec.circle.get("inputs") or spec.tensor_args
    # a non-tensor argument listed among the inputs (an output size, a shape) is an int32
    # constant tensor, as Circle builtins take such parameters
    inputs = [bound[n] if bound[n] is None or isinstance(bound[n], Value) else
              ctx.i32(list(bound[n]) if isinstance(bound[n], (list, tuple)) else [bound[n]]) for n in names]
    ys = ctx.emit(spec.circle["builtin"], inputs, spec.circle.get("options"),
                  outs=_outs(ctx), **_options(spec, _attributes(ctx, spec, bound, spec.attribute_args)))
    return ys if isinstance(ctx.out, (tuple, list)) else ys[0]


def lower_registered(ctx, node, *args, **kwargs):
    """The lowering of a registered op with no @lower of its own: from its spec alone."""
    spec = by_overload(node.target)
    return fused(ctx, spec, spec.bind(args, kwargs), _generic_builtin)


def _resolve(target: Any) -> Callable[..., Any] | None:
    return lower_registered if by_overload(target) is not None else None


RESOLVERS.append(_resolve)


def composite(ctx, spec: OpSpec, bound: dict[str, Any]) -> Any:
    """STABLEHLO_COMPOSITE(tensor args) with the reference kernel as its decomposition."""
    tensors = {n: v for n, v in bound.items() if isinstance(v, Value)}
    values = _attributes(ctx, spec, bound, set(spec.tflite["attributes"].values()))
    attributes = {key: values[arg] for key, arg in spec.tflite["attributes"].items()}
    with ctx.subgraph(f"{spec.name}_{ctx.node.name}") as index:
        inner = {n: ctx.input(v.shape, v.dtype, n) if n in tensors else v for n, v in bound.items()}
        result = ctx.call(spec.reference, **inner)
        outs = list(result) if isinstance(result, (tuple, list)) else [result]
        ctx.sg.outputs = [ctx.index(o) for o in outs]
    ys = ctx.emit("STABLEHLO_COMPOSITE", list(tensors.values()), "StableHLOCompositeOptions",
                  outs=[(o.shape, o.dtype) for o in outs], name=spec.tflite["composite"],
                  decompositionSubgraphIndex=index, compositeAttributes=attributes, version=0)
    return ys if isinstance(result, (tuple, list)) else ys[0]


def _options(spec: OpSpec, bound: dict[str, Any]) -> dict[str, Any]:
    """The builtin's options from the contract's option_fields / option_values."""
    values = spec.circle.get("option_values", {})
    return {field: values.get(arg, {}).get(bound[arg], bound[arg])
            for field, arg in spec.circle["option_fields"].items()}


# ------------------------------------------------------------------------ rms_norm
def _weight_plus(ctx, w: Value, offset: float, dtype: torch.dtype) -> Value:
    """offset + w in ``dtype``, in the reference kernel's order (folded for constants)."""
    w = ctx.cast(w, dtype)
    if offset == 0.0:
        return w
    if w.is_const:
        return const_value(offset + w.const)
    return ctx.add(offset, w, dtype)


def _rms_norm_builtin(ctx, spec, x, weight, eps, offset, multiply, policy):
    native = x.dtype == _FLOAT32
    if policy == "scaled" or (policy == "native" and not native):
        return None  # computed in the input dtype by design: only the decomposition says so
    c = x.shape[-1]
    after = None  # a multiply that happens after the cast back to x.dtype
    if weight is None:
        gamma = ctx.const(torch.ones(c, dtype=_FLOAT32))
    elif multiply == "fp32":
        gamma = _weight_plus(ctx, weight, offset, _FLOAT32)
    elif native:
        gamma = ctx.cast(_weight_plus(ctx, weight, offset, weight.dtype), _FLOAT32)
    else:
        # fp16/bf16 Llama-style: normalize in fp32, cast back, then w · y in the input dtype.
        # RMS_NORM runs as an fp32 island with gamma = 1 (exact), the multiply stays outside.
        gamma = ctx.const(torch.ones(c, dtype=_FLOAT32))
        after = _weight_plus(ctx, weight, offset, weight.dtype)
    h = ctx.cast(x, _FLOAT32)
    if not ctx.supports(spec.circle["builtin"], rank=h.rank):
        h = ctx.reshape(h, (1, -1, c))  # onert: rank 3 or 4 only
    y = ctx.emit(spec.circle["builtin"], [h, gamma], spec.circle["options"], out_shape=h.shape,
                 out_dtype=_FLOAT32, **_options(spec, {"eps": float(eps)}))
    y = ctx.cast(ctx.reshape(y, x.shape), x.dtype)
    if after is not None:
        y = ctx.mul(after, y, ctx.out_dtype)
    return ctx.cast(y, ctx.out_dtype)


def _offset_folded(bound: dict[str, Any]) -> dict[str, Any]:
    """A constant weight with its offset added, and offset 0: the same values the reference
    kernel multiplies by (in the dtype it adds them in). odml.rms_norm's second input is the
    multiplier itself (LiteRT's delegates compute x̂·scale), so Gemma's 1 + w goes in whole."""
    w, offset = bound["weight"], bound["offset"]
    if offset == 0.0 or not isinstance(w, Value) or not w.is_const:
        return bound
    t = w.const.to(at_least_fp32(bound["x"].dtype)) if bound["multiply"] == "fp32" else w.const
    return {**bound, "weight": const_value(offset + t), "offset": 0.0}


@lower(torch.ops.circle.rms_norm)
def _(ctx, node, *args, **kwargs):
    spec = REGISTRY["rms_norm"]
    bound = spec.bind(args, kwargs)
    if form(ctx, spec) == COMPOSITE:
        bound = _offset_folded(bound)
    return fused(ctx, spec, bound, _rms_norm_builtin)


# ------------------------------------------------------------------------ rope
def _table(ctx, t: Value) -> Value:
    """cos/sin as rank 4 [B, 1, S, R], the layout ROPE takes."""
    if t.rank == 2:
        return ctx.reshape(t, (1, 1) + t.shape)
    if t.rank == 3:
        return ctx.reshape(t, (t.shape[0], 1) + t.shape[1:])
    return t


def _rope_builtin(ctx, spec, x, cos, sin, mode):
    limit = ctx.profile.rope_max_positions
    if mode not in ctx.profile.rope_modes or (limit is not None and x.shape[2] > limit):
        return None  # onert reads only the first row of the tables, and has GPT_NEOX only
    dtype = ctx.out_dtype
    x = ctx.cast(x, dtype)
    cos, sin = _table(ctx, ctx.cast(cos, dtype)), _table(ctx, ctx.cast(sin, dtype))
    r, d = cos.shape[-1], x.shape[-1]
    named = {"x": ctx.slice(x, -1, 0, r), "cos": cos, "sin": sin}
    y = ctx.emit(spec.circle["builtin"], [named[n] for n in spec.circle["inputs"]], spec.circle["options"],
                 out_shape=named["x"].shape, out_dtype=dtype, **_options(spec, {"mode": mode}))
    if r < d:  # partial rotary: the rest of the head passes through
        y = ctx.concat([y, ctx.slice(x, -1, r, d)], -1)
    return y


@lower(torch.ops.circle.rope)
def _(ctx, node, *args, **kwargs):
    spec = REGISTRY["rope"]
    return fused(ctx, spec, spec.bind(args, kwargs), _rope_builtin)


# ------------------------------------------------------------------------ attention
def _attention_builtin(ctx, spec, **bound):
    d = bound["k_cache"].shape[3]
    if bound["scale"] not in (0.0, d ** -0.5):
        return None  # AttentionOptions has no scale field
    if bound["cache_update"] != "full":
        return None  # ONE's kernel writes the caches in place and has no rows output
    out_shape, out_dtype = ctx.out[0].shape, ctx.out[0].dtype
    inputs = [bound[n] for n in spec.circle["inputs"]]
    out = ctx.emit(spec.circle["builtin"], inputs, spec.circle["options"], out_shape=out_shape,
                   out_dtype=out_dtype, **_options(spec, bound))
    # ONE's kernel has one output and writes the new k/v into k_cache/v_cache in place:
    # the op's updated caches are those same tensors.
    return out, bound["k_cache"], bound["v_cache"]


def _attention_with_rope_op(**bound):
    """attention's reference kernel with its q/k RoPE traced as circle.rope, so that a
    decomposed attention still gets the rope lowering's choice (on onert: the ROPE
    builtin in a one-token decode step, decomposed for a prefill)."""
    return REGISTRY["attention"].reference(**bound, rope=torch.ops.circle.rope)


def _attention_with_joint_rope(**bound):
    """attention's reference kernel with q and k rotated as one tensor, in plain ops
    (``TargetProfile.attention_joint_rope``: circleops.lowering.attention_rope)."""
    from circleops.lowering.attention_rope import joint_rope

    return REGISTRY["attention"].reference(**bound, rope_qk=joint_rope)


@lower(torch.ops.circle.attention)
def _(ctx, node, *args, **kwargs):
    spec = REGISTRY["attention"]
    bound = spec.bind(args, kwargs)
    if form(ctx, spec) == DECOMPOSED:
        return ctx.call(_attention_with_rope_op, **bound)
    if ctx.profile.attention_joint_rope and node is not None and node.meta.get(LOWERING_META) == DECOMPOSED:
        return ctx.call(_attention_with_joint_rope, **bound)  # written inline (graph_inline_ops)
    return fused(ctx, spec, bound, _attention_builtin)


# ------------------------------------------------------------------------ instance_norm
def _instance_norm_builtin(ctx, spec, x, weight, bias, eps):
    c = x.shape[1]
    gamma = ctx.cast(weight, _FLOAT32) if weight is not None else ctx.const(torch.ones(c, dtype=_FLOAT32))
    beta = ctx.cast(bias, _FLOAT32) if bias is not None else ctx.const(torch.zeros(c, dtype=_FLOAT32))
    to_last = [0, *range(2, x.rank), 1]  # NCHW -> NHWC: Circle's INSTANCE_NORM is channels-last
    h = ctx.transpose(ctx.cast(x, _FLOAT32), to_last)
    y = ctx.emit(spec.circle["builtin"], [h, gamma, beta], spec.circle["options"], out_shape=h.shape,
                 out_dtype=_FLOAT32, fusedActivationFunction=0, **_options(spec, {"eps": float(eps)}))
    back = [0, x.rank - 1, *range(1, x.rank - 1)]
    return ctx.cast(ctx.transpose(y, back), x.dtype)


def instance_norm(ctx, x, weight, bias, eps):
    """Instance norm of NCHW ``x`` for ctx's target (shared with aten.instance_norm)."""
    spec = REGISTRY["instance_norm"]
    return fused(ctx, spec, {"x": x, "weight": weight, "bias": bias, "eps": float(eps)}, _instance_norm_builtin)


@lower(torch.ops.circle.instance_norm)
def _(ctx, node, *args, **kwargs):
    spec = REGISTRY["instance_norm"]
    return fused(ctx, spec, spec.bind(args, kwargs), _instance_norm_builtin)

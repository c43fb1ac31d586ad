"""The Circle fused ops through the op registry's reference kernels, STABLEHLO_COMPOSITE,
and CUSTOM ops through the reference kernel of the op their custom_code names.

The registry kernel is the contract (circleops.ops, schema/ops.yaml), so the interpreter
computes exactly what the torch op computes. Only the Circle conventions are mapped here:
input order (ROPE is x, sin, cos), layout (INSTANCE_NORM is NHWC) and option encoding.
"""
from __future__ import annotations

import torch

from circleops.ops import REGISTRY, by_custom_code, unknown_custom_code
from circleops.runtime.kernels import Kernel, KernelError, activation, enum_value, ints, kernel, option
from circleops.serialize.composite import decode_attributes

_ROPE_MODES = ("GPT_NEOX", "GPT_J")


@kernel("RMS_NORM")
def _rms_norm(op, inputs, ctx):
    x = inputs[0]
    gamma = inputs[1] if len(inputs) > 1 else None
    return [REGISTRY["rms_norm"].reference(x, gamma, float(option(op, "epsilon", default=0.0)))]


@kernel("ROPE")
def _rope(op, inputs, ctx):
    x, sin, cos = inputs
    mode = ("gpt_neox", "gpt_j")[enum_value(option(op, "mode", default=0), _ROPE_MODES)]
    return [REGISTRY["rope"].reference(x, cos, sin, mode)]


@kernel("INSTANCE_NORM")
def _instance_norm(op, inputs, ctx):
    x, gamma, beta = (list(inputs) + [None, None])[:3]
    # Circle's INSTANCE_NORM is channels-last; the registry kernel is NCHW. A contiguous
    # copy makes the reductions sum in the same order as the torch op (bit-equal results).
    y = REGISTRY["instance_norm"].reference(x.movedim(-1, 1).contiguous(), gamma, beta, float(option(op, "epsilon", default=0.0)))
    return [activation(y.movedim(1, -1), op)]


@kernel("ATTENTION", in_place=(8, 9))
def _attention(op, inputs, ctx):
    # Inputs in the contract order (x, wq, wk, wv, wo, cos, sin, mask, k_cache, v_cache, pos).
    # Returns out, k_cache', v_cache'. An operator with three outputs gets all three; with
    # one output (ONE's kernel, which updates the caches in place) the interpreter stores
    # the new caches in the k_cache/v_cache tensors, as that kernel would.
    return list(REGISTRY["attention"].reference(*inputs[:11], float(option(op, "scale", default=0.0))))


@kernel("STABLEHLO_COMPOSITE")
def _composite(op, inputs, ctx):
    # A composite means exactly its decomposition subgraph (that is what LiteRT runs).
    return ctx.call(int(option(op, "decompositionSubgraphIndex", default=0)), list(inputs))


def custom_spec(op):
    """The registered op a CUSTOM operator's custom_code names (plugins loaded on a miss);
    an UnknownCustomOpError naming the code when nobody provides it."""
    code = op.options.get("customCode") or ""
    spec = by_custom_code(code)
    if spec is None:
        raise unknown_custom_code(code)
    return spec


def _attribute(arg, value):
    # flexbuffers keeps ints and floats apart; a float argument written as 1 reads back as 1
    if value is not None and isinstance(arg.type, torch.FloatType):
        return float(value)
    return value


@kernel("CUSTOM")
def _custom(op, inputs, ctx):
    # The op's reference kernel: tensor arguments from the operator's inputs in schema
    # order, the others from custom_options (a flexbuffer map by name; absent: the default).
    spec = custom_spec(op)
    options = decode_attributes(op.options.get("customOptions") or b"")
    tensors = iter(inputs)
    args = []
    for arg in spec.arguments:
        if arg.name in spec.tensor_args:
            args.append(next(tensors, None))
        elif arg.name in options:
            args.append(_attribute(arg, options[arg.name]))
        elif arg.has_default_value():
            args.append(arg.default_value)
        else:
            raise KernelError(f"{spec.qualname}: custom_options lack the argument {arg.name!r} "
                              f"(they hold {sorted(options)})")
    out = spec.reference(*args)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def registered_builtin(opcode: str) -> Kernel | None:
    """The kernel of a registered op's Circle builtin that has no kernel of its own (a new
    built-in op of schema/ops.yaml, a user's op with ``circle={"builtin": ...}``): the op's
    reference kernel, reading back what lowering.circle_ops writes for it from its contract
    alone: the inputs in ``circle.inputs`` order (a non-tensor argument there is an int32
    tensor), the other non-tensor arguments from the options (``option_fields``, through
    ``option_values``), the schema's defaults for the rest. None if no registered op names
    ``opcode`` as its builtin."""
    spec = next((s for s in REGISTRY.values() if s.circle["form"] == "builtin" and s.circle["builtin"] == opcode),
                None)
    if spec is None:
        return None
    names = spec.circle.get("inputs") or spec.tensor_args
    fields = {arg: field for field, arg in spec.circle["option_fields"].items()}

    def run(op, inputs, ctx):
        given = dict(zip(names, inputs))
        args = []
        for arg in spec.arguments:
            if arg.name in given and arg.name not in spec.tensor_args:
                values = ints(given[arg.name])
                args.append(list(values) if isinstance(arg.type, torch.ListType) else values[0])
            elif arg.name in given:
                args.append(given[arg.name])
            elif arg.name in fields and fields[arg.name] in op.options:
                stored = {v: k for k, v in spec.circle.get("option_values", {}).get(arg.name, {}).items()}
                value = op.options[fields[arg.name]]
                args.append(_attribute(arg, stored.get(value, value)))
            elif arg.has_default_value():
                args.append(arg.default_value)
            else:
                raise KernelError(f"{opcode} ({spec.qualname}): no input or option gives its argument {arg.name!r}")
        out = spec.reference(*args)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    return run

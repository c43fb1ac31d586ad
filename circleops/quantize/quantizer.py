"""CircleQuantizer: a torchao PT2E ``Quantizer`` for integer Circle graphs.

    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e, convert_pt2e
    q = CircleQuantizer("uint8").set_module_name("model.norm", "int16")
    m = prepare_pt2e(torch.export.export(model, args).module(), q)
    m(*calibration_args)                      # observers record ranges
    m = convert_pt2e(m)                       # quantize/dequantize pairs around each op
    circleops.save(torch.export.export(m, args), "model.circle")

Schemes (what NPU compilers for Circle run):
* activations: ``uint8`` asymmetric per tensor, or ``int16`` symmetric per tensor (zero point 0);
* weights: ``int8`` symmetric per output channel (default), ``int4`` the same in [-7, 7] (written
  as Circle INT4, two values per byte), or ``uint8`` asymmetric per tensor;
* bias: int32, scale = s_input · s_weight (per channel), zero point 0 (a DerivedQuantizationSpec).
Mixed precision: ``set_module_name(name, "int16")`` / ``set_operator_type(op, "int16")``
give chosen layers (e.g. the norms) 16-bit activations; the rest keep the global scheme.

Each annotated op is one quantized operator: its inputs and its output are quantized, so
the lowering writes it with integer tensors. The fused circle ops (rms_norm, rope,
attention, instance_norm) are annotated whole, per schema/ops.yaml's ``quantized`` field.
Ops that only move data (reshape, transpose, slice, relu, max-pool, padding) share their
input's parameters, so they need no requantization.
"""
from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.fx import GraphModule, Node

from circleops.errors import CircleOpsError


def torchao_pt2e():
    """torchao's pt2e modules, imported quietly (torchao logs a warning per optional CUDA
    extension it cannot load on a CPU machine)."""
    saved = logging.getLogger("torchao").level
    logging.getLogger("torchao").setLevel(logging.ERROR)
    try:
        import torchao.quantization.pt2e as pt2e
        import torchao.quantization.pt2e.quantizer as quantizer
    finally:
        logging.getLogger("torchao").setLevel(saved)
    return pt2e, quantizer


ACTIVATIONS = ("uint8", "int16")
WEIGHTS = ("int8", "uint8", "int4", "int4-grouped")

aten = torch.ops.aten


class QuantizeConfigError(CircleOpsError):
    """A quantization scheme that CircleQuantizer does not offer."""


@dataclass(frozen=True)
class Scheme:
    """One activation/weight choice and the torchao specs it stands for."""

    activation: str = "uint8"
    weight: str = "int8"

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise QuantizeConfigError(f"activation scheme {self.activation!r} is not offered: choose one of "
                                      f"{', '.join(ACTIVATIONS)} (uint8 asymmetric, int16 symmetric)")
        if self.weight not in WEIGHTS:
            raise QuantizeConfigError(f"weight scheme {self.weight!r} is not offered: choose one of "
                                      f"{', '.join(WEIGHTS)} (int8 / int4 symmetric per channel, uint8 per tensor)")

    def act(self) -> Any:
        pt2e, q = torchao_pt2e()
        if self.activation == "uint8":
            return q.QuantizationSpec(dtype=torch.uint8, quant_min=0, quant_max=255, qscheme=torch.per_tensor_affine,
                                      observer_or_fake_quant_ctr=pt2e.MinMaxObserver.with_args(eps=2 ** -20))
        return q.QuantizationSpec(dtype=torch.int16, quant_min=-32767, quant_max=32767,
                                  qscheme=torch.per_tensor_symmetric,
                                  observer_or_fake_quant_ctr=pt2e.MinMaxObserver.with_args(eps=2 ** -30))

    def weight_spec(self, axis: int = 0) -> Any:
        pt2e, q = torchao_pt2e()
        if self.weight == "int8":
            return q.QuantizationSpec(dtype=torch.int8, quant_min=-127, quant_max=127,
                                      qscheme=torch.per_channel_symmetric, ch_axis=axis,
                                      observer_or_fake_quant_ctr=pt2e.PerChannelMinMaxObserver.with_args(
                                          ch_axis=axis, eps=2 ** -30))
        # int8 storage in torch, [-7, 7]: written as Circle INT4 (passes/qdq.py); "int4-grouped"
        # linears are rounded before PT2E (circleops.quantize.grouped), other weights per channel
        if self.weight in ("int4", "int4-grouped"):
            return q.QuantizationSpec(dtype=torch.int8, quant_min=-7, quant_max=7,
                                      qscheme=torch.per_channel_symmetric, ch_axis=axis,
                                      observer_or_fake_quant_ctr=pt2e.PerChannelMinMaxObserver.with_args(
                                          ch_axis=axis, eps=2 ** -30))
        return q.QuantizationSpec(dtype=torch.uint8, quant_min=0, quant_max=255, qscheme=torch.per_tensor_affine,
                                  observer_or_fake_quant_ctr=pt2e.MinMaxObserver.with_args(eps=2 ** -30))

    def bias_spec(self, act_node: Node, weight_node: Node, node: Node) -> Any:
        _, q = torchao_pt2e()
        per_channel = self.weight in ("int8", "int4", "int4-grouped")
        return q.DerivedQuantizationSpec(
            derived_from=[(act_node, node), (weight_node, node)], derive_qparams_fn=_bias_qparams,
            dtype=torch.int32, quant_min=-(2 ** 31) + 1, quant_max=2 ** 31 - 1,
            qscheme=torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric,
            ch_axis=0 if per_channel else None)


def _bias_qparams(observers: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """bias scale = s_input · s_weight (per output channel), zero point 0: the integer
    accumulator of a FULLY_CONNECTED / CONV_2D adds the bias without rescaling."""
    act_scale, _ = observers[0].calculate_qparams()
    w_scale, _ = observers[1].calculate_qparams()
    scale = (act_scale.to(torch.float32) * w_scale.to(torch.float32)).reshape(-1)
    return scale, torch.zeros_like(scale, dtype=torch.int32)


# --------------------------------------------------------------------------- op tables
# weighted ops: (activation arg, weight arg, bias arg)
WEIGHTED = {aten.linear.default: (0, 1, 2), aten.conv2d.default: (0, 1, 2), aten.conv2d.padding: (0, 1, 2)}

# ops computed on quantized inputs into a freshly quantized output (their own observer)
COMPUTE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.matmul.default, aten.bmm.default,
    aten.silu.default, aten.sigmoid.default, aten.tanh.default, aten.gelu.default, aten.softmax.int,
    aten._softmax.default, aten.mean.dim, aten.neg.default, aten.exp.default, aten.rsqrt.default,
    aten.sqrt.default, aten.avg_pool2d.default, aten.adaptive_avg_pool2d.default, aten.cat.default,
    aten.hardswish.default, aten.leaky_relu.default, aten.instance_norm.default, aten.layer_norm.default,
    aten.pow.Tensor_Scalar, aten.square.default,
}

# ops that only move or clamp values: output shares the input's parameters
SHARED = {
    aten.relu.default, aten.relu6.default, aten.hardtanh.default, aten.max_pool2d.default, aten.view.default,
    aten.reshape.default, aten.permute.default, aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints, aten.slice.Tensor, aten.select.int,
    aten.expand.default, aten.contiguous.default, aten.clone.default, aten.reflection_pad2d.default,
    aten.replication_pad2d.default, aten.upsample_nearest2d.vec, aten.upsample_nearest2d.default,
    aten.dropout.default, aten.alias.default, aten.t.default, aten.pixel_shuffle.default, aten.pad.default,
    aten.constant_pad_nd.default, aten.reflection_pad1d.default, aten.replication_pad1d.default,
}

# norm parameters are weights (per channel); everything else of a norm is an activation
NORM_WEIGHTS = {aten.instance_norm.default: (1, 2), aten.layer_norm.default: (2, 3)}


def _is_float_node(a: Any) -> bool:
    if not isinstance(a, Node):
        return False
    v = a.meta.get("val")
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _circle_quantized(target: Any) -> dict[str, Any] | None:
    """The ``quantized`` contract of a fused circle op (schema/ops.yaml), else None."""
    from circleops.ops import by_overload

    spec = by_overload(target)
    return None if spec is None else spec.contract.get("quantized")


class CircleQuantizer:  # replaced by a real torchao Quantizer subclass in _make_class()
    pass


def _make_class() -> type:
    _, q = torchao_pt2e()

    class CircleQuantizer(q.Quantizer):
        """PT2E quantizer for Circle integer graphs (see the module docstring). ``activation``: "uint8"
        (asymmetric) or "int16" (symmetric); ``weight``: "int8" (symmetric per channel) or "uint8" (per tensor)."""

        def __init__(self, activation: str = "uint8", weight: str = "int8"):
            super().__init__()
            self.global_scheme = Scheme(activation, weight)
            self.module_names: dict[str, Scheme] = {}
            self.operator_types: dict[Any, Scheme] = {}
            self.node_names: dict[str, Scheme] = {}
            self.fixed_inputs: dict[str, Any] = {}  # graph input name -> its fixed spec
            self._matched: set[str] = set()  # module names that matched an op (annotate checks)

        def set_module_name(self, name: str, activation: str, weight: str | None = None) -> "CircleQuantizer":
            """Quantize the ops inside submodule ``name`` (e.g. "model.layers.0.input_layernorm",
            or a glob such as "*.mlp.down_proj") with ``activation`` (and ``weight``) instead
            of the global scheme. Module names win over operator types."""
            self.module_names[name] = Scheme(activation, weight or self.global_scheme.weight)
            return self

        def set_operator_type(self, op: Any, activation: str, weight: str | None = None) -> "CircleQuantizer":
            """Quantize every call of ``op`` (e.g. ``torch.ops.circle.rms_norm`` or
            ``torch.ops.aten.linear``) with ``activation`` (and ``weight``)."""
            self.operator_types[op] = Scheme(activation, weight or self.global_scheme.weight)
            return self

        def set_node_name(self, name: str, activation: str, weight: str | None = None) -> "CircleQuantizer":
            """Quantize the one op whose node in the exported graph is named ``name`` with
            ``activation`` (and ``weight``): what mixed precision chosen by measurement
            (circleops.quantize.sensitivity) uses. Node names win over module names."""
            self.node_names[name] = Scheme(activation, weight or self.global_scheme.weight)
            return self

        def set_fixed_input(self, name: str, low: float, high: float) -> "CircleQuantizer":
            """Graph input ``name`` (a fused op's ``cache``) at parameters fixed from [low, high]."""
            self.fixed_inputs[name] = fixed_spec(self.global_scheme.activation, low, high)
            return self

        # ---------------------------------------------------------------- pt2e hooks
        def transform_for_annotation(self, model: GraphModule) -> GraphModule:
            """Python scalars of add/sub/mul/div become constant tensors, so that they are
            quantized like any other input (an integer ADD takes two quantized tensors)."""
            return _scalars_to_attrs(model)

        def annotate(self, model: GraphModule) -> GraphModule:
            self._matched = set()
            for node in model.graph.nodes:
                if node.op != "call_function":
                    continue
                scheme = self._scheme(node)
                _annotate(node, scheme, self.fixed_inputs)
            _check_matched(self.module_names, self._matched)
            return model

        def validate(self, model: GraphModule) -> None:
            pass

        def _scheme(self, node: Node) -> Scheme:
            if node.name in self.node_names:
                return self.node_names[node.name]
            if self.module_names:
                paths = _module_paths(node)
                hits = [name for name in self.module_names if any(fnmatch.fnmatchcase(p, name) for p in paths)]
                if hits:
                    self._matched.update(hits)
                    return self.module_names[hits[0]]
            target = node.target
            packet = getattr(target, "overloadpacket", None)
            for op, scheme in self.operator_types.items():
                if op is target or op is packet:
                    return scheme
            return self.global_scheme

    CircleQuantizer.__module__ = __name__
    CircleQuantizer.__qualname__ = "CircleQuantizer"
    return CircleQuantizer


def _check_matched(module_names: Any, matched: set[str]) -> None:
    """Every set_module_name name matched an op of the model (a typo is an error, not a
    silently global scheme)."""
    unmatched = [n for n in module_names if n not in matched]
    # a name and its "*.name" form (circleops.quantize.pt2e.int16_parts) need one match
    unmatched = [n for n in unmatched if not ({"*." + n, n[2:] if n.startswith("*.") else n} & matched)]
    if unmatched:
        raise QuantizeConfigError(
            f"set_module_name: no op of the model lies in a module named {', '.join(map(repr, unmatched))}; "
            "give a qualified submodule name as model.named_modules() lists it (or a glob such as "
            "'*.mlp.down_proj')")


def _module_paths(node: Node) -> list[str]:
    """The qualified names of the modules a node was traced in (torch.export's
    nn_module_stack), outermost first: what set_module_name matches."""
    paths = []
    for path, _ in node.meta.get("nn_module_stack", {}).values():
        paths.append(path[len("L['self']."):] if path.startswith("L['self'].") else path)
    return paths


def fixed_spec(activation: str, low: float, high: float) -> Any:
    """torchao's FixedQParamsQuantizationSpec of ``activation`` ("uint8" asymmetric, "int16"
    symmetric) covering [low, high] (widened to hold 0 exactly: an empty cache is zeros)."""
    _, q = torchao_pt2e()
    if activation not in ACTIVATIONS:
        raise QuantizeConfigError(f"activation scheme {activation!r} is not offered: choose one of "
                                  f"{', '.join(ACTIVATIONS)}")
    low, high = min(float(low), 0.0), max(float(high), 0.0)
    if activation == "int16":
        scale = max(abs(low), abs(high), 2 ** -30) / 32767
        return q.FixedQParamsQuantizationSpec(torch.int16, scale, 0, -32767, 32767, torch.per_tensor_symmetric)
    scale = max(high - low, 2 ** -20) / 255
    zero = int(min(255, max(0, round(-low / scale))))
    return q.FixedQParamsQuantizationSpec(torch.uint8, scale, zero, 0, 255, torch.per_tensor_affine)


def _annotate(node: Node, scheme: Scheme, fixed: dict[str, Any] | None = None) -> None:
    _, q = torchao_pt2e()
    target = node.target
    if "quantization_annotation" in node.meta:
        return
    inputs: dict[Node, Any] = {}
    output: Any = None
    act = scheme.act()
    if target in WEIGHTED:
        a, w, b = WEIGHTED[target]
        x, weight = node.args[a], node.args[w]
        if not (_is_float_node(x) and _is_float_node(weight)):
            return
        inputs[x] = act
        if scheme.weight == "int4-grouped" and target is aten.linear.default:
            # per-group int4, rounded before PT2E (circleops.quantize.grouped): the weight (and a
            # bias, int32 at s_in · s_row) are written by the lowering from the rounding's record
            output = act
        else:
            inputs[weight] = scheme.weight_spec(0)
            bias = node.args[b] if len(node.args) > b else node.kwargs.get("bias")
            if _is_float_node(bias):
                inputs[bias] = scheme.bias_spec(x, weight, node)
            output = act
    elif target in COMPUTE:
        params = NORM_WEIGHTS.get(target, ())
        for i, a in enumerate(node.args):
            for leaf in (a if isinstance(a, (list, tuple)) else [a]):
                if _is_float_node(leaf):
                    inputs[leaf] = _param_spec(scheme, leaf) if i in params else act
        if not inputs or not _is_float_node(node):
            return
        output = act
    elif target in SHARED:
        x = node.args[0]
        if not (_is_float_node(x) and _is_float_node(node)):
            return
        inputs[x] = act
        output = q.SharedQuantizationSpec((x, node))
    elif target is aten.embedding.default:
        table = node.args[0]
        if not _is_float_node(table):
            return
        inputs[table] = act
        output = q.SharedQuantizationSpec((table, node))
    else:
        contract = _circle_quantized(target)
        if contract is None:
            return
        from circleops.ops import by_overload

        names = [a.name for a in by_overload(target).overload._schema.arguments]
        bound = dict(zip(names, node.args))
        bound.update(node.kwargs)
        fixed = fixed or {}
        for name, kind in contract["inputs"].items():
            arg = bound.get(name)
            if _is_float_node(arg):
                if kind == "cache":  # fixed parameters when given (generation graphs), else float
                    if arg.op == "placeholder" and arg.name in fixed:
                        inputs[arg] = fixed[arg.name]
                    continue
                if kind == "weight" and scheme.weight == "int4-grouped" and arg.meta["val"].dim() == 2:
                    continue  # rounded per group before PT2E, written by the lowering (as for linears)
                inputs[arg] = _param_spec(scheme, arg) if kind == "weight" else act
        if isinstance(node.meta.get("val"), (tuple, list)):
            # multi-output (attention): the quantized outputs are its getitem users
            written = {index: inputs.get(bound.get(name)) for name, index in contract.get("in_place", {}).items()}
            for user in node.users:
                if user.target.__name__ != "getitem" or "quantization_annotation" in user.meta:
                    continue
                spec = act if user.args[1] in contract["outputs"] else written.get(user.args[1])
                if spec is not None:  # an in-place cache output: its input's fixed parameters
                    user.meta["quantization_annotation"] = q.QuantizationAnnotation(output_qspec=spec, _annotated=True)
        elif _is_float_node(node):
            output = act
    node.meta["quantization_annotation"] = q.QuantizationAnnotation(
        input_qspec_map=inputs, output_qspec=output, _annotated=True)


def _param_spec(scheme: Scheme, node: Node) -> Any:
    """A weight: per output channel (dim 0) when it has rows; a vector (a norm's gamma or
    beta) is quantized per tensor like an activation (uint8 / int16)."""
    return scheme.weight_spec(0) if node.meta["val"].dim() >= 2 else scheme.act()


def _scalars_to_attrs(model: GraphModule) -> GraphModule:
    """add/sub/mul/div with a Python scalar: the scalar becomes a 0-dim buffer (get_attr)."""
    binary = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor}
    count = 0
    for node in list(model.graph.nodes):
        if node.op != "call_function" or node.target not in binary or not _is_float_node(node):
            continue
        args = list(node.args)
        changed = False
        for i, a in enumerate(args[:2]):
            if isinstance(a, (int, float)) and not isinstance(a, bool):
                while hasattr(model, f"_circle_scalar_{count}"):
                    count += 1
                name = f"_circle_scalar_{count}"
                value = torch.tensor(float(a), dtype=node.meta["val"].dtype)
                model.register_buffer(name, value)
                with model.graph.inserting_before(node):
                    attr = model.graph.get_attr(name)
                fake = node.meta["val"].fake_mode
                attr.meta["val"] = fake.from_tensor(value, static_shapes=True) if fake is not None else value
                args[i] = attr
                changed = True
        if changed:
            node.args = tuple(args)
    model.recompile()
    return model


def __getattr__(name: str) -> Any:
    # CircleQuantizer subclasses torchao's Quantizer: built on first use, so that importing
    # circleops does not import torchao.
    if name == "CircleQuantizer":
        cls = _make_class()
        globals()["CircleQuantizer"] = cls
        return cls
    raise AttributeError(name)


del CircleQuantizer  # resolved lazily by __getattr__

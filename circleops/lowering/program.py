"""ExportedProgram -> ir.Model: walk the graph once, fold, lower node by node.

The export's default IR is lowered directly (aten.linear -> FULLY_CONNECTED, ...) without
``run_decompositions()``: only a node with no lowering of its own is decomposed, by
tracing its decomposition locally and lowering the result inline.

Constant folding happens during the walk (see circleops.passes.fold for the rules): a node
whose tensor inputs are all constants is evaluated with torch and becomes a constant, and
only nodes the outputs depend on are visited (dead code never reaches the file).
"""
from __future__ import annotations

import operator
from typing import Any, Sequence

import numpy as np
import torch
import torch.fx
from torch.export.graph_signature import InputKind, OutputKind

from circleops import ir
from circleops.ir import prune
from circleops.dtypes import float_dtype
from circleops.errors import REPORT_BUG, CircleOpsError, InternalError, TargetError, UnsupportedOpError
from circleops.lowering.context import LoweringContext
from circleops.lowering.registry import lower, lowering_for
from circleops.lowering.trace import fallback_decompositions
from circleops.lowering.value import Value, const_value, source_line
from circleops.passes.fold import evaluate, is_foldable, live_nodes
from circleops.targets import PROFILES, TargetProfile, profile

_CONST_INPUTS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _program_dtype(ep: torch.export.ExportedProgram) -> torch.dtype | None:
    """The float dtype most of the program's weights and inputs have (None: no floats)."""
    sizes: dict[torch.dtype, int] = {}
    for t in list(ep.state_dict.values()) + list(ep.constants.values()):
        if isinstance(t, torch.Tensor) and t.dtype in _FLOATS:
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            v = node.meta.get("val")
            if isinstance(v, torch.Tensor) and v.dtype in _FLOATS:
                sizes[v.dtype] = sizes.get(v.dtype, 0) + v.numel()
    return max(sizes, key=sizes.get) if sizes else None


def _as_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = float_dtype(dtype)  # the one name map (circleops.dtypes)
    if resolved is None:
        raise TargetError(f"unknown dtype {dtype!r}: use float32, float16 or bfloat16")
    return resolved


def _check_dtype(ep: torch.export.ExportedProgram, target: TargetProfile, dtype: Any) -> None:
    found = _program_dtype(ep)
    if dtype is not None:
        want = _as_dtype(dtype)
        if found is not None and found != want:
            raise TargetError(
                f"the exported program computes in {found} but dtype={want} was requested: convert "
                f"the model (model.to({want})) before torch.export, or pass dtype=None")
        found = want
    if found is not None and not target.allows_float(found):
        raise TargetError(
            f"target {target.name!r} runs {_floats(target)} only ({target.runtime} refuses {found} tensors), "
            f"but the program computes in {found}: export the model in float32 (model.float()), or use "
            f"{_targets_for(found)}")


_FLOAT_TENSORS = ("FLOAT32", "FLOAT16", "BFLOAT16", "FLOAT64")


def _floats(target: TargetProfile) -> str:
    return " / ".join(sorted(target.float_dtypes))


def _targets_for(dtype: Any) -> str:
    names = [f"{p.name!r}" for p in PROFILES.values() if p.allows_float(dtype)]
    return f"target {' or '.join(names)}" if names else "another dtype"


def _check_floats(model: ir.Model, target: TargetProfile) -> None:
    """Every float tensor in a dtype the target runs (a cast inside the model can bring others)."""
    for sg in model.subgraphs:
        for t in sg.tensors:
            if t.dtype in _FLOAT_TENSORS and not target.allows_float(t.dtype):
                raise TargetError(
                    f"target {target.name!r} runs {_floats(target)} only, but tensor {t.name!r} is {t.dtype}: "
                    f"make the model compute in float32 (no .half()/autocast), or use {_targets_for(t.dtype)}")


def _static(node: torch.fx.Node) -> None:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor) and any(not isinstance(d, int) for d in v.shape):
        raise TargetError(
            f"input {node.name!r} has a dynamic shape {list(v.shape)}: circleops writes static "
            f"shapes; export without dynamic_shapes (one program per sequence length)")


def lower_program(ep: torch.export.ExportedProgram, target: str | TargetProfile, *,
                  dtype: Any = None) -> ir.Model:
    """Lower an ExportedProgram to an ir.Model for ``target`` (a name in circleops.targets.TARGETS:
    "circle", "onert" or "tflite", or a TargetProfile).

    Parameters, buffers and lifted constants become constant tensors whose data is the
    torch tensor itself (no copy; shared tensors are written once); user inputs become
    the main subgraph's inputs and the user outputs (flattened) its outputs.

    ``dtype``: the float dtype the program is expected to compute in (None: taken from
    its weights and inputs). A dtype the target does not run (TargetProfile.float_dtypes:
    onert runs float32 only) is a TargetError.
    """
    from circleops.passes.functionalize import functionalize

    ep = functionalize(ep)  # in-place / out= / *_copy nodes -> functional ops (a no-op without them)
    target = profile(target)
    ctx = LoweringContext(target, ir.Model(description=f"circleops ({target.name})"), lower_graph=lower_fx_graph)
    _check_dtype(ep, target, dtype)
    with ctx.subgraph("main"):
        sg = ctx.sg
        graph = ep.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        env: list[Any] = []
        sig_inputs: dict[str, int] = {}
        detached: dict[int, torch.Tensor] = {}  # one tensor per parameter, however many names it has
        for spec, node in zip(ep.graph_signature.input_specs, placeholders):
            if spec.kind in _CONST_INPUTS:
                t = ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]
                t = detached.setdefault(id(t), t.detach())
                env.append(const_value(t, name=spec.target))
            elif spec.kind == InputKind.USER_INPUT:
                _static(node)
                v = node.meta.get("val")
                if isinstance(v, torch.Tensor) and v.dim() == 0 and not target.rank0_inputs:
                    # onert refuses rank-0 graph inputs ("unsupported rank: 0"): take [1]
                    value = ctx.input((1,), v.dtype, node.name)
                    sig_inputs[node.name] = value.index
                    env.append(ctx.emit("RESHAPE", [value, ctx.i32([])], out_shape=(), out_dtype=v.dtype))
                elif isinstance(v, torch.Tensor):
                    value = ctx.input(v.shape, v.dtype, node.name)
                    sig_inputs[node.name] = value.index
                    env.append(value)
                else:
                    env.append(v)  # a specialized Python scalar
            else:
                raise UnsupportedOpError(
                    f"input {node.name!r} is a {spec.kind.name} input, which circleops cannot "
                    f"write; export a module whose inputs are tensors")
        results = lower_fx_graph(ctx, graph, env, module=ep.graph_module)
        sig_outputs: dict[str, int] = {}
        for i, (spec, value) in enumerate(zip(ep.graph_signature.output_specs, results)):
            if spec.kind != OutputKind.USER_OUTPUT:
                continue
            if not isinstance(value, Value):
                if value is None:
                    continue
                value = ctx.const(value)
            idx = ctx.index(value)
            sg.outputs.append(idx)
            sig_outputs[f"output_{len(sig_outputs)}"] = idx
    if target.copy_consumed_outputs:
        _copy_consumed_outputs(sg)
        sig_outputs = {name: sg.outputs[k] for k, name in enumerate(sig_outputs)}
    remap = [prune(g) for g in ctx.model.subgraphs]
    ctx.model.signatures.append(ir.Signature(
        "serving_default", 0, {k: remap[0][i] for k, i in sig_inputs.items()},
        {k: remap[0][i] for k, i in sig_outputs.items()}))
    _check_floats(ctx.model, target)
    if target.legalize_fp16:
        # fp16 ops without a LiteRT CPU kernel compute in fp32 (see tflite_fp16)
        from circleops.lowering.tflite_fp16 import legalize_fp16

        legalize_fp16(ctx.model)
    return ctx.model


def _copy_consumed_outputs(sg: ir.Subgraph) -> None:
    """onert 0.1.0 corrupts a subgraph output that a TRANSPOSE or RESHAPE also reads (its
    buffer is reused; measured, see tests/onert): such outputs get their own RESHAPE copy."""
    consumed = {i for op in sg.operators for i in op.inputs}
    for k, idx in enumerate(sg.outputs):
        if idx in consumed:
            t = sg.tensors[idx]
            shape = sg.add_tensor(ir.Tensor(f"{t.name}_shape", (len(t.shape),), "INT32",
                                            np.array(t.shape, dtype=np.int32)))
            copy = sg.add_tensor(ir.Tensor(f"{t.name}_out", t.shape, t.dtype))
            sg.operators.append(ir.Operator("RESHAPE", [idx, shape], [copy]))
            sg.outputs[k] = copy


def _map(x: Any, fn: Any, kind: type) -> Any:
    """``fn`` applied to every ``kind`` leaf of FX-style arguments (tuples, lists, dicts):
    torch's pytree is general and ~5x slower, and this runs for every node."""
    if isinstance(x, kind):
        return fn(x)
    if isinstance(x, (list, tuple)):
        out = [_map(v, fn, kind) for v in x]
        return out if isinstance(x, list) else tuple(out)
    if isinstance(x, dict):
        return {k: _map(v, fn, kind) for k, v in x.items()}
    return x


def _any_input_dependent(x: Any) -> bool:
    if isinstance(x, Value):
        return x.const is None
    if isinstance(x, (list, tuple)):
        return any(_any_input_dependent(v) for v in x)
    if isinstance(x, dict):
        return any(_any_input_dependent(v) for v in x.values())
    return False


def _materialize(x: Value) -> Any:
    return x.const


def lower_fx_graph(ctx: LoweringContext, graph: torch.fx.Graph, inputs: Sequence[Any],
                module: torch.nn.Module | None = None) -> Any:
    """Lower ``graph`` into ctx's current subgraph; ``inputs`` are its placeholders' Values.

    Returns the output node's argument with nodes replaced by Values.
    """
    env: dict[torch.fx.Node, Any] = {}
    it = iter(inputs)
    live = live_nodes(graph)
    outer_node = ctx.node
    top = ctx.root is None
    result = None
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = next(it)
            continue
        if node not in live:
            continue
        if node.op == "output":
            result = _map(node.args[0], env.__getitem__, torch.fx.Node)
            break
        if node.op == "get_attr":
            obj = getattr(module, node.target)
            env[node] = const_value(obj.detach(), name=node.target) if isinstance(obj, torch.Tensor) else obj
            continue
        if node.op != "call_function":
            raise UnsupportedOpError(f"node {node.name!r}: {node.op} nodes are not supported; at {source_line(node)}")
        args, kwargs = _map((node.args, node.kwargs), env.__getitem__, torch.fx.Node)
        if node.target is operator.getitem:
            env[node] = args[0][args[1]]
            continue
        ctx.node = node
        if top:
            ctx.root = node
        try:
            env[node] = _lower_node(ctx, node, args, kwargs)
        except CircleOpsError:
            raise
        except Exception as err:
            raise _internal_error(ctx, node, err) from err
        finally:
            ctx.node = outer_node
            if top:
                ctx.root = None
    return result


def _internal_error(ctx: LoweringContext, node: torch.fx.Node, err: Exception) -> InternalError:
    """An unexpected failure inside a lowering, as a CircleOpsError naming the user's node
    (the top-level one when it happened inside a decomposition), its op and source line."""
    root = ctx.root or node
    inner = f" (inside {node.target} node {node.name!r})" if node is not root else ""
    return InternalError(
        f"lowering node {root.name!r} ({root.target}){inner} for target {ctx.target!r} failed: "
        f"{type(err).__name__}: {err}; at {source_line(root)}. {REPORT_BUG}")


def _lower_node(ctx: LoweringContext, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    if is_foldable(node) and not _any_input_dependent((args, kwargs)):
        targs, tkwargs = _map((args, kwargs), _materialize, Value)
        return _map(evaluate(node.target, targs, tkwargs), const_value, torch.Tensor)
    fn = lowering_for(node.target)
    if fn is not None:
        return fn(ctx, node, *args, **kwargs)
    return _decompose(ctx, node, args, kwargs)


def _decomposable(target: Any) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return target in fallback_decompositions() or target.has_kernel_for_dispatch_key(
        torch._C.DispatchKey.CompositeImplicitAutograd)


def _decompose(ctx: LoweringContext, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
    """Lower a node with no lowering of its own through its decomposition (torch's
    core-aten table, or the op's CompositeImplicit kernel), traced locally down to ops that
    have lowerings."""
    target = node.target
    if target in ctx.decomposing or not _decomposable(target):
        raise ctx.unsupported(
            f"calls {target}, which has no lowering for target {ctx.target!r} and no decomposition into ops that do",
            "Replace that call in the model with supported ops, register a lowering with "
            "@circleops.lowering.lower(<op>), or, for your own op, define it with @circleops.op(schema) "
            "(a torch op already defined with torch.library: circleops.register_op(op, reference)), which "
            "writes it for every target (docs/own-ops.md).")
    ctx.decomposing.append(target)
    try:
        return ctx.call(target, *args, _decompose=True, **kwargs)
    finally:
        ctx.decomposing.pop()


# ------------------------------------------------------------------------ regions
# torch.export wraps `with torch.no_grad()` / `torch.autocast(enabled=False)` regions in
# higher-order ops over a submodule: their graphs are lowered inline.
def _inline_region(ctx: LoweringContext, submodule: torch.fx.GraphModule, operands: tuple) -> Any:
    return list(lower_fx_graph(ctx, submodule.graph, operands, module=submodule))


@lower(torch.ops.higher_order.wrap_with_set_grad_enabled)
def _(ctx, node, enabled, submodule, *operands):
    return _inline_region(ctx, submodule, operands)


@lower(torch.ops.higher_order.wrap_with_autocast)
def _(ctx, node, device_type, dtype, enabled, cache_enabled, submodule, *operands):
    if enabled:
        raise ctx.unsupported(
            "runs under torch.autocast, whose casts are not in the exported graph",
            "Export outside autocast (convert the model with model.to(dtype) instead), or call "
            "ep.run_decompositions() first so that the casts become graph nodes.")
    return _inline_region(ctx, submodule, operands)

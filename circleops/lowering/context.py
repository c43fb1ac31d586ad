"""The builder one lowering works with: the subgraph being built, and helpers that emit or fold.

Values (circleops.lowering.value) are what FX nodes lower to. Constants are materialized
lazily, once per subgraph, the first time an operator uses them, so constants that only
feed folded computations (RoPE tables, masks, shape arithmetic) never reach the file, and
the same torch tensor (a tied embedding / lm_head weight) becomes one tensor.

The helpers (``reshape``, ``transpose``, ``cast``, ``binary``, ...) fold when their
inputs are constants, so a lowering can write ``ctx.transpose(weight, perm)`` and get a
pre-transposed constant for free.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch
import torch.fx

from circleops import ir
from circleops.errors import UnsupportedOpError
from circleops.lowering.trace import trace
# Values and their helpers, re-exported: lowerings import them from here
from circleops.lowering.value import (Value, broadcast_shape, const_value, result_type,  # noqa: F401
                                      scalar_dtype, source_line)
from circleops.targets import TargetProfile, profile


class GraphLowerer(Protocol):
    """Lowers an FX graph into ctx's current subgraph (circleops.lowering.program.lower_fx_graph):
    passed in, so that this module does not import the program walker that imports it."""

    def __call__(self, ctx: "LoweringContext", graph: torch.fx.Graph, inputs: Sequence[Any],
                 module: torch.nn.Module | None = None) -> Any: ...


# Elementwise unary builtins: they commute with a transpose of their input.
LAYOUT_FREE = frozenset({
    "RELU", "RELU6", "RELU_N1_TO_1", "LEAKY_RELU", "LOGISTIC", "TANH", "GELU", "HARD_SWISH",
    "NEG", "ABS", "EXP", "LOG", "SQRT", "RSQRT", "SIN", "COS", "FLOOR", "CEIL", "ROUND", "SIGN",
    "SQUARE", "LOGICAL_NOT",
})


# Ops that ``emit`` writes once per subgraph for the same inputs and options (pure, cheap to
# key, and repeated by per-layer decompositions): views, casts, compares and logic.
SHARED = frozenset({
    "RESHAPE", "CAST", "EQUAL", "NOT_EQUAL", "LESS", "LESS_EQUAL", "GREATER", "GREATER_EQUAL",
    "LOGICAL_AND", "LOGICAL_OR", "LOGICAL_NOT",
})


# Integer constants up to this size are shared by value within a subgraph (see ``index``);
# float constants are not: the integer pass quantizes those per consumer.
_SHARED_CONST_DTYPES = frozenset({torch.int32, torch.int64, torch.bool})
_SHARED_CONST_NUMEL = 1 << 16


class LoweringContext:
    """Builds one ir.Model; lowerings call ``emit`` and the helpers below."""

    def __init__(self, target: str | TargetProfile, model: ir.Model, *, lower_graph: GraphLowerer):
        self.profile: TargetProfile = profile(target)  # what the target runs: lowerings ask it
        self.target = self.profile.name  # for messages only; decisions read self.profile
        self.model = model
        self._lower_graph = lower_graph
        self.sg: ir.Subgraph = None  # type: ignore[assignment] - set by subgraph()
        self.node: torch.fx.Node | None = None  # the node being lowered (any graph)
        self.root: torch.fx.Node | None = None  # the exported program's node being lowered
        self.decomposing: list[Any] = []  # ops being decomposed (guards recursion)
        self._consts: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
        self._names = itertools.count()
        # TRANSPOSE outputs -> (its input, perm), so that transpose(transpose(x)) composes:
        # NCHW <-> NHWC pairs around consecutive channels-last ops cancel.
        self._transposed: dict[tuple[int, int], tuple[Value, list[int]]] = {}
        # RESHAPE outputs -> the tensor they reshape, so that reshape(reshape(x)) is one op
        self._reshaped: dict[tuple[int, int], Value] = {}
        # (subgraph, opcode, inputs, options) -> outputs of the ops in SHARED: a decomposition
        # that recomputes the same view or mask per layer (RoPE tables, a cache-slot mask,
        # an FC's flattened input) gets one op, not one per layer
        self._emitted: dict[tuple, Any] = {}
        self._i32: dict[tuple[int, ...], Value] = {}

    # ---------------------------------------------------------------- target queries
    def supports(self, opcode: str, dtype: torch.dtype | None = None, rank: int | None = None) -> bool:
        """Whether the target's runtime executes builtin ``opcode`` (on ``dtype`` data of ``rank``)."""
        return self.profile.runs(opcode, dtype, rank)

    # ---------------------------------------------------------------- the current node
    @property
    def out(self) -> Any:
        """The current node's fake value (shape/dtype of what the lowering must produce)."""
        return self.node.meta.get("val") if self.node is not None else None

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.out.shape)

    @property
    def out_dtype(self) -> torch.dtype:
        return self.out.dtype

    def _name(self, hint: str = "") -> str:
        base = self.node.name if self.node is not None else "t"
        return f"{base}{'_' + hint if hint else ''}_{next(self._names)}"

    # ---------------------------------------------------------------- tensors
    def new(self, shape: Sequence[int], dtype: torch.dtype, name: str | None = None) -> Value:
        """A fresh non-constant tensor of the current subgraph."""
        name = name or self._name()
        shape = tuple(int(d) for d in shape)
        if dtype not in ir.TORCH_TO_TYPE:
            raise UnsupportedOpError(self._where(f"produces a {dtype} tensor, which has no Circle/TFLite type")
                                     + " Cast to a supported dtype (float32, float16, int32, int64, bool) in the model.")
        idx = self.sg.add_tensor(ir.Tensor(name, shape, ir.TORCH_TO_TYPE[dtype]))
        return Value(shape, dtype, index=idx, name=name, sg=self.sg)

    def input(self, shape: Sequence[int], dtype: torch.dtype, name: str) -> Value:
        """A new input of the current subgraph."""
        v = self.new(shape, dtype, name)
        self.sg.inputs.append(v.index)
        return v

    def const(self, value: Any, dtype: torch.dtype | None = None, name: str = "") -> Value:
        """A constant Value from a Python scalar/list, numpy array or torch tensor."""
        if isinstance(value, Value):
            return self.cast(value, dtype) if dtype is not None else value
        if isinstance(value, np.ndarray):
            t = torch.from_numpy(value)
            t = t.to(dtype) if dtype is not None else t
        elif isinstance(value, torch.Tensor):
            t = value.detach().to(dtype) if dtype is not None else value.detach()
        else:
            t = torch.tensor(value, dtype=dtype if dtype is not None else scalar_dtype(value))
        return const_value(t, name)

    def i32(self, values: Sequence[int]) -> Value:
        """An int32 vector constant (shapes, perms, axes, slice bounds); one per distinct
        vector, so that ops taking the same shape share it (and ``emit`` can see they match)."""
        key = tuple(int(v) for v in values)
        v = self._i32.get(key)
        if v is None:
            v = self._i32[key] = const_value(torch.tensor(key, dtype=torch.int32))
        return v

    def index(self, v: Value | None) -> int:
        """The tensor index of ``v`` in the current subgraph (materializing a constant)."""
        if v is None:
            return -1
        if not isinstance(v, Value):
            raise TypeError(f"expected a Value, got {type(v).__name__}: {v!r}")
        if v.const is None:
            if v.sg is not self.sg:
                raise UnsupportedOpError(self._where(f"uses {v} outside the subgraph that defines it"))
            return v.index
        key = (id(self.sg), id(v.const))
        hit = self._consts.get(key)
        if hit is None and v.const.dtype in _SHARED_CONST_DTYPES and v.const.numel() <= _SHARED_CONST_NUMEL:
            # an integer constant a decomposition rebuilds per call (an arange of cache
            # slots, shapes, indices) is one tensor, so ops that read it can be shared
            by_value = (id(self.sg), v.const.dtype, tuple(v.const.shape), v.const.cpu().numpy().tobytes())
            hit = self._consts.get(by_value)
            if hit is not None:
                self._consts[key] = (v.const, hit[1])
                return hit[1]
            key_value = by_value
        else:
            key_value = None
        if hit is None:
            data = v.const
            if data.dtype not in ir.TORCH_TO_TYPE:
                raise UnsupportedOpError(self._where(f"needs a {data.dtype} constant, which has no Circle/TFLite type"))
            name = v.name or self._name("const")
            idx = self.sg.add_tensor(ir.Tensor(name, tuple(data.shape), ir.TORCH_TO_TYPE[data.dtype], data))
            hit = (v.const, idx)  # keeps the tensor alive, so id() cannot be reused
            self._consts[key] = hit
            if key_value is not None:
                self._consts[key_value] = hit
        return hit[1]

    # ---------------------------------------------------------------- operators
    def emit(self, opcode: str, inputs: Sequence[Value | None], options_type: str | None = None, *,
             out_shape: Sequence[int] | None = None, out_dtype: torch.dtype | None = None,
             outs: Sequence[tuple[Sequence[int], torch.dtype]] | None = None, op_version: int = 1,
             **options: Any) -> Any:
        """Append one operator; returns its output Value (a list of them when ``outs`` is given).

        The output shape/dtype default to the current node's; ``options`` are the fields of
        ``options_type`` by object-API name.
        """
        ins = [self.index(v) for v in inputs]
        key = None
        if opcode in SHARED:
            key = (id(self.sg), opcode, tuple(ins), options_type, repr(sorted(options.items())), op_version,
                   None if out_shape is None else tuple(out_shape), out_dtype,
                   None if outs is None else tuple((tuple(sh), dt) for sh, dt in outs))
            hit = self._emitted.get(key)
            if hit is not None:
                return hit
        if outs is None:
            shape = self.out_shape if out_shape is None else out_shape
            dtype = self.out_dtype if out_dtype is None else out_dtype
            results = [self.new(shape, dtype)]
        else:
            results = [self.new(s, d) for s, d in outs]
        self.sg.operators.append(ir.Operator(opcode, ins, [r.index for r in results], options_type,
                                             dict(options), op_version))
        result = results if outs is not None else results[0]
        if key is not None:
            self._emitted[key] = result
        return result

    # ---------------------------------------------------------------- helpers
    def reshape(self, x: Value, shape: Sequence[int]) -> Value:
        shape = tuple(int(d) for d in shape)
        if -1 in shape:
            known = math.prod(d for d in shape if d != -1)
            shape = tuple(x.numel // known if d == -1 else d for d in shape)
        if shape == x.shape:
            return x
        if x.is_const:
            return const_value(x.const.reshape(shape))
        src = self._reshaped.get((id(self.sg), x.index))
        if src is not None:
            return self.reshape(src, shape)
        y = self.emit("RESHAPE", [x, self.i32(shape)], out_shape=shape, out_dtype=x.dtype)
        self._reshaped[(id(self.sg), y.index)] = x
        return y

    def transpose(self, x: Value, perm: Sequence[int]) -> Value:
        perm = [p % max(x.rank, 1) for p in perm]
        if perm == sorted(perm):
            return x
        if x.is_const:
            return const_value(x.const.permute(perm))
        producer = self._transposed.get((id(self.sg), x.index))
        if producer is not None:
            src, inner = producer
            return self.transpose(src, [inner[p] for p in perm])
        moved = [p for p in perm if x.shape[p] != 1]
        if moved == sorted(moved):
            # only size-1 dims move: the same memory order, a RESHAPE (no copy on most
            # runtimes) instead of a TRANSPOSE ([1, S=1, H, D] <-> [1, H, 1, D] in a decode step)
            return self.reshape(x, [x.shape[p] for p in perm])
        if not x.dtype.is_floating_point and not self.supports("TRANSPOSE", x.dtype):
            # integers and masks through int32 (positions and counts: far inside its range)
            return self.cast(self.transpose(self.cast(x, torch.int32), perm), x.dtype)
        shape = tuple(x.shape[p] for p in perm)
        y = self.emit("TRANSPOSE", [x, self.i32(perm)], out_shape=shape, out_dtype=x.dtype)
        self._transposed[(id(self.sg), y.index)] = (x, perm)
        return y

    def cast(self, x: Any, dtype: torch.dtype) -> Value:
        """``x`` (Value or Python scalar) as ``dtype``; a CAST op only when needed."""
        if not isinstance(x, Value):
            return self.const(x, dtype)
        if x.dtype == dtype:
            return x
        if x.is_const:
            return const_value(x.const.to(dtype))
        return self.emit("CAST", [x], out_shape=x.shape, out_dtype=dtype)

    def transposed(self, x: Any) -> tuple[Value, list[int]] | None:
        """(src, perm) when ``x`` is the output of a TRANSPOSE(src, perm) emitted here."""
        if not isinstance(x, Value) or x.is_const:
            return None
        return self._transposed.get((id(self.sg), x.index))

    def unary(self, opcode: str, x: Value, options_type: str | None = None, **options: Any) -> Value:
        t = self.transposed(x) if opcode in LAYOUT_FREE else None
        if t is not None:
            # op(transpose(src)) = transpose(op(src)): the transpose can then cancel with the
            # next one (NHWC conv -> relu -> NHWC conv keeps no NCHW detour)
            return self.transpose(self.unary(opcode, t[0], options_type, **options), t[1])
        return self.emit(opcode, [x], options_type, out_shape=x.shape, out_dtype=x.dtype, **options)

    def binary(self, opcode: str, a: Any, b: Any, options_type: str | None = None, *,
               dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
               **options: Any) -> Value:
        """An elementwise binary op computed in ``dtype`` (default: promotion of a and b).

        Inputs of another dtype get a CAST (Circle/TFLite ops take one dtype); Python
        scalars become constants of ``dtype``.
        """
        dtype = dtype or result_type(a, b)
        a, b = self.cast(a, dtype), self.cast(b, dtype)
        ta, tb = self.transposed(a), self.transposed(b)
        if ta and tb and ta[1] == tb[1] and a.shape == b.shape:  # same layout: compute in the source's
            y = self.binary(opcode, ta[0], tb[0], options_type, dtype=dtype, out_dtype=out_dtype, **options)
            return self.transpose(y, ta[1])
        if ta and b.numel == 1 and b.rank <= a.rank:
            y = self.binary(opcode, ta[0], b, options_type, dtype=dtype, out_dtype=out_dtype, **options)
            return self.transpose(y, ta[1])
        if tb and a.numel == 1 and a.rank <= b.rank:
            y = self.binary(opcode, a, tb[0], options_type, dtype=dtype, out_dtype=out_dtype, **options)
            return self.transpose(y, tb[1])
        shape = broadcast_shape(a.shape, b.shape)
        return self.broadcasting(opcode, [a, b], shape, out_dtype or dtype, options_type, **options)

    def broadcasting(self, opcode: str, operands: list[Value], shape: Sequence[int], out_dtype: torch.dtype,
                     options_type: str | None = None, **options: Any) -> Value:
        """Elementwise ``opcode`` over ``operands`` broadcast to ``shape``. Above the rank the
        target runs it at (onert computes comparisons, MAXIMUM/MINIMUM and SELECT_V2 wrong
        from rank 5 or 6), the dims where every operand broadcasts alike are merged: the same
        elementwise op on reshaped operands."""
        if not self.supports(opcode, rank=len(shape)):
            runs = _broadcast_runs(shape, [v.shape for v in operands])
            if len(runs) < len(shape) and self.supports(opcode, rank=len(runs)):
                merged = [self.reshape(v, [r[k + 1] for r in runs]) for k, v in enumerate(operands)]
                y = self.emit(opcode, merged, options_type, out_shape=[r[0] for r in runs], out_dtype=out_dtype,
                              **options)
                return self.reshape(y, shape)
        return self.emit(opcode, list(operands), options_type, out_shape=tuple(shape), out_dtype=out_dtype, **options)

    def add(self, a: Any, b: Any, dtype: torch.dtype | None = None) -> Value:
        return self.binary("ADD", a, b, "AddOptions", dtype=dtype)

    def sub(self, a: Any, b: Any, dtype: torch.dtype | None = None) -> Value:
        return self.binary("SUB", a, b, "SubOptions", dtype=dtype)

    def mul(self, a: Any, b: Any, dtype: torch.dtype | None = None) -> Value:
        return self.binary("MUL", a, b, "MulOptions", dtype=dtype)

    def div(self, a: Any, b: Any, dtype: torch.dtype | None = None) -> Value:
        return self.binary("DIV", a, b, "DivOptions", dtype=dtype)

    def slice(self, x: Value, dim: int, start: int, end: int, step: int = 1) -> Value:
        """x[..., start:end:step, ...] along ``dim`` (bounds already normalized)."""
        dim %= x.rank
        n = len(range(start, end, step))
        if start == 0 and step == 1 and end >= x.shape[dim]:
            return x
        if x.is_const:
            idx = [slice(None)] * x.rank
            idx[dim] = slice(start, end, step)
            return const_value(x.const[tuple(idx)])
        if not self.supports("STRIDED_SLICE", x.dtype, x.rank):  # onert: rank 6 fails at prepare
            # the same slice of [before, dim, after]: the dims around ``dim`` merged
            before, after = math.prod(x.shape[:dim]), math.prod(x.shape[dim + 1:])
            part = self.slice(self.reshape(x, [before, x.shape[dim], after]), 1, start, end, step)
            return self.reshape(part, list(x.shape[:dim]) + [n] + list(x.shape[dim + 1:]))
        begin = [0] * x.rank
        stop = list(x.shape)
        strides = [1] * x.rank
        begin[dim], stop[dim], strides[dim] = start, end, step
        shape = list(x.shape)
        shape[dim] = n
        return self.emit("STRIDED_SLICE", [x, self.i32(begin), self.i32(stop), self.i32(strides)],
                         "StridedSliceOptions", out_shape=shape, out_dtype=x.dtype)

    def gather(self, x: Value, indices: Value | Sequence[int], axis: int) -> Value:
        axis %= x.rank
        if not isinstance(indices, Value):
            indices = self.i32(indices)
        shape = x.shape[:axis] + indices.shape + x.shape[axis + 1:]
        if indices.is_const and indices.shape == (x.shape[axis],) and torch.equal(
                indices.const.long(), torch.arange(x.shape[axis])):
            return x  # every row in order (a KV-cache write that fills the whole cache)
        if x.is_const and indices.is_const:
            return const_value(x.const.index_select(axis, indices.const.reshape(-1).long()).reshape(shape))
        if x.dtype in (torch.int64, torch.bool) and not self.supports("GATHER", x.dtype):
            # int64 here is positions and counts, far inside int32
            return self.cast(self.gather(self.cast(x, torch.int32), indices, axis), x.dtype)
        return self.emit("GATHER", [x, indices], "GatherOptions", out_shape=shape, out_dtype=x.dtype,
                         axis=axis, batchDims=0)

    def concat(self, xs: Sequence[Value], axis: int, dtype: torch.dtype | None = None) -> Value:
        xs = [x for x in xs if x.numel > 0] or list(xs[:1])
        dtype = dtype or xs[0].dtype
        xs = [self.cast(x, dtype) for x in xs]
        if len(xs) == 1:
            return xs[0]
        axis %= xs[0].rank
        shape = list(xs[0].shape)
        shape[axis] = sum(x.shape[axis] for x in xs)
        if all(x.is_const for x in xs):
            return const_value(torch.cat([x.const for x in xs], axis))
        return self.emit("CONCATENATION", list(xs), "ConcatenationOptions", out_shape=shape, out_dtype=dtype,
                         axis=axis, fusedActivationFunction=0)

    # ---------------------------------------------------------------- subgraphs
    @contextlib.contextmanager
    def subgraph(self, name: str) -> Iterator[int]:
        """Build a new subgraph of the model; yields its index."""
        prev = self.sg
        sg = ir.Subgraph(name)
        self.model.subgraphs.append(sg)
        self.sg = sg
        try:
            yield len(self.model.subgraphs) - 1
        finally:
            self.sg = prev

    # ---------------------------------------------------------------- tracing
    def call(self, fn: Callable[..., Any], *args: Any, _decompose: bool = False, **kwargs: Any) -> Any:
        """Lower ``fn(*args, **kwargs)`` inline: trace it with make_fx over the Values'
        shapes and dtypes (other arguments are baked in) and lower the traced aten nodes
        through the same registry. Returns fn's result with tensors replaced by Values.

        The trace keeps composite ops whole (linear, matmul: the export's own dialect)
        unless ``_decompose``, which traces below them (for ops with no lowering).
        """
        gm, values = trace(fn, args, kwargs, decompose=_decompose)
        return self._lower_graph(self, gm.graph, values, module=gm)

    # ---------------------------------------------------------------- errors
    def _where(self, what: str) -> str:
        node = self.root or self.node
        inner = f" (inside {self.node.target} node {self.node.name!r})" if self.node is not None and self.node is not node else ""
        if node is None:
            return what
        return f"node {node.name!r} ({node.target}){inner} {what}; at {source_line(node)}."

    def unsupported(self, what: str, hint: str) -> UnsupportedOpError:
        """An UnsupportedOpError naming the node, its source line, and what to do."""
        return UnsupportedOpError(f"{self._where(what)} {hint}")


def _broadcast_runs(shape: Sequence[int], operands: Sequence[Sequence[int]]) -> list[list[int]]:
    """[out, operand sizes...] of the runs of adjacent dims along which every operand
    broadcasts to ``shape`` alike (full or 1); size-1 dims join any run."""
    r = len(shape)
    padded = [(1,) * (r - len(o)) + tuple(o) for o in operands]
    runs: list[list[int]] = []
    keys: list[tuple[bool, ...]] = []
    for i, o in enumerate(shape):
        if o == 1 and runs:
            continue
        sizes = [p[i] for p in padded]
        key = tuple(d == o for d in sizes)
        if runs and keys[-1] == key:
            runs[-1] = [a * b for a, b in zip(runs[-1], [o, *sizes])]
        else:
            runs.append([o, *sizes])
            keys.append(key)
    return runs

"""The pure-torch reference interpreter: runs any Circle or TFLite file op by op.

    outputs = reference.run("model.circle", [ids])          # list[np.ndarray] -> list[np.ndarray]
    session = reference.Session("model.circle")             # reuse the plan (generation loops)
    logits, k, v = session.run_torch([ids, k, v])           # torch in, torch out, no copies

Semantics are TFLite/Circle's, computed in each tensor's dtype (an fp16 graph runs in fp16,
a CAST is a cast). The fused Circle ops run through circleops.ops' reference kernels,
STABLEHLO_COMPOSITE through its decomposition subgraph. The kernels live in
circleops.runtime.kernels (one short function per opcode).

Per subgraph a plan is computed once: kernel, input and output indices per operator,
constants as torch tensors sharing the file's memory, and which intermediates can be freed
after each operator, so that whole LLMs run with little per-op overhead.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from circleops import ir
from circleops.errors import RuntimeRunError
from circleops.quantize.ggml import BlockTensor
from circleops.runtime import TensorSpec
from circleops.runtime.inputs import check_inputs, in_order
from circleops.runtime.kernels import (BLOCK_WEIGHT_INPUTS, IN_PLACE, KERNELS, Kernel, KernelContext, KernelError,
                                       check_alloc, max_tensor_bytes)
from circleops.runtime.kernels import quantized as quantized_kernels
from circleops.runtime.kernels.fused import custom_spec, registered_builtin
from circleops.ops import UnknownCustomOpError
from circleops.runtime.kernels.elementwise import BINARY

# Ops whose output shape is the broadcast of their inputs: checked against the allocation
# limit before the kernel runs ([N, 1] + [1, M] from two small inputs can be huge).
_BROADCASTING = frozenset(BINARY) | {"SELECT", "SELECT_V2", "ADD_N", "PRELU"}
# Nested subgraph calls (composites' decompositions, control flow) deeper than this mean a
# subgraph calls itself.
_MAX_CALL_DEPTH = 32


def _check_broadcast(opcode: str, args: list[Tensor]) -> None:
    try:
        shape = torch.broadcast_shapes(*(a.shape for a in args))
    except RuntimeError:
        return  # not broadcastable (SELECT's row form, or an error the kernel reports)
    check_alloc(shape, args[-1].dtype, f"broadcasting {opcode}")

__all__ = ["run", "Session", "Interpreter", "supported_opcodes", "KERNELS"]


def supported_opcodes() -> frozenset[str]:
    """The BuiltinOperator names the interpreter has a kernel for."""
    return frozenset(KERNELS)


def _to_torch(data: Any, dtype: str, shape: tuple[int, ...]) -> Tensor | BlockTensor:
    """A constant's data as a torch tensor, sharing memory where possible (GGML blocks as a
    BlockTensor, which the kernels of BLOCK_WEIGHT_INPUTS unpack)."""
    if dtype in ir.GGML_BLOCKS:
        return BlockTensor(data, dtype, shape)
    if isinstance(data, Tensor):
        t = data.detach()
    else:
        arr = np.asarray(data)
        if not arr.flags.c_contiguous or arr.dtype.byteorder == ">":
            arr = np.array(arr, dtype=arr.dtype.newbyteorder("="), order="C")  # keeps 0-d arrays 0-d
        if not arr.flags.writeable:
            # Constants are never written to; torch only warns that it could.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                t = torch.from_numpy(arr)
        else:
            t = torch.from_numpy(arr)
    want = ir.TYPE_TO_TORCH.get(dtype)
    if want is not None and t.dtype != want:
        # bf16 is stored as its raw 16-bit pattern; anything else is converted.
        raw_bf16 = want == torch.bfloat16 and t.dtype in (torch.uint16, torch.int16)
        t = t.view(want) if raw_bf16 else t.to(want)
    if tuple(t.shape) != tuple(shape) and t.numel() == int(np.prod(shape, dtype=np.int64)):
        t = t.reshape(shape)  # flat buffer data
    return t


@dataclass
class _Step:
    index: int
    op: ir.Operator
    fn: Kernel
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    ctx: KernelContext
    checks: tuple[tuple[int, torch.dtype, Optional[tuple[int, ...]]], ...]
    free: tuple[int, ...]
    writes: tuple[int, ...] = ()  # input tensors updated in place with the extra results


class SubgraphPlan:
    """One subgraph, prepared for execution."""

    def __init__(self, interp: "Interpreter", index: int):
        sg = interp.model.subgraphs[index]
        _check_declared_sizes(sg, index)
        self.subgraph = sg
        self.index = index
        self.base: list[Optional[Tensor]] = [
            _to_torch(t.data, t.dtype, t.shape) if t.data is not None else None for t in sg.tensors]
        self.inputs = list(sg.inputs)
        self.outputs = list(sg.outputs)
        self.steps: list[_Step] = []
        last_use: dict[int, int] = {}
        for k, op in enumerate(sg.operators):
            fn = KERNELS.get(op.opcode) or registered_builtin(op.opcode)
            if op.opcode == "CUSTOM":
                try:
                    custom_spec(op)  # an unknown custom_code is an error at prepare, not mid-run
                except UnknownCustomOpError as err:
                    raise RuntimeRunError(f"reference interpreter: operator {k} of subgraph {index} {sg.name!r}: "
                                          f"{err}") from None
            if fn is None:
                name = op.opcode
                if name == "CUSTOM":  # the custom code is what names a custom op
                    name += f" {op.options.get('customCode')!r}"
                raise RuntimeRunError(
                    f"reference interpreter: no kernel for opcode {name} (operator {k} of subgraph "
                    f"{index} {sg.name!r}, output tensor {_out_name(sg, op)!r}). The interpreter knows "
                    f"{len(KERNELS)} opcodes (circleops.runtime.reference.supported_opcodes()); add one "
                    "with @kernel in circleops/runtime/kernels/, or run the file with --runtime onert/litert.")
            for pos, j in enumerate(op.inputs):
                if j >= 0 and sg.tensors[j].dtype in ir.GGML_BLOCKS and \
                        pos not in BLOCK_WEIGHT_INPUTS.get(op.opcode, ()):
                    raise RuntimeRunError(
                        f"reference interpreter: operator {k} ({op.opcode}) of subgraph {index} "
                        f"{sg.name!r} takes {sg.tensors[j].dtype} tensor {sg.tensors[j].name!r} as input "
                        f"{pos}; GGML blocks are read only as a FULLY_CONNECTED weight or a GATHER "
                        "table (what onert runs); store this tensor as FLOAT32")
            ctx = KernelContext([sg.tensors[j] for j in op.outputs], interp._call,
                                [sg.tensors[j] if j >= 0 else None for j in op.inputs])
            fn = quantized_kernels.select(op, ctx) or fn  # integer tensors: TFLite's integer arithmetic
            writes: tuple[int, ...] = ()
            if op.opcode in IN_PLACE and len(op.outputs) == 1:
                # The updated tensors are results too: checked like declared outputs.
                writes = tuple(op.inputs[p] for p in IN_PLACE[op.opcode])
            checks = tuple((j, self._dtype(sg.tensors[j], k, op), self._static_shape(sg.tensors[j]))
                           for j in (*op.outputs, *writes))
            self.steps.append(_Step(k, op, fn, tuple(op.inputs), tuple(op.outputs), ctx, checks, (), writes))
            for j in op.inputs:
                if j >= 0:
                    last_use[j] = k
            for j in op.outputs:
                last_use.setdefault(j, k)  # an output nobody reads is freed at once
        keep = set(self.outputs)
        frees: dict[int, list[int]] = {}
        for j, k in last_use.items():
            if j not in keep and self.base[j] is None and j not in self.inputs:
                frees.setdefault(k, []).append(j)
        for step in self.steps:
            step.free = tuple(frees.get(step.index, ()))

    def _dtype(self, t: ir.Tensor, k: int, op: ir.Operator) -> torch.dtype:
        dtype = ir.TYPE_TO_TORCH.get(t.dtype)
        if dtype is None:
            raise RuntimeRunError(
                f"reference interpreter: tensor {t.name!r} (output of operator {k}, {op.opcode}, subgraph "
                f"{self.index}) has type {t.dtype}, which the interpreter does not compute with (quantized "
                f"and exotic types are not supported); supported: {sorted(ir.TYPE_TO_TORCH)}.")
        return dtype

    @staticmethod
    def _static_shape(t: ir.Tensor) -> Optional[tuple[int, ...]]:
        # Shapes with unknown dims (-1) and empty shapes (some writers leave scalars and
        # unknown shapes empty) are not checked.
        shape = tuple(int(d) for d in t.shape)
        if not shape or any(d < 0 for d in shape):
            return None
        return shape

    def execute(self, inputs: Sequence[Tensor]) -> list[Tensor]:
        values = list(self.base)
        for j, t in zip(self.inputs, inputs):
            values[j] = t
        for step in self.steps:
            args = [values[j] if j >= 0 else None for j in step.inputs]
            try:
                if step.op.opcode in _BROADCASTING:
                    present = [a for a in args if a is not None]
                    if len(present) > 1 and any(a.shape != present[0].shape for a in present[1:]):
                        _check_broadcast(step.op.opcode, present)  # equal shapes cannot grow
                results = step.fn(step.op, args, step.ctx)
            except RuntimeRunError:
                raise
            except Exception as err:  # noqa: BLE001 - any kernel failure gets the op's context
                raise self._error(step, args, err) from err
            if len(results) < len(step.outputs) + len(step.writes):
                raise self._error(step, args, KernelError(
                    f"kernel returned {len(results)} outputs, the operator declares {len(step.outputs)}"))
            for (j, dtype, shape), r in zip(step.checks, results):
                if r.dtype != dtype or (shape is not None and tuple(r.shape) != shape):
                    raise self._error(step, args, KernelError(
                        f"output {self.subgraph.tensors[j].name!r} computed as {r.dtype} {list(r.shape)} "
                        f"but declared {dtype} {list(self.subgraph.tensors[j].shape)}"))
                values[j] = r
            for j in step.free:
                values[j] = None
        missing = [j for j in self.outputs if values[j] is None]
        if missing:
            raise RuntimeRunError(
                f"reference interpreter: output tensor(s) {[self.subgraph.tensors[j].name for j in missing]} of "
                f"subgraph {self.index} {self.subgraph.name!r} are never computed (no operator writes them and they "
                "are neither inputs nor constants); the file is inconsistent")
        return [values[j] for j in self.outputs]

    def _error(self, step: _Step, args: list, err: Exception) -> RuntimeRunError:
        tensors = self.subgraph.tensors
        ins = ", ".join("omitted" if a is None else f"{tensors[j].name!r} {str(a.dtype).replace('torch.', '')}"
                        f"{list(a.shape)}" for j, a in zip(step.inputs, args))
        outs = ", ".join(repr(tensors[j].name) for j in step.outputs)
        return RuntimeRunError(
            f"reference interpreter: operator {step.index} ({step.op.opcode}) of subgraph {self.index} "
            f"{self.subgraph.name!r}, output {outs}, failed on inputs ({ins}): {err}. The file is "
            "inconsistent or uses the op in a way the interpreter does not support.")


def _check_declared_sizes(sg: ir.Subgraph, index: int) -> None:
    """Refuse, by name, computed tensors whose declared shape is over the allocation limit."""
    limit = max_tensor_bytes()
    for j, t in enumerate(sg.tensors):
        if t.data is not None or t.dtype not in ir.TYPE_TO_TORCH:
            continue
        n = 1
        for d in t.shape:
            n *= max(int(d), 1)
        nbytes = n * torch.empty((), dtype=ir.TYPE_TO_TORCH[t.dtype]).element_size()
        if nbytes > limit:
            raise RuntimeRunError(
                f"reference interpreter: tensor {j} {t.name!r} of subgraph {index} is declared {t.dtype} "
                f"{list(t.shape)} ({nbytes} bytes), over the limit of {limit} bytes per tensor; set "
                "CIRCLEOPS_MAX_TENSOR_BYTES to allow more if the file is trusted")


def _out_name(sg: ir.Subgraph, op: ir.Operator) -> str:
    return sg.tensors[op.outputs[0]].name if op.outputs and op.outputs[0] >= 0 else "?"


def _input_to_torch(value: Any, t: ir.Tensor, position: str) -> Tensor:
    """A user input as a torch tensor (no copy; check_inputs checks it against the file)."""
    if isinstance(value, Tensor):
        x = value.detach()
    else:
        arr = np.asarray(value)
        if t.dtype == "BFLOAT16" and arr.dtype.name == "bfloat16":  # ml_dtypes.bfloat16
            arr = arr.view(np.uint16)
            x = torch.from_numpy(np.ascontiguousarray(arr)).view(torch.bfloat16)
        else:
            if not arr.flags.c_contiguous or not arr.flags.writeable:
                arr = np.array(arr, order="C")
            try:
                x = torch.from_numpy(arr)
            except TypeError:
                raise RuntimeRunError(f"input {position} ({t.name!r}): numpy dtype {arr.dtype} is not supported; "
                                      f"the model expects {t.dtype}") from None
    if t.dtype not in ir.TYPE_TO_TORCH:
        raise RuntimeRunError(f"input {position} ({t.name!r}) has type {t.dtype}, which the reference "
                              "interpreter does not support (quantized and exotic types)")
    return x


def _to_numpy(t: Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        try:
            import ml_dtypes

            return t.contiguous().view(torch.uint16).numpy().copy().view(ml_dtypes.bfloat16)
        except ImportError:  # no numpy bf16 type: widen, which is exact
            return t.to(torch.float32).numpy()
    # A copy: outputs may alias constants or the caller's inputs.
    return np.array(t.contiguous().numpy(), copy=True)


class Interpreter:
    """Runs an ir.Model; build once and call ``run``/``run_torch`` many times."""

    def __init__(self, model: ir.Model):
        if not isinstance(model, ir.Model):
            raise TypeError(f"Interpreter expects a circleops.ir.Model, got {type(model).__name__}")
        if not model.subgraphs:
            raise RuntimeRunError("the model has no subgraphs; nothing to run")
        self.model = model
        self.source = "the model"  # how input errors name it (Session: the file's path)
        self._plans: dict[int, SubgraphPlan] = {}
        self._depth = 0

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "Interpreter":
        """Read a .circle or .tflite file (weights inline or after the flatbuffer)."""
        return cls(_read(path))

    def plan(self, subgraph: int = 0) -> SubgraphPlan:
        plan = self._plans.get(subgraph)
        if plan is None:
            if not 0 <= subgraph < len(self.model.subgraphs):
                raise RuntimeRunError(f"subgraph index {subgraph} out of range: the model has "
                                      f"{len(self.model.subgraphs)} subgraphs")
            try:
                plan = SubgraphPlan(self, subgraph)
            except RuntimeRunError:
                raise
            except Exception as err:  # noqa: BLE001 - an inconsistent ir.Model (bad indices, types)
                raise RuntimeRunError(
                    f"reference interpreter: subgraph {subgraph} cannot be prepared ({type(err).__name__}: {err}); "
                    "the model is inconsistent (tensor or operator indices, types or shapes)") from None
            self._plans[subgraph] = plan
        return plan

    def _call(self, subgraph: int, inputs: list[Tensor]) -> list[Tensor]:
        plan = self.plan(subgraph)
        if len(inputs) != len(plan.inputs):
            raise KernelError(f"subgraph {subgraph} takes {len(plan.inputs)} inputs, got {len(inputs)}")
        if self._depth >= _MAX_CALL_DEPTH:
            raise KernelError(f"subgraph calls nested deeper than {_MAX_CALL_DEPTH} (subgraph {subgraph} calls "
                              "itself, directly or through others)")
        self._depth += 1
        try:
            return plan.execute(inputs)
        finally:
            self._depth -= 1

    def entry(self, signature: Optional[str]) -> tuple[int, list[int], list[int], list[str]]:
        """(subgraph index, input and output tensor indices, input names) of the entry point."""
        if signature is None:
            sg = self.model.subgraphs[0]
            return 0, list(sg.inputs), list(sg.outputs), [sg.tensors[j].name for j in sg.inputs]
        for sig in self.model.signatures:
            if sig.key == signature:
                return (sig.subgraph_index, list(sig.inputs.values()), list(sig.outputs.values()),
                        list(sig.inputs))
        keys = [s.key for s in self.model.signatures]
        raise RuntimeRunError(f"no signature {signature!r} in the model; it has {keys or 'none'}")

    def run_torch(self, inputs: Union[Sequence[Any], Mapping[str, Any]], signature: Optional[str] = None
                  ) -> list[Tensor]:
        """Run on torch tensors (or numpy arrays); returns torch tensors, which may share
        memory with the model's constants or the inputs (do not modify them in place)."""
        try:
            return self._run_torch(inputs, signature)
        except RuntimeRunError:
            raise
        except (Exception, RecursionError) as err:  # noqa: BLE001 - an inconsistent model
            raise RuntimeRunError(
                f"reference interpreter: the model cannot be run ({type(err).__name__}: {err}); its subgraphs, "
                "signatures or tensors are inconsistent") from None

    def _run_torch(self, inputs: Union[Sequence[Any], Mapping[str, Any]], signature: Optional[str]) -> list[Tensor]:
        self._depth = 0
        index, in_idx, out_idx, names = self.entry(signature)
        sg = self.model.subgraphs[index]
        where = self.source if signature is None else f"{self.source} (signature {signature!r})"
        specs = [_spec(n, sg.tensors[j]) for n, j in zip(names, in_idx)]
        inputs = in_order(specs, inputs, where)
        if len(inputs) != len(in_idx):
            check_inputs(specs, inputs, where)  # says how many, and which
        plan = self.plan(index)
        tensors = [_input_to_torch(v, sg.tensors[j], f"#{i}") for i, (v, j) in enumerate(zip(inputs, in_idx))]
        check_inputs(specs, tensors, where)
        # target onert writes a 0-d input as [1] (onert takes no rank-0 inputs)
        tensors = [x.reshape(1) if x.dim() == 0 and tuple(sg.tensors[j].shape) == (1,) else x
                   for x, j in zip(tensors, in_idx)]
        if in_idx != plan.inputs:  # a signature may list the inputs in another order
            order = {j: t for j, t in zip(in_idx, tensors)}
            tensors = [order[j] for j in plan.inputs]
        with torch.no_grad():
            results = plan.execute(tensors)
        if out_idx != plan.outputs:
            by_index = dict(zip(plan.outputs, results))
            results = [by_index[j] for j in out_idx]
        return results

    def run(self, inputs: Union[Sequence[Any], Mapping[str, Any]], signature: Optional[str] = None
            ) -> list[np.ndarray]:
        """Run on numpy arrays; returns fresh numpy arrays (bf16 as ml_dtypes.bfloat16)."""
        return [_to_numpy(t) for t in self.run_torch(inputs, signature)]


def _read(path: Union[str, os.PathLike]) -> ir.Model:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise RuntimeRunError(f"model file {path!r} does not exist")
    from circleops.serialize import read_model

    return read_model(path)


class Session:
    """The interpreter on one file (or ir.Model) and entry point: the main subgraph, or the
    signature ``signature``. The file is read and the plan built once."""

    def __init__(self, path: Union[str, os.PathLike, ir.Model], signature: Optional[str] = None):
        model = path if isinstance(path, ir.Model) else _read(path)
        self.path = "<ir.Model>" if isinstance(path, ir.Model) else os.fspath(path)
        self.signature = signature
        self.interpreter = Interpreter(model)
        self.interpreter.source = self.path
        index, in_idx, out_idx, names = self.interpreter.entry(signature)  # an unknown signature fails now
        try:
            sg = model.subgraphs[index]
            out_names = (list(next(s for s in model.signatures if s.key == signature).outputs)
                         if signature is not None else [sg.tensors[j].name for j in out_idx])
            self.inputs = [_spec(n, sg.tensors[j]) for n, j in zip(names, in_idx)]
            self.outputs = [_spec(n, sg.tensors[j]) for n, j in zip(out_names, out_idx)]
        except (IndexError, KeyError, TypeError, AttributeError) as err:  # an inconsistent ir.Model
            raise RuntimeRunError(f"reference interpreter: the model's entry point is inconsistent "
                                  f"({type(err).__name__}: {err})") from None

    def run(self, inputs: Union[Sequence[Any], Mapping[str, Any]]) -> list[np.ndarray]:
        """Numpy arrays (or torch tensors) in :attr:`inputs` order, or a dict by name -> fresh
        numpy arrays (bf16 as ml_dtypes.bfloat16)."""
        return self.interpreter.run(inputs, self.signature)

    def run_torch(self, inputs: Union[Sequence[Any], Mapping[str, Any]]) -> list[Tensor]:
        """As :meth:`run`, torch tensors out, without copies (see :meth:`Interpreter.run_torch`)."""
        return self.interpreter.run_torch(inputs, self.signature)


def _spec(name: str, t: ir.Tensor) -> TensorSpec:
    return TensorSpec(name, tuple(int(d) for d in t.shape), t.dtype.lower())


def run(path_or_model: Union[str, os.PathLike, ir.Model], inputs: Union[Sequence[Any], Mapping[str, Any]],
        signature: Optional[str] = None) -> list[np.ndarray]:
    """Run a Circle/TFLite file (or an ir.Model) on ``inputs`` with the reference interpreter.

    ``inputs`` are numpy arrays (or torch tensors) in the order of the subgraph's inputs, or
    of the signature's inputs when ``signature`` names one; a dict maps input names to
    arrays. Returns the outputs as numpy arrays. For repeated runs of the same model use
    :class:`Session` (the file is read and the plan built once).
    """
    return Session(path_or_model, signature).run(inputs)

"""The generic op battery: what tests/ops runs on the built-in ops, for anyone's op.

    from circleops.testing import check_op
    check_op(swiglu, [((torch.randn(2, 3, 16),), {"alpha": 0.5})])

``samples`` are ``(args, kwargs)`` pairs (as the built-ins' ``sample_inputs``), or a
callable ``sample_inputs(dtype)`` giving them per dtype; a list is cast to each dtype
(its floating tensors). Each check is also in :data:`CHECKS` (name -> function), so a test
suite can run them one by one (tests/ops does, over the built-ins):

* ``schema``: the registered torch schema is the one declared; the reference kernel takes
  every schema argument, by the schema's names;
* ``kernel``: the eager op gives the reference kernel's exact results (fp32, fp16, bf16);
* ``opcheck``: torch.library.opcheck in fp32, fp16 and bf16 (the fake's shapes, dtypes
  and strides against the real output; schema; autograd registration; AOT dispatch) and
  once with grad;
* ``gradcheck``: the gradient in fp64 (autograd runs through the reference kernel);
* ``autocast``: the op follows its autocast rule;
* ``export``: torch.export keeps the op one node (also after run_decompositions), and the
  exported program computes what eager does;
* ``targets``: every target converts a module calling the op, and the written file runs
  equal to torch (circle: reference interpreter, onert: onert, tflite: LiteRT).

A failing check raises :class:`OpCheckError` naming the op, the check and the sample.
"""
from __future__ import annotations

import inspect
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, Union

import torch

from circleops.errors import CircleOpsError
from circleops.ops import OpSpec, lookup

Samples = Union[Sequence[tuple[tuple, dict]], Callable[[torch.dtype], Sequence[tuple[tuple, dict]]]]

LOW = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32, *LOW)
CHEAP_OPCHECK = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# With grad in fp16/bf16: AOT dispatch traced with static shapes. The dynamic-shape trace of
# the backward (opcheck's default, run in fp32) is dtype-independent (symbolic sizes, the same
# autograd formula) and costs 5-10 s of CPU per op and dtype (attention: 20 s of its 42 s).
GRAD_OPCHECK_LOW = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static")


class OpCheckError(CircleOpsError, AssertionError):
    """An op failed one check of the battery; the message names the op, check and sample."""


def _tuple(out: Any) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _with_grad(args: tuple) -> tuple:
    return tuple(a.detach().clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point()
                 else a for a in args)


def _tensors(args: Iterable[Any]) -> tuple:
    return tuple(a for a in args if isinstance(a, torch.Tensor))


class CallOp(torch.nn.Module):
    """``forward(*tensors)`` = the op with a sample's non-tensor arguments baked in: what
    the export and conversion checks export."""

    def __init__(self, op: Any, args: tuple, kwargs: dict):
        super().__init__()
        self.op, self.kwargs = op, kwargs
        self.template = [None if isinstance(a, torch.Tensor) else a for a in args]
        self.slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def forward(self, *tensors: torch.Tensor) -> Any:
        args = list(self.template)
        for i, t in zip(self.slots, tensors):
            args[i] = t
        return self.op(*args, **self.kwargs)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def samples_for(samples: Samples, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    """``samples`` in ``dtype``: the callable's own, or the list's floating tensors cast."""
    if callable(samples):
        return list(samples(dtype))
    return [(tuple(_cast(a, dtype) for a in args), dict(kwargs)) for args, kwargs in samples]


def _spec(op: Any) -> OpSpec:
    if isinstance(op, OpSpec):
        return op
    name = op if isinstance(op, str) else getattr(op, "_qualname", None) or getattr(
        getattr(op, "_schema", None), "name", None) or getattr(op, "_qualified_op_name", None)
    spec = lookup(name) if name else None
    if spec is None:
        raise OpCheckError(f"check_op: {op!r} is not a registered op; define it with @circleops.op(schema)")
    return spec


class _Stage:
    """Turns any failure inside the ``with`` into an OpCheckError naming op, check, sample."""

    def __init__(self, spec: OpSpec, check: str, what: str = ""):
        self.spec, self.check, self.what = spec, check, what

    def __enter__(self) -> "_Stage":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, OpCheckError) or not isinstance(exc, Exception):
            return False
        where = f" ({self.what})" if self.what else ""
        raise OpCheckError(f"check_op({self.spec.qualname}): check {self.check!r} failed{where}: "
                           f"{type(exc).__name__}: {exc}") from exc


def _fail(spec: OpSpec, check: str, what: str, message: str) -> OpCheckError:
    return OpCheckError(f"check_op({spec.qualname}): check {check!r} failed ({what}): {message}")


# ------------------------------------------------------------------------ the checks
def check_schema(spec: OpSpec, samples: Samples) -> None:
    """The registered schema is the declared one; the reference kernel takes its arguments."""
    declared = torch._C.parse_schema(spec.schema)
    if declared != spec.overload._schema:
        raise _fail(spec, "schema", "registration", f"declared {spec.schema} but registered {spec.overload._schema}")
    fn = getattr(spec.reference, "__wrapped__", spec.reference)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # a builtin/C callable: nothing to compare
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return
    names = [a.name for a in declared.arguments]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if positional[:len(names)] != names:
        raise _fail(spec, "schema", "reference kernel",
                    f"its parameters {positional} must be the schema's arguments {names}, in order")


def check_kernel(spec: OpSpec, samples: Samples) -> None:
    """The eager op equals the reference kernel, bit for bit, in fp32, fp16 and bf16."""
    for dtype in DTYPES:
        for i, (args, kwargs) in enumerate(samples_for(samples, dtype)):
            what = f"sample {i}, {dtype}"
            with _Stage(spec, "kernel", what):
                got, want = _tuple(spec(*args, **kwargs)), _tuple(spec.reference(*args, **kwargs))
            for g, w in zip(got, want):
                if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g, w):
                    diff = (g.double() - w.double()).abs().max().item() if g.shape == w.shape else "shape"
                    raise _fail(spec, "kernel", what, f"the eager kernel gives {g.dtype}{list(g.shape)}, the "
                                f"reference kernel {w.dtype}{list(w.shape)} (max difference {diff})")


def check_opcheck(spec: OpSpec, samples: Samples) -> None:
    """torch.library.opcheck on every sample in fp32/fp16/bf16, and with grad."""
    for dtype in DTYPES:
        for i, (args, kwargs) in enumerate(samples_for(samples, dtype)):
            with _Stage(spec, "opcheck", f"sample {i}, {dtype}"):
                torch.library.opcheck(spec.op, args, kwargs, test_utils=CHEAP_OPCHECK)
        all_samples = samples_for(samples, dtype)
        args, kwargs = all_samples[0] if dtype == torch.float32 else all_samples[-1]
        if any(isinstance(a, torch.Tensor) and a.is_floating_point() for a in args):
            with _Stage(spec, "opcheck", f"with grad, {dtype}"):
                torch.library.opcheck(spec.op, _with_grad(args), kwargs,
                                      test_utils=CHEAP_OPCHECK if dtype == torch.float32 else GRAD_OPCHECK_LOW)


def check_gradcheck(spec: OpSpec, samples: Samples) -> None:
    """torch.autograd.gradcheck in fp64 on the first two samples."""
    for i, (args, kwargs) in enumerate(samples_for(samples, torch.float64)[:2]):
        args = _with_grad(args)
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            continue
        with _Stage(spec, "gradcheck", f"sample {i}, float64"):
            module = CallOp(spec.op, args, kwargs)
            if not torch.autograd.gradcheck(module, _tensors(args), fast_mode=True):
                raise AssertionError("gradcheck returned False")


def _autocast_expected(spec: OpSpec, args: tuple, kwargs: dict, autocast_dtype: torch.dtype) -> Any:
    if spec.autocast == "none":
        return spec(*args, **kwargs)
    target = torch.float32 if spec.autocast == "fp32" else autocast_dtype
    return spec(*(_cast(a, target) for a in args), **kwargs)


def check_autocast(spec: OpSpec, samples: Samples) -> None:
    """Inside torch.autocast the op follows its rule (fp32 / lower_precision / none)."""
    for dtype, autocast_dtype in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                  (torch.float32, torch.float16)):
        for i, (args, kwargs) in enumerate(samples_for(samples, dtype)):
            what = f"sample {i}, {dtype} under autocast({autocast_dtype})"
            with _Stage(spec, "autocast", what):
                expected = _tuple(_autocast_expected(spec, args, kwargs, autocast_dtype))
                with torch.autocast("cpu", dtype=autocast_dtype):
                    got = _tuple(spec(*args, **kwargs))
            for g, e in zip(got, expected):
                if g.dtype != e.dtype or not torch.equal(g, e):
                    raise _fail(spec, "autocast", what, f"rule {spec.autocast!r} not followed: got {g.dtype}, "
                                f"expected {e.dtype}")


def check_export(spec: OpSpec, samples: Samples) -> None:
    """torch.export (non-strict and strict) keeps the op one node, through run_decompositions."""
    args, kwargs = samples_for(samples, torch.float32)[0]
    module = CallOp(spec.op, args, kwargs)
    for strict in (False, True):
        what = f"sample 0, {'strict' if strict else 'non-strict'} export"
        with _Stage(spec, "export", what):
            ep = torch.export.export(module, _tensors(args), strict=strict)
            decomposed = ep.run_decompositions()
        for program in (ep, decomposed):
            nodes = [n for n in program.graph.nodes if n.op == "call_function" and n.target in (spec.overload, spec.op)]
            if len(nodes) != 1:
                raise _fail(spec, "export", what, f"the op must stay one node, found {len(nodes)} in:\n{program.graph}")
        with _Stage(spec, "export", what + ", running the exported program"):
            got = _tuple(decomposed.module()(*_tensors(args)))
            want = _tuple(spec(*args, **kwargs))
        for g, w in zip(got, want):
            if not torch.equal(g, w):
                raise _fail(spec, "export", what, "the exported program computes something else than eager")


def check_targets(spec: OpSpec, samples: Samples, targets: Sequence[str] | None = None,
                  out_dir: str | Path | None = None) -> dict[str, Any]:
    """Convert a module calling the op for every target and verify the written file against
    torch on its target's runtime. Returns target -> circleops Report."""
    from circleops.pipeline.convert import convert
    from circleops.targets import PROFILES, TARGETS

    args, kwargs = samples_for(samples, torch.float32)[0]
    module = CallOp(spec.op, args, kwargs)
    reports = {}
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(out_dir) if out_dir is not None else Path(tmp)
        for target in targets or TARGETS:
            path = where / f"{spec.name}.{target}.{PROFILES[target].format}"
            with _Stage(spec, "targets", f"sample 0, target {target} ({spec.form(PROFILES[target])})"):
                reports[target] = convert(module, _tensors(args), path, target=target, verify=True)
    return reports


CHECKS: dict[str, Callable[[OpSpec, Samples], Any]] = {
    "schema": check_schema,
    "kernel": check_kernel,
    "opcheck": check_opcheck,
    "gradcheck": check_gradcheck,
    "autocast": check_autocast,
    "export": check_export,
    "targets": check_targets,
}


def check_op(op: Any, samples: Samples | None = None, *, checks: Iterable[str] | None = None,
             targets: Sequence[str] | None = None) -> list[str]:
    """Run the op battery on ``op`` (an OpSpec from ``@circleops.op``, its torch op, or its
    name). ``samples``: ``[(args, kwargs), ...]`` or ``sample_inputs(dtype)`` (default: the
    op's own ``samples=``). ``checks``: a subset of :data:`CHECKS` (default: all);
    ``targets``: for the targets check (default: every target). Raises
    :class:`OpCheckError` on the first failure; returns the checks that passed."""
    spec = _spec(op)
    samples = samples if samples is not None else spec.sample_inputs
    if not callable(samples) and not list(samples):
        raise OpCheckError(f"check_op({spec.qualname}): no samples: give at least one (args, kwargs)")
    names = list(checks) if checks is not None else list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise OpCheckError(f"check_op: unknown checks {unknown}; choose from {list(CHECKS)}")
    for name in names:
        if name == "targets":
            check_targets(spec, samples, targets)
        else:
            CHECKS[name](spec, samples)
    return names


__all__ = ["CHECKS", "CallOp", "OpCheckError", "check_autocast", "check_export", "check_gradcheck", "check_kernel",
           "check_op", "check_opcheck", "check_schema", "check_targets", "samples_for"]

"""Op coverage measured with torch's own OpInfo database.

For each OpInfo entry in ``OPS`` (an op of torch's Core ATen opset that inference uses, as
users call it: ``F.conv1d``, ``torch.sort``, ``x.cumsum``), a few of its float32 sample
inputs are each wrapped in a tiny ``nn.Module``, exported, converted to every target and
the written file is run (reference interpreter for circle, onert, LiteRT for tflite) and
compared with torch eager.

Outcome per op x target (the worst over its samples):
  pass        converted by circleops' own lowerings, runs, matches torch
  decomposed  matches torch, but some node went through torch's decomposition table
  refused     circleops raised a CircleOpsError (the reason is recorded)
  wrong       ran but did not match torch          (a bug)
  runtime     the runtime refused the written file (a bug)
  crash       an exception that is not a CircleOpsError (a bug)
  export      torch.export failed on every sample (not circleops; never expected)

tools/coverage.py regenerates docs/coverage.md from this module; tests/coverage asserts
the outcomes.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

TARGETS = ("circle", "onert", "tflite")
SAMPLES = 2  # per op, in CI and in docs/coverage.md
OK = ("pass", "decomposed")

# OpInfo name[.variant] -> (Core ATen op it reaches, which tensors are constants).
# Constants: "" = every tensor is a graph input; "args" = only the sample's input is a graph
# input (weights, biases, running statistics are module buffers, as in a real model);
# "input" = the sample's input is the constant (embedding's weight).
OPS: dict[str, tuple[str, str]] = {
    # ---- elementwise unary
    **{n: (n, "") for n in (
        "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "ceil", "cos", "cosh", "erf", "exp",
        "exp2", "expm1", "floor", "frac", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round",
        "rsqrt", "sigmoid", "sign", "sin", "sinh", "sqrt", "square", "tan", "tanh", "trunc", "logical_not",
        "isinf", "isnan", "isfinite", "nan_to_num", "signbit", "positive", "deg2rad", "rad2deg", "sgn")},
    # ---- elementwise binary / ternary
    **{n: (n.split(".")[0], "") for n in (
        "add", "sub", "mul", "div.no_rounding_mode", "div.trunc_rounding", "div.floor_rounding", "true_divide",
        "atan2", "pow", "fmod", "remainder", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge",
        "logical_and", "logical_or", "logical_xor", "clamp", "clamp_min", "clamp_max", "where", "masked_fill",
        "floor_divide", "rsub", "lerp", "addcmul", "addcdiv", "xlogy", "copysign", "hypot", "fmax", "fmin",
        "max.binary", "min.binary", "logaddexp", "heaviside")},
    # ---- activations
    "nn.functional.relu": ("relu", ""), "nn.functional.relu6": ("hardtanh", ""),
    "nn.functional.elu": ("elu", ""), "nn.functional.selu": ("elu", ""), "nn.functional.celu": ("elu", ""),
    "nn.functional.gelu": ("gelu", ""), "nn.functional.silu": ("sigmoid", ""), "nn.functional.mish": ("tanh", ""),
    "nn.functional.hardswish": ("hardswish", ""), "nn.functional.hardsigmoid": ("hardsigmoid", ""),
    "nn.functional.hardtanh": ("hardtanh", ""), "nn.functional.leaky_relu": ("leaky_relu", ""),
    "nn.functional.prelu": ("prelu", "args"), "nn.functional.logsigmoid": ("log_sigmoid", ""),
    "nn.functional.softplus": ("softplus", ""), "nn.functional.threshold": ("threshold", ""),
    "nn.functional.hardshrink": ("hardshrink", ""), "nn.functional.softshrink": ("softshrink", ""),
    "nn.functional.glu": ("glu", ""), "nn.functional.softsign": ("div", ""),
    "nn.functional.tanhshrink": ("tanh", ""), "softmax": ("_softmax", ""), "log_softmax": ("_log_softmax", ""),
    "nn.functional.softmin": ("_softmax", ""), "logit": ("log", ""),
    # ---- normalization
    "nn.functional.layer_norm": ("native_layer_norm", "args"), "native_layer_norm": ("native_layer_norm", "args"),
    "nn.functional.group_norm": ("native_group_norm", "args"), "native_group_norm": ("native_group_norm", "args"),
    "nn.functional.batch_norm": ("_native_batch_norm_legit_no_training", "args"),
    "nn.functional.instance_norm": ("_native_batch_norm_legit", "args"),
    "nn.functional.rms_norm": ("rsqrt", "args"), "nn.functional.normalize": ("div", ""),
    "nn.functional.local_response_norm": ("avg_pool2d", ""),
    # ---- matrix products
    "mm": ("mm", ""), "bmm": ("bmm", ""), "addmm": ("addmm", ""), "matmul": ("mm", ""),
    "nn.functional.linear": ("addmm", "args"), "baddbmm": ("bmm", ""), "addmv": ("addmm", ""), "mv": ("mm", ""),
    "dot": ("mm", ""), "outer": ("mul", ""), "einsum": ("bmm", ""), "nn.functional.bilinear": ("bmm", "args"),
    "nn.functional.scaled_dot_product_attention": ("bmm", ""),
    # ---- convolutions
    **{f"nn.functional.{n}": ("convolution", "args") for n in (
        "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")},
    # ---- pooling
    "nn.functional.avg_pool1d": ("avg_pool1d", ""), "nn.functional.avg_pool2d": ("avg_pool2d", ""),
    "nn.functional.avg_pool3d": ("avg_pool3d", ""), "nn.functional.max_pool1d": ("max_pool2d_with_indices", ""),
    "nn.functional.max_pool2d": ("max_pool2d_with_indices", ""),
    "nn.functional.max_pool3d": ("max_pool3d_with_indices", ""),
    "nn.functional.adaptive_avg_pool1d": ("adaptive_avg_pool1d", ""),
    "nn.functional.adaptive_avg_pool2d": ("_adaptive_avg_pool2d", ""),
    "nn.functional.adaptive_avg_pool3d": ("_adaptive_avg_pool3d", ""),
    "nn.functional.adaptive_max_pool1d": ("max_pool2d_with_indices", ""),
    "nn.functional.adaptive_max_pool2d": ("max_pool2d_with_indices", ""),
    # ---- resize
    **{f"nn.functional.interpolate.{m}": ("upsample_nearest2d" if "nearest" in m else "upsample_bilinear2d", "")
       for m in ("nearest", "nearest-exact", "linear", "bilinear", "bicubic", "trilinear", "area")},
    "nn.functional.upsample_nearest": ("upsample_nearest2d", ""),
    "nn.functional.upsample_bilinear": ("upsample_bilinear2d", ""),
    "nn.functional.pixel_shuffle": ("permute", ""), "nn.functional.pixel_unshuffle": ("permute", ""),
    # ---- padding
    "constant_pad_nd": ("constant_pad_nd", ""), "nn.functional.pad.constant": ("constant_pad_nd", ""),
    "nn.functional.pad.reflect": ("reflection_pad2d", ""), "nn.functional.pad.replicate": ("replication_pad2d", ""),
    "nn.functional.pad.circular": ("cat", ""),
    # ---- reductions
    **{n: (n.split(".")[0], "") for n in (
        "sum", "mean", "amax", "amin", "prod", "any", "all", "argmax", "argmin", "max.reduction_with_dim",
        "max.reduction_no_dim", "min.reduction_with_dim", "min.reduction_no_dim", "var", "std", "var_mean",
        "std_mean", "logsumexp", "cumsum", "cumprod", "norm", "linalg.vector_norm", "count_nonzero", "aminmax",
        "nansum", "histc")},
    # ---- sorting and selection
    **{n: (n, "") for n in ("topk", "sort", "argsort", "msort", "kthvalue", "gather", "index_select",
                            "take_along_dim", "scatter", "scatter_add", "index_put", "index_add", "index_fill",
                            "index_copy", "masked_scatter", "nonzero", "masked_select", "unique", "argwhere")},
    "scatter_reduce.sum": ("scatter_reduce", ""), "scatter_reduce.amax": ("scatter_reduce", ""),
    "nn.functional.embedding": ("embedding", "input"), "__getitem__": ("index", ""),
    # ---- shapes and data movement
    **{n: (n.split(".")[0], "") for n in (
        "view", "reshape", "flatten", "unflatten", "squeeze", "squeeze.multiple", "unsqueeze", "permute",
        "transpose", "t", "expand", "expand_as", "broadcast_to", "repeat", "tile", "cat", "stack", "hstack",
        "vstack", "split", "split_with_sizes", "chunk", "unbind", "narrow", "select", "slice", "flip", "roll",
        "tril", "triu", "diagonal", "movedim", "select_scatter", "slice_scatter", "diagonal_scatter",
        "repeat_interleave", "clone", "contiguous", "alias_copy", "view_as", "reshape_as", "unfold",
        "nn.functional.channel_shuffle", "diag_embed", "rot90")},
    # ---- constants shaped like the input, factories
    **{n: (n, "") for n in ("full_like", "zeros_like", "ones_like", "new_full", "new_zeros", "new_ones",
                            "arange", "full", "scalar_tensor", "linspace", "eye")},
}


@functools.lru_cache(maxsize=None)
def opinfos() -> dict[str, Any]:
    """OPS's OpInfo entries by name[.variant]."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    by_name = {o.name + (f".{o.variant_test_name}" if o.variant_test_name else ""): o for o in op_db}
    return {name: by_name[name] for name in OPS}


_DTYPES = (torch.float32, torch.int64, torch.int32, torch.bool)
_HALF_DTYPES = (torch.float16, torch.int64, torch.int32, torch.bool)


def _leaves(sample) -> list[Any]:
    return pytree.tree_leaves((sample.input, sample.args, sample.kwargs))


def _usable(sample, kinds=_DTYPES) -> bool:
    """Non-empty tensors of dtypes every target writes, no other dtype asked for (a
    ``dtype=torch.float64`` keyword), rank <= 5."""
    leaves = _leaves(sample)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    dtypes = [d for d in leaves if isinstance(d, torch.dtype)]
    return all(t.numel() > 0 and t.dtype in kinds and t.dim() <= 5 for t in tensors) and \
        all(d in kinds for d in dtypes)


def _output_usable(opinfo, sample, kinds=_DTYPES) -> bool:
    """The op's outputs are non-empty tensors of dtypes every target writes."""
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = opinfo.op(sample.input, *sample.args, **sample.kwargs)
    except Exception:  # noqa: BLE001 - a sample torch itself rejects
        return False
    tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(t.numel() > 0 and t.dtype in kinds for t in tensors)


def samples(name: str, count: int, dtype: torch.dtype = torch.float32) -> list[Any]:
    """Up to ``count`` usable ``dtype`` samples of OpInfo ``name``, spread over its sample list
    (first, last, evenly between: the variants - strides, groups, modes - sit far apart).
    Samples whose tensors are all rank >= 1 come first: a rank-0 tensor is a corner case."""
    torch.manual_seed(0)
    opinfo = opinfos()[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dtype not in opinfo.supported_dtypes("cpu"):
            return []
        kinds = _DTYPES if dtype == torch.float32 else _HALF_DTYPES
        found = [s for s in opinfo.sample_inputs("cpu", dtype, requires_grad=False) if _usable(s, kinds)]
    found = [s for s in found if _output_usable(opinfo, s, kinds)]
    ranked = [s for s in found if all(t.dim() > 0 for t in _leaves(s) if isinstance(t, torch.Tensor))] or found
    if len(ranked) <= count:
        return ranked
    picks = sorted({round(i * (len(ranked) - 1) / max(count - 1, 1)) for i in range(count)})
    return [ranked[i] for i in picks]


class SampleModule(torch.nn.Module):
    """``op(sample.input, *sample.args, **sample.kwargs)`` with the chosen tensors as graph
    inputs and the others as buffers; Python values are baked in."""

    def __init__(self, op, sample, consts: str):
        super().__init__()
        self.op = op
        leaves, self.spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        n_input = len(pytree.tree_leaves(sample.input))
        self.leaves = leaves
        self.slots: list[int] = []
        self.inputs: list[torch.Tensor] = []
        self.buffer_slots: dict[int, str] = {}
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                continue
            const = (consts == "args" and i >= n_input) or (consts == "input" and i < n_input)
            if const:
                self.register_buffer(f"c{i}", leaf.clone())
                self.buffer_slots[i] = f"c{i}"
            else:
                self.slots.append(i)
                self.inputs.append(leaf.clone())

    def forward(self, *xs):
        filled = list(self.leaves)
        for i, x in zip(self.slots, xs):
            filled[i] = x
        for i, name in self.buffer_slots.items():
            filled[i] = getattr(self, name)
        inp, args, kwargs = pytree.tree_unflatten(filled, self.spec)
        return self.op(inp, *args, **kwargs)


@dataclass
class Outcome:
    status: str
    detail: str = ""
    samples: int = 0


_RANK = {"pass": 0, "decomposed": 1, "refused": 2, "n/a": 3, "export": 3, "runtime": 4, "wrong": 5, "crash": 6}


def _short(err: BaseException, limit: int = 240) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    # the source line is always this module's forward: drop it
    text = re.sub(r"; at File .*?\*\*kwargs\)\.?", ".", text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _outputs(y: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(y) if isinstance(t, torch.Tensor)]


def _matches(got: np.ndarray, want: torch.Tensor) -> str | None:
    """None when ``got`` equals torch's ``want`` within tolerance (1e-4 fp32, 1e-2 fp16:
    torch and the runtimes round fp16 differently), else why not."""
    tol = 1e-4 if want.dtype != torch.float16 else 1e-2
    want_np = want.detach().numpy() if want.dtype != torch.bool else want.numpy()
    if tuple(got.shape) != tuple(want_np.shape):
        return f"shape {list(got.shape)} instead of {list(want_np.shape)}"
    if want.dtype.is_floating_point:
        g, w = got.astype(np.float64), want_np.astype(np.float64)
        finite = np.isfinite(w)
        scale = max(1.0, float(np.abs(w[finite]).max(initial=0.0)))
        bad = ~np.isclose(g, w, rtol=tol, atol=tol * scale, equal_nan=True)
        if bad.any():
            return f"max abs error {float(np.nanmax(np.abs(g - w)[bad])):.3g} at scale {scale:.3g}"
        return None
    if got.dtype == np.bool_ or want_np.dtype == np.bool_:
        return None if np.array_equal(got.astype(bool), want_np.astype(bool)) else "boolean values differ"
    return None if np.array_equal(got.astype(np.int64), want_np.astype(np.int64)) else "integer values differ"


@contextlib.contextmanager
def _recording_decompositions(seen: set[str]):
    """Record the ops lowered through torch's decomposition table (no lowering of their own)."""
    from circleops.lowering import program

    original = program._decompose

    def recorded(ctx, node, args, kwargs):
        seen.add(str(node.target))
        return original(ctx, node, args, kwargs)

    program._decompose = recorded
    try:
        yield
    finally:
        program._decompose = original


def _run(target: str, path: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    from circleops.runtime import litert, onert, reference

    if target == "onert":
        return onert.run(path, inputs)
    if target == "tflite":
        return litert.run(path, inputs)
    return reference.run(path, inputs)


def run_sample(opinfo, sample, consts: str, targets=TARGETS, workdir: str | None = None,
               dtype: torch.dtype = torch.float32) -> dict[str, Outcome]:
    """One sample exported once, converted to each target, run and compared with torch."""
    from circleops.pipeline.convert import export, save
    from circleops.errors import CircleOpsError

    module = SampleModule(opinfo.op, sample, consts).eval()
    args = tuple(module.inputs)
    try:
        with torch.no_grad():
            want = _outputs(module(*args))
        ep = export(module, args, adapters=False)
    except Exception as err:  # noqa: BLE001 - torch.export's own failures are recorded, not ours
        return {t: Outcome("export", _short(err)) for t in targets}
    result = {}
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for target in targets:
            path = os.path.join(tmp, f"m.{'tflite' if target == 'tflite' else 'circle'}")
            decomposed: set[str] = set()
            try:
                with _recording_decompositions(decomposed):
                    save(ep, path, target=target, fuse="none", dtype=dtype)
            except CircleOpsError as err:
                result[target] = Outcome("refused", _short(err))
                continue
            except Exception as err:  # noqa: BLE001 - what the coverage measures
                result[target] = Outcome("crash", f"{type(err).__name__}: {_short(err)}")
                continue
            try:
                got = _run(target, path, [a.numpy() for a in args])
            except Exception as err:  # noqa: BLE001
                result[target] = Outcome("runtime", _short(err))
                continue
            why = f"{len(got)} outputs instead of {len(want)}" if len(got) != len(want) else None
            for i, (g, w) in enumerate(zip(got, want)):
                why = why or (lambda m: m and f"output {i}: {m}")(_matches(g, w))
            if why:
                result[target] = Outcome("wrong", why)
            else:
                result[target] = Outcome("decomposed" if decomposed else "pass", ", ".join(sorted(decomposed)))
    return result


def run_op(name: str, count: int = 2, targets=TARGETS, dtype: torch.dtype = torch.float32) -> dict[str, Outcome]:
    """The worst outcome over ``count`` samples of OpInfo ``name``, per target."""
    opinfo = opinfos()[name]
    consts = OPS[name][1]
    picked = samples(name, count, dtype)
    if not picked:
        return {t: Outcome("n/a", f"no {str(dtype)[6:]} sample with static non-empty tensors") for t in targets}
    worst: dict[str, Outcome] = {}
    exported = 0
    for sample in picked:
        outcome = run_sample(opinfo, sample, consts, targets, dtype=dtype)
        if all(o.status == "export" for o in outcome.values()):
            if not exported and sample is picked[-1]:
                return {t: o for t, o in outcome.items()}
            continue
        exported += 1
        for t, o in outcome.items():
            prev = worst.get(t)
            if prev is None or _RANK[o.status] > _RANK[prev.status]:
                worst[t] = o
    for o in worst.values():
        o.samples = exported
    return worst


EXPECTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "expected.json")


def load_expected() -> dict[str, dict[str, str]]:
    """The outcomes tests/coverage asserts (written by tools/coverage.py)."""
    if not os.path.exists(EXPECTED):
        return {}
    import json

    with open(EXPECTED) as f:
        return json.load(f)

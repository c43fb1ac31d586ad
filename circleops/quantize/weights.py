"""ir.Model pass: store linear weights (and the embedding table) as GGML blocks, in the form
onert 0.1.0 executes (shared/FACTS.md, "onert quantized weights"):

* FULLY_CONNECTED with a GGML_Q4_0 / GGML_Q8_0 weight [N, K], K % 32 == 0, a rank-2 input,
  no bias and no fused activation: a bias becomes an ADD and an activation its own op
  (onert drops an all-zero bias, fails on another, ignores the activation);
* a linear that target onert wrote as a 1x1 CONV_2D is written back as that FULLY_CONNECTED
  (onert runs GGML weights only there);
* q4_0 only: GATHER of a model parameter [V, H] (the embedding) as a GGML_Q4_0 table with
  int32 indices (onert fails on Q8_0 tables and int64 indices);
* q4_0 keeps the output head (a tied lm_head, or a parameter named ``lm_head.weight``) at
  GGML_Q8_0, as llama.cpp's q4_0 recipe keeps output.weight at a higher type: it alone cost
  SmolLM2 +6 % perplexity at 4 bits. A tied head then has two buffers (the Q4_0 table the
  GATHER reads, the Q8_0 weight of the FULLY_CONNECTED); ``q4_0-pure`` stores everything at
  4 bits, the tied lm_head sharing the embedding's one Q4_0 buffer;
* with ``importance`` (circleops.quantize.importance: each linear's mean square input over
  calibration text), Q4_0 block scales minimise the importance-weighted error
  (ggml.quantize_q4_0_weighted, same format); without, ggml's reference rounding.

``w8`` (circleops.quantize.int8) stores each linear weight as INT8 [N, K] with scale [1.0]
for onert's hybrid FULLY_CONNECTED (float input and output), then a MUL by the per-channel
scales [N] (onert reads only scale[0]), then the bias ADD and the activation as above, in
the same FULLY_CONNECTED form; any K; the embedding stays FLOAT32 (onert loads no INT8
GATHER table), so a tied lm_head gets its own INT8 weight. In a .tflite file (form
PER_CHANNEL: LiteRT's dynamic-range FULLY_CONNECTED, the weight carrying its per-row scales)
the table is that same INT8 tensor, read by an EMBEDDING_LOOKUP (which LiteRT dequantizes),
so a tied table and head are one buffer, as in litert-torch's int8 files.

It runs after lowering, on the IR, so it needs nothing from the lowering beyond the ops it
wrote. GGML weights whose K is not a multiple of 32 stay FLOAT32 and the report names them.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from circleops import ir
from circleops.errors import TargetError
from circleops.quantize import formats, ggml
from circleops.quantize.linears import is_f32_const as _is_f32_const
from circleops.quantize.linears import is_table as _is_table
from circleops.quantize.linears import linear_weight as _linear_weight
from circleops.quantize.linears import note_float_inputs
from circleops.quantize.topk_head import HEAD_ROLE
from circleops.system.memory import Pager
from circleops.system.snapshot import restore_read

_ACTIVATION_OPS = {1: "RELU", 2: "RELU_N1_TO_1", 3: "RELU6", 4: "TANH"}
_ACTIVATION_NAMES = {"RELU": 1, "RELU_N1_TO_1": 2, "RELU6": 3, "TANH": 4, "NONE": 0}

# A GGUF file's weights: source key -> (GGML dtype and its blocks, or another GGUF type
# name and None: requantized, and the report counts it)
Pretrained = dict[tuple, tuple[str, "np.ndarray | None"]]


@dataclass
class QuantizedWeight:
    name: str
    shape: tuple[int, ...]
    dtype: str  # GGML_Q4_0 / GGML_Q8_0 / INT8 (w8)
    origin: str  # "quantized" (reference rounding), "weighted" (importance-weighted Q4_0 scales) or "gguf"
    nbytes: int


@dataclass
class QuantReport:
    """What ``quantize_weights`` stored as GGML blocks (or w8's int8) and what it left in fp32."""

    format: str  # "q4_0" | "q4_0-pure" | "q8_0" | "w8"
    weights: list[QuantizedWeight] = field(default_factory=list)  # one per distinct weight
    kept_fp32: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)  # name, shape, why
    embedding: str | None = None  # the GATHER table stored as Q4_0, if any
    requantized_from: dict[str, int] = field(default_factory=dict)  # GGUF type -> tensors requantized
    requantized: dict[tuple[str, str], int] = field(default_factory=dict)  # (GGUF type, GGML type) -> tensors
    fp32_bytes: int = 0  # what the quantized weights took in fp32
    smoothing: str | None = None  # w8: what SmoothQuant folded (circleops.quantize.smooth.SmoothReport)
    form: str | None = None  # how the linears were written (formats.FORMS; None: the format's own form)
    # name -> (shape, why): linears stored at a higher type than the format's (int4: int8 per channel)
    fallbacks: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    # head name -> k: heads written two-stage (a 4-bit copy, the k best rescored: quantize.topk_head)
    two_stage: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # (torch source tensor, blocks, dtype, [N, K], "linear" | "table"): what verify swaps
        # into the torch model. Not a field: asdict() would deep-copy the weights.
        self.sources: list[tuple[torch.Tensor, np.ndarray, str, tuple[int, ...], str]] = []
        self.parameter_names: dict[tuple, str] = {}  # source_key -> parameter name
        self._counted: set = set()  # source keys already in fp32_bytes
        self.table_keys: set[tuple] = set()  # embedding tables the set's models look up (quantize_weights)
        # tied tables no graph looks up: the generator reads their rows from the quantized head
        # (circleops.package.split.PartBytes.head_rows), so verify's torch embedding does too
        self.host_tables: set[tuple] = set()

    @property
    def ggml_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights)

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "embedding": self.embedding,
                "weights": [vars(w) for w in self.weights],
                "kept_fp32": [{"name": n, "shape": list(s), "reason": r} for n, s, r in self.kept_fp32],
                "requantized_from": self.requantized_from, "fp32_bytes": self.fp32_bytes,
                "ggml_bytes": self.ggml_bytes, "higher_precision": [w.name for w in self.higher_precision],
                "smoothing": self.smoothing, "form": self.form or formats.get(self.format).form,
                "fallbacks": [{"name": n, "shape": list(s), "reason": r} for n, (s, r) in self.fallbacks.items()],
                "two_stage": dict(self.two_stage)}

    @property
    def format_entry(self) -> formats.WeightFormat:
        return formats.get(self.format)

    @property
    def higher_precision(self) -> list[QuantizedWeight]:
        """Weights stored at a higher type than the format's (q4_0's Q8_0 output head)."""
        return [w for w in self.weights if w.dtype != formats.get(self.format).tensor_type]

    def summary_lines(self) -> list[str]:
        fmt = formats.get(self.format)
        dtype = fmt.tensor_type
        form = self.form or fmt.form
        if form == formats.BLOCKWISE:
            from circleops.quantize import int4_tflite

            return int4_tflite.summary_lines(self) + ([self.smoothing] if self.smoothing else []) + self._kept_lines()
        if form == formats.HYBRID:
            dtype = "INT8 per channel (hybrid FULLY_CONNECTED + MUL by the scales)"
        elif form == formats.PER_CHANNEL:
            dtype = "INT8 per channel (dynamic-range FULLY_CONNECTED, the scales in the weight)"
        gguf = sum(w.origin == "gguf" for w in self.weights)
        higher = self.higher_precision
        count = f"{len(self.weights) - len(higher)} weights as {dtype}" + \
            "".join(f", {n} as {d}" for d, n in sorted(Counter(w.dtype for w in higher).items()))
        table = "INT8 per row, an EMBEDDING_LOOKUP" if form == formats.PER_CHANNEL else "GGML_Q4_0 (int32 ids)"
        lines = [f"{count} ({self.fp32_bytes / 1e6:.1f} MB fp32 -> "
                 f"{self.ggml_bytes / 1e6:.1f} MB)" + (f"; embedding {self.embedding} as {table}"
                                                       if self.embedding else "")]
        if higher:
            lines.append("kept at higher precision: the output head (lm_head) " + ", ".join(
                f"{w.name} {list(w.shape)} as {w.dtype}" for w in higher) + "; --quantize q4_0-pure stores it at 4 bits")
        weighted = sum(w.origin == "weighted" for w in self.weights)
        if weighted:
            lines.append(f"{weighted} GGML_Q4_0 weights with block scales fitted to their inputs' importance "
                         "(the shipped calibration text)")
        if gguf:
            lines.append(f"{gguf} carried over bit for bit from the GGUF file")
        for (src, to), n in sorted(self.requantized.items()):
            lines.append(f"{n} GGUF {src} tensors requantized to {to} from their dequantized values")
        if self.smoothing:
            lines.append(self.smoothing)
        return lines + self._kept_lines()

    def _kept_lines(self) -> list[str]:
        if not self.kept_fp32:
            return []
        names = ", ".join(f"{n} {list(s)} ({r})" for n, s, r in self.kept_fp32[:6])
        more = f" and {len(self.kept_fp32) - 6} more" if len(self.kept_fp32) > 6 else ""
        return [f"kept FLOAT32: {names}{more}"]


def input_rounding(report: QuantReport | None, runtime: str | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What ``runtime`` does to a quantized linear's float input before its integer product,
    as a float function (issue 32: torch on the file's own weights *and* the runtime's
    activation rounding is the reference a quantized file is verified against, so the
    tolerance no longer grows with the model's size and depth):

    * GGML blocks (q4_0, q8_0) on onert and the reference interpreter: the input in Q8_0
      blocks of 32 (circleops.quantize.ggml.quantize_q8_0_input; FACTS.md);
    * w8 written for onert's hybrid FULLY_CONNECTED (onert, reference): per row, symmetric
      int8 (circleops.quantize.int8.quantize_rows);
    * w8 and int4 in a TFLite file on LiteRT: XNNPACK's per-row asymmetric int8 (its qd8
      kernels; circleops.quantize.int8.quantize_rows_asymmetric); the reference interpreter
      runs those files' kernels the same way.

    None where the runtime computes in float (or ``runtime`` is None)."""
    if report is None or runtime is None:
        return None
    form = report.form or formats.get(report.format).form
    if form == formats.BLOCKS:
        return ggml.quantize_q8_0_input
    from circleops.quantize import int8

    if form == formats.HYBRID:
        def symmetric(x: torch.Tensor) -> torch.Tensor:
            xq, sx = int8.quantize_rows(x)
            return (xq.to(torch.float32) * sx)
        return symmetric
    if form in (formats.PER_CHANNEL, formats.BLOCKWISE):  # int4: XNNPACK's qd8-f32-qb4w / qc4w rows
        def asymmetric(x: torch.Tensor) -> torch.Tensor:
            xq, sx, _ = int8.quantize_rows_asymmetric(x)
            return (xq.to(torch.float32) * sx)
        return asymmetric
    return None


# How far another summation order moves a product's input: 16 fp32 ulps (sums of a few
# hundred terms in two orders differ by ~sqrt(K) ulps), enough to flip a runtime's rounding of
# that input one step the other way where it lies near a rounding boundary
NUDGE = 2.0 ** -20


# A quantized graph passes verify within its tolerance, or within this many times the model's
# own noise floor (how far its outputs move under the nudge; circleops.package.step): the
# runtime's summation order moves the inputs it rounds as the nudge does, so its error is
# another draw of the same difference (the Llama-3.2-1B shape, q4_0: onert 1.36, nudges of 1
# and 16 ulps 1.37-1.51; bench/results/31-scale-q4-depth.yaml)
NOISE_FLOORS = 2.0


def perturbed(rounding: Callable[[torch.Tensor], torch.Tensor], seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``rounding`` of the input nudged first (each element times 1 + u NUDGE, u uniform in
    [-1, 1], the same draws for a seed): verify's second reference. Where a model amplifies
    the few input roundings such a nudge flips (a deep random model does: a 1B Llama's logits
    move by 14 % of their range, as far as onert's own summation order moves them;
    bench/q4_depth.py), the two references' difference is the model's own noise floor."""
    g = torch.Generator().manual_seed(seed)

    def moved(x: torch.Tensor) -> torch.Tensor:
        u = torch.rand(x.shape, generator=g, dtype=torch.float32).mul_(2 * NUDGE).sub_(NUDGE).add_(1.0)
        return rounding(x * u)
    return moved


def _rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` over the rows [.., K] of ``x``, in x's shape and dtype."""
    return fn(x.reshape(-1, x.shape[-1])).reshape(x.shape).to(x.dtype)


class _RoundedInputs(torch.overrides.TorchFunctionMode):
    """Every ``F.linear`` whose weight is one of ``weights`` (by identity, or a view of one)
    gets its input through the runtime's rounding first: nn.Linear's forward and the fused
    ops' reference kernels (circle.attention's projections) alike."""

    def __init__(self, weights: dict[int, Callable[[torch.Tensor], torch.Tensor]]):
        super().__init__()
        self.weights = weights

    def _rounding(self, w: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self.weights.get(id(w)) or self.weights.get(id(getattr(w, "_base", None)))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and len(args) >= 2 and isinstance(args[0], torch.Tensor):
            fn = self._rounding(args[1])
            if fn is not None:
                args = (_rows(fn, args[0]), *args[1:])
            return func(*args, **kwargs)
        if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and \
                any(isinstance(a, torch.Tensor) and self._rounding(a) for a in args):
            from circleops.ops.registry import by_overload

            spec = by_overload(func)
            if spec is not None:  # a circleops op reading quantized weights: its reference kernel, seen through
                with self:
                    return spec.reference(*args, **kwargs)
        return func(*args, **kwargs)


def _decoded(codec: Any, blocks: Any, dtype: str, shape2d: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """The values of ``blocks`` in ``like``'s shape and dtype: written straight into a new
    float32 tensor (no float temporaries of the whole weight), else decoded and cast."""
    if like.dtype == torch.float32:
        return codec.decode_into(blocks, dtype, torch.empty(like.shape, dtype=torch.float32))
    return codec.decode(blocks, dtype, shape2d).reshape(like.shape).to(like.dtype)


def _weight_modules(model: torch.nn.Module) -> tuple[dict[int, torch.nn.Module], dict[tuple, list[torch.nn.Module]]]:
    """Each module's parent (by id), and the ``nn.Linear`` / ``nn.Embedding`` modules of
    ``model`` by their contiguous weight's (data pointer, size)."""
    parents: dict[int, torch.nn.Module] = {}
    by_weight: dict[tuple, list[torch.nn.Module]] = {}
    for module in model.modules():
        for child in module.children():
            parents.setdefault(id(child), module)
        w = getattr(module, "weight", None)
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and isinstance(w, torch.Tensor) \
                and w.is_contiguous():
            by_weight.setdefault((w.data_ptr(), w.numel()), []).append(module)
    return parents, by_weight


def _served_modules(entry: tuple, entries: list, modules: list[torch.nn.Module], hybrid: bool) -> list[torch.nn.Module]:
    """The modules among ``modules`` (those holding the entry's source weight) that compute
    on the entry's stored blocks (``hybrid``: a tied table stays float in the file)."""
    src, role = entry[0], entry[4]
    # a linear entry serves the Linears (and, with shared blocks, the tied Embedding; a head
    # whose rows the generator reads as the embeddings too: QuantReport.host_tables); a
    # table entry the Embeddings; a hybrid format's tied table stays float in the file
    chosen = [m for m in modules if (isinstance(m, torch.nn.Linear) if role == "linear" else
                                     isinstance(m, torch.nn.Embedding))]
    if role == "linear" and not hybrid and not any(e[4] == "table" and e[0].data_ptr() == src.data_ptr()
                                                   for e in entries):
        chosen += [m for m in modules if isinstance(m, torch.nn.Embedding)]
    # and a table whose blocks a tied head reads too (tflite int4: one INT8 table for the
    # lookup and the head): the head's Linear computes on them, its input rounded. Left
    # out, it ran on the checkpoint's fp32 values (not the file's), reading the whole
    # table's file pages back (the Gemma-3-1B shape: 1.2 GB beside the decoded lookup table)
    if role == "table" and not hybrid and not any(e[4] == "linear" and e[0].data_ptr() == src.data_ptr()
                                                  for e in entries):
        chosen += [m for m in modules if isinstance(m, torch.nn.Linear)]
    return chosen


@contextlib.contextmanager
def _lazy_modules(entries: list, model: torch.nn.Module | None, codec: Any, hybrid: bool,
                  rounding: Callable[[torch.Tensor], torch.Tensor] | None,
                  host_tables: set[tuple] = frozenset()) -> Iterator[list]:
    """The entries whose weight is a whole ``nn.Linear`` / ``nn.Embedding`` weight of
    ``model``: their stored weights are decoded while the module's parent runs (forward
    hooks: a fused op reads its children's weights in the parent's forward) and dropped
    after, so the reference holds no second copy of the model's weights (the in-place swap
    kept a clone of every weight and wrote the mapped ones: 2x the weights, issue 32); a
    quantized linear's input goes through ``rounding`` (:class:`_RoundedInputs`). Yields the
    entries left for the in-place swap."""
    if model is None:
        yield entries
        return
    parents, by_weight = _weight_modules(model)
    groups: dict[int, tuple[torch.nn.Module, list]] = {}
    rest = []
    for entry in entries:
        src = entry[0]
        modules = by_weight.get((src.data_ptr(), src.numel()), []) if src.is_contiguous() else []
        # a hybrid head whose rows are the generator's embeddings (host_tables) serves the table too
        chosen = _served_modules(entry, entries, modules, hybrid and source_key(src) not in host_tables)
        if not chosen:
            rest.append(entry)
            continue
        for m in chosen:
            # decoded while its parent runs (a fused op reads its children's weights), but an
            # embedding and a child of the model itself (the lm_head) while they run: the
            # model's whole forward would hold their tables decoded (1B: 2 x 1.05 GB, issue 32)
            parent = parents.get(id(m), m)
            if isinstance(m, torch.nn.Embedding) or parent is model:
                parent = m
            groups.setdefault(id(parent), (parent, []))[1].append((m, entry, m.weight))
    rounded: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}
    handles: list[Any] = []

    def hooks(parent: torch.nn.Module, members: list) -> None:
        def before(mod: torch.nn.Module, args: tuple) -> None:
            with torch.no_grad():
                for m, (_, blocks, dtype, shape2d, _), original in members:
                    values = _decoded(codec, blocks, dtype, shape2d, original)
                    m.weight = torch.nn.Parameter(values, requires_grad=False)
                    if rounding is not None and isinstance(m, torch.nn.Linear):
                        rounded[id(m.weight)] = rounding

        def after(mod: torch.nn.Module, args: tuple, out: Any) -> None:
            for m, _, original in members:
                rounded.pop(id(m.weight), None)
                m.weight = original

        handles.append(parent.register_forward_pre_hook(before))
        handles.append(parent.register_forward_hook(after))

    try:
        for parent, members in groups.values():
            hooks(parent, members)
        with _RoundedInputs(rounded) if rounding is not None else contextlib.nullcontext():
            yield rest
    finally:
        for h in handles:
            h.remove()
        for _, members in groups.values():  # a forward that raised skipped its after-hook
            for m, _, original in members:
                m.weight = original
        rounded.clear()


@contextlib.contextmanager
def dequantized_sources(report: QuantReport | None, model: torch.nn.Module | None = None,
                        runtime: str | None = None, perturb: int | None = None) -> Iterator[None]:
    """Inside: the torch weights the report quantized hold their dequantized values (what
    the file computes with), so torch is the reference for a quantized file; restored after.
    With ``runtime``, each quantized linear's input also goes through that runtime's
    activation rounding (:func:`input_rounding`); with ``perturb`` (a seed), that input
    nudged by a summation order's few ulps first (:func:`perturbed`).

    The weights of ``model``'s own Linear / Embedding modules are decoded as each module
    runs (no copy of the model's weights kept); any other source (a view a lowering made)
    is swapped in place, its old values kept until the end.

    A tied embedding stored twice (q4_0: the GATHER's Q4_0 table, the lm_head's Q8_0 weight;
    w8: the fp32 table, the lm_head's int8 weight) cannot hold both in one tensor: the shared
    tensor takes the lm_head's values and every ``nn.Embedding`` of ``model`` reading it gets
    its own tensor of the table's values. A tied table no graph stores (the report's
    ``host_tables``: the generator reads its rows from the head) takes the head's values in
    the ``nn.Embedding`` too, as the generator feeds them.
    """
    entries = report.sources if report is not None else []
    codec = formats.get(report.format).codec_module() if entries else None  # unpacks the format's types
    rounding = input_rounding(report, runtime) if entries else None
    if rounding is not None and perturb is not None:
        rounding = perturbed(rounding, perturb)
    heads = [e for e in entries if e[4] == HEAD_ROLE]  # a two-stage head's 4-bit copy: the head's hook reads it
    entries = [e for e in entries if e[4] != HEAD_ROLE]
    host = report.host_tables if report is not None else set()
    with _lazy_modules(entries, model, codec, bool(entries) and _hybrid(report), rounding, host) as rest:
        with _swapped_in_place(rest, report, model, codec), _two_stage_heads(heads, report, model, codec, rounding):
            yield


@contextlib.contextmanager
def _two_stage_heads(heads: list, report: QuantReport | None, model: torch.nn.Module | None, codec: Any,
                     rounding: Callable[[torch.Tensor], torch.Tensor] | None) -> Iterator[None]:
    """Inside: each ``nn.Linear`` of ``model`` reading a two-stage head's source computes the
    two-stage head (circleops.quantize.topk_head.install) on the file's 4-bit copy and INT8 rows."""
    from circleops.quantize import topk_head

    if not heads or model is None:
        yield
        return
    k = next(iter(report.two_stage.values()), formats.get(report.format).head_topk)
    _, by_weight = _weight_modules(model)
    with contextlib.ExitStack() as stack:
        for src, blocks, dtype, shape2d, _ in heads:
            for m in by_weight.get((src.data_ptr(), src.numel()), []):
                if isinstance(m, torch.nn.Linear):  # the blocks, decoded by slices as the head runs
                    stack.enter_context(topk_head.install(m, blocks, k, rounding))
        yield


@contextlib.contextmanager
def _swapped_in_place(entries: list, report: QuantReport | None, model: torch.nn.Module | None,
                      codec: Any) -> Iterator[None]:
    """The former swap, for the sources :func:`_lazy_modules` cannot decode as a module runs."""
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    swapped: list[tuple[torch.nn.Module, torch.nn.Parameter]] = []
    linear = {src.data_ptr(): dtype for src, _, dtype, _, role in entries if role == "linear"}
    workers = torch.get_num_threads()
    try:
        # whole weights on parallel workers, each on one intra-op thread: SmolLM2's 212
        # unpack-and-copy steps took 35 s as many small two-thread ops on busy cores
        with torch.no_grad(), ggml.one_thread(), _pool(workers if len(entries) > 1 else 1) as pool:
            def swap_in(entry: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
                """(the table's own values, None) for a split tied table, else (src, its old values)."""
                src, blocks, dtype, shape2d, role = entry
                if role == "table" and linear.get(src.data_ptr(), dtype) != dtype:
                    return codec.decode(blocks, dtype, shape2d).reshape(src.shape).to(src.dtype), None
                old = src.clone()
                if src.dtype == torch.float32 and src.is_contiguous():
                    codec.decode_into(blocks, dtype, src)
                else:
                    src.copy_(codec.decode(blocks, dtype, shape2d).reshape(src.shape))
                return src, old

            for (src, _, dtype, _, _), (values, old) in zip(entries, pool(swap_in, entries)):
                if old is not None:
                    saved.append((src, old))
                    # w8: a tied table stays fp32 in the file, its head int8 (unless the
                    # generator reads the table's rows from that head: host_tables)
                    if _hybrid(report) and source_key(src) not in report.host_tables:
                        for module in (model.modules() if model is not None else ()):
                            if isinstance(module, torch.nn.Embedding) and module.weight.data_ptr() == src.data_ptr():
                                swapped.append((module, module.weight))
                                module.weight = torch.nn.Parameter(old.reshape(module.weight.shape), requires_grad=False)
                    continue
                for module in (model.modules() if model is not None else ()):
                    if isinstance(module, torch.nn.Embedding) and module.weight.data_ptr() == src.data_ptr():
                        swapped.append((module, module.weight))
                        module.weight = torch.nn.Parameter(values, requires_grad=False)
        yield
    finally:
        with torch.no_grad(), ggml.one_thread():
            for src, old in reversed(saved):
                src.copy_(old)
        for module, weight in reversed(swapped):
            module.weight = weight


def _hybrid(report: QuantReport) -> bool:
    """Whether the report's format writes onert's hybrid int8 linears (HYBRID: an embedding
    table then stays float in the file while its tied head is quantized; PER_CHANNEL
    .tflite files store the table as the head's INT8 tensor)."""
    return (report.form or formats.get(report.format).form) == formats.HYBRID


@contextlib.contextmanager
def _pool(workers: int) -> Iterator[Callable]:
    """A ``map`` over ``workers`` threads (the builtin one for a single worker)."""
    if workers < 2:
        yield map
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers, thread_name_prefix="circleops-dequantize") as pool:
        yield pool.map


def source_key(data: Any) -> tuple | None:
    """Identifies a weight's memory whatever view of it a lowering made (a CONV_2D filter
    is a reshaped view of the linear's weight; a tied lm_head is the embedding table)."""
    if isinstance(data, torch.Tensor):
        if not data.is_contiguous():
            return None
        return ("torch", data.data_ptr(), data.numel(), str(data.dtype))
    if isinstance(data, np.ndarray) and data.flags.c_contiguous:
        return ("numpy", data.__array_interface__["data"][0], data.size, data.dtype.str)
    return None


class _Quantizer:
    def __init__(self, fmt: str, report: QuantReport, pretrained: Pretrained | None,
                 cache: dict[tuple, np.ndarray] | None, importance: dict[tuple, torch.Tensor] | None):
        self.format = formats.get(fmt)
        self.dtype = self.format.tensor_type
        self.head_dtype = self.format.head_type
        self.block = self.format.block
        form = report.form or self.format.form
        self.hybrid = form == formats.HYBRID
        self.per_channel = form == formats.PER_CHANNEL
        self.blockwise = form == formats.BLOCKWISE  # INT4 blocks for LiteRT (circleops.quantize.int4_tflite)
        self.codec_options = self.format.codec_options()
        self.codec = self.format.codec_module()  # packs the format's types (the head's too)
        self.pure = self.format.tied_table  # the embedding table's blocks serve a tied head too
        # the GATHER tables stored quantized: the format's (q4_0, int4), or w8's in a .tflite
        # file, where an INT8 table with per-row scales is an EMBEDDING_LOOKUP LiteRT dequantizes
        self.tables_quantized = self.format.embedding or self.per_channel
        self.report = report
        self.pretrained = pretrained or {}
        self.cache = cache if cache is not None else {}
        self.importance = importance or {}
        self.tables: set[tuple] = set()  # source keys of the embedding tables (a tied head's too)
        self.pending: dict[tuple, Any] = {}  # (source key, dtype) -> Future of _make's result
        self.pager = Pager()  # a mapped source weight leaves the resident set once encoded (issue 32)

    def fits(self, k: int) -> bool:
        """Whether a linear with inputs of length ``k`` can be stored in this format."""
        return k % self.block == 0

    def linear_dtype(self, w: ir.Tensor, k: int) -> str:
        """The type a linear's weight ``w`` with inputs of length ``k`` is stored as."""
        if self.head_dtype and self.is_head(w):
            return self.head_dtype
        if self.blockwise:
            from circleops.quantize import int4_tflite

            return int4_tflite.linear_dtype(k, self.format, self.name(w))
        return self.dtype

    def is_head(self, t: ir.Tensor) -> bool:
        """The output head: a linear reading an embedding table (tied), or lm_head.weight."""
        key = source_key(t.data)
        return (key is not None and key in self.tables) or self.name(t).endswith("lm_head.weight")

    def name(self, t: ir.Tensor) -> str:
        """The parameter ``t`` views (a lowering may have named a reshaped view otherwise)."""
        key = source_key(t.data)
        return self.report.parameter_names.get(key, t.name) if key is not None else t.name

    def _make(self, t: ir.Tensor, shape2d: tuple[int, ...], dtype: str, role: str) -> tuple[Any, str, str | None]:
        """(blocks, origin, the GGUF type they were requantized from or None); touches no
        shared state, so workers run it."""
        key = source_key(t.data)
        pre = self.pretrained.get(key) if key is not None else None
        if pre is not None and pre[0] == dtype and pre[1] is not None:
            return pre[1], pre[2] if len(pre) > 2 else "gguf", None  # a GGUF file's blocks, or GPTQ's (int4_gptq)
        data = t.data if isinstance(t.data, torch.Tensor) else torch.from_numpy(np.asarray(t.data))
        # a table's rows are read as they are: weighted by a linear's inputs only when a
        # tied head shares its blocks (q4_0-pure)
        imp = self.importance.get(key) if key is not None and (role in ("linear", HEAD_ROLE) or self.pure) else None
        if imp is not None and (not self.format.importance or dtype != self.dtype or imp.numel() != shape2d[-1]):
            imp = None
        blocks = self.codec.encode(data.reshape(shape2d), dtype, importance=imp, **self.codec_options)
        self.pager.release_tensor(data)
        return blocks, "quantized" if imp is None else "weighted", pre[0] if pre is not None else None

    def prefetch(self, jobs: Iterable[tuple[ir.Tensor, tuple[int, ...], str, str]], workers: int) -> None:
        """Start computing the blocks of ``jobs`` (tensor, [N, K], dtype, role) on ``workers``
        threads (torch and numpy release the GIL); ``blocks`` then takes each result in the
        graph's order, so the report and the file are the same as computed one by one."""
        if workers < 2:
            return
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(workers, thread_name_prefix="circleops-quantize")
        for t, shape2d, dtype, role in jobs:
            key = source_key(t.data)
            if key is not None and (key, dtype) not in self.cache and (key, dtype) not in self.pending:
                self.pending[(key, dtype)] = pool.submit(self._make, t, shape2d, dtype, role)
        pool.shutdown(wait=False)

    def blocks(self, t: ir.Tensor, shape2d: tuple[int, ...], dtype: str, role: str = "linear") -> np.ndarray:
        """``t``'s values as ``dtype`` blocks of ``shape2d``, computed once per source memory
        (the cache may be shared by several models: the prefill and decode graphs).
        role: "linear" (a FULLY_CONNECTED weight) or "table" (a GATHER's)."""
        key = source_key(t.data)
        if key is not None and (key, dtype) in self.cache:
            return self.cache[(key, dtype)]
        pending = self.pending.pop((key, dtype), None) if key is not None else None
        blocks, origin, requantized = pending.result() if pending is not None else self._make(t, shape2d, dtype, role)
        if requantized is not None:
            self.report.requantized_from[requantized] = self.report.requantized_from.get(requantized, 0) + 1
            pair = (requantized, dtype)
            self.report.requantized[pair] = self.report.requantized.get(pair, 0) + 1
        if key is not None:
            self.cache[(key, dtype)] = blocks
        # the blocks are the file's: a weight SmoothQuant folded in place takes its own values
        # back now (its written pages given back), not when the whole fold is undone
        restore_read(t.data)
        self.report.weights.append(QuantizedWeight(self.name(t), tuple(shape2d), dtype, origin, int(blocks.nbytes)))
        if key is None or key not in self.report._counted:
            self.report.fp32_bytes += int(np.prod(shape2d)) * 4
            if key is not None:
                self.report._counted.add(key)
        if isinstance(t.data, torch.Tensor):
            self.report.sources.append((t.data, blocks, dtype, tuple(shape2d), role))
        return blocks


def _parameter_test(parameters: Iterable[str] | None) -> Callable[[str], bool]:
    """Whether a constant's name is a parameter's (among ``parameters``; None: any "...weight")."""
    names = set(parameters) if parameters is not None else None
    return (lambda n: n in names) if names is not None else (lambda n: n.endswith("weight"))


def table_keys(model: ir.Model, parameters: Iterable[str] | None = None) -> set[tuple]:
    """The ``source_key`` of each embedding table ``model`` looks up (a GATHER table among
    ``parameters``, as :func:`quantize_weights` takes them)."""
    is_param = _parameter_test(parameters)
    keys = set()
    for sg in model.subgraphs:
        for op in sg.operators:
            if op.opcode == "GATHER" and _is_table(sg, op, is_param):
                key = source_key(sg.tensors[op.inputs[0]].data)
                if key is not None:
                    keys.add(key)
    return keys


def quantize_weights(model: ir.Model, fmt: str, *, parameters: Iterable[str] | None = None,
                     pretrained: Pretrained | None = None, cache: dict[tuple, np.ndarray] | None = None,
                     report: QuantReport | None = None,
                     importance: dict[tuple, torch.Tensor] | None = None,
                     file_format: str | None = None) -> QuantReport:
    """Store ``model``'s linear weights (and for q4_0 its embedding) as GGML blocks, in place.

    parameters: the model's parameters (names, or a name -> tensor dict, which also names
        each GGML tensor after the parameter it holds): only a GATHER table among them is
        an embedding (folded tables such as RoPE's cos/sin stay fp32). None: any constant
        table whose name ends in "weight".
    pretrained: blocks already in the asked format (a GGUF file's), by ``source_key`` of the
        torch parameter: written as they are instead of quantizing the float values.
    cache: shares blocks between several models (the prefill and decode graphs).
    importance: input-channel importances by ``source_key`` of the weight
        (circleops.quantize.importance.input_importance): Q4_0 weights with one get block
        scales fitted to it (ggml.quantize_q4_0_weighted); others the reference rounding.
    file_format: "circle" or "tflite", the file written (None: the format's own form):
        ``WeightFormat.form_for`` says how a linear is written there (w8 in a .tflite file:
        PER_CHANNEL, the weight carrying its scales, LiteRT's dynamic-range FULLY_CONNECTED).
    report: shared by the models of a set; its ``table_keys`` (:func:`table_keys` of every
        model, filled by the caller) are tables other models look up: a split model's last
        part holds the tied head and no table (the first part looks it up), and its head is
        stored at the format's head type all the same.
    """
    if fmt not in formats.names(formats.WEIGHTS):
        raise TargetError(f"quantize_weights: {fmt!r} is not a weight-only format "
                          f"({', '.join(formats.names(formats.WEIGHTS))})")
    report = report or QuantReport(fmt, form=formats.get(fmt).form_for(file_format))
    names = set(parameters) if parameters is not None else None
    if isinstance(parameters, dict):  # name -> tensor: GGML tensors are named after their parameter
        for name, value in parameters.items():
            key = source_key(value.detach() if isinstance(value, torch.Tensor) else value)
            if key is not None:
                report.parameter_names.setdefault(key, name)
    is_param = _parameter_test(names)
    q = _Quantizer(fmt, report, pretrained, cache, importance)
    kept: dict[str, tuple] = {}
    # the embedding tables first: a tied head reads one (in this model, or in another part of a split one)
    q.tables |= table_keys(model, names) | report.table_keys | report.host_tables

    # one worker per torch thread the caller allows, each on one intra-op thread (whole
    # weights in parallel instead of many small parallel ops: see ggml.one_thread)
    workers = torch.get_num_threads()
    with ggml.one_thread():
        q.prefetch((job for sg in model.subgraphs for job in _jobs(sg, q, is_param)), workers)
        for si, sg in enumerate(model.subgraphs):
            _quantize_subgraph(sg, q, is_param, kept)
            ir.prune_subgraph(model, si)  # the fp32 weights the GGML tensors replaced
    report.kept_fp32 = [(n, s, r) for n, (s, r) in kept.items()]
    return report


def _jobs(sg: ir.Subgraph, q: _Quantizer, is_param: Callable[[str], bool]) -> Iterator[tuple]:
    """The (tensor, [N, K], dtype, role) blocks _quantize_subgraph will ask for, in its order."""
    for op in sg.operators:
        if op.opcode == "GATHER" and q.tables_quantized:
            t = sg.tensors[op.inputs[0]]
            if _is_table(sg, op, is_param) and t.shape[1] % q.block == 0:
                yield t, tuple(t.shape), q.format.table_type or q.dtype, "table"
            continue
        lin = _linear_weight(sg, op)
        if lin is not None and q.fits(lin[1]):
            w = sg.tensors[lin[2]]
            yield w, (lin[0], lin[1]), q.linear_dtype(w, lin[1]), "linear"


def _quantize_subgraph(sg: ir.Subgraph, q: _Quantizer, is_param: Callable[[str], bool],
                       kept: dict[str, tuple]) -> None:
    """Rewrite the subgraph's linears and (q4_0) embedding; the replaced weights stay as
    unused tensors until prune."""
    if q.blockwise:
        from circleops.quantize import int4_tflite

        int4_tflite.rewrite_subgraph(sg, q, is_param, kept)
        return
    rw = _Rewrite(sg, q)
    new_ops: list[ir.Operator] = []
    for op in sg.operators:
        if op.opcode == "GATHER" and q.per_channel:
            new_ops.extend(_per_channel_lookup(sg, op, q, is_param, rw))
            continue
        if op.opcode == "GATHER" and q.format.embedding:
            new_ops.extend(_gather(sg, op, q, is_param, kept, ggml_tensor=rw.ggml_tensor, new_tensor=rw.new_tensor))
            continue
        lin = _linear_weight(sg, op)
        if lin is None:
            note_float_inputs(sg, op, is_param, kept)
            new_ops.append(op)
            continue
        new_ops.extend(rw.linear(op, lin, kept))
    sg.operators = new_ops


class _Rewrite:
    """One subgraph's weight tensors in the format (each written once, however many ops
    use it) and its linears rewritten over them."""

    def __init__(self, sg: ir.Subgraph, q: _Quantizer):
        self.sg, self.q = sg, q
        # (weight tensor index, dtype or kind, 2-D shape) -> its new tensor's index
        self.converted: dict[tuple[int, str, tuple], int] = {}

    def _tied_suffix(self, t: ir.Tensor, suffix: str) -> str:
        # a tied head beside its table (4-bit or fp32) gets a name of its own
        return suffix if source_key(t.data) in self.q.tables else ""

    def ggml_tensor(self, index: int, shape2d: tuple[int, int], dtype: str, role: str = "linear") -> int:
        key = (index, dtype, shape2d)
        if key not in self.converted:
            t = self.sg.tensors[index]
            blocks = self.q.blocks(t, shape2d, dtype, role)
            name = self.q.name(t)
            if dtype != self.q.dtype:
                name += self._tied_suffix(t, f"_{dtype[5:].lower()}")
            self.converted[key] = self.sg.add_tensor(ir.Tensor(name, shape2d, dtype, blocks))
        return self.converted[key]

    def int8_tensors(self, index: int, shape2d: tuple[int, int]) -> tuple[int, int]:
        """(the INT8 weight with scale [1.0], the FLOAT32 [N] scales of the MUL after it)."""
        key = (index, self.q.dtype, shape2d)
        if key not in self.converted:
            t = self.sg.tensors[index]
            packed = self.q.blocks(t, shape2d, self.q.dtype)
            name = self.q.name(t) + self._tied_suffix(t, "_int8")
            self.converted[key] = self.sg.add_tensor(ir.Tensor(name, shape2d, self.q.dtype, packed.q, ir.QuantParams(
                np.ones(1, np.float32), np.zeros(1, np.int64))))
            self.converted[(index, "scale", shape2d)] = self.sg.add_tensor(
                ir.Tensor(f"{name}_scale", (shape2d[0],), "FLOAT32", packed.scale))
        return self.converted[key], self.converted[(index, "scale", shape2d)]

    def int8_per_channel(self, index: int, shape2d: tuple[int, int], role: str = "linear") -> int:
        """The INT8 weight carrying its per-output-channel scales (quantized_dimension 0, zero
        points 0): TFLite's dynamic-range FULLY_CONNECTED, as LiteRT's own quantizer writes it;
        an embedding table's rows the same way (one tensor with its tied head)."""
        key = (index, "per_channel", shape2d)
        if key not in self.converted:
            t = self.sg.tensors[index]
            packed = self.q.blocks(t, shape2d, self.q.dtype, role)
            name = self.q.name(t)
            self.converted[key] = self.sg.add_tensor(ir.Tensor(name, shape2d, self.q.dtype, packed.q, ir.QuantParams(
                np.asarray(packed.scale, np.float32), np.zeros(shape2d[0], np.int64), 0)))
        return self.converted[key]

    def new_tensor(self, like: ir.Tensor, shape: tuple[int, ...], suffix: str, dtype: str | None = None) -> int:
        return self.sg.add_tensor(ir.Tensor(f"{like.name}_{suffix}", tuple(shape), dtype or like.dtype))

    def reshape(self, src: int, shape: tuple[int, ...], out: int | None = None) -> tuple[ir.Operator, int]:
        sg = self.sg
        shape_t = sg.add_tensor(ir.Tensor(f"{sg.tensors[src].name}_shape{len(sg.tensors)}", (len(shape),), "INT32",
                                          np.array(shape, dtype=np.int32)))
        if out is None:
            out = self.new_tensor(sg.tensors[src], shape, "2d")
        return ir.Operator("RESHAPE", [src, shape_t], [out], "ReshapeOptions", {"newShape": list(shape)}), out

    def linear(self, op: ir.Operator, lin: tuple[int, int, int], kept: dict[str, tuple]) -> list[ir.Operator]:
        """The ops that replace the linear ``op`` (its weight ``lin`` = (N, K, tensor index)):
        the op itself where the format does not apply (recorded in ``kept``)."""
        sg, q = self.sg, self.q
        n, k, wi = lin
        w = sg.tensors[wi]
        if not q.fits(k):
            kept[w.name] = ((n, k), f"K={k} is not a multiple of {q.block}")
            return [op]
        if q.per_channel and n == 1:  # one scale would read as onert's form (the interpreter's hybrid kernel)
            kept[w.name] = ((n, k), "one output channel")
            return [op]
        if q.per_channel:  # TFLite's dynamic-range FULLY_CONNECTED: the op as it was, its weight int8
            return [ir.Operator(op.opcode, [op.inputs[0], self.int8_per_channel(wi, (n, k)), *op.inputs[2:]],
                                list(op.outputs), op.options_type, dict(op.options), max(op.version, 5))]
        if q.hybrid:
            qi, scale_i = self.int8_tensors(wi, (n, k))
        else:
            qi, scale_i = self.ggml_tensor(wi, (n, k), q.head_dtype if q.head_dtype and q.is_head(w) else q.dtype), -1
        x_i, out_i = op.inputs[0], op.outputs[0]
        x, out = sg.tensors[x_i], sg.tensors[out_i]
        rows = int(np.prod(x.shape, dtype=np.int64)) // k
        pre: list[ir.Operator] = []
        if len(x.shape) != 2:
            r, x_i = self.reshape(x_i, (rows, k))
            pre.append(r)
        bias = op.inputs[2] if len(op.inputs) > 2 else -1
        if bias >= 0 and sg.tensors[bias].data is not None and not np.any(_numpy(sg.tensors[bias].data)):
            bias = -1  # all zero (the CONV_2D form always has one): onert drops it anyway
        act = op.options.get("fusedActivationFunction", 0) or 0
        act = _ACTIVATION_NAMES.get(act.upper(), act) if isinstance(act, str) else int(act)
        last = len(out.shape) == 2 and bias < 0 and not act  # the next op may write the output
        fc_out = out_i if last and scale_i < 0 else self.new_tensor(out, (rows, n), "fc")
        fc = ir.Operator("FULLY_CONNECTED", [x_i, qi, -1], [fc_out], "FullyConnectedOptions",
                         {"fusedActivationFunction": 0, "keepNumDims": False})
        return [*pre, fc, *self._after(fc_out, op, (rows, n), scale_i, bias, act)]

    def _after(self, y: int, op: ir.Operator, shape2d: tuple[int, int], scale_i: int, bias: int,
               act: int) -> list[ir.Operator]:
        """What follows the FULLY_CONNECTED: w8's scales, the bias, the activation, the
        reshape back to the op's output shape, each into the output when it is the last."""
        out_i = op.outputs[0]
        out = self.sg.tensors[out_i]
        post: list[ir.Operator] = []
        if scale_i >= 0:  # w8: the per-channel scales, which onert's hybrid FC cannot apply
            z = out_i if len(out.shape) == 2 and bias < 0 and not act else self.new_tensor(out, shape2d, "scaled")
            post.append(ir.Operator("MUL", [y, scale_i], [z], "MulOptions", {"fusedActivationFunction": 0}))
            y = z
        if bias >= 0:
            z = out_i if (len(out.shape) == 2 and not act) else self.new_tensor(out, shape2d, "bias")
            post.append(ir.Operator("ADD", [y, bias], [z], "AddOptions", {"fusedActivationFunction": 0}))
            y = z
        if act:
            if act not in _ACTIVATION_OPS:
                raise TargetError(f"{op.opcode} {out.name!r}: fused activation {act} has no separate op")
            z = out_i if len(out.shape) == 2 else self.new_tensor(out, shape2d, "act")
            post.append(ir.Operator(_ACTIVATION_OPS[act], [y], [z]))
            y = z
        if y != out_i:
            post.append(self.reshape(y, tuple(out.shape), out_i)[0])
        return post


def _per_channel_lookup(sg: ir.Subgraph, op: ir.Operator, q: _Quantizer, is_param: Callable[[str], bool],
                        rw: _Rewrite) -> list[ir.Operator]:
    """w8 in a .tflite file: the GATHER of an embedding table as an EMBEDDING_LOOKUP of the
    table's INT8 rows, each with its scale (a tied head's FULLY_CONNECTED reads the same
    tensor); any other GATHER as it is."""
    if not _is_table(sg, op, is_param):
        return [op]
    from circleops.quantize import int4_tflite

    return int4_tflite.lookup(sg, op, q, lambda index, shape2d, dtype, role: rw.int8_per_channel(index, shape2d, role))


def _gather(sg, op, q, is_param, kept, *, ggml_tensor, new_tensor) -> list[ir.Operator]:
    table_i, idx_i = op.inputs[0], op.inputs[1]
    t = sg.tensors[table_i]
    if not _is_table(sg, op, is_param):
        return [op]
    if t.shape[1] % q.block:
        kept[t.name] = (tuple(t.shape), f"row length {t.shape[1]} is not a multiple of {q.block}")
        return [op]
    q.report.embedding = q.report.embedding or q.name(t)
    qi = ggml_tensor(table_i, tuple(t.shape), q.dtype, "table")
    ops = []
    idx = sg.tensors[idx_i]
    if idx.dtype != "INT32":  # onert's Q4_0 GATHER takes int32 ids only
        if idx.data is not None:
            idx_i = sg.add_tensor(ir.Tensor(f"{idx.name}_i32", idx.shape, "INT32",
                                            _numpy(idx.data).astype(np.int32)))
        else:
            cast = new_tensor(idx, idx.shape, "i32", "INT32")
            ops.append(ir.Operator("CAST", [idx_i, ], [cast], "CastOptions",
                                   {"inDataType": idx.dtype, "outDataType": "INT32"}))
            idx_i = cast
    ops.append(ir.Operator("GATHER", [qi, idx_i], list(op.outputs), op.options_type or "GatherOptions",
                           dict(op.options)))
    return ops


def _numpy(data: Any) -> np.ndarray:
    return data.detach().cpu().numpy() if isinstance(data, torch.Tensor) else np.asarray(data)



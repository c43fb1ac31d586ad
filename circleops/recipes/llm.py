"""Prefill and decode graphs of a causal LM over a static KV cache, for ``circleops generate``.

    from circleops.recipes.llm import convert_graphs
    report = convert_graphs(model, "out/", target="onert", prefill_len=(64, 8), max_cache_len=256,
                            tokenizer=tokenizer, verify=True)

The graphs are one :class:`~circleops.adapters.decode.DecoderWithCache` step exported at
several sequence lengths:

* prefill (one per length N; the longest is ``prefill``, the others ``prefill_N``):
  ``input_ids [1, N]`` (a chunk of the prompt, right-padded to N when the whole prompt is
  shorter), ``pos [1]``, ``logits_row [1]`` and the caches in; ``logits [1, 1, V]`` of that
  one row (generation needs only the last prompt token's: the lm_head runs on one row) and
  the caches holding the N tokens out. Padding needs no mask of its own: the causal mask
  already hides it from the real tokens, and its cache slots are hidden from every later
  step by the decode mask (slot c visible iff c <= pos) and overwritten by the tokens
  decoded there.
* decode: ``input_ids [1, 1]``, ``pos [1]`` and the caches in; ``logits [1, 1, V]`` and the
  caches with that token's k/v written at ``pos`` out.

Caches are ``[1, C, Hkv, D]`` (ONE's layout, C = ``max_cache_len``), all k caches then all
v caches, one per layer, fp32 for an fp32 model.

``cache_update`` (manifest.json records it) says what the cache outputs are. "full": the
whole updated caches (``new_k_cache_i``), the next step's inputs. "rows" (the default where
attention is decomposed or a composite: targets onert and tflite): only the new tokens'
rows ``k_new_i``/``v_new_i`` [1, S, Hkv, D]; the caches are inputs only, and the Generator
writes the rows into its arrays at ``pos`` (llama.cpp's in-place form: a decode step no
longer reads and writes every slot of every cache, ~24 MB per SmolLM2 step at C = 256).
Target circle keeps "full": its ATTENTION builtin updates the caches in place itself.
Rows graphs take their caches head-major, k [1, Hkv, C, D] and v [1, Hkv, D, C]
(manifest ``cache_layout``): the operands BATCH_MATMUL reads in place, so no cache is
transposed per step either (slot-major, each step copied every cache into that layout).

Files: onert 0.1.0 runs subgraph 0 of a file and its Python API cannot select a signature
(measured: tests/generate/test_graphs.py), so target onert writes one file per graph
(prefill.circle, prefill_8.circle, decode.circle), each with the weights. Circle and TFLite
targets write one file with a signature per graph whose subgraphs share every weight
buffer: the reference interpreter and LiteRT run any signature. ``manifest.json`` records
which.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from circleops.dtypes import short_name
from circleops.errors import CircleOpsError, OutputError, TargetError, VerifyError
from circleops.generation.generator import GRAPH_THREAD_CAPS, cache_window, empty_caches, open_graph, store_caches
from circleops.package.manifest import (GRAPH_NAMES, LOGITS_ROW, MANIFEST, TOKENIZER_DIR, Manifest, graph_runtimes,
                                prefill_graph_name)
from circleops.options import CACHE_UPDATES, HEAD_MAJOR, SLOT_MAJOR
from circleops.quantize import INTEGER_FORMATS, WEIGHT_ONLY_FORMATS
from circleops.targets import PROFILES
from circleops.package import split

# The prefill graphs' lengths, longest first: a prompt runs through them in chunks
# (Generator.plan): long prompts in runs of the longest, short ones (and the remainder) in
# the short one. Measured by bench/ttft.py (bench/README.md).
DEFAULT_PREFILL_LENS = (64, 8)
DEFAULT_PREFILL_LEN = DEFAULT_PREFILL_LENS[0]
DEFAULT_MAX_CACHE_LEN = 512
# Which targets get one file per graph is TargetProfile.one_file_per_graph (onert: see the
# module docstring, and bench/onert_dynamic_seq.py for why one file with a dynamic sequence
# dimension does not work on onert 0.1.0 either).

Progress = Callable[[str], None]


# --------------------------------------------------------------------------- options

def parse_graph_names(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"prefill,decode"`` -> ("prefill", "decode"), in canonical order; unknown names refused."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    unknown = [n for n in names if n not in GRAPH_NAMES]
    if unknown or not names:
        raise TargetError(f"--graphs takes a comma-separated list of {', '.join(GRAPH_NAMES)}; got "
                          f"{','.join(names) or 'nothing'}. Use --graphs prefill,decode for circleops generate.")
    return tuple(n for n in GRAPH_NAMES if n in names)


def prefill_lengths(value: int | str | Sequence[int]) -> tuple[int, ...]:
    """``64``, ``"64,8"`` or ``(8, 64)`` -> the distinct prefill lengths, longest first."""
    items = value.split(",") if isinstance(value, str) else [value] if isinstance(value, int) else list(value)
    try:
        lengths = sorted({int(str(v).strip()) for v in items if str(v).strip()}, reverse=True)
    except ValueError:
        lengths = []
    if not lengths or lengths[-1] < 1:
        raise TargetError(f"--seq-len takes one prefill length or a comma-separated list (e.g. 64,8), each at least "
                          f"1; got {value!r}.")
    return tuple(lengths)


def check_lengths(prefill_len: int, max_cache_len: int, max_positions: int | None, source: str) -> None:
    """1 <= prefill length <= cache length <= the model's position limit."""
    if prefill_len < 1 or max_cache_len < 1:
        raise TargetError(f"--seq-len (prefill length, {prefill_len}) and --max-cache-len ({max_cache_len}) "
                          f"must be at least 1.")
    if prefill_len > max_cache_len:
        raise TargetError(f"the prefill length --seq-len {prefill_len} is larger than the cache, --max-cache-len "
                          f"{max_cache_len}: the prefill writes all its {prefill_len} slots into the cache. Use "
                          f"--max-cache-len >= --seq-len.")
    if max_positions is not None and max_cache_len > max_positions:
        raise TargetError(f"--max-cache-len {max_cache_len} is more than {source} supports "
                          f"(max_position_embeddings {max_positions}). Choose --max-cache-len <= {max_positions}.")


# --------------------------------------------------------------------------- build, export, lower

def decoder_step(model: Any, max_cache_len: int, cache_update: str = "full", cache_layout: str | None = None) -> Any:
    """The model as a :class:`DecoderWithCache` (fuses the model's modules in place); the
    cache layout defaults to head-major for "rows" (the caller owns the caches, so they can
    be kept in the layout the attention's products read without a copy)."""
    from circleops.adapters.decode import DecoderWithCache

    if cache_layout is None:
        cache_layout = HEAD_MAJOR if cache_update == "rows" else SLOT_MAJOR
    return DecoderWithCache(model, max_len=max_cache_len, cache_update=cache_update, cache_layout=cache_layout)


def default_cache_windows(target: str, prefill_len: int, max_cache_len: int, cache_update: str) -> tuple[int, ...]:
    """The cache windows the longest prefill is also written for: C/2, C/4, ... down to
    twice its length, where the graphs share one file's weights (not onert's file per graph)
    and return new rows (the caches are inputs only). Target tflite only: on LiteRT a 64-row
    SmolLM2 w8 chunk took 76 ms of CPU over 512 slots, 57 over 256, 51 over 128
    (bench/results/18-*.yaml); each window is one more session (its own packed weights)."""
    if cache_update != "rows" or PROFILES[target].one_file_per_graph or PROFILES[target].runtime != "litert":
        return ()
    windows, w = [], max_cache_len // 2
    while w >= 2 * prefill_len:
        windows.append(w)
        w //= 2
    return tuple(windows)


def check_windows(windows: Sequence[int] | None, target: str, prefill_len: int, max_cache_len: int,
                  cache_update: str) -> tuple[int, ...]:
    """``windows`` (None: :func:`default_cache_windows`) checked: each a whole number from the
    longest prefill length up to less than the cache length, with cache_update "rows"."""
    if windows is None:
        return default_cache_windows(target, prefill_len, max_cache_len, cache_update)
    windows = tuple(sorted(set(windows), reverse=True))
    if windows and cache_update != "rows":
        raise TargetError(f"cache_windows need cache_update='rows' (the caches are then inputs only); got "
                          f"{cache_update!r}.")
    bad = [w for w in windows if not isinstance(w, int) or isinstance(w, bool) or not prefill_len <= w < max_cache_len]
    if bad:
        raise TargetError(f"cache_windows {bad} out of range: each window is a whole number of cache slots from the "
                          f"longest prefill length ({prefill_len}) to less than the cache length ({max_cache_len}).")
    return windows


def parse_windows(text: str | None) -> tuple[int, ...] | None:
    """``--cache-windows``: None (the target's default), "none" -> (), "256,128" -> (256, 128)."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise TargetError(f"--cache-windows takes cache slot counts separated by commas (e.g. 256,128) or 'none'; "
                          f"got {text!r}.") from None


def windowed_step(step: Any, window: int) -> Any:
    """``step`` reading only the first ``window`` cache slots: the same modules and parameters
    (so the graphs share every weight), caches of ``window`` slots."""
    import copy

    narrow = copy.copy(step)
    narrow.max_len = int(window)
    return narrow


def default_cache_update(target: str) -> str:
    """"rows" unless the target writes attention as its in-place builtin (target circle's
    ATTENTION updates the caches itself: its graphs return them whole)."""
    from circleops.targets import BUILTIN

    return "full" if PROFILES[target].fused_form("ATTENTION") == BUILTIN else "rows"


def example_args(step: Any, graph: str, prefill_len: int) -> tuple:
    """Export inputs of ``graph``: token ids, pos, (prefill: the logits row,) zero caches."""
    import torch

    if graph == "prefill":
        ids = torch.zeros((1, prefill_len), dtype=torch.int64)
        row = torch.tensor([prefill_len - 1], dtype=torch.int64)
        return (ids, torch.tensor([0], dtype=torch.int64), row, *step.empty_caches())
    ids = torch.zeros((1, 1), dtype=torch.int64)
    return (ids, torch.tensor([prefill_len], dtype=torch.int64), *step.empty_caches())


def _save_generation_config(model: Any, out_dir: Path) -> None:
    """The model's generation_config.json next to the graphs: `circleops generate --sample`
    takes its temperature / top-k / top-p / repetition penalty as defaults."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return
    try:
        config.to_json_file(str(out_dir / "generation_config.json"))
    except OSError as err:
        raise OutputError(f"cannot write {out_dir / 'generation_config.json'}: {err}.") from None


def io_names(num_layers: int, graph: str = "decode", cache_update: str = "full") -> tuple[list[str], list[str]]:
    """Input and output names of ``graph``, in order. The prefill has one more input after
    ``pos``: ``logits_row``, the one row of the chunk whose logits it computes. The cache
    outputs are ``new_k_cache_i`` (whole caches) or, for ``cache_update="rows"``, ``k_new_i``."""
    caches = [f"k_cache_{i}" for i in range(num_layers)] + [f"v_cache_{i}" for i in range(num_layers)]
    row = [LOGITS_ROW] if graph == "prefill" else []
    if cache_update == "rows":
        outs = [f"{kv}_new_{i}" for kv in "kv" for i in range(num_layers)]
    else:
        outs = [f"new_{c}" for c in caches]
    return ["input_ids", "pos", *row, *caches], ["logits", *outs]


def export_graph(step: Any, graph: str, prefill_len: int) -> Any:
    """torch.export of one step at the graph's sequence length (errors as ExportError)."""
    import torch

    from circleops.adapters.decode import OneRowPrefill
    from circleops.pipeline.stages import export

    module = OneRowPrefill(step) if graph == "prefill" else step
    with torch.no_grad():
        return export(module, example_args(step, graph, prefill_len), adapters=False, warn_list=[])


def lower_step(ep: Any, graph: str, target: Any, num_layers: int, *, dtype: Any = None, kind: str | None = None,
               cache_update: str = "full", names: tuple[Sequence[str], Sequence[str]] | None = None) -> Any:
    """Lower one exported step; its subgraph is named ``graph`` and its signature key is
    ``graph`` with the io names of :func:`io_names` for ``kind`` ("prefill" or "decode";
    default: ``graph``'s own) and ``cache_update``, or ``names`` (inputs, outputs) when
    given. ``target``: a target's name, a TargetProfile, or the pipeline's Options
    (circleops.pipeline.stages)."""
    from circleops.pipeline import stages as pipeline
    from circleops.targets import profile

    opts = target if isinstance(target, pipeline.Options) else None
    pipeline.inline_fused_ops(ep, (opts.profile if opts is not None else profile(target)).graph_inline_ops)
    if opts is None:
        from circleops.lowering import lower_program

        model = lower_program(ep, target, dtype=dtype)
    else:
        model = pipeline.lower(ep, opts)
    sub = model.subgraphs[0]
    sub.name = graph
    ins, outs = names or io_names(num_layers, kind or ("decode" if graph == "decode" else "prefill"), cache_update)
    ins, outs = list(ins), list(outs)
    if len(sub.inputs) != len(ins) or len(sub.outputs) != len(outs):
        raise CircleOpsError(f"internal: the {graph} graph has {len(sub.inputs)} inputs and {len(sub.outputs)} "
                             f"outputs, expected {len(ins)} and {len(outs)}.")
    inputs = set(sub.inputs)
    for idx, name in zip(sub.inputs, ins):
        sub.tensors[idx].name = name
    for idx, name in zip(sub.outputs, outs):
        if idx not in inputs:  # an in-place cache update (Circle ATTENTION) outputs the input itself
            sub.tensors[idx].name = name
    sig = model.signatures[0]
    sig.key = graph
    sig.inputs = dict(zip(ins, sub.inputs))
    sig.outputs = dict(zip(outs, sub.outputs))
    return model


def merge_models(models: dict[str, Any]) -> Any:
    """One ir.Model holding every graph's subgraphs, one signature per graph.

    Constants keep their tensors (the model's parameters), so the writer stores each
    weight once and both subgraphs point at the same buffer.
    """
    from circleops import ir

    merged = ir.Model(description=" + ".join(f"{g}" for g in models) + " (circleops)")
    for graph, model in models.items():
        offset = len(merged.subgraphs)
        for sub in model.subgraphs:
            if offset:
                for op in sub.operators:
                    for key, value in list(op.options.items()):
                        # STABLEHLO_COMPOSITE's decomposition, IF/WHILE/CALL_ONCE bodies
                        if key.endswith("SubgraphIndex") and isinstance(value, int):
                            op.options[key] = value + offset
            merged.subgraphs.append(sub)
        for sig in model.signatures:
            merged.signatures.append(ir.Signature(sig.key, sig.subgraph_index + offset, sig.inputs, sig.outputs))
        merged.metadata.update(model.metadata)
    return merged


# --------------------------------------------------------------------------- convert

@dataclass
class GraphInfo:
    name: str
    file: str
    signature: str | None
    ops: dict[str, int]
    file_size: int
    inputs: list[tuple[str, list[int], str]]
    outputs: list[tuple[str, list[int], str]]
    max_abs_error: float | None = None
    part_files: list[str] | None = None  # a split graph's files, one per layer range (circleops.package.split)


@dataclass
class GraphsReport:
    """What ``convert_graphs`` wrote."""

    directory: str
    target: str
    dtype: str
    graphs: dict[str, GraphInfo]
    manifest: Manifest | None
    timings: dict[str, float] = field(default_factory=dict)
    verify_runtime: str | None = None
    verify_note: str | None = None  # why verify did not run on the target's own runtime
    tolerance: float | None = None
    source: str = ""
    quantization: Any = None  # circleops.quantize.weights.QuantReport when quantize= was given
    attention: str | None = None  # which layers' attention is decomposed, and why (DecoderWithCache.attention_note)

    def to_json(self) -> dict[str, Any]:
        """The report as plain data (``circleops convert --graphs --report``)."""
        from dataclasses import asdict

        return {"directory": self.directory, "target": self.target, "dtype": self.dtype, "source": self.source,
                "quantization": self.quantization.to_dict() if self.quantization is not None else None,
                "graphs": {g: asdict(info) for g, info in self.graphs.items()},
                "manifest": self.manifest.to_json() if self.manifest else None,
                "attention": self.attention, "verify_runtime": self.verify_runtime, "verify_note": self.verify_note, "tolerance": self.tolerance,
                "timings": {k: round(v, 3) for k, v in self.timings.items()}}

    @property
    def one_file_per_graph(self) -> bool:
        return len({g.file for g in self.graphs.values()}) > 1

    def summary(self) -> str:
        lines = [f"circleops: wrote {len(self.graphs)} graph(s) of {self.source or 'the model'} to {self.directory}/ "
                 f"(target {self.target}, {self.dtype})"]
        m = self.manifest
        if m is not None and m.parts:
            lines.append(f"  split: {len(m.parts)} consecutive files per graph (layers "
                         f"{', '.join(f'{a}-{b - 1}' for a, b in m.parts)}): each within the target's file limit; the "
                         f"first holds the embedding table, the last the lm_head, the generator passes the hidden state")
        if self.one_file_per_graph:
            lines.append(f"  files: one per graph: onert 0.1.0 runs only subgraph 0 of a file and cannot select a "
                         f"signature, so the weights are stored in each file")
        else:
            lines.append(f"  files: one file, a signature per graph, weights shared between them")
        width = max([8, *(len(g) for g in self.graphs)])
        for g in self.graphs.values():
            where = g.file + (f" [signature {g.signature}]" if g.signature else "")
            ops = ", ".join(f"{k} {v}" for k, v in sorted(g.ops.items(), key=lambda kv: -kv[1])
                            if k in ("RMS_NORM", "ROPE", "ATTENTION") or "composite" in k.lower() or "(" in k)
            lines.append(f"  {g.name:{width}s} {where}  {_mb(g.file_size)}  in: {_io(g.inputs)}  out: {_io(g.outputs)}")
            lines.append(f"  {'':{width}s} {sum(g.ops.values())} ops" + (f"; fused: {ops}" if ops else ""))
        if self.attention:
            lines.append(f"  attention: {self.attention}")
        if self.quantization is not None:
            lines += [f"  {'quantize:' if k == 0 else '':9} {line}"
                      for k, line in enumerate(self.quantization.summary_lines())]
        if self.manifest is not None:
            m = self.manifest
            lines.append(f"  manifest.json: prefill length{'s' if len(m.prefill_graphs) > 1 else ''} "
                         f"{', '.join(map(str, m.prefill_graphs))}, cache length {m.max_cache_len}, "
                         f"tokenizer {m.tokenizer or 'none'}, eos ids {m.eos_token_ids}")
        if self.verify_runtime:
            errs = ", ".join(f"{g.name} {g.max_abs_error:.3g}" for g in self.graphs.values() if g.max_abs_error is not None)
            lines.append(f"  verify ({self.verify_runtime}, against the model's own forward): max abs logit error "
                         f"{errs} (tolerance {self.tolerance:.3g}): passed")
            if self.verify_note:
                lines.append(f"  note: {self.verify_note}")
        lines.append("  time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.timings.items())
                     + f", total {sum(self.timings.values()):.1f} s")
        if set(GRAPH_NAMES) <= set(self.graphs):
            hint = "; for onert, convert with --target onert" if self.target == "circle" else ""
            lines.append(f"  next: circleops generate {self.directory} --prompt \"...\" (runtime "
                         f"{PROFILES[self.target].runtime}{hint})")
        return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _io(items: list[tuple[str, list[int], str]]) -> str:
    def is_row(name: str) -> bool:
        return name.startswith(("k_new_", "v_new_"))

    caches = [x for x in items if "cache" in x[0]]
    rows = [x for x in items if is_row(x[0])]
    rest = [f"{n} {s}" for n, s, _ in items if "cache" not in n and not is_row(n)]
    if caches:
        rest.append(f"{len(caches)} caches {caches[0][1]}")
    if rows:
        rest.append(f"{len(rows)} new cache rows {rows[0][1]}")
    return ", ".join(rest)


def _eos_ids(model: Any) -> list[int]:
    ids: list[int] = []
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if value is not None:
            ids += list(value) if isinstance(value, (list, tuple)) else [value]
    return sorted({int(i) for i in ids})


def _pad_id(model: Any, eos: list[int]) -> int:
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    return int(pad) if pad is not None else (eos[0] if eos else 0)


def _prepare_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"-o {out_dir} is a file; with --graphs, -o names a directory (e.g. -o out/).")
    parent = out_dir.parent if str(out_dir.parent) else Path(".")
    if not out_dir.exists():
        if not parent.is_dir():
            raise OutputError(f"cannot create {out_dir}: the directory {parent} does not exist. Create it first.")
        try:
            out_dir.mkdir()
        except OSError as err:
            raise OutputError(f"cannot create {out_dir}: {err.strerror}. Choose a directory you can write.") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write into {out_dir}: permission denied. Choose a directory you can write.")


def _staging_dir(out_dir: Path) -> Path:
    """A new directory beside ``out_dir`` where the whole output is built and verified
    before anything in ``out_dir`` changes (``.NAME.<pid>-<random>.tmp``: a later run removes
    those whose process died)."""
    from circleops.serialize.writer import default_dir_mode, remove_stale_temporaries, temp_prefix

    parent = out_dir.parent if str(out_dir.parent) else Path(".")
    remove_stale_temporaries(out_dir)
    try:
        staging = Path(tempfile.mkdtemp(prefix=temp_prefix(out_dir), suffix=".tmp", dir=parent))
        staging.chmod(default_dir_mode())  # mkdtemp's 0700 would survive the publish of new dirs
    except OSError as err:
        raise OutputError(f"cannot create a directory beside {out_dir}: {err.strerror or err}. "
                          "Choose an output directory whose parent you can write.") from None
    return staging


def _publish(staging: Path, out_dir: Path) -> None:
    """Move the complete, verified output from ``staging`` into ``out_dir``. The old
    manifest goes only now, and the new one is moved last: a reader never sees a manifest
    describing files that are not all there."""
    out_dir.mkdir(exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)
    for entry in sorted(staging.iterdir()):
        if entry.name == MANIFEST:
            continue
        dest = out_dir / entry.name
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        os.replace(entry, dest)
    os.replace(staging / MANIFEST, out_dir / MANIFEST)
    staging.rmdir()


def convert_graphs(model: Any, out_dir: str | os.PathLike, *, graphs: Sequence[str] = GRAPH_NAMES,
                   target: str = "onert", prefill_len: int | Sequence[int] = DEFAULT_PREFILL_LENS,
                   max_cache_len: int = DEFAULT_MAX_CACHE_LEN, tokenizer: Any = None,
                   verify: bool | str = False, tolerance: float | None = None, source: str = "",
                   progress: Progress | None = None, quantize: str | None = None,
                   threads: int | None = None, cache_update: str | None = None,
                   cache_windows: Sequence[int] | None = None, max_file_bytes: int | None = None,
                   onert_signatures: bool | None = None) -> GraphsReport:
    """Write ``model``'s prefill and/or decode graphs for ``target`` into ``out_dir``,
    with ``manifest.json`` and (when given) the tokenizer in ``out_dir/tokenizer``.

    ``prefill_len``: the prefill graph's length, or several (one prefill graph each; the
    longest is ``prefill``, the others ``prefill_N``): generation picks per chunk. Each
    prefill returns the logits of one row (its ``logits_row`` input), the last prompt
    token's, so a chunk pays for one row of the lm_head.
    ``model`` is a Hugging Face causal LM (Llama, Mistral, Phi3, Gemma, Qwen2/2.5, Qwen3, OLMo2,
    Gemma 2/3; see DecoderWithCache); it is fused in place. Layers whose attention
    circle.attention cannot express attend decomposed over the same caches (the report's
    ``attention`` line says which and why).
    ``verify``: run the written graphs (True: the target's default runtime, or name one)
    against the model's own forward: a prefill of a half-length prompt, then one decode
    step; raises VerifyError above ``tolerance`` x max(1, max|logit|).
    ``threads``: the onert NUM_THREADS the files are made for (as for :func:`circleops.convert`;
    default 1 with ``quantize``), recorded in the manifest: ``generate`` runs onert with it.
    ``quantize``: "q4_0" / "q8_0" GGML weights, as for :func:`circleops.convert`; the graphs
    share one set of blocks, and verify compares with the model running those weights
    dequantized.
    ``cache_update``: "rows" (the graphs return only the new k/v rows; the Generator writes
    them into its caches) or "full" (the whole updated caches); default
    :func:`default_cache_update` of the target.
    ``cache_windows``: cache windows W < ``max_cache_len`` for which the longest prefill is
    also written reading only the first W cache slots (graph ``prefill_cW``; a chunk at
    pos <= W runs it); default :func:`default_cache_windows`, ``()`` for none.
    ``max_file_bytes``: the most one file may hold (default: 2 GiB for a target whose runtime
    reads no weights after the flatbuffer, onert; no limit otherwise). A model whose weights
    pass it is written as consecutive files of a layer range each (circleops.package.split); the
    manifest's ``parts`` says which layers each holds.
    ``onert_signatures``: target onert writes one file with a signature per graph, sharing
    the weights, run through onert's C API (circleops.runtime.onert_c; manifest
    ``signature_api`` "nnfw-c"), instead of a file per graph. None (default): when the
    installed onert has that API (0.2.0.dev; not 0.1.0).
    """
    import torch

    from circleops.pipeline import stages as pipeline
    from circleops.runtime import choose_runtime
    from circleops.pipeline.validate import model_dtype, validate_quantize, validate_target_dtype, validate_threads

    graphs = parse_graph_names(graphs)
    if target not in PROFILES:
        raise TargetError(f"unknown target {target!r}: choose one of {', '.join(PROFILES)}.")
    profile = PROFILES[target]
    if cache_update is None:
        cache_update = default_cache_update(target)
    if cache_update not in CACHE_UPDATES:
        raise TargetError(f"cache_update takes one of {', '.join(CACHE_UPDATES)}; got {cache_update!r}.")
    torch_dtype = model_dtype(model) or torch.float32
    quantize = validate_quantize(quantize, target)
    if quantize in INTEGER_FORMATS:
        raise TargetError(f"quantize={quantize!r} makes an integer graph, which --graphs does not write: use one of "
                          f"{', '.join(WEIGHT_ONLY_FORMATS)} (weight-only), or circleops convert for an integer file")
    validate_target_dtype(target, torch_dtype, quantize)
    validate_threads(threads)
    if threads is None and quantize:
        threads = profile.quantized_threads  # the thread count quantized files are made for (the profile says)
    runtime, verify_note = None, None
    if verify:
        if verify is not True and str(verify) not in graph_runtimes(target):
            raise TargetError(f"runtime {verify} cannot run target {target}'s files; use one of "
                              f"{', '.join(graph_runtimes(target))}.")
        runtime, verify_note = choose_runtime(verify, target, quantize)  # GGML on a CPU without AVX-512
    config = getattr(model, "config", None)
    lengths = prefill_lengths(prefill_len)
    check_lengths(lengths[0], max_cache_len, getattr(config, "max_position_embeddings", None), source or "the model")
    check_lengths(lengths[-1], max_cache_len, None, source or "the model")
    # graph name -> (kind, length): every prefill length, then decode
    named = {prefill_graph_name(n, lengths): ("prefill", n) for n in lengths} if "prefill" in graphs else {}
    windows: dict[str, int] = {}
    if "prefill" in graphs:
        for w in check_windows(cache_windows, target, lengths[0], max_cache_len, cache_update):
            windows[f"{prefill_graph_name(lengths[0], lengths)}_c{w}"] = w
            named[f"{prefill_graph_name(lengths[0], lengths)}_c{w}"] = ("prefill", lengths[0])
    if "decode" in graphs:
        named["decode"] = ("decode", lengths[0])
    out_dir = Path(out_dir)
    fmt = profile.format
    per_graph = profile.one_file_per_graph and not signature_files(profile, onert_signatures)
    files = {g: (f"{g}.{fmt}" if per_graph else f"model.{fmt}") for g in named}
    max_file_bytes = file_limit(profile, max_file_bytes)
    parts = split_plan(model, quantize, max_file_bytes)  # sizes alone: before any work
    if parts:
        files = {g: split.part_file_name(g, 0, fmt, per_graph) for g in named}
    opts = pipeline.Options(target, torch_dtype, quantize=quantize, threads=threads, runtime=runtime,
                            tolerance=tolerance, functionalize=False)
    _prepare_dir(out_dir)
    staging = _staging_dir(out_dir)
    plan = GraphsPlan(named, lengths, max_cache_len, cache_update, files, tokenizer, source, staging, out_dir, windows,
                      parts, per_graph, max_file_bytes)
    tracker = pipeline.Tracker(progress)
    try:
        with contextlib.ExitStack() as restore:  # w8's SmoothQuant weights live until the files are written
            weights = pipeline.prepare_weights(model.eval(), opts, restore, tokenizer=tokenizer, tracker=tracker)
            report = _convert_graphs_into(model, plan, opts, weights, tracker)
        report.verify_note = verify_note
        _publish(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report.manifest.directory = out_dir
    return report


def graph_options(opts: Any, rows: int) -> Any:
    """The lowering options of a graph of ``rows`` rows: lowered for the thread count it runs
    at. A graph that generate runs at one thread on the target's runtime (fewer rows than
    circleops.generation.generator.GRAPH_THREAD_CAPS says: onert's 8-row prefill and decode) is lowered
    for one thread, which writes its multi-row linears FULLY_CONNECTED (pipeline.target_profile):
    SmolLM2's 8-row prefill took 0.66-0.85x the CPU so (bench/results/09-llm-speed.yaml)."""
    import dataclasses

    few_rows, cap = GRAPH_THREAD_CAPS.get(PROFILES[opts.target].runtime, (0, 0))
    if rows < few_rows and cap == 1 and opts.threads != 1:
        return dataclasses.replace(opts, threads=1)
    return opts


@dataclass
class GraphsPlan:
    """What convert_graphs writes: the graphs, their lengths and files, and where."""

    graphs: dict[str, tuple[str, int]]  # graph name -> (kind: "prefill" / "decode", sequence length)
    lengths: tuple[int, ...]  # the prefill lengths, longest first
    max_cache_len: int
    cache_update: str
    files: dict[str, str]  # graph name -> file name
    tokenizer: Any
    source: str
    out_dir: Path  # where the files are written (the staging directory)
    final_dir: Path  # where they are published
    windows: dict[str, int] = field(default_factory=dict)  # windowed prefill graph -> its cache window W
    parts: list[tuple[int, int]] = field(default_factory=list)  # split: each file's layer range ([]: not split)
    per_graph_files: bool = True  # a file (or a part's file) per graph, else one with a signature per graph
    max_file_bytes: int | None = None  # the most one file may hold (split parts are planned within it)

    def programs(self) -> dict[str, tuple[str, int | None]]:
        """The programs to export and lower: program name -> (graph, part index or None)."""
        if not self.parts:
            return {g: (g, None) for g in self.graphs}
        return {split.part_graph_name(g, j): (g, j) for g in self.graphs for j in range(len(self.parts))}

    def program_file(self, graph: str, part: int | None) -> str:
        if part is None:
            return self.files[graph]
        fmt = Path(self.files[graph]).suffix.lstrip(".")
        return split.part_file_name(graph, part, fmt, self.per_graph_files)


def signature_files(profile: Any, wanted: bool | None) -> bool:
    """Whether a target that writes a file per graph (onert) writes one file with a signature
    per graph instead: ``wanted``, or (None) when the installed onert selects signatures through
    its C API (circleops.runtime.onert_c: onert 0.2.0.dev; 0.1.0 cannot)."""
    if not profile.one_file_per_graph or profile.runtime != "onert" or wanted is False:
        return False
    if wanted:
        return True
    from circleops.runtime import onert_c

    return onert_c.available()


def file_limit(profile: Any, max_file_bytes: int | None) -> int | None:
    """The most one file may hold: ``max_file_bytes``, else 2 GiB where the target's runtime
    reads no weights after the flatbuffer (onert), else no limit (None)."""
    from circleops.serialize.writer import FLATBUFFER_LIMIT

    if max_file_bytes is None:
        return None if profile.weights_after_flatbuffer else FLATBUFFER_LIMIT
    if isinstance(max_file_bytes, bool) or not isinstance(max_file_bytes, int) or max_file_bytes < 1:
        raise TargetError(f"max_file_bytes must be a positive whole number of bytes; got {max_file_bytes!r}.")
    return max_file_bytes


def split_plan(model: Any, quantize: str | None, max_file_bytes: int | None) -> list[tuple[int, int]]:
    """The layer ranges of a split model's files ([]: one file holds it): past ``max_file_bytes``."""
    ranges = split.plan_parts(split.part_bytes(model, quantize), max_file_bytes)
    return ranges if len(ranges) > 1 else []


def _convert_graphs_into(model: Any, plan: GraphsPlan, opts: Any, weights: Any, tracker: Any) -> GraphsReport:
    """convert_graphs' work, written into ``plan.out_dir`` (the staging directory): export
    each graph, then the pipeline (circleops.pipeline.stages.build), the write and verify."""
    from circleops.pipeline import stages as pipeline
    from circleops.quantize.weights import dequantized_sources

    timings = tracker.timings
    references = None
    if opts.runtime is not None and not opts.quantize:  # the model's own forward, before its modules are fused
        with tracker.stage("torch reference logits", "verify", enter=False):
            references = _verify_references(model, plan.lengths)
    with tracker.stage("export"):
        step = decoder_step(model, plan.max_cache_len, plan.cache_update)
        eps = {name: _export_program(windowed_step(step, plan.windows[g]) if g in plan.windows else step, plan, g, j)
               for name, (g, j) in plan.programs().items()}

    def lower_one(name: str, ep: Any) -> Any:
        g, j = plan.programs()[name]
        kind, n = plan.graphs[g]
        names = None if j is None else split.part_io_names(kind, *plan.parts[j], step.num_layers, plan.cache_update)
        return lower_step(ep, g, graph_options(opts, n if kind == "prefill" else 1), step.num_layers,
                          kind=kind, cache_update=plan.cache_update, names=names)

    built = pipeline.build(eps, opts, weights, tracker, lower_one=lower_one)
    lowered = built.models
    del eps, built
    if opts.runtime is not None and weights.report is not None:
        # the model's forward (fused by now: same numerics) on the weights the files hold
        with tracker.stage("torch reference logits", "verify", enter=False), dequantized_sources(weights.report, model, opts.runtime):
            references = _verify_references(model, plan.lengths)

    with tracker.stage("write"):
        infos = _write_graphs(lowered, plan, opts, step.num_layers)
        del lowered
        manifest = _write_manifest(model, plan, opts, step, infos)
    report = GraphsReport(directory=str(plan.final_dir), target=opts.target, dtype=manifest.dtype, graphs=infos,
                          manifest=manifest, timings=timings, source=plan.source, quantization=weights.report,
                          attention=step.attention_note())
    if opts.runtime is not None:
        tol = opts.verify_tolerance()
        tol = pipeline.format_tolerance(None, opts.dtype) if tol is None else tol
        pipeline.release_weights()  # written and referenced: the runtime's child needs the memory now
        with tracker.stage("verify"):
            errors = _verify(manifest, plan.graphs, opts.runtime, references, tol)
        for g, err in errors.items():
            infos[g].max_abs_error = err
        report.verify_runtime, report.tolerance = opts.runtime, tol
    manifest.write()
    return report


def _export_program(step: Any, plan: GraphsPlan, graph: str, part: int | None) -> Any:
    """torch.export of one graph, or of one part of it (a split model's layer range)."""
    import torch

    from circleops.pipeline.stages import export

    kind, n = plan.graphs[graph]
    if part is None:
        return export_graph(step, kind, n)
    start, stop = plan.parts[part]
    module = split.part_module(step, kind, start, stop)
    with torch.no_grad():
        return export(module, split.part_example_args(step, kind, n, start, stop), adapters=False, warn_list=[])


def _write_graphs(lowered: dict[str, Any], plan: GraphsPlan, opts: Any, num_layers: int) -> dict[str, GraphInfo]:
    """Write the lowered graphs into their files (one per graph, or one with a signature
    per graph, as the target profile says); every file fits its target before the first is
    written."""
    from circleops.pipeline import stages as pipeline

    one_file_per_graph = plan.per_graph_files
    programs = plan.programs()
    groups: dict[str, dict[str, Any]] = {}
    for name, m in lowered.items():
        groups.setdefault(plan.program_file(*programs[name]), {})[name] = m
    files_ir = {file: next(iter(members.values())) if len(members) == 1 and one_file_per_graph
                else merge_models(members) for file, members in groups.items()}
    for file, one in files_ir.items():
        pipeline.check_size(one, opts.profile)
        split.check_part_size(one, plan.max_file_bytes, file)
    infos: dict[str, GraphInfo] = {}
    written: dict[str, int] = {}
    for file, members in groups.items():
        info = pipeline.write(files_ir[file], plan.out_dir / file, opts)
        written[file] = info.file_bytes
        for g, m in members.items():
            if programs[g][1] is not None:
                continue  # a split graph's parts: one GraphInfo of the whole, below
            sub = m.subgraphs[0]
            infos[g] = GraphInfo(
                name=g, file=file, signature=None if one_file_per_graph else g,
                ops=pipeline.op_histogram(m), file_size=info.file_bytes,
                inputs=[(sub.tensors[i].name, list(sub.tensors[i].shape), sub.tensors[i].dtype) for i in sub.inputs],
                outputs=[(n, list(sub.tensors[i].shape), sub.tensors[i].dtype)
                         for n, i in zip(io_names(num_layers, plan.graphs[g][0], plan.cache_update)[1], sub.outputs)])
    if plan.parts:
        for g in plan.graphs:
            infos[g] = _split_info(g, [lowered[split.part_graph_name(g, j)] for j in range(len(plan.parts))], plan,
                                   written, None if one_file_per_graph else g)
    return infos


def _split_info(graph: str, models: list[Any], plan: GraphsPlan, written: dict[str, int],
                signature: str | None) -> GraphInfo:
    """The GraphInfo of a split graph: its parts' files, bytes and ops together; inputs and
    outputs those of the one graph the parts replace (circleops.runtime.chain)."""
    from collections import Counter

    from circleops.pipeline import stages as pipeline

    files = [plan.program_file(graph, j) for j in range(len(models))]
    ops: Counter = Counter()
    ins: dict[str, tuple] = {}
    outs: dict[str, tuple] = {}
    for j, m in enumerate(models):
        ops.update(pipeline.op_histogram(m))
        sub = m.subgraphs[0]
        names = split.part_io_names(plan.graphs[graph][0], *plan.parts[j], plan.parts[-1][1], plan.cache_update)
        for name, i in zip(names[0], sub.inputs):
            ins.setdefault(name, (name, list(sub.tensors[i].shape), sub.tensors[i].dtype))
        for name, i in zip(names[1], sub.outputs):
            outs.setdefault(name, (name, list(sub.tensors[i].shape), sub.tensors[i].dtype))
    want_in, want_out = io_names(plan.parts[-1][1], plan.graphs[graph][0], plan.cache_update)
    return GraphInfo(name=graph, file=files[0], signature=signature, ops=dict(ops),
                     file_size=sum(written[f] for f in dict.fromkeys(files)),
                     inputs=[ins[n] for n in want_in], outputs=[outs[n] for n in want_out], part_files=files)


def _write_manifest(model: Any, plan: GraphsPlan, opts: Any, step: Any, infos: dict[str, GraphInfo]) -> Manifest:
    """The tokenizer, generation_config.json and the Manifest (written last, by the caller)."""
    out_dir = plan.out_dir
    tokenizer_dir = None
    if plan.tokenizer is not None:
        try:
            plan.tokenizer.save_pretrained(str(out_dir / TOKENIZER_DIR))
        except OSError as err:
            raise OutputError(f"cannot save the tokenizer into {out_dir / TOKENIZER_DIR}: {err}.") from None
        tokenizer_dir = TOKENIZER_DIR
    _save_generation_config(model, out_dir)
    eos = _eos_ids(model)
    ins, outs = io_names(step.num_layers, "decode", plan.cache_update)
    config = model.config
    return Manifest(
        directory=out_dir, target=opts.target, dtype=short_name(opts.dtype),
        files={g: plan.files[g] for g in plan.graphs}, signatures={g: infos[g].signature for g in plan.graphs},
        prefill_len=plan.lengths[0], prefill_lens=list(plan.lengths),
        prefill_inputs=io_names(step.num_layers, "prefill")[0],
        max_cache_len=plan.max_cache_len, num_layers=step.num_layers,
        cache_shape=list(step.cache_shape), cache_layout=step.cache_layout, vocab_size=int(config.vocab_size),
        inputs=ins, outputs=outs,
        eos_token_ids=eos, pad_token_id=_pad_id(model, eos), tokenizer=tokenizer_dir, source=plan.source,
        quantize=opts.quantize, num_threads=opts.threads, cache_update=plan.cache_update,
        prefill_windows={g: [plan.graphs[g][1], w] for g, w in plan.windows.items()} or None,
        parts=[list(r) for r in plan.parts] or None,
        signature_api="nnfw-c" if opts.profile.one_file_per_graph and not plan.per_graph_files else None,
        part_files={g: infos[g].part_files for g in plan.graphs} if plan.parts else None)


# --------------------------------------------------------------------------- verify

@dataclass
class _References:
    ids: Any  # [P + 1] int64
    logits: Any  # [P + 1, V]: the model's logits of every prefix of ``ids``


def _verify_references(model: Any, lengths: Sequence[int]) -> _References:
    """The model's own (HF, no cache) logits over one token sequence: each prefill graph
    of length L is checked on its first max(1, L // 2) tokens (a right-padded chunk), and
    the decode step on the token after them. Causal, so one forward gives every prefix."""
    import torch

    from circleops.sources.models import example_token_ids

    p = max(1, max(lengths) // 2)
    ids = example_token_ids(p + 1, int(model.config.vocab_size))[0]
    with torch.no_grad():
        logits = model(input_ids=ids[None], use_cache=False).logits[0].float().numpy()
    return _References(ids, logits)


def _verify(manifest: Manifest, graphs: Sequence[str], runtime: str, refs: _References, tol: float) -> dict[str, float]:
    """Max abs logit error per graph; VerifyError above tol x max(1, max|logit|).

    Each prefill graph of length L runs the first p = max(1, L // 2) tokens from pos 0 (the
    logits of token p - 1); then, when there is a decode graph, one decode step at p (the
    logits of token p), which reads every key and value the prefill wrote. A decode graph
    alone is checked as the first token at pos 0 on empty caches.
    """
    import numpy as np

    ids = [int(i) for i in refs.ids]
    errors: dict[str, float] = {}
    wants: dict[str, Any] = {}
    # isolated: a runtime crash on a written graph is reported, not fatal (issue 24). One
    # runtime child at a time (each holds the file's weights): the decode step runs last, on
    # the caches the longest prefill wrote
    after: tuple[list, int] | None = None
    zeros = empty_caches(manifest)
    for n, g in manifest.prefill_graphs.items():
        if g not in graphs:
            continue
        p = max(1, n // 2)
        buf = np.full((1, n), manifest.pad_token_id, dtype=np.int64)
        buf[0, :p] = ids[:p]
        caches = [z.copy() for z in zeros]
        outs = open_graph(manifest, g, runtime, isolated=True).run([buf, np.zeros(1, np.int64), np.array([p - 1], np.int64), *caches])
        errors[g], wants[g] = float(np.abs(outs[0][0, 0] - refs.logits[p - 1]).max()), refs.logits[p - 1]
        if "decode" in graphs and after is None:  # after the longest prefill
            after = (store_caches(caches, outs[1:], 0, manifest.cache_update, manifest.cache_layout), p)
        del outs
    for g, (n, w) in manifest.windowed_prefills.items():  # the same chunk at pos 0, reading W slots
        if g not in graphs:
            continue
        p = max(1, n // 2)
        buf = np.full((1, n), manifest.pad_token_id, dtype=np.int64)
        buf[0, :p] = ids[:p]
        caches = [np.ascontiguousarray(c) for c in cache_window(zeros, w, manifest.cache_layout)]
        outs = open_graph(manifest, g, runtime, isolated=True).run([buf, np.zeros(1, np.int64), np.array([p - 1], np.int64), *caches])
        errors[g], wants[g] = float(np.abs(outs[0][0, 0] - refs.logits[p - 1]).max()), refs.logits[p - 1]
    if "decode" in graphs:
        decode = open_graph(manifest, "decode", runtime, isolated=True)
        if after is not None:
            caches, p = after
            step = decode.run([np.array([[ids[p]]], np.int64), np.array([p], np.int64), *caches])[0][0, 0]
            errors["decode"], wants["decode"] = float(np.abs(step - refs.logits[p]).max()), refs.logits[p]
        else:
            out = decode.run([np.array([ids[:1]], np.int64), np.zeros(1, np.int64), *zeros])[0][0, 0]
            errors["decode"], wants["decode"] = float(np.abs(out - refs.logits[0]).max()), refs.logits[0]
        del decode  # its child ends (IsolatedSession.__del__)
    _check_errors(errors, wants, runtime, tol, manifest)
    return errors


def _check_errors(errors: dict[str, float], refs: dict[str, Any], runtime: str, tol: float, manifest: Manifest) -> None:
    import numpy as np

    for g, err in errors.items():
        scale = max(1.0, float(np.abs(refs[g]).max()))
        if not err <= tol * scale:
            raise VerifyError(
                f"the written {g} graph does not match the model: {runtime} gives max abs logit error {err:.3g} "
                f"(tolerance {tol:.3g} x {scale:.3g}); nothing was written (an earlier output there is unchanged). Convert "
                f"without --verify to inspect them (circleops inspect), and report the model.")


# the output directory's life cycle and the model's token ids, shared by the other graph
# writers (circleops.recipes.speech, circleops.recipes.vlm): a directory that exists or can be made, a staging
# directory beside it, the publish of a complete output
prepare_output_dir = prepare_dir = _prepare_dir
staging_dir, publish, eos_ids, pad_id = _staging_dir, _publish, _eos_ids, _pad_id

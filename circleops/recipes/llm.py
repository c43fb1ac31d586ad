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

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from circleops.dtypes import short_name
from circleops.errors import OutputError, TargetError
from circleops.generation.generator import cache_window, empty_caches, open_graph, store_caches
from circleops.options import CACHE_UPDATES, DEFAULT_PREFILL_LENS, HEAD_MAJOR, SLOT_MAJOR, ConvertOptions
from circleops.package import split, step as package_step
from circleops.package.manifest import GRAPH_NAMES, LOGITS_ROW, TOKENIZER_DIR, Manifest, prefill_graph_name
from circleops.package.report import GraphsReport
from circleops.package.step import Graph
from circleops.recipes.base import Recipe, pad_token_id, save_generation_config
from circleops.targets import PROFILES

DEFAULT_PREFILL_LEN = DEFAULT_PREFILL_LENS[0]
# Which targets get one file per graph is TargetProfile.one_file_per_graph (onert: see the
# module docstring, and bench/onert_dynamic_seq.py for why one file with a dynamic sequence
# dimension does not work on onert 0.1.0 either).


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

def positions_of(config: Any, max_cache_len: int) -> int | None:
    """The model's positions for the manifest (its config's max_position_embeddings), or None
    when the config names none or names fewer than the cache holds (the manifest reader's rule)."""
    p = getattr(config, "max_position_embeddings", None)
    return p if isinstance(p, int) and not isinstance(p, bool) and p >= max_cache_len else None


def decoder_step(model: Any, max_cache_len: int, cache_update: str = "full", cache_layout: str | None = None,
                 rope_tables: bool = False) -> Any:
    """The model as a :class:`DecoderWithCache` (fuses the model's modules in place); the
    cache layout defaults to head-major for "rows" (the caller owns the caches, so they can
    be kept in the layout the attention's products read without a copy). ``rope_tables``:
    cos/sin gathered by position from tables of every cache slot (the integer graphs': no
    position or angle is quantized with a calibrated range)."""
    from circleops.adapters.decode import DecoderWithCache

    if cache_layout is None:
        cache_layout = HEAD_MAJOR if cache_update == "rows" else SLOT_MAJOR
    return DecoderWithCache(model, max_len=max_cache_len, cache_update=cache_update, cache_layout=cache_layout,
                            rope_tables=rope_tables)


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


# the narrowest decode window: below it a decode step's attention is no longer what it costs
DECODE_MIN_WINDOW = 32


def decode_windows(windows: Sequence[int] | None, target: str, max_cache_len: int, cache_update: str) -> tuple[int, ...]:
    """The cache windows the decode graph is also written for: ``windows`` (the checked
    --cache-windows) when given, else (the default) C/2, C/4, ... down to
    :data:`DECODE_MIN_WINDOW` where :func:`default_cache_windows` writes prefill windows.
    On LiteRT XNNPACK packs the cache operand of every attention BATCH_MATMUL on each run: a
    decode step over all C slots cost C slots whatever its position (SmolLM2 int4, C=512: 29 %
    of the step's CPU in that packing; bench/results/26-int4-speed.yaml)."""
    if windows is not None:
        return tuple(windows)
    if not default_cache_windows(target, 1, max_cache_len, cache_update):
        return ()
    out, w = [], max_cache_len // 2
    while w >= DECODE_MIN_WINDOW:
        out.append(w)
        w //= 2
    return tuple(out)


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
               cache_update: str = "full") -> Any:
    """Lower one exported step for ``target`` (a name or a TargetProfile; the package step
    lowers a recipe's graphs itself); its subgraph and signature are named ``graph``, its
    inputs and outputs those of :func:`io_names` for ``kind`` ("prefill" or "decode";
    default: ``graph``'s own) and ``cache_update``."""
    from circleops.lowering import lower_program
    from circleops.pipeline import stages
    from circleops.targets import profile

    stages.inline_fused_ops(ep, profile(target).graph_inline_ops)
    ins, outs = io_names(num_layers, kind or ("decode" if graph == "decode" else "prefill"), cache_update)
    return package_step.name_graph(lower_program(ep, target, dtype=dtype), graph, ins, outs)


# --------------------------------------------------------------------------- the recipe

class LLMRecipe(Recipe):
    """A causal LM's prefill graphs (one per length, and the longest's cache windows) and
    decode graph over a static KV cache (see the module docstring). Its options:
    ``graphs``, ``seq_len`` (the prefill lengths), ``max_cache_len``, ``cache_update``,
    ``cache_windows`` of circleops.options.ConvertOptions."""

    kind = "text"
    graph_names = GRAPH_NAMES
    part_embedding: str | None = None  # the manifest's: set by graphs() (circleops.package.split)
    head_table: Any = None  # the tied table read from the quantized head, if so: set by graphs()
    target: str | None = None  # set by check()

    @classmethod
    def check_options(cls, options: ConvertOptions, source: str | None = None) -> None:
        parse_graph_names(options.graphs if options.graphs is not None else GRAPH_NAMES)
        if source is not None and Path(source).suffix.lower() in (".pt2", ".pt", ".ep"):
            raise TargetError(f"--graphs needs the model itself, not an ExportedProgram ({source}): the prefill "
                              f"and decode graphs are exported from the model with its KV cache. Pass the HF "
                              f"directory, .gguf file or smollm2.")
        if options.fuse not in ("auto", "adapters"):
            raise TargetError(f"--graphs always routes attention, RMSNorm and RoPE through the adapters (the cache "
                              f"lives in circle.attention); --fuse {options.fuse} cannot apply. Drop --fuse.")
        lengths = prefill_lengths(DEFAULT_PREFILL_LENS if options.seq_len is None else options.seq_len)
        check_lengths(lengths[0], options.max_cache_len, None, source or "the model")
        from circleops.quantize import INTEGER_FORMATS, WEIGHT_ONLY_FORMATS

        if options.quantize in INTEGER_FORMATS and options.target in PROFILES:  # before the model loads
            package_step.check_integer(cls, options.target, options.quantize, WEIGHT_ONLY_FORMATS)

    @classmethod
    def from_source(cls, model: str | None, options: ConvertOptions) -> "LLMRecipe":
        from circleops.pipeline.validate import resolve_dtype
        from circleops.sources import models

        o = options
        loaded = models.load(model, config=o.config, dtype=resolve_dtype(o.dtype, None), seed=o.seed,
                             allow_random_init=o.allow_random_init)
        if loaded.kind != "hf":
            raise TargetError(f"--graphs needs a Hugging Face causal LM; {loaded.source} is not one.")
        return cls(loaded.module, options, tokenizer=loaded.tokenizer, source=loaded.source)

    def check(self, opts: Any) -> None:
        o = self.options
        self.check_options(o)
        self.target = opts.target  # the checked name (the size plan asks it: split.head_rows_target)
        self.names = parse_graph_names(o.graphs if o.graphs is not None else GRAPH_NAMES)
        self.cache_update = o.cache_update if o.cache_update is not None else default_cache_update(opts.target)
        if self.cache_update not in CACHE_UPDATES:
            raise TargetError(f"cache_update takes one of {', '.join(CACHE_UPDATES)}; got {self.cache_update!r}.")
        self.lengths = lengths = prefill_lengths(DEFAULT_PREFILL_LENS if o.seq_len is None else o.seq_len)
        self.max_cache_len = o.max_cache_len
        source = self.source or "the model"
        check_lengths(lengths[0], o.max_cache_len, getattr(self.model.config, "max_position_embeddings", None), source)
        check_lengths(lengths[-1], o.max_cache_len, None, source)
        # graph name -> (kind, length): every prefill length, its windows, then decode
        longest = prefill_graph_name(lengths[0], lengths)
        named = {prefill_graph_name(n, lengths): ("prefill", n) for n in lengths} if "prefill" in self.names else {}
        self.windows: dict[str, int] = {}
        if "prefill" in self.names:
            for w in check_windows(o.cache_windows, opts.target, lengths[0], o.max_cache_len, self.cache_update):
                self.windows[f"{longest}_c{w}"] = w
                named[f"{longest}_c{w}"] = ("prefill", lengths[0])
        if "decode" in self.names:
            named["decode"] = ("decode", lengths[0])
            given = (None if o.cache_windows is None
                     else check_windows(o.cache_windows, opts.target, 1, o.max_cache_len, self.cache_update))
            for w in decode_windows(given, opts.target, o.max_cache_len, self.cache_update):
                self.windows[f"decode_c{w}"] = w
                named[f"decode_c{w}"] = ("decode", lengths[0])
        self.named = named
        if opts.integer_format is not None and (self.cache_update != "full" or self.windows):
            raise TargetError(f"--quantize {opts.quantize} --graphs writes integer graphs whose attention updates "
                              f"its integer caches in place (cache_update 'full', no cache windows); drop "
                              f"--cache-update {self.cache_update} and --cache-windows.")

    def layer_bytes(self, quantize: str | None) -> Any:
        return split.part_bytes(self.model, quantize, self.target)

    def references(self) -> "References":
        return references(self.model, self.lengths)

    def graphs(self, opts: Any, parts: Sequence[tuple[int, int]]) -> list[Graph]:
        from circleops.adapters.decode import OneRowPrefill

        # integer graphs gather cos/sin from tables: a position past the calibrated ones would
        # saturate an in-graph angle (fp32 graphs compute them, the tables' exact values too)
        self.step = step = decoder_step(self.model, self.max_cache_len, self.cache_update,
                                        rope_tables=opts.integer_format is not None)
        # split with a tied fp32 table: stored once, as the last part's lm_head; a tied table the
        # format stores at another type than the head (onert's w8, q4_0, q8_0): not stored at
        # all, split or not, its rows read from the head (circleops.package.split)
        sizes = split.part_bytes(self.model, opts.quantize, opts.target)
        host = sizes.head_rows or (len(parts) > 1 and sizes.host_table)
        self.part_embedding = "head" if host else None
        # the table whose rows the generator reads from the head: verify's torch reference
        # looks its embeddings up in the head's stored values (circleops.package.step)
        self.head_table = self.model.get_input_embeddings().weight if host and opts.quantize else None
        num_layers = step.num_layers
        graphs = []
        for g, (kind, n) in self.named.items():
            module = windowed_step(step, self.windows[g]) if g in self.windows else step
            rows = n if kind == "prefill" else 1
            if host and not parts:  # one file that takes the rows: the one part of every layer
                graph = Graph(g, split.part_module(module, kind, 0, num_layers, True),
                              split.part_example_args(module, kind, n, 0, num_layers, True),
                              *split.part_io_names(kind, 0, num_layers, num_layers, self.cache_update, True),
                              rows=rows)
                graphs.append(graph)
                continue
            graph = Graph(g, OneRowPrefill(module) if kind == "prefill" else module, example_args(module, kind, n),
                          *io_names(step.num_layers, kind, self.cache_update), rows=rows)
            graph.parts = [Graph(g, split.part_module(module, kind, a, b, host),
                                 split.part_example_args(module, kind, n, a, b, host),
                                 *split.part_io_names(kind, a, b, step.num_layers, self.cache_update, host), rows=rows,
                                 layers=(a, b)) for a, b in parts]
            graphs.append(graph)
        return graphs

    def manifest(self, directory: Path, opts: Any, plan: Any, infos: dict[str, Any]) -> Manifest:
        step, graphs = self.step, list(self.named)
        tokenizer_dir = save_tokenizer(self.tokenizer, directory)
        save_generation_config(self.model, directory)
        eos = self.eos_token_ids()
        ins, outs = io_names(step.num_layers, "decode", self.cache_update)
        return Manifest(
            directory=directory, target=opts.target, dtype=short_name(opts.dtype),
            files={g: plan.file(g) for g in graphs}, signatures={g: infos[g].signature for g in graphs},
            prefill_len=self.lengths[0], prefill_lens=list(self.lengths),
            prefill_inputs=io_names(step.num_layers, "prefill")[0],
            max_cache_len=self.max_cache_len, num_layers=step.num_layers,
            cache_shape=list(step.cache_shape), cache_layout=step.cache_layout,
            vocab_size=int(self.model.config.vocab_size), inputs=ins, outputs=outs,
            eos_token_ids=eos, pad_token_id=pad_token_id(self.model.config, eos), tokenizer=tokenizer_dir,
            source=self.source, quantize=opts.quantize, num_threads=opts.threads, cache_update=self.cache_update,
            prefill_windows={g: [self.named[g][1], w] for g, w in self.windows.items()
                             if self.named[g][0] == "prefill"} or None,
            decode_windows={g: w for g, w in self.windows.items() if self.named[g][0] == "decode"} or None,
            parts=[list(r) for r in plan.parts] or None, signature_api=plan.signature_api,
            part_files={g: infos[g].part_files for g in graphs} if plan.parts else None,
            part_embedding=self.part_embedding,
            max_positions=positions_of(self.model.config, self.max_cache_len))

    def compare(self, manifest: Manifest, runtime: str, refs: "References") -> dict[str, tuple[float, float]]:
        return compare(manifest, list(self.named), runtime, refs)

    def noise(self, refs: "References", moved: "References") -> dict[str, float]:
        """Per graph, at the row :func:`compare` reads: a prefill graph of length L the row
        p - 1 (p = :func:`checked_tokens` (L)), decode the row after the longest prefill's (or 0)."""
        import numpy as np

        rows = np.abs(moved.logits - refs.logits).max(axis=-1)
        after = checked_tokens(self.lengths[0]) if "prefill" in self.names else 0
        return {g: float(rows[checked_tokens(n) - 1 if kind == "prefill" else after])
                for g, (kind, n) in self.named.items()}

    def describe(self, manifest: Manifest) -> dict[str, Any]:
        return {**text_lines(manifest, self.named), "attention": self.step.attention_note()}

    # integer (PT2E) graphs: circleops.recipes.llm_integer (the caches' fixed scales, and why)
    integer_graphs = True

    def integer_calibration(self, count: int) -> Any:
        """Each graph's calibration inputs and the caches' fixed ranges, from the fp32 step over
        ``count`` windows of the calibration text (llm_integer.calibrate)."""
        from circleops.recipes import llm_integer

        n = self.lengths[0] if "prefill" in self.names else 0
        length = min(self.max_cache_len, 2 * n + llm_integer.CALIBRATION_DECODE_STEPS)
        windows = llm_integer.calibration_windows(self.model, self.tokenizer, count, length)
        caches = io_names(self.step.num_layers, "decode", self.cache_update)[0][2:]
        return llm_integer.calibrate(self.step, self.named, windows, caches, self.max_cache_len)

    def integer_probe(self) -> Any:
        """(hold-out ids, the model's fp32 logits of them), before the recipe changes its
        weights: what the quality against fp32 is measured on; None without prefill and decode."""
        from circleops.recipes import llm_integer

        if "prefill" not in self.names or "decode" not in self.names:
            return None
        length = min(self.max_cache_len, self.lengths[0] + llm_integer.QUALITY_DECODE_STEPS)
        ids = llm_integer.hold_out_ids(self.model, self.tokenizer, length)
        return ids, llm_integer.fp32_logits(self.model, ids)

    def integer_references(self, converted: dict[str, Any], references: "References") -> "References":
        from circleops.recipes.llm_integer import quantized_references

        pad = pad_token_id(self.model.config, self.eos_token_ids())
        return quantized_references(references, converted, self.named, self.step, pad, checked_tokens)

    def integer_rounding(self, converted: dict[str, Any]) -> Any:
        from circleops.recipes.llm_integer import stochastic_rounding

        return stochastic_rounding(converted)

    def integer_quality(self, converted: dict[str, Any], probe: Any) -> Any:
        from circleops.recipes.llm_integer import quality

        if probe is None:
            return None
        longest = prefill_graph_name(self.lengths[0], self.lengths)
        return quality(probe[1], probe[0], converted, longest, self.lengths[0], self.step)


def save_tokenizer(tokenizer: Any, directory: Path) -> str | None:
    """The tokenizer (or a processor) saved in ``directory/tokenizer``; its name there, or None."""
    if tokenizer is None:
        return None
    try:
        tokenizer.save_pretrained(str(directory / TOKENIZER_DIR))
    except OSError as err:
        raise OutputError(f"cannot save the tokenizer into {directory / TOKENIZER_DIR}: {err}.") from None
    return TOKENIZER_DIR


def text_lines(manifest: Manifest, graphs: Sequence[str]) -> dict[str, Any]:
    """The report's lines of a text (or vision) manifest: what it records and, when it holds
    a prefill and the decode graph, the ``circleops generate`` that runs them."""
    m = manifest
    line = (f"prefill length{'s' if len(m.prefill_graphs) > 1 else ''} {', '.join(map(str, m.prefill_graphs))}, "
            f"cache length {m.max_cache_len}, tokenizer {m.tokenizer or 'none'}, eos ids {m.eos_token_ids}")
    runs = "decode" in graphs and any(g.startswith("prefill") for g in graphs)
    return {"manifest_line": line, "next_args": '--prompt "..."' if runs else None}


def convert_graphs(model: Any, out_dir: str | os.PathLike, options: ConvertOptions | None = None, *,
                   tokenizer: Any = None, source: str = "", progress: package_step.Progress | None = None,
                   **fields: Any) -> GraphsReport:
    """Write ``model``'s prefill and/or decode graphs for ``target`` into ``out_dir``,
    with ``manifest.json`` and (when given) the tokenizer in ``out_dir/tokenizer``: the
    :class:`LLMRecipe` through the package step (circleops.package.step.run).

    The options are ``options`` (circleops.options.ConvertOptions) or the same names as
    keyword arguments (``target`` defaults to "onert" here); these apply:

    ``graphs``: "prefill", "decode" or both (the default).

    ``seq_len`` (or ``prefill_len``): the prefill graph's length, or several (one prefill graph each; the
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
    dequantized. "int16" / "uint8" (target circle, with the integer recipe's options): integer
    graphs, each calibrated on its own, the KV caches at one fixed scale per layer's K and V
    (circleops.recipes.llm_integer); verify compares with torch running the converted
    (fake-quantized) graphs, and the report's ``quality`` is theirs against fp32.
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
    opts = ConvertOptions.of(options, fields, "convert_graphs", target="onert")
    return package_step.run(LLMRecipe(model, opts, tokenizer=tokenizer, source=source), out_dir, progress)


# --------------------------------------------------------------------------- verify

@dataclass
class References:
    ids: Any  # [P + 1] int64
    logits: Any  # [P + 1, V]: the model's logits of every prefix of ``ids``
    # a two-stage head's approximate and exact logits, [P + 1, V] each, and k
    # (circleops.quantize.topk_head.recording); None: one head product
    heads: dict | None = None

    def error(self, out: Any, row: int) -> float:
        """The largest error of a graph's logits ``out`` [V] at ``row`` (compare's rule; with a
        two-stage head its boundary candidates either way: topk_head.head_error)."""
        from circleops.quantize import topk_head

        return topk_head.rows_error(out, self.logits[row], self.heads, row)


def references(model: Any, lengths: Sequence[int]) -> References:
    """The model's own (HF, no cache) logits over one token sequence: each prefill graph
    of length L is checked on its first max(1, L // 2) tokens (a right-padded chunk), and
    the decode step on the token after them. Causal, so one forward gives every prefix."""
    import torch

    from circleops.sources.models import example_token_ids

    from circleops.quantize import topk_head

    p = checked_tokens(max(lengths))
    ids = example_token_ids(p + 1, int(model.config.vocab_size))[0]
    with torch.no_grad(), topk_head.recording() as heads:
        logits = model(input_ids=ids[None], use_cache=False).logits[0].float().numpy()
    return References(ids, logits, heads or None)


def checked_tokens(length: int) -> int:
    """The tokens a prefill graph of ``length`` is checked on: its first half (a right-padded chunk)."""
    return max(1, length // 2)


def compare(manifest: Manifest, graphs: Sequence[str], runtime: str, refs: "References") -> dict[str, tuple[float, float]]:
    """Graph -> (max abs logit error, max |logit| of torch): the written graphs on ``runtime``
    against the model's own logits (the package step applies the tolerance).

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
        p = checked_tokens(n)
        buf = np.full((1, n), manifest.pad_token_id, dtype=np.int64)
        buf[0, :p] = ids[:p]
        caches = [z.copy() for z in zeros]
        outs = open_graph(manifest, g, runtime, isolated=True).run([buf, np.zeros(1, np.int64), np.array([p - 1], np.int64), *caches])
        errors[g], wants[g] = refs.error(outs[0][0, 0], p - 1), refs.logits[p - 1]
        if "decode" in graphs and after is None:  # after the longest prefill
            after = (store_caches(caches, outs[1:], 0, manifest.cache_update, manifest.cache_layout), p)
        del outs
    for g, (n, w) in manifest.windowed_prefills.items():  # the same chunk at pos 0, reading W slots
        if g not in graphs:
            continue
        p = checked_tokens(n)
        buf = np.full((1, n), manifest.pad_token_id, dtype=np.int64)
        buf[0, :p] = ids[:p]
        caches = [np.ascontiguousarray(c) for c in cache_window(zeros, w, manifest.cache_layout)]
        outs = open_graph(manifest, g, runtime, isolated=True).run([buf, np.zeros(1, np.int64), np.array([p - 1], np.int64), *caches])
        errors[g], wants[g] = refs.error(outs[0][0, 0], p - 1), refs.logits[p - 1]
    if "decode" in graphs:
        decode = open_graph(manifest, "decode", runtime, isolated=True)
        if after is not None:
            caches, p = after
            step = decode.run([np.array([[ids[p]]], np.int64), np.array([p], np.int64), *caches])[0][0, 0]
            errors["decode"], wants["decode"] = refs.error(step, p), refs.logits[p]
        else:
            out = decode.run([np.array([ids[:1]], np.int64), np.zeros(1, np.int64), *zeros])[0][0, 0]
            errors["decode"], wants["decode"] = refs.error(out, 0), refs.logits[0]
        del decode  # its child ends (IsolatedSession.__del__)
    for g, w in manifest.windowed_decodes.items():  # the same step, reading the first W slots
        if g not in graphs:
            continue
        caches, p = after if after is not None and after[1] <= w else (zeros, 0)
        token = ids[p] if after is not None and after[1] <= w else ids[0]
        window = [np.ascontiguousarray(c) for c in cache_window(caches, w, manifest.cache_layout)]
        out = open_graph(manifest, g, runtime, isolated=True).run([np.array([[token]], np.int64),
                                                                   np.array([p], np.int64), *window])[0][0, 0]
        errors[g], wants[g] = refs.error(out, p), refs.logits[p]
    return {g: (err, float(np.abs(wants[g]).max())) for g, err in errors.items()}

"""``manifest.json``: what ``circleops convert --graphs`` wrote and ``circleops generate`` runs.

The one contract between the two: a recipe (circleops.recipes) writes a manifest through the
package step, circleops.generation reads it (:func:`read_manifest`, and
circleops.package.speech_manifest for speech); neither imports the other for it.

One schema for every kind of graphs (version 4): the keys every directory has at the top
(``format``, ``version``, ``kind``, where the graphs are: ``files``, ``signatures``, ``parts``,
``signature_api``; what they are: ``source``, ``target``, ``dtype``, ``quantize``,
``num_threads``) and one section per kind: ``text`` (the prefill and decode graphs, their KV
cache, the tokens), ``vision`` (a VLM's image side; kind "vision" has ``text`` too),
``text2text`` (an encoder-decoder text model's encoder and decoding rules; kind "text2text" has
``text`` too, its decoder's) and ``speech`` (Whisper's encoder and decoder, its decoding rules). Directories written before it
still read: format ``circleops-generate`` versions 1-3 and ``circleops-speech`` version 1 were
flat (:func:`manifest_fields` reads both).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from circleops.errors import ModelLoadError
from circleops.options import CACHE_LAYOUTS, CACHE_UPDATES, HEAD_MAJOR, HEADS_ROWS, SLOT_MAJOR
from circleops.inputs.remote_code import refuse_remote_code
from circleops.targets import PROFILES
from circleops.inputs.token_ids import check_token_ids
from circleops.inputs.user_files import outside_reason, read_json

GRAPH_NAMES = ("prefill", "decode")
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "circleops-generate"
# 2: "cache_update" (the graphs may return only the new k/v rows) and a "cache_layout" that
# is read (version 1 wrote it, always slot-major; "rows" graphs take head-major caches). A
# version-1 manifest still reads, as cache_update "full"; a reader older than 2 refuses a
# version-2 directory instead of feeding rows back as caches.
# 3: "parts" and "part_files": a graph split into consecutive files, a layer range each
# (circleops.package.split: onert reads no file past 2 GiB); "signature_api": onert runs the graphs as
# signatures of one file through its C API (circleops.runtime.onert_c): each file (or part) once
# on disk and loaded once, its weights mapped (1x); without it a file per graph, each holding
# every weight (onert 0.1.0: 3x for prefill, prefill_8, decode, on disk and in memory). Written only
# when a directory uses them: a reader of version 2 refuses such a directory instead of
# running the first part as the whole model; every other directory stays version 2.
# 4: one schema for every kind: the common keys on top, a section per kind (text, vision,
# speech); every directory is written so. Readers of 1-3 refuse it (its format and version say
# why) instead of misreading it.
MANIFEST_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
# the flat manifests of Whisper's graphs (before version 4)
SPEECH_FORMAT = "circleops-speech"
KINDS = ("text", "vision", "speech", "text2text")
# the kinds whose own section sits beside the text one (kept as one entry of the Manifest)
TEXT_PLUS = ("vision", "text2text")
# the keys at the top of a version-4 manifest, whatever its kind (and their defaults)
COMMON_KEYS = {"source": "", "target": None, "dtype": None, "default_runtime": None, "files": None,
               "signatures": None, "one_file_per_graph": None, "quantize": None, "num_threads": None,
               "parts": None, "part_files": None, "part_embedding": None, "signature_api": None}
# How the graphs hand back the KV cache (circle::attention's cache_update):
#   full: every cache output is the whole updated cache [1, C, Hkv, D]; it is the next input
#   rows: every cache output is the step's new rows [1, S, Hkv, D]; the caller writes them
#         into its caches at slots pos..pos+S-1 (in place: no cache is copied per step)
TOKENIZER_DIR = "tokenizer"
# where the graphs (a split model's first part) get their embeddings: None, their own table;
# "head", the generator looks them up in the tied lm_head of the graph's (last part's) file,
# dequantizing its rows where it is quantized (circleops.package.split). Without ``parts``
# (written since the quantized head tables): one file per graph that takes the embeddings
PART_EMBEDDINGS = (None, "head")
# the prefill input naming the one row of the chunk whose logits it computes (absent in
# manifests written before it: those prefills compute the logits of every row)
LOGITS_ROW = "logits_row"


def prefill_graph_name(length: int, lengths: Sequence[int]) -> str:
    """The name (files/signatures key) of the prefill graph of ``length`` among ``lengths``:
    ``prefill`` for the longest, ``prefill_N`` for the others."""
    return "prefill" if length == max(lengths) else f"prefill_{length}"


def manifest_json(kind: str, common: dict[str, Any], sections: dict[str, Any]) -> dict[str, Any]:
    """A version-4 manifest: the format, version and ``kind``, the ``common`` keys (those of
    :data:`COMMON_KEYS`; ``parts``, ``part_files`` and ``signature_api`` only when set), then
    one section per kind (``text``, ``vision``, ``text2text``, ``speech``)."""
    optional = ("parts", "part_files", "part_embedding", "signature_api")
    top = {k: common.get(k, default) for k, default in COMMON_KEYS.items()
           if k not in optional or common.get(k) is not None}
    return {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "kind": kind, **top, **sections}


def manifest_kind(data: Any) -> str | None:
    """The kind of a manifest's JSON: one of :data:`KINDS` (any version), else None."""
    if not isinstance(data, dict):
        return None
    if data.get("format") == SPEECH_FORMAT:
        return "speech"
    if data.get("format") != MANIFEST_FORMAT:
        return None
    if data.get("version") == MANIFEST_VERSION:
        return data.get("kind") if data.get("kind") in KINDS else None
    return "vision" if data.get("vision") is not None else "text"


def manifest_fields(data: dict[str, Any]) -> dict[str, Any]:
    """A manifest's fields as one flat dict: a version-4 manifest's common keys and its
    sections' keys together (a ``vision`` or ``text2text`` section stays one entry, as the text
    manifest holds it); a flat manifest of an earlier version as it is. KeyError for a missing section."""
    if data.get("version") != MANIFEST_VERSION or data.get("format") != MANIFEST_FORMAT:
        return dict(data)
    kind = data.get("kind")
    flat = {k: data[k] for k in ("format", "version", "kind", *COMMON_KEYS) if k in data}
    for section in ("speech",) if kind == "speech" else ("text",):
        if not isinstance(data[section], dict):
            raise TypeError(f"the {section} section is not a mapping")
        flat.update(data[section])
    if kind in TEXT_PLUS:
        flat[kind] = data[kind]
    return flat


def graph_runtimes(target: str) -> tuple[str, ...]:
    """The runtimes that run a target's generation graphs: the target's own runtime and the
    reference interpreter (onert does not run target circle's ATTENTION, LiteRT reads no
    Circle)."""
    return tuple(dict.fromkeys((PROFILES[target].runtime, "reference")))


@dataclass
class Manifest:
    """What ``circleops generate`` needs to run the written graphs (``out/manifest.json``).

    ``files[g]`` is the file of graph g (relative to the directory) and ``signatures[g]``
    the signature to run in it (None: the file's main subgraph). ``inputs``/``outputs``
    name the decode graph's inputs and outputs in order; ``prefill_inputs`` the prefill's
    (``inputs`` with ``logits_row`` after ``pos``: it returns that row's logits only).
    """

    directory: Path
    target: str
    dtype: str
    files: dict[str, str]
    signatures: dict[str, str | None]
    prefill_len: int
    max_cache_len: int
    num_layers: int
    cache_shape: list[int]
    vocab_size: int
    inputs: list[str]
    outputs: list[str]
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int = 0
    tokenizer: str | None = None
    source: str = ""
    quantize: str | None = None  # GGML weight format of the files ("q4_0", "q8_0"), if any
    num_threads: int | None = None  # the onert NUM_THREADS the files were made for
    prefill_inputs: list[str] | None = None  # None: the same as ``inputs`` (every row's logits)
    prefill_lens: list[int] | None = None  # every prefill graph's length, longest first (None: [prefill_len])
    cache_update: str = "full"  # what the cache outputs are: whole caches, or the new rows (CACHE_UPDATES)
    cache_layout: str = SLOT_MAJOR  # the cache arrays' layout (CACHE_LAYOUTS); cache_shape is [1, C, Hkv, D] in any
    # a vision-language model's image side (circleops.package.vision_manifest.VisionSpec.to_json): its vision graph
    # (a key of ``files``), image token, tokens per image and the embeddings input of the prefill
    vision: dict[str, Any] | None = None
    # prefill graphs that read only the first W cache slots (graph name -> [length, W]): a
    # chunk at pos <= W attends to nothing past slot W, and attention over all C slots was a
    # third of a 64-row chunk's time on LiteRT (SmolLM2 w8, bench/results/18-*.yaml)
    prefill_windows: dict[str, list[int]] | None = None
    # decode graphs that read only the first W cache slots (graph name -> W): a step at pos <= W
    # runs the narrowest. XNNPACK packs the cache operand of each attention BATCH_MATMUL on
    # every run, so a decode step over all C slots paid for C slots whatever its position
    # (SmolLM2 int4 on LiteRT: 29 % of the step's CPU in packing at C=512, bench/results/26-*)
    decode_windows: dict[str, int] | None = None
    # a split model (circleops.package.split): each file's layer range [start, stop), consecutive from
    # 0 to num_layers, the same for every graph; part_files[g] the files of graph g in that
    # order (files[g] is the first). None: every graph is one file.
    parts: list[list[int]] | None = None
    part_files: dict[str, list[str]] | None = None
    # "head": each graph (a split model's first part) takes the embeddings, which the generator
    # looks up in the tied lm_head weight of the graph's (last part's) file: the table stored
    # once (fp32 split), or not at all where the head is quantized (onert's w8, q4_0, q8_0: its
    # rows dequantized). None: the graphs take the token ids
    part_embedding: str | None = None
    # how the target's runtime selects a graph's signature where one file holds several:
    # "nnfw-c" (onert >= 0.2.0.dev's C API, nnfw_set_signature_run). None: the runtime's own way
    signature_api: str | None = None
    # an encoder-decoder text model's encoder and decoding rules (circleops.package.text2text_manifest.Text2TextSpec
    # .to_json): its encoder graph (a key of ``files``), source length and cross-attention K/V
    text2text: dict[str, Any] | None = None
    # the model's positions (its config's max_position_embeddings; None: unknown or unlimited): a
    # generation past the cache is told to convert with a longer cache only when the model has the positions
    max_positions: int | None = None

    @property
    def windowed_prefills(self) -> dict[str, tuple[int, int]]:
        """Graph name -> (prefill length, cache window W) of the prefill graphs whose caches
        are the first W slots ([1, Hkv, W, D] and [1, Hkv, D, W] head-major), if any."""
        return {g: (int(n), int(w)) for g, (n, w) in (self.prefill_windows or {}).items()}

    @property
    def windowed_decodes(self) -> dict[str, int]:
        """Graph name -> cache window W of the decode graphs whose caches are the first W slots."""
        return {g: int(w) for g, w in (self.decode_windows or {}).items()}

    @property
    def cache_shapes(self) -> list[list[int]]:
        """The shape of each cache array the graphs take: the k caches, then the v caches."""
        _, c, h, d = self.cache_shape
        if self.cache_layout == HEADS_ROWS:
            return [[1, h, c, d]] * (2 * self.num_layers)
        k, v = ([1, h, c, d], [1, h, d, c]) if self.cache_layout == HEAD_MAJOR else (self.cache_shape, self.cache_shape)
        return [list(k)] * self.num_layers + [list(v)] * self.num_layers

    @property
    def prefill_graphs(self) -> dict[int, str]:
        """Prefill length -> graph name (a key of ``files``), longest first."""
        lengths = sorted(set(self.prefill_lens or [self.prefill_len]), reverse=True)
        return {n: prefill_graph_name(n, lengths) for n in lengths}

    @property
    def prefill_one_row(self) -> bool:
        """The prefill computes the logits of one row (its ``logits_row`` input), not all."""
        return LOGITS_ROW in (self.prefill_inputs or ())

    @property
    def default_runtime(self) -> str:
        return PROFILES[self.target].runtime

    def path(self, graph: str) -> Path:
        return self.directory / self.files[graph]

    def graph_files(self, graph: str) -> list[str]:
        """The files of ``graph``: one, or a split graph's parts in layer order."""
        if self.part_files and graph in self.part_files:
            return list(self.part_files[graph])
        return [self.files[graph]]

    @property
    def kind(self) -> str:
        """The manifest's kind: "vision" for a vision-language model's graphs, "text2text" for
        an encoder-decoder text model's, else "text"."""
        return "text2text" if self.text2text is not None else "text" if self.vision is None else "vision"

    def to_json(self) -> dict[str, Any]:
        common = {"source": self.source, "target": self.target, "dtype": self.dtype,
                  "default_runtime": self.default_runtime, "files": self.files, "signatures": self.signatures,
                  "one_file_per_graph": len(set(self.files.values())) > 1, "quantize": self.quantize,
                  "num_threads": self.num_threads, "parts": self.parts or None,
                  "part_files": self.part_files if self.parts else None,
                  "part_embedding": self.part_embedding, "signature_api": self.signature_api}
        text = {
            "prefill_len": self.prefill_len, "prefill_lens": list(self.prefill_graphs),
            "prefill_inputs": self.prefill_inputs or self.inputs, "max_cache_len": self.max_cache_len,
            "num_layers": self.num_layers, "cache_shape": self.cache_shape, "cache_layout": self.cache_layout,
            "cache_update": self.cache_update, "vocab_size": self.vocab_size, "inputs": self.inputs,
            "outputs": self.outputs, "eos_token_ids": self.eos_token_ids, "pad_token_id": self.pad_token_id,
            "tokenizer": self.tokenizer,
            **({"prefill_windows": self.prefill_windows} if self.prefill_windows else {}),
            **({"decode_windows": self.decode_windows} if self.decode_windows else {}),
            **({"max_positions": self.max_positions} if self.max_positions is not None else {})}
        extra = {k: getattr(self, k) for k in TEXT_PLUS if getattr(self, k) is not None}
        return manifest_json(self.kind, common, {"text": text, **extra})

    def write(self) -> Path:
        path = self.directory / MANIFEST
        tmp = path.with_name(f".{MANIFEST}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        os.replace(tmp, path)
        return path


def confined(directory: Path, name: Any, what: str, manifest_path: Path) -> str:
    """``name`` from a manifest, checked to stay inside ``directory``: a relative path without
    ``..`` whose real location (symlinks followed) is inside the directory. A converted
    directory may come from someone else; its manifest must not point circleops (and onert,
    which reads without verifying) at /etc/passwd or at a file beside the directory."""
    why = outside_reason(directory, name)
    if why:
        raise ModelLoadError(f"{manifest_path}: {what} {name!r} {why}; a manifest names only files inside its own "
                             f"directory. The directory is damaged or was not written by `circleops convert "
                             f"--graphs`: convert again.")
    return name


def confined_tokenizer(directory: Path, name: str, manifest_path: Path) -> Path:
    """The tokenizer directory ``name`` of a manifest, and every file in it, confined to
    ``directory`` (see :func:`confined`); returns its path."""
    confined(directory, name, "the tokenizer directory", manifest_path)
    path = directory / name
    if path.is_dir():
        for entry in sorted(path.iterdir()):
            confined(directory, str(Path(name) / entry.name), "the tokenizer file", manifest_path)
    return path


def _check_types(m: Manifest, path: Path) -> None:
    """ModelLoadError unless every field has its type (a hand-edited or hostile manifest must
    fail here, not as a TypeError deep in generation)."""
    def strings(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)

    def ints(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)

    wrong = [name for name, ok in (
        ("target", isinstance(m.target, str)), ("dtype", isinstance(m.dtype, str)),
        ("files", isinstance(m.files, dict) and all(isinstance(k, str) for k in m.files)),
        ("signatures", isinstance(m.signatures, dict)
         and all(isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in m.signatures.items())),
        ("inputs", strings(m.inputs)), ("outputs", strings(m.outputs)),
        ("prefill_inputs", m.prefill_inputs is None or strings(m.prefill_inputs)),
        ("eos_token_ids", ints(m.eos_token_ids)), ("cache_shape", ints(m.cache_shape)),
        ("tokenizer", m.tokenizer is None or isinstance(m.tokenizer, str)),
        ("source", isinstance(m.source, str)), ("quantize", m.quantize is None or isinstance(m.quantize, str)),
        ("num_threads", m.num_threads is None or (isinstance(m.num_threads, int) and 1 <= m.num_threads <= 1024)),
        ("cache_update", isinstance(m.cache_update, str)), ("cache_layout", isinstance(m.cache_layout, str)),
        ("vision", m.vision is None or (isinstance(m.vision, dict) and all(isinstance(k, str) for k in m.vision))),
        ("text2text", m.text2text is None or isinstance(m.text2text, dict)),
        ("prefill_windows", m.prefill_windows is None or (
            isinstance(m.prefill_windows, dict) and all(isinstance(k, str) and k in m.files and ints(v) and len(v) == 2
                                                        and 1 <= v[0] <= v[1] < m.max_cache_len
                                                        for k, v in m.prefill_windows.items()))),
        ("decode_windows", m.decode_windows is None or (
            isinstance(m.decode_windows, dict) and all(isinstance(k, str) and k in m.files and ints([w])
                                                       and 1 <= w < m.max_cache_len
                                                       for k, w in m.decode_windows.items()))),
    ) if not ok]
    if wrong:
        raise ModelLoadError(f"{path}: {', '.join(wrong)} {'has' if len(wrong) == 1 else 'have'} the wrong type. "
                             f"Convert again with --graphs.")
    _check_parts(m, path)


SIGNATURE_APIS = ("nnfw-c",)


def _check_parts(m: Manifest, path: Path) -> None:
    """ModelLoadError unless ``parts`` are consecutive layer ranges from 0 to num_layers and
    every graph lists one file per range (the first being its ``files`` entry)."""
    if m.signature_api is not None and m.signature_api not in SIGNATURE_APIS:
        raise ModelLoadError(f"{path}: unknown signature_api {m.signature_api!r} (this circleops knows "
                             f"{', '.join(SIGNATURE_APIS)}). Convert again with --graphs.")
    if m.part_embedding not in PART_EMBEDDINGS:
        raise ModelLoadError(f"{path}: unknown part_embedding {m.part_embedding!r} (this circleops knows \"head\"). "
                             f"Convert again with --graphs.")
    if m.parts is None and m.part_files is None:
        return
    ok = isinstance(m.parts, list) and len(m.parts) >= 2 and isinstance(m.part_files, dict)
    if ok:
        edges = [0]
        for r in m.parts:
            ok = ok and isinstance(r, list) and len(r) == 2 and all(type(v) is int for v in r) and r[0] == edges[-1] \
                and r[1] > r[0]
            edges.append(r[1] if ok else -1)
        ok = ok and edges[-1] == m.num_layers and set(m.part_files) == set(m.files)
        ok = ok and all(isinstance(fs, list) and len(fs) == len(m.parts) and all(isinstance(f, str) for f in fs)
                        and fs[0] == m.files[g] for g, fs in m.part_files.items())
    if not ok:
        raise ModelLoadError(f"{path}: parts and part_files must give consecutive layer ranges from 0 to num_layers "
                             f"({m.num_layers}) and, for every graph, one file per range. The directory is damaged: "
                             f"convert again with --graphs.")


def manifest_path(directory: str | os.PathLike) -> tuple[Path, Path]:
    """(the directory, its manifest.json) of a directory or of its manifest.json's path."""
    d = Path(directory)
    if d.is_dir():
        return d, d / MANIFEST
    if d.name == MANIFEST and d.is_file():
        return d.parent, d
    raise ModelLoadError(f"{directory} is not a directory: pass the directory that `circleops convert "
                         f"MODEL --graphs prefill,decode -o DIR` wrote.")


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """The manifest of a directory written by ``circleops convert --graphs`` for a text or
    vision-language model (any version: :func:`manifest_fields`)."""
    d, path = manifest_path(directory)
    if not path.is_file():
        raise ModelLoadError(
            f"{d} has no {MANIFEST}, so it was not written by `circleops convert --graphs`. Run "
            f"`circleops convert MODEL --graphs prefill,decode --target onert -o {d}` first.")
    data = read_json(path, error=ModelLoadError, fix="Convert again with --graphs.")
    if not isinstance(data, dict):
        data = {}  # reported as the wrong format just below
    if manifest_kind(data) == "speech":  # circleops.package.speech_manifest's graphs (Whisper)
        raise ModelLoadError(f"{d} holds the speech graphs of a Whisper-style model, which take audio, not a "
                             f"prompt: run `circleops generate {d} --audio clip.wav`.")
    if data.get("format") != MANIFEST_FORMAT or data.get("version") not in READABLE_VERSIONS:
        raise ModelLoadError(f"{path} is not a circleops generate manifest of version "
                             f"{' or '.join(map(str, READABLE_VERSIONS))} "
                             f"(format {data.get('format')!r}, version {data.get('version')!r}). Convert again "
                             f"with --graphs.")
    try:
        m = _from_fields(d, manifest_fields(data))
    except (KeyError, TypeError, ValueError, OverflowError) as err:  # int(inf) is an OverflowError
        raise ModelLoadError(f"{path} is incomplete ({type(err).__name__}: {err}). Convert again with --graphs.") from None
    _check_types(m, path)
    _check_values(m, path)
    return m


def _from_fields(d: Path, data: dict[str, Any]) -> Manifest:
    """The Manifest of a flat dict of fields (a version 1-3 manifest, or a version-4 one's
    common keys and sections together); KeyError / TypeError / ValueError where one is wrong."""
    return Manifest(directory=d, target=data["target"], dtype=data["dtype"], files=data["files"],
                    signatures=data["signatures"], prefill_len=int(data["prefill_len"]),
                    max_cache_len=int(data["max_cache_len"]), num_layers=int(data["num_layers"]),
                    cache_shape=list(data["cache_shape"]), vocab_size=int(data["vocab_size"]),
                    inputs=list(data["inputs"]), outputs=list(data["outputs"]),
                    eos_token_ids=list(data.get("eos_token_ids") or []),
                    pad_token_id=int(data.get("pad_token_id") or 0), tokenizer=data.get("tokenizer"),
                    source=data.get("source", ""), quantize=data.get("quantize"),
                    num_threads=data.get("num_threads"), prefill_inputs=data.get("prefill_inputs"),
                    prefill_lens=[int(n) for n in data.get("prefill_lens") or [data["prefill_len"]]],
                    cache_update=data.get("cache_update") or "full",
                    cache_layout=data.get("cache_layout") or SLOT_MAJOR, vision=data.get("vision"),
                    prefill_windows=data.get("prefill_windows"), decode_windows=data.get("decode_windows"),
                    parts=data.get("parts"),
                    part_files=data.get("part_files"), part_embedding=data.get("part_embedding"),
                    signature_api=data.get("signature_api"),
                    text2text=data.get("text2text"), max_positions=data.get("max_positions"))


def _check_values(m: Manifest, path: Path) -> None:
    """ModelLoadError unless the manifest's values are ones this circleops runs: known cache
    update and layout, target, positive sizes, token ids in the vocabulary, a cache as long as
    max_cache_len, files and the tokenizer inside the directory (and no remote code)."""
    d = m.directory
    if m.cache_update not in CACHE_UPDATES:
        raise ModelLoadError(f"{path}: unknown cache_update {m.cache_update!r} (this circleops reads "
                             f"{', '.join(CACHE_UPDATES)}). Convert again with --graphs.")
    layouts = (*CACHE_LAYOUTS, HEADS_ROWS) if m.text2text is not None else CACHE_LAYOUTS  # an encoder-decoder's
    if m.cache_layout not in layouts or (m.cache_layout in (HEAD_MAJOR, HEADS_ROWS) and m.cache_update != "rows"):
        raise ModelLoadError(f"{path}: unknown cache_layout {m.cache_layout!r} (this circleops reads "
                             f"{' or '.join(map(repr, layouts))}). Convert again with --graphs.")
    if m.target not in PROFILES:
        raise ModelLoadError(f"{path}: unknown target {m.target!r}. Convert again with --graphs.")
    sizes = [m.prefill_len, m.max_cache_len, m.num_layers, m.vocab_size, *m.prefill_graphs]
    if len(m.cache_shape) != 4 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                          for n in sizes + m.cache_shape):
        raise ModelLoadError(f"{path}: the sizes (prefill_len, max_cache_len, num_layers, vocab_size, cache_shape "
                             f"[1, C, H, D]) must be positive integers. Convert again with --graphs.")
    again = "Convert again with --graphs."
    check_token_ids([m.pad_token_id], m.vocab_size, f"{path}: pad_token_id", fix=again)
    check_token_ids(m.eos_token_ids, m.vocab_size, f"{path}: eos_token_ids", fix=again)
    if isinstance(m.vision, dict) and "image_token_id" in m.vision:
        check_token_ids([m.vision["image_token_id"]], m.vocab_size, f"{path}: the vision entry's image_token_id",
                        fix=again)
    if m.text2text is not None:  # every value checked (ModelLoadError) before any graph opens
        from circleops.package.text2text_manifest import Text2TextSpec

        Text2TextSpec.from_json(m.text2text, path, m.vocab_size)
    if m.cache_shape[1] != m.max_cache_len:  # the caches (checked against the graph) hold C slots, no more
        raise ModelLoadError(f"{path}: max_cache_len is {m.max_cache_len} but the caches (cache_shape "
                             f"{m.cache_shape}) hold {m.cache_shape[1]} slots; generating past them would write "
                             f"outside the cache. Convert again with --graphs.")
    p = m.max_positions
    if p is not None and (not isinstance(p, int) or isinstance(p, bool) or p < m.max_cache_len):
        raise ModelLoadError(f"{path}: max_positions must be an integer of at least max_cache_len "
                             f"({m.max_cache_len}), got {p!r}. Convert again with --graphs.")
    for graph, name in m.files.items():
        confined(d, name, f"the file of graph {graph!r}", path)
    for graph, names in (m.part_files or {}).items():
        for name in names:
            confined(d, name, f"a part file of graph {graph!r}", path)
    if m.tokenizer is not None:
        # refused on reading, before any graph opens: generate, chat and a VLM's processor read it
        refuse_remote_code(confined_tokenizer(d, m.tokenizer, path))

"""``manifest.json``: what ``circleops convert --graphs`` wrote and ``circleops generate`` runs.

The one contract between the two: circleops.graphs writes a :class:`Manifest`,
circleops.generate reads it (:func:`read_manifest`); neither imports the other for it.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from circleops.errors import ModelLoadError
from circleops.targets import PROFILES

GRAPH_NAMES = ("prefill", "decode")
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "circleops-generate"
MANIFEST_VERSION = 1
TOKENIZER_DIR = "tokenizer"


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
    name the graphs' inputs and outputs in order (the same for both graphs).
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

    @property
    def default_runtime(self) -> str:
        return PROFILES[self.target].runtime

    def path(self, graph: str) -> Path:
        return self.directory / self.files[graph]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "source": self.source,
            "target": self.target, "dtype": self.dtype, "default_runtime": self.default_runtime,
            "files": self.files, "signatures": self.signatures,
            "one_file_per_graph": len(set(self.files.values())) > 1,
            "prefill_len": self.prefill_len, "max_cache_len": self.max_cache_len,
            "num_layers": self.num_layers, "cache_shape": self.cache_shape, "cache_layout": "[1, C, Hkv, D]",
            "vocab_size": self.vocab_size, "inputs": self.inputs, "outputs": self.outputs,
            "eos_token_ids": self.eos_token_ids, "pad_token_id": self.pad_token_id, "tokenizer": self.tokenizer,
            "quantize": self.quantize, "num_threads": self.num_threads,
        }

    def write(self) -> Path:
        path = self.directory / MANIFEST
        tmp = path.with_name(f".{MANIFEST}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        os.replace(tmp, path)
        return path


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """The manifest of a directory written by ``circleops convert --graphs``."""
    d = Path(directory)
    if d.is_dir():
        path = d / MANIFEST
    elif d.name == MANIFEST and d.is_file():
        path, d = d, d.parent
    else:
        raise ModelLoadError(f"{directory} is not a directory: pass the directory that `circleops convert "
                             f"MODEL --graphs prefill,decode -o DIR` wrote.")
    if not path.is_file():
        raise ModelLoadError(
            f"{d} has no {MANIFEST}, so it was not written by `circleops convert --graphs`. Run "
            f"`circleops convert MODEL --graphs prefill,decode --target onert -o {d}` first.")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}. Convert again with --graphs.") from None
    if data.get("format") != MANIFEST_FORMAT or data.get("version") != MANIFEST_VERSION:
        raise ModelLoadError(f"{path} is not a circleops generate manifest of version {MANIFEST_VERSION} "
                             f"(format {data.get('format')!r}, version {data.get('version')!r}). Convert again "
                             f"with --graphs.")
    try:
        m = Manifest(directory=d, target=data["target"], dtype=data["dtype"], files=data["files"],
                     signatures=data["signatures"], prefill_len=int(data["prefill_len"]),
                     max_cache_len=int(data["max_cache_len"]), num_layers=int(data["num_layers"]),
                     cache_shape=list(data["cache_shape"]), vocab_size=int(data["vocab_size"]),
                     inputs=list(data["inputs"]), outputs=list(data["outputs"]),
                     eos_token_ids=list(data.get("eos_token_ids") or []),
                     pad_token_id=int(data.get("pad_token_id") or 0), tokenizer=data.get("tokenizer"),
                     source=data.get("source", ""), quantize=data.get("quantize"),
                     num_threads=data.get("num_threads"))
    except (KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"{path} is incomplete ({type(err).__name__}: {err}). Convert again with --graphs.") from None
    if m.target not in PROFILES:
        raise ModelLoadError(f"{path}: unknown target {m.target!r}. Convert again with --graphs.")
    return m

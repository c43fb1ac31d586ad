"""``manifest.json`` of a speech directory (Whisper-style: encoder, prefill and decode graphs):
what ``circleops convert --graphs encoder,prefill,decode`` (circleops.recipes.speech) writes and
``circleops generate DIR --audio`` (circleops.generation.speech) reads, with the checks a
hand-edited or hostile manifest fails on before any graph opens.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from circleops.errors import CircleOpsError, ModelLoadError
from circleops.package.manifest import (COMMON_KEYS, MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION, SPEECH_FORMAT,
                                        confined, confined_tokenizer, manifest_fields, manifest_json, manifest_kind)
from circleops.targets import PROFILES
from circleops.inputs.remote_code import refuse_remote_code
from circleops.inputs.token_ids import check_token_ids
from circleops.inputs.user_files import read_json

SPEECH_VERSION = 1  # of the flat SPEECH_FORMAT manifests written before the one schema (version 4)
SPEECH_GRAPHS = ("encoder", "prefill", "decode")
PROCESSOR_DIR = "processor"


class SpeechInputError(CircleOpsError):
    """The audio, the language or the task cannot be used with this model."""


# --------------------------------------------------------------------------- which models

def speech_model_type(directory: str | os.PathLike) -> str | None:
    """The model_type of an HF directory's config.json when it is a Whisper-style speech
    seq2seq model circleops writes speech graphs for, else None."""
    path = Path(directory) / "config.json"
    try:
        cfg = read_json(path)
    except CircleOpsError:  # not JSON, or damaged: reported by the reader that needs it
        return None
    if not isinstance(cfg, dict):
        return None
    return "whisper" if cfg.get("model_type") == "whisper" else None



def io_names(graph: str, num_layers: int) -> tuple[list[str], list[str]]:
    """The inputs and outputs of a speech graph, in order."""
    rows = [f"{kv}_new_{i}" for kv in "kv" for i in range(num_layers)]
    cross = [f"cross_{kv}_{i}" for kv in "kv" for i in range(num_layers)]
    if graph == "encoder":
        return ["input_features"], ["encoder_hidden_states"]
    if graph == "prefill":
        return ["input_ids", "logits_row", "encoder_hidden_states"], ["logits", *rows, *cross]
    caches = [f"{kv}_cache_{i}" for kv in "kv" for i in range(num_layers)]
    return ["input_ids", "pos", *caches, *cross], ["logits", *rows]



# --------------------------------------------------------------------------- the manifest

@dataclass
class SpeechManifest:
    """``manifest.json`` of a speech directory: the graphs' files and the decoding rules
    (Whisper's generation_config: start, language and task tokens, suppressed tokens).
    ``open_graph`` (circleops.generation.generator) reads target, directory, files, signatures and
    num_threads of it as of a text manifest."""

    directory: Path
    target: str
    dtype: str
    files: dict[str, str]
    signatures: dict[str, str | None]
    num_layers: int
    cache_shape: list[int]  # [1, H, C, D], the k and the v caches alike
    cross_shape: list[int]  # [1, H, T, D]
    input_features: list[int]  # [1, mel, frames]
    prefill_len: int
    vocab_size: int
    decoder_start_token_id: int
    eos_token_ids: list[int]
    pad_token_id: int
    max_target_positions: int
    is_multilingual: bool = False
    lang_to_id: dict[str, int] = field(default_factory=dict)
    task_to_id: dict[str, int] = field(default_factory=dict)
    no_timestamps_token_id: int | None = None
    forced_decoder_ids: list[list[Any]] = field(default_factory=list)  # the legacy [[index, id], ...]
    suppress_tokens: list[int] = field(default_factory=list)
    begin_suppress_tokens: list[int] = field(default_factory=list)
    processor: str | None = PROCESSOR_DIR
    source: str = ""
    num_threads: int | None = None
    quantize: str | None = None  # never set: read by circleops.generation.generator's runtime choice
    signature_api: str | None = None  # "nnfw-c": onert runs the one file's signatures through its C API

    @property
    def kind(self) -> str:
        return "speech"

    @property
    def max_cache_len(self) -> int:
        return self.cache_shape[2]

    def path(self, graph: str) -> Path:
        return self.directory / self.files[graph]

    def to_json(self) -> dict[str, Any]:
        """The version-4 manifest (circleops.package.manifest): the common keys, and the
        ``speech`` section: every graph's inputs and outputs, the shapes, the decoding rules."""
        data = {k: v for k, v in asdict(self).items() if k != "directory"}
        common = {k: data.pop(k) for k in list(data) if k in COMMON_KEYS}
        common.update(default_runtime=PROFILES[self.target].runtime, one_file_per_graph=len(set(self.files.values())) > 1)
        graphs = {g: {"inputs": io_names(g, self.num_layers)[0], "outputs": io_names(g, self.num_layers)[1]}
                  for g in SPEECH_GRAPHS}
        return manifest_json("speech", common, {"speech": {"graphs": graphs, "cache_update": "rows", **data}})

    def write(self, directory: Path | None = None) -> Path:
        path = (directory or self.directory) / MANIFEST
        tmp = path.with_name(f".{MANIFEST}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        os.replace(tmp, path)
        return path


def is_speech_dir(directory: str | os.PathLike) -> bool:
    """``directory`` holds a manifest.json of speech graphs."""
    try:
        return manifest_kind(read_json(Path(directory) / MANIFEST)) == "speech"
    except CircleOpsError:
        return False


def read_speech_manifest(directory: str | os.PathLike) -> SpeechManifest:
    """The manifest of a directory written by ``convert --graphs encoder,prefill,decode``;
    SpeechInputError for any other directory, saying what it is."""
    d = Path(directory)
    path = d / MANIFEST
    what = ("a Hugging Face model directory, not converted graphs" if (d / "config.json").is_file()
            else "not a directory written by `circleops convert --graphs`")
    if path.is_file():  # damaged (not JSON, nested too deep...): said as such, not as "not speech graphs"
        data = read_json(path, error=ModelLoadError, fix="Convert again with --graphs encoder,prefill,decode.")
    else:
        data = None
    if isinstance(data, dict) and manifest_kind(data) != "speech" and data.get("format"):
        what = f"a directory of {data.get('format')} graphs (a text model: use --prompt), not speech graphs"
    if manifest_kind(data) != "speech":
        hint = (f"; convert it with `circleops convert {d} --graphs encoder,prefill,decode --target onert -o OUT`"
                if speech_model_type(d) else "")
        how = (" first." if hint else f". Convert a Whisper directory with `circleops convert WHISPER_DIR --graphs "
               f"encoder,prefill,decode -o OUT`, then run `circleops generate OUT --audio clip.wav`.")
        raise SpeechInputError(f"--audio needs the graphs of a Whisper-style speech model, and {d} is {what}{hint}{how}")
    if (data.get("format"), data.get("version")) not in ((SPEECH_FORMAT, SPEECH_VERSION), (MANIFEST_FORMAT, MANIFEST_VERSION)):
        raise ModelLoadError(f"{path}: speech manifest version {data.get('version')!r}; this circleops reads "
                             f"{MANIFEST_VERSION} (and {SPEECH_VERSION} of format {SPEECH_FORMAT}). Convert again with "
                             "--graphs encoder,prefill,decode.")
    names = {f.name for f in SpeechManifest.__dataclass_fields__.values()} - {"directory"}
    try:
        m = SpeechManifest(directory=d, **{k: v for k, v in manifest_fields(data).items() if k in names})
        if m.target not in PROFILES or set(m.files) != set(SPEECH_GRAPHS) or len(m.cache_shape) != 4:
            raise ValueError("target, files or cache_shape")
    except (KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"{path} is incomplete or damaged ({err}). Convert again with --graphs "
                             f"encoder,prefill,decode.") from None
    _check_speech_types(m, path)
    _check_speech_ids(m, path)
    for graph, name in m.files.items():
        confined(d, name, f"the file of graph {graph!r}", path)
    if m.processor is not None:
        refuse_remote_code(confined_tokenizer(d, m.processor, path))  # before any graph opens
    return m


def check_extractor(extractor: Any, m: SpeechManifest) -> None:
    """ModelLoadError unless the saved feature extractor makes the encoder graph's input: its
    mel bins and its window (n_samples / hop_length frames) come from preprocessor_config.json,
    and a hostile window (chunk_length 10^9) would size a buffer of terabytes."""
    _, mel, frames = m.input_features
    got = {k: getattr(extractor, k, None) for k in ("feature_size", "n_samples", "hop_length", "sampling_rate")}
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in got.values())
    if not ok or got["feature_size"] != mel or got["n_samples"] // got["hop_length"] != frames:
        raise ModelLoadError(f"{m.directory / (m.processor or PROCESSOR_DIR)}: the feature extractor (feature_size "
                             f"{got['feature_size']!r}, n_samples {got['n_samples']!r}, hop_length "
                             f"{got['hop_length']!r}) does not make the encoder's input of {mel} mel bins x {frames} "
                             f"frames. The processor files are damaged: convert again.")


def _check_speech_types(m: SpeechManifest, path: Path) -> None:
    """ModelLoadError naming every field of the wrong type or size (a hand-edited or hostile
    manifest fails here, not as a TypeError or a MemoryError in generation)."""
    def integer(v: Any, low: int = 0) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= low

    def ints(v: Any, n: int | None = None, low: int = 0) -> bool:
        return isinstance(v, list) and (n is None or len(v) == n) and all(integer(x, low) for x in v)

    # a token id's range (and whether a number is a whole one) is _check_speech_ids' to name
    def tid(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def tids(v: Any) -> bool:
        return isinstance(v, list) and all(tid(x) for x in v)

    def ids(v: Any) -> bool:
        return isinstance(v, dict) and all(isinstance(k, str) and tid(x) for k, x in v.items())

    checks = {"num_layers": integer(m.num_layers, 1), "prefill_len": integer(m.prefill_len, 1),
              "vocab_size": integer(m.vocab_size, 1), "max_target_positions": integer(m.max_target_positions, 1),
              "decoder_start_token_id": tid(m.decoder_start_token_id), "pad_token_id": tid(m.pad_token_id),
              "cache_shape": ints(m.cache_shape, 4, 1), "cross_shape": ints(m.cross_shape, 4, 1),
              "input_features": ints(m.input_features, 3, 1), "eos_token_ids": tids(m.eos_token_ids),
              "suppress_tokens": tids(m.suppress_tokens), "begin_suppress_tokens": tids(m.begin_suppress_tokens),
              "lang_to_id": ids(m.lang_to_id), "task_to_id": ids(m.task_to_id),
              "no_timestamps_token_id": m.no_timestamps_token_id is None or tid(m.no_timestamps_token_id),
              "is_multilingual": isinstance(m.is_multilingual, bool),
              "forced_decoder_ids": isinstance(m.forced_decoder_ids, list) and all(
                  isinstance(p, list) and len(p) == 2 and integer(p[0]) and (p[1] is None or tid(p[1]))
                  for p in m.forced_decoder_ids),
              "files": isinstance(m.files, dict) and all(isinstance(v, str) for v in m.files.values()),
              "signatures": isinstance(m.signatures, dict) and all(v is None or isinstance(v, str)
                                                                   for v in m.signatures.values()),
              "dtype": isinstance(m.dtype, str), "source": isinstance(m.source, str),
              "processor": m.processor is None or isinstance(m.processor, str),
              "num_threads": m.num_threads is None or (integer(m.num_threads, 1) and m.num_threads <= 1024)}
    wrong = [name for name, ok in checks.items() if not ok]
    if wrong:
        raise ModelLoadError(f"{path}: {', '.join(wrong)} {'has' if len(wrong) == 1 else 'have'} the wrong type or "
                             f"size. Convert again with --graphs encoder,prefill,decode.")


def _check_speech_ids(m: SpeechManifest, path: Path) -> None:
    """ModelLoadError unless every token id the manifest holds (start, end, pad, language,
    task, no-timestamps, forced, suppressed) is in the vocabulary: they are fed to the
    prefill graph or index the logits."""
    again = "Convert again with --graphs encoder,prefill,decode."
    if not isinstance(m.vocab_size, int) or isinstance(m.vocab_size, bool) or m.vocab_size < 1:
        raise ModelLoadError(f"{path}: vocab_size {m.vocab_size!r} is not a positive integer. {again}")
    pairs = m.forced_decoder_ids if isinstance(m.forced_decoder_ids, list) else [None]
    if not all(isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], int) for p in pairs):
        raise ModelLoadError(f"{path}: forced_decoder_ids must be a list of [index, token id] pairs. {again}")
    maps = {"lang_to_id": m.lang_to_id, "task_to_id": m.task_to_id}
    for name, table in maps.items():
        if not isinstance(table, dict):
            raise ModelLoadError(f"{path}: {name} must map names to token ids. {again}")
    lists = {"eos_token_ids": m.eos_token_ids, "suppress_tokens": m.suppress_tokens,
             "begin_suppress_tokens": m.begin_suppress_tokens}
    for name, ids in lists.items():
        if not isinstance(ids, list):
            raise ModelLoadError(f"{path}: {name} must be a list of token ids. {again}")
    fields = {"decoder_start_token_id": [m.decoder_start_token_id], "pad_token_id": [m.pad_token_id],
              "no_timestamps_token_id": [] if m.no_timestamps_token_id is None else [m.no_timestamps_token_id],
              "forced_decoder_ids": [t for _, t in pairs if t is not None],
              **lists, **{k: list(v.values()) for k, v in maps.items()}}
    for name, ids in fields.items():
        check_token_ids(ids, m.vocab_size, f"{path}: {name}", fix=again)


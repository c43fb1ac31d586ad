"""Whisper-style speech recognition: an encoder graph, a decoder prefill graph and a decode
graph with a self-attention KV cache and cross-attention K/V computed once, and greedy
generation over them (``circleops convert DIR --graphs encoder,prefill,decode``,
``circleops generate DIR --audio clip.wav``).

    from circleops.recipes import speech
    speech.convert_speech("whisper-tiny/", "asr/", target="onert", verify=True)
    gen = speech.SpeechGenerator("asr/")
    result = gen.transcribe("clip.wav", language="en")
    result.tokens, result.text

The graphs (B = 1; E = d_model, H heads of D, L decoder layers, T = max_source_positions
encoder frames, C = the self-attention cache length, P = the prefill length, V = vocab):

* encoder: ``input_features [1, mel, 2T]`` -> ``encoder_hidden_states [1, T, E]``.
* prefill: ``input_ids [1, P]`` (the forced start tokens: <|startoftranscript|>, language,
  task, <|notimestamps|>; right-padded when fewer), ``logits_row [1]`` (the row whose
  logits it returns: the last start token's) and ``encoder_hidden_states`` ->
  ``logits [1, 1, V]``, the P tokens' self-attention rows ``k_new_i`` / ``v_new_i``
  ``[1, H, P, D]`` and every layer's cross-attention ``cross_k_i`` / ``cross_v_i``
  ``[1, H, T, D]``, projected from the encoder states here, once per clip.
* decode: ``input_ids [1, 1]``, ``pos [1]``, the caches ``k_cache_i`` / ``v_cache_i``
  ``[1, H, C, D]`` (slots >= pos are masked) and ``cross_k_i`` / ``cross_v_i`` (read, never
  recomputed) -> ``logits [1, 1, V]`` and the token's rows ``k_new_i`` / ``v_new_i``
  ``[1, H, 1, D]``, which the generator writes into its caches at ``pos`` (the "rows"
  cache update of circleops.recipes.llm: no cache is copied per step).

Attention is written as matmuls and a softmax, not the fused ATTENTION op: its contract
(schema/ops.yaml) projects K and V from the same ``x`` as Q (cross-attention takes them
from the encoder states), has no projection biases (Whisper's q, v and out projections
have them) and always applies RoPE. The layer norms are LayerNorm (no RMS_NORM).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from circleops.errors import CircleOpsError, ModelLoadError, OutputError, TargetError, VerifyError
from circleops.package.manifest import MANIFEST, confined, confined_tokenizer, graph_runtimes
from circleops.targets import PROFILES
from circleops.inputs.remote_code import refuse_remote_code
from circleops.inputs.token_ids import check_token_ids
from circleops.inputs.user_files import read_json

SPEECH_FORMAT = "circleops-speech"
SPEECH_VERSION = 1
SPEECH_GRAPHS = ("encoder", "prefill", "decode")
PROCESSOR_DIR = "processor"
# the longest forced start: <|startoftranscript|> <|lang|> <|task|> <|notimestamps|>
PREFILL_LEN = 4
TASK_NAMES = ("transcribe", "translate")
DEFAULT_MAX_NEW_TOKENS = 64


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


def parse_speech_graphs(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"encoder,prefill,decode"`` -> the three names; anything else is refused (the
    decoder graphs need the encoder's states, so the three are written together)."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    if sorted(names) != sorted(SPEECH_GRAPHS):
        raise TargetError(f"a speech model's --graphs is {','.join(SPEECH_GRAPHS)} (all three: generate runs the "
                          f"encoder once, then the prefill and the decode steps); got {','.join(names) or 'nothing'}.")
    return SPEECH_GRAPHS


# --------------------------------------------------------------------------- the torch graphs

def _torch_modules() -> tuple[Any, Any, Any]:
    """The three graph modules' constructors (defined on first use: importing
    circleops.recipes.speech does not import torch); the decoder graphs are the encoder-decoder
    core's (circleops.adapters.seq2seq), Whisper one row of its family table."""
    import torch

    from circleops.adapters.seq2seq import CrossFromStates, Seq2SeqDecoderStep

    class WhisperEncoderGraph(torch.nn.Module):
        """input_features -> the encoder's last hidden state."""

        def __init__(self, model: Any):
            super().__init__()
            self.encoder = model.get_encoder()

        def forward(self, input_features: Any) -> Any:
            return self.encoder(input_features=input_features, return_dict=True).last_hidden_state

    def whisper_prefill(model: Any) -> Any:
        """The forced start tokens from slot 0: one row's logits, the tokens' self-attention
        rows, and every layer's cross-attention K/V from the encoder states (Whisper's row of
        circleops.adapters.seq2seq)."""
        return CrossFromStates(Seq2SeqDecoderStep(model, int(model.config.max_target_positions), source_mask=False))

    def whisper_decode(model: Any) -> Any:
        """One token at ``pos``: its logits and its self-attention k/v rows; the caches and
        the cross-attention K/V are inputs."""
        return Seq2SeqDecoderStep(model, int(model.config.max_target_positions), source_mask=False)

    return WhisperEncoderGraph, whisper_prefill, whisper_decode


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


@dataclass
class _Shapes:
    mel: int
    frames: int  # encoder input frames, 2 x max_source_positions
    enc_len: int  # T
    d_model: int
    heads: int
    head_dim: int
    num_layers: int
    cache_len: int  # C
    vocab: int


def _shapes(config: Any, max_cache_len: int) -> _Shapes:
    heads = int(config.decoder_attention_heads)
    return _Shapes(mel=int(config.num_mel_bins), frames=2 * int(config.max_source_positions),
                   enc_len=int(config.max_source_positions), d_model=int(config.d_model), heads=heads,
                   head_dim=int(config.d_model) // heads, num_layers=int(config.decoder_layers),
                   cache_len=min(int(max_cache_len), int(config.max_target_positions)), vocab=int(config.vocab_size))


def example_args(graph: str, s: _Shapes, seed: int = 0) -> tuple:
    """Export (and verify) inputs of a graph: random features and states, zero caches."""
    import torch

    g = torch.Generator().manual_seed(seed)
    states = torch.randn((1, s.enc_len, s.d_model), generator=g)
    if graph == "encoder":
        return (torch.randn((1, s.mel, s.frames), generator=g),)
    if graph == "prefill":
        return (torch.zeros((1, PREFILL_LEN), dtype=torch.int64), torch.tensor([PREFILL_LEN - 1]), states)
    # one tensor per input: torch.export makes inputs given the same tensor object one
    # aliased value, and the lowered graph then reads one cache where each layer has its own
    caches = [torch.zeros((1, s.heads, s.cache_len, s.head_dim)) for _ in range(2 * s.num_layers)]
    cross = [torch.zeros((1, s.heads, s.enc_len, s.head_dim)) for _ in range(2 * s.num_layers)]
    return (torch.zeros((1, 1), dtype=torch.int64), torch.tensor([PREFILL_LEN]), *caches, *cross)


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

    @property
    def max_cache_len(self) -> int:
        return self.cache_shape[2]

    def path(self, graph: str) -> Path:
        return self.directory / self.files[graph]

    def to_json(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if k != "directory"}
        return {"format": SPEECH_FORMAT, "version": SPEECH_VERSION, "default_runtime": PROFILES[self.target].runtime,
                "graphs": {g: {"inputs": io_names(g, self.num_layers)[0], "outputs": io_names(g, self.num_layers)[1]}
                           for g in SPEECH_GRAPHS},
                "cache_update": "rows", **data}

    def write(self, directory: Path | None = None) -> Path:
        path = (directory or self.directory) / MANIFEST
        tmp = path.with_name(f".{MANIFEST}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        os.replace(tmp, path)
        return path


def is_speech_dir(directory: str | os.PathLike) -> bool:
    """``directory`` holds a manifest.json of speech graphs."""
    try:
        return read_json(Path(directory) / MANIFEST).get("format") == SPEECH_FORMAT
    except (CircleOpsError, AttributeError):
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
    if isinstance(data, dict) and data.get("format") != SPEECH_FORMAT and data.get("format"):
        what = f"a directory of {data.get('format')} graphs (a text model: use --prompt), not speech graphs"
    if not isinstance(data, dict) or data.get("format") != SPEECH_FORMAT:
        hint = (f"; convert it with `circleops convert {d} --graphs encoder,prefill,decode --target onert -o OUT`"
                if speech_model_type(d) else "")
        how = (" first." if hint else f". Convert a Whisper directory with `circleops convert WHISPER_DIR --graphs "
               f"encoder,prefill,decode -o OUT`, then run `circleops generate OUT --audio clip.wav`.")
        raise SpeechInputError(f"--audio needs the graphs of a Whisper-style speech model, and {d} is {what}{hint}{how}")
    if data.get("version") != SPEECH_VERSION:
        raise ModelLoadError(f"{path}: speech manifest version {data.get('version')!r}; this circleops reads "
                             f"{SPEECH_VERSION}. Convert again with --graphs encoder,prefill,decode.")
    names = {f.name for f in SpeechManifest.__dataclass_fields__.values()} - {"directory"}
    try:
        m = SpeechManifest(directory=d, **{k: v for k, v in data.items() if k in names})
        if m.target not in PROFILES or set(m.files) != set(SPEECH_GRAPHS) or len(m.cache_shape) != 4:
            raise ValueError("target, files or cache_shape")
    except (TypeError, ValueError) as err:
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


# --------------------------------------------------------------------------- convert

@dataclass
class SpeechReport:
    """What ``convert_speech`` wrote."""

    directory: str
    target: str
    source: str
    graphs: dict[str, dict[str, Any]]  # name -> file, signature, ops, size, inputs, outputs, max_abs_error
    manifest: SpeechManifest
    timings: dict[str, float] = field(default_factory=dict)
    verify_runtime: str | None = None
    tolerance: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"directory": self.directory, "target": self.target, "source": self.source, "graphs": self.graphs,
                "manifest": self.manifest.to_json(), "verify_runtime": self.verify_runtime,
                "tolerance": self.tolerance, "timings": {k: round(v, 3) for k, v in self.timings.items()}}

    def summary(self) -> str:
        m = self.manifest
        lines = [f"circleops: wrote the speech graphs of {self.source or 'the model'} to {self.directory}/ "
                 f"(target {self.target}, {m.dtype})"]
        for name, g in self.graphs.items():
            where = g["file"] + (f" [signature {g['signature']}]" if g["signature"] else "")
            ins = ", ".join(f"{n} {s}" for n, s, _ in g["inputs"][:3]) + (
                f", +{len(g['inputs']) - 3} caches" if len(g["inputs"]) > 3 else "")
            lines.append(f"  {name:8s} {where}  {g['size'] / 1e6:.1f} MB  in: {ins}  ({sum(g['ops'].values())} ops)")
        lines.append(f"  manifest.json: prefill of {m.prefill_len} start tokens, self-attention cache "
                     f"{m.cache_shape} x {2 * m.num_layers}, cross-attention K/V {m.cross_shape} x {2 * m.num_layers} "
                     f"(computed once per clip by the prefill), processor {m.processor or 'none'}")
        if self.verify_runtime:
            errs = ", ".join(f"{n} {g['max_abs_error']:.3g}" for n, g in self.graphs.items())
            lines.append(f"  verify ({self.verify_runtime}, against the model's own forward): max abs error {errs} "
                         f"(tolerance {self.tolerance:.3g} x max(1, max|output|)): passed")
        lines.append("  time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.timings.items()))
        lines.append(f"  next: circleops generate {self.directory} --audio clip.wav")
        return "\n".join(lines)


def convert_speech(model: Any, out_dir: str | os.PathLike, *, target: str = "onert", max_cache_len: int = 448,
                   processor: Any = None, verify: bool | str = False, tolerance: float | None = None,
                   source: str = "", progress: Callable[[str], None] | None = None,
                   threads: int | None = None) -> SpeechReport:
    """Write the encoder, prefill and decode graphs of ``model`` (a
    WhisperForConditionalGeneration, or the path of its HF directory) into ``out_dir``, with
    ``manifest.json``, ``generation_config.json`` and the processor (feature extractor +
    tokenizer; loaded from the directory when ``model`` is a path) in ``out_dir/processor``.

    ``max_cache_len``: self-attention cache slots (at most the model's
    max_target_positions, which it is cut to). ``verify``: run each written graph (True: the
    target's runtime, or name one) against the model's own forward on random features and
    start tokens; VerifyError above ``tolerance`` (default 1e-3) x max(1, max|output|).
    Nothing is changed in ``out_dir`` unless every graph was written (and verified).
    """
    import torch

    from circleops.recipes import llm as graph_files
    from circleops.pipeline import stages as pipeline
    from circleops.runtime import choose_runtime
    from circleops.pipeline.validate import validate_threads

    if target not in PROFILES:
        raise TargetError(f"unknown target {target!r}: choose one of {', '.join(PROFILES)}.")
    validate_threads(threads)
    if isinstance(model, (str, os.PathLike)):
        model, processor, source = _load(model, processor, source)
    if getattr(getattr(model, "config", None), "model_type", None) != "whisper":
        raise TargetError(f"{source or type(model).__name__} is not a Whisper model (model_type "
                          f"{getattr(getattr(model, 'config', None), 'model_type', None)!r}): the speech graphs "
                          f"are written for WhisperForConditionalGeneration.")
    runtime = None
    if verify:
        if verify is not True and str(verify) not in graph_runtimes(target):
            raise TargetError(f"runtime {verify} cannot run target {target}'s files; use one of "
                              f"{', '.join(graph_runtimes(target))}.")
        runtime, _ = choose_runtime(verify, target, None)
    model = model.eval().float()
    shapes = _shapes(model.config, max_cache_len)
    if shapes.cache_len <= PREFILL_LEN:
        raise TargetError(f"--max-cache-len {max_cache_len} leaves no room to generate after the {PREFILL_LEN} "
                          f"start tokens; use a larger value (the model allows {model.config.max_target_positions}).")
    profile = PROFILES[target]
    fmt = profile.format
    files = {g: (f"{g}.{fmt}" if profile.one_file_per_graph else f"model.{fmt}") for g in SPEECH_GRAPHS}
    opts = pipeline.Options(target, torch.float32, threads=threads, runtime=runtime, tolerance=tolerance)
    tracker = pipeline.Tracker(progress)
    out = Path(out_dir)
    graph_files.prepare_output_dir(out)
    staging = graph_files.staging_dir(out)
    try:
        modules = dict(zip(SPEECH_GRAPHS, (cls(model) for cls in _torch_modules())))
        args = {g: example_args(g, shapes) for g in SPEECH_GRAPHS}
        with tracker.stage("export"), torch.no_grad():
            eps = {g: pipeline.export(modules[g], args[g], adapters=False, warn_list=[]) for g in SPEECH_GRAPHS}
        built = pipeline.build(eps, opts, None, tracker,
                               lower_one=lambda g, ep: _name_io(pipeline.lower(ep, opts), g, shapes.num_layers))
        with tracker.stage("write"):
            infos = _write(built.models, files, staging, opts)
            manifest = _manifest(model, target, files, infos, shapes, source=source, threads=threads)
            manifest.directory = staging
            try:
                if processor is not None:
                    processor.save_pretrained(str(staging / PROCESSOR_DIR))
                else:
                    manifest.processor = None
                if getattr(model, "generation_config", None) is not None:
                    model.generation_config.to_json_file(str(staging / "generation_config.json"))
            except OSError as err:
                raise OutputError(f"cannot write the processor into {staging}: {err.strerror or err}.") from None
        report = SpeechReport(str(out), target, source, infos, manifest, tracker.timings)
        if runtime is not None:
            tol = 1e-3 if tolerance is None else tolerance
            with tracker.stage("verify"):
                errors = _verify(manifest, modules, args, runtime, tol)
            for g, err in errors.items():
                infos[g]["max_abs_error"] = err
            report.verify_runtime, report.tolerance = runtime, tol
        manifest.write(staging)
        graph_files.publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    manifest.directory = out
    return report


def _load(path: Any, processor: Any, source: str) -> tuple[Any, Any, str]:
    """The model of an HF directory (or hub id), and its processor."""
    from circleops.sources import models
    from circleops.sources.hub import resolve_model

    path = resolve_model(str(path))
    if speech_model_type(path) is None:
        raise TargetError(f"{path} is not a Whisper directory (its config.json's model_type is not 'whisper'): "
                          f"--graphs encoder,prefill,decode writes Whisper's speech graphs. For a causal LM use "
                          f"--graphs prefill,decode.")
    from transformers import WhisperForConditionalGeneration

    loaded = models.load(path, model_class=lambda *a: WhisperForConditionalGeneration)
    if (Path(path) / "generation_config.json").is_file():  # the start, language and task tokens live there
        from transformers import GenerationConfig

        loaded.module.generation_config = GenerationConfig.from_pretrained(str(path), trust_remote_code=False)
    if processor is None:
        processor = load_processor(Path(path))
    return loaded.module, processor, source or loaded.source


def load_processor(path: Path) -> Any:
    """The WhisperProcessor saved in ``path`` (feature extractor and tokenizer), or None."""
    import contextlib
    import io

    from transformers import WhisperProcessor

    refuse_remote_code(path)  # before the except below, which takes any failure for "no processor"
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return WhisperProcessor.from_pretrained(str(path), trust_remote_code=False)
    except Exception:  # a directory with no processor: the graphs still convert
        return None


def _name_io(model: Any, graph: str, num_layers: int) -> Any:
    """Name the lowered graph's subgraph, inputs, outputs and signature after ``graph``."""
    sub = model.subgraphs[0]
    sub.name = graph
    ins, outs = io_names(graph, num_layers)
    if len(sub.inputs) != len(ins) or len(sub.outputs) != len(outs):
        raise CircleOpsError(f"internal: the {graph} graph has {len(sub.inputs)} inputs and {len(sub.outputs)} "
                             f"outputs, expected {len(ins)} and {len(outs)}.")
    for idx, name in zip(sub.inputs, ins):
        sub.tensors[idx].name = name
    for idx, name in zip(sub.outputs, outs):
        sub.tensors[idx].name = name
    sig = model.signatures[0]
    sig.key, sig.inputs, sig.outputs = graph, dict(zip(ins, sub.inputs)), dict(zip(outs, sub.outputs))
    return model


def _write(lowered: dict[str, Any], files: dict[str, str], out_dir: Path, opts: Any) -> dict[str, dict[str, Any]]:
    """One file per graph, or one file with a signature per graph (the target says)."""
    from circleops.pipeline import stages as pipeline
    from circleops.recipes.llm import merge_models

    groups: dict[str, dict[str, Any]] = {}
    for g, m in lowered.items():
        groups.setdefault(files[g], {})[g] = m
    one_per_graph = opts.profile.one_file_per_graph
    infos: dict[str, dict[str, Any]] = {}
    for file, members in groups.items():
        ir_model = next(iter(members.values())) if one_per_graph else merge_models(members)
        info = pipeline.write(ir_model, out_dir / file, opts)
        for g, m in members.items():
            sub = m.subgraphs[0]
            infos[g] = {"file": file, "signature": None if one_per_graph else g, "ops": pipeline.op_histogram(m),
                        "size": info.file_bytes,
                        "inputs": [(sub.tensors[i].name, list(sub.tensors[i].shape), sub.tensors[i].dtype)
                                   for i in sub.inputs],
                        "outputs": [(sub.tensors[i].name, list(sub.tensors[i].shape), sub.tensors[i].dtype)
                                    for i in sub.outputs], "max_abs_error": None}
    return infos


def _manifest(model: Any, target: str, files: dict[str, str], infos: dict[str, Any], s: _Shapes, *, source: str,
              threads: int | None) -> SpeechManifest:
    cfg, gen = model.config, getattr(model, "generation_config", None)

    def get(name: str, default: Any = None) -> Any:
        value = getattr(gen, name, None) if gen is not None else None
        return value if value is not None else getattr(cfg, name, default)

    eos = get("eos_token_id")
    eos_ids = sorted({int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]) if i is not None})
    return SpeechManifest(
        directory=Path("."), target=target, dtype="fp32", files=files,
        signatures={g: infos[g]["signature"] for g in SPEECH_GRAPHS}, num_layers=s.num_layers,
        cache_shape=[1, s.heads, s.cache_len, s.head_dim], cross_shape=[1, s.heads, s.enc_len, s.head_dim],
        input_features=[1, s.mel, s.frames], prefill_len=PREFILL_LEN, vocab_size=s.vocab,
        decoder_start_token_id=int(get("decoder_start_token_id")), eos_token_ids=eos_ids,
        pad_token_id=int(get("pad_token_id", eos_ids[0] if eos_ids else 0)),
        max_target_positions=int(cfg.max_target_positions), is_multilingual=bool(get("is_multilingual", False)),
        lang_to_id={str(k): int(v) for k, v in (get("lang_to_id") or {}).items()},
        task_to_id={str(k): int(v) for k, v in (get("task_to_id") or {}).items()},
        no_timestamps_token_id=get("no_timestamps_token_id"),
        forced_decoder_ids=[list(pair) for pair in get("forced_decoder_ids") or []],
        suppress_tokens=[int(t) for t in get("suppress_tokens") or []],
        begin_suppress_tokens=[int(t) for t in get("begin_suppress_tokens") or []],
        source=source, num_threads=threads)


def _verify(manifest: SpeechManifest, modules: dict[str, Any], args: dict[str, tuple], runtime: str,
            tol: float) -> dict[str, float]:
    """Each graph on its runtime against its torch module: the encoder on random features,
    the prefill on the start tokens over those states, one decode step after it over the
    prefill's own rows and cross K/V. VerifyError above tol x max(1, max|output|)."""
    import numpy as np
    import torch

    from circleops.generation.generator import open_graph

    first = [manifest.decoder_start_token_id, *list(manifest.lang_to_id.values())[:1],
             *list(manifest.task_to_id.values())[:1]]
    ids = torch.tensor([(first + [manifest.eos_token_ids[0]] * PREFILL_LEN)[:PREFILL_LEN]])
    features = args["encoder"][0]
    with torch.no_grad():
        states = modules["encoder"](features)
        pre = modules["prefill"](ids, torch.tensor([PREFILL_LEN - 1]), states)
        n = manifest.num_layers
        caches = [torch.nn.functional.pad(r, (0, 0, 0, manifest.max_cache_len - PREFILL_LEN)) for r in pre[1:2 * n + 1]]
        token = torch.tensor([[int(pre[0][0, 0].argmax())]])
        dec = modules["decode"](token, torch.tensor([PREFILL_LEN]), *caches, *pre[2 * n + 1:])
    runs = {"encoder": ([features], [states]), "prefill": ([ids, torch.tensor([PREFILL_LEN - 1]), states], pre),
            "decode": ([token, torch.tensor([PREFILL_LEN]), *caches, *pre[2 * n + 1:]], dec)}
    errors = {}
    for g, (inputs, want) in runs.items():
        got = open_graph(manifest, g, runtime, isolated=True).run([np.asarray(t.numpy()) for t in inputs])
        err = max(float(np.abs(np.asarray(a) - w.numpy()).max()) for a, w in zip(got, want))
        scale = max(1.0, max(float(w.abs().max()) for w in want))
        if not err <= tol * scale:
            raise VerifyError(f"the written {g} graph does not match the model: {runtime} gives max abs error "
                              f"{err:.3g} (tolerance {tol:.3g} x {scale:.3g}); nothing was written. Convert without "
                              f"--verify to inspect the files (circleops inspect), and report the model.")
        errors[g] = err
    return errors


# --------------------------------------------------------------------------- audio and generation

def read_audio(path: str | os.PathLike, sampling_rate: int) -> Any:
    """A WAV file (8/16/32-bit PCM, mono or mixed down) as float32 samples; a file at
    another rate than the model's is refused (resampling would change what it hears)."""
    from circleops.recipes.task_io import read_wav

    samples, rate = read_wav(str(path))
    if rate != sampling_rate:
        raise SpeechInputError(f"{path} is sampled at {rate} Hz and the model hears {sampling_rate} Hz: resample it "
                               f"first (e.g. `sox {path} -r {sampling_rate} clip-{sampling_rate // 1000}k.wav`, or "
                               f"`ffmpeg -i {path} -ar {sampling_rate} clip-{sampling_rate // 1000}k.wav`).")
    return samples


@dataclass
class Transcription:
    """What :meth:`SpeechGenerator.generate` produced: the generated tokens as transformers'
    ``WhisperForConditionalGeneration.generate(...)[0]`` returns them (transformers 5: without
    the start tokens and without the end token; ``stopped_at_eos`` says whether the end token
    was reached), the start tokens it was given, the text, and where the time went."""

    tokens: list[int]
    start_tokens: list[int]
    text: str | None = None
    language: str | None = None  # the language token, given or detected
    encode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stopped_at_eos: bool = False

    def timing_line(self) -> str:
        steps = max(0, len(self.tokens) - 1)
        rate = f", {steps / self.decode_seconds:.1f} tokens/s" if steps and self.decode_seconds > 0 else ""
        return (f"circleops: encoder {self.encode_seconds * 1e3:.0f} ms, prefill of {len(self.start_tokens)} start "
                f"tokens {self.prefill_seconds * 1e3:.0f} ms, {len(self.tokens)} tokens decoded in "
                f"{self.decode_seconds:.2f} s{rate}")


class SpeechGenerator:
    """Greedy speech-to-text over a speech directory's graphs, as transformers'
    ``WhisperForConditionalGeneration.generate(input_features, do_sample=False)`` decodes
    (short-form: one window): the same start tokens for ``language`` / ``task`` (the
    language detected from the first token's logits when the model is multilingual and
    none is given), the same suppressed tokens. One Session per graph, opened once."""

    def __init__(self, directory: str | os.PathLike | SpeechManifest, runtime: str | None = None):
        from circleops.generation.generator import choose_runtime, open_graph

        self.manifest = directory if isinstance(directory, SpeechManifest) else read_speech_manifest(directory)
        self.runtime, self.note = choose_runtime(self.manifest, runtime)
        self.sessions = {g: open_graph(self.manifest, g, self.runtime) for g in SPEECH_GRAPHS}
        self._check_sessions()
        self._processor: Any = None

    def _check_sessions(self) -> None:
        m = self.manifest
        counts = {g: len(self.sessions[g].inputs) for g in SPEECH_GRAPHS}
        if counts["decode"] != 2 + 4 * m.num_layers:  # before any list is sized by num_layers
            raise ModelLoadError(f"{m.directory}/{MANIFEST} does not describe its decode graph: num_layers "
                                 f"{m.num_layers} means {2 + 4 * m.num_layers} inputs, the graph takes "
                                 f"{counts['decode']}. Convert again with --graphs encoder,prefill,decode.")
        want = {"encoder": [m.input_features], "prefill": [[1, m.prefill_len], [1], [1, m.cross_shape[2], m.cross_shape[1] * m.cross_shape[3]]],
                "decode": [[1, 1], [1]] + [m.cache_shape] * (2 * m.num_layers) + [m.cross_shape] * (2 * m.num_layers)}
        for g, shapes in want.items():
            got = [list(spec.shape) for spec in self.sessions[g].inputs]
            if got != shapes:
                raise ModelLoadError(f"{m.directory}/{MANIFEST} does not describe its {g} graph: it takes inputs of "
                                     f"shapes {got}, the manifest says {shapes}. Convert again with --graphs "
                                     f"encoder,prefill,decode.")
        for g in ("prefill", "decode"):  # the ids are checked against vocab_size: it must be the graphs'
            logits = list(self.sessions[g].outputs[0].shape)
            if logits[-1:] != [m.vocab_size]:
                raise ModelLoadError(f"{m.directory}/{MANIFEST} says vocab_size {m.vocab_size}, and the {g} graph's "
                                     f"logits have shape {logits}. Convert again with --graphs encoder,prefill,decode.")

    @property
    def processor(self) -> Any:
        """The saved WhisperProcessor (feature extractor + tokenizer)."""
        if self._processor is None:
            if self.manifest.processor is None:
                raise ModelLoadError(f"{self.manifest.directory} has no processor (the model directory had no "
                                     f"preprocessor_config.json / tokenizer): pass input features and token ids "
                                     f"from Python (SpeechGenerator.generate).")
            self._processor = load_processor(self.manifest.directory / self.manifest.processor)
            if self._processor is None:
                raise ModelLoadError(f"cannot load the processor in {self.manifest.directory / self.manifest.processor}. "
                                     f"Convert again.")
        return self._processor

    def features(self, audio: str | os.PathLike | Any, *, warn: Callable[[str], None] | None = None) -> Any:
        """log-mel ``input_features [1, mel, frames]`` of a WAV file or of float samples at
        the model's rate, by the saved feature extractor (padded or cut to one window)."""
        import numpy as np

        extractor = self.processor.feature_extractor
        check_extractor(extractor, self.manifest)  # its window sizes the buffers: checked before any is made
        samples = read_audio(audio, extractor.sampling_rate) if isinstance(audio, (str, os.PathLike)) else audio
        samples = np.asarray(samples, dtype=np.float32)
        if warn is not None and samples.size > extractor.n_samples:
            warn(f"the audio is {samples.size / extractor.sampling_rate:.1f} s long and the model hears windows of "
                 f"{extractor.n_samples / extractor.sampling_rate:.1f} s: only the first window is transcribed "
                 f"(long-form transcription is not implemented)")
        feats = extractor(samples, sampling_rate=extractor.sampling_rate, return_tensors="np")["input_features"]
        return np.asarray(feats, dtype=np.float32)

    def transcribe(self, audio: str | os.PathLike | Any, *, language: str | None = None, task: str | None = None,
                   max_new_tokens: int | None = None, on_token: Callable[[int], None] | None = None,
                   warn: Callable[[str], None] | None = None) -> Transcription:
        """:meth:`generate` on the features of ``audio``, with the text decoded."""
        result = self.generate(self.features(audio, warn=warn), language=language, task=task,
                               max_new_tokens=max_new_tokens, on_token=on_token)
        result.text = self.processor.tokenizer.decode(result.tokens, skip_special_tokens=True)
        return result

    # ------------------------------------------------------------------ decoding

    def _language_id(self, language: str) -> int:
        m = self.manifest
        if not m.lang_to_id:
            raise SpeechInputError(f"{m.source or m.directory} is English-only (its generation config lists no "
                                   f"languages): drop --language.")
        from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

        name = language.lower()
        token = (name if name in m.lang_to_id else f"<|{TO_LANGUAGE_CODE[name]}|>" if name in TO_LANGUAGE_CODE
                 else f"<|{name}|>")
        if token not in m.lang_to_id:
            codes = ", ".join(t.strip("<|>") for t in m.lang_to_id)
            raise SpeechInputError(f"language {language!r} is not one of the model's: {codes}.")
        return m.lang_to_id[token]

    def start_tokens(self, encoder_states: Any, language: str | None = None, task: str | None = None) -> list[int]:
        """The forced start tokens, by transformers' rules (WhisperGenerationMixin's
        _retrieve_init_tokens, short-form, no timestamps)."""
        import numpy as np

        m = self.manifest
        if task is not None and task not in TASK_NAMES:
            raise SpeechInputError(f"task {task!r}: Whisper's tasks are {', '.join(TASK_NAMES)}.")
        if not m.is_multilingual and (task is not None or language is not None):
            raise SpeechInputError(f"{m.source or m.directory} is English-only: it takes no --language or --task.")
        init: list[Any] = [m.decoder_start_token_id]
        if task is None and language is None:
            forced = sorted((int(i), t) for i, t in m.forced_decoder_ids)
            for k, (i, t) in enumerate(forced):
                if i != k + 1:
                    break
                init.append(None if t is None else int(t))
        undefined = len(init) <= 1 or init[1] is None
        lang: int | None = None
        if language is not None:
            lang = self._language_id(language)
        elif m.lang_to_id and undefined:
            logits = self._prefill([m.decoder_start_token_id], encoder_states, row=0)[0].reshape(-1)
            ids = sorted(m.lang_to_id.values())
            lang = ids[int(np.argmax(logits[ids]))]
        if lang is not None:
            if len(init) > 1:
                init[1] = lang
            else:
                init.append(lang)
        if task is not None:
            task_id = m.task_to_id.get(task)
            if task_id is None:
                raise SpeechInputError(f"the model's generation config has no task {task!r}.")
            if any(t in m.task_to_id.values() for t in init):
                init = [task_id if t in m.task_to_id.values() else t for t in init]
            else:
                init.append(task_id)
        elif language is not None and "transcribe" in m.task_to_id:
            if not any(t in m.task_to_id.values() for t in init):
                init.append(m.task_to_id["transcribe"])
        if m.no_timestamps_token_id is not None and init[-1] != m.no_timestamps_token_id:
            init.append(int(m.no_timestamps_token_id))
        init = [int(t) for t in init if t is not None]
        if len(init) > m.prefill_len:
            raise SpeechInputError(f"the start tokens {init} are more than the prefill graph's {m.prefill_len}.")
        return init

    def _prefill(self, tokens: Sequence[int], encoder_states: Any, row: int) -> list[Any]:
        import numpy as np

        m = self.manifest
        ids = np.full((1, m.prefill_len), m.pad_token_id, dtype=np.int64)
        ids[0, :len(tokens)] = tokens
        return self.sessions["prefill"].run([ids, np.array([row], np.int64), encoder_states])

    def generate(self, input_features: Any, *, language: str | None = None, task: str | None = None,
                 max_new_tokens: int | None = None, on_token: Callable[[int], None] | None = None) -> Transcription:
        """Greedy tokens for ``input_features [1, mel, frames]``; ``max_new_tokens`` (None:
        up to max_target_positions, as transformers) is cut to what the cache holds."""
        import numpy as np

        m = self.manifest
        feats = np.asarray(input_features, dtype=np.float32)
        if list(feats.shape) != m.input_features:
            raise SpeechInputError(f"input_features of shape {list(feats.shape)}; the encoder graph takes "
                                   f"{m.input_features} (one window of the model's feature extractor).")
        t0 = time.perf_counter()
        states = self.sessions["encoder"].run([feats])[0]
        t1 = time.perf_counter()
        init = self.start_tokens(states, language, task)
        n, layers = len(init), m.num_layers
        outs = self._prefill(init, states, row=n - 1)
        caches = [np.zeros(m.cache_shape, np.float32) for _ in range(2 * layers)]
        for cache, rows in zip(caches, outs[1:2 * layers + 1]):
            cache[:, :, :m.prefill_len] = rows
        cross = [np.ascontiguousarray(c) for c in outs[2 * layers + 1:]]
        t2 = time.perf_counter()
        # transformers: at most max_target_positions tokens in all; the cache holds the fed ones
        limit = min(m.max_target_positions, m.max_cache_len + 1) - n
        budget = limit if max_new_tokens is None else min(int(max_new_tokens), limit)
        suppress = [t for t in m.suppress_tokens if 0 <= t < m.vocab_size]
        begin = [t for t in m.begin_suppress_tokens if 0 <= t < m.vocab_size]
        logits, tokens, pos, stopped = outs[0].reshape(-1), [], n, False
        while len(tokens) < budget:
            scores = logits.astype(np.float32).copy()
            scores[suppress] = -np.inf
            if not tokens:
                scores[begin] = -np.inf
            token = int(np.argmax(scores))
            if token in m.eos_token_ids:  # the end: transformers' Whisper generate leaves it out of its output
                stopped = True
                break
            tokens.append(token)
            if on_token is not None:
                on_token(token)
            if len(tokens) == budget:
                break
            step = self.sessions["decode"].run([np.array([[token]], np.int64), np.array([pos], np.int64),
                                                *caches, *cross])
            for cache, row in zip(caches, step[1:]):
                cache[:, :, pos:pos + 1] = row
            logits, pos = step[0].reshape(-1), pos + 1
        lang = next((k.strip("<|>") for k, v in m.lang_to_id.items() if v in init[1:2]), None)
        return Transcription(tokens, init, language=lang, encode_seconds=t1 - t0, prefill_seconds=t2 - t1,
                             decode_seconds=time.perf_counter() - t2, stopped_at_eos=stopped)

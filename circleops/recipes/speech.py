"""Whisper-style speech recognition: an encoder graph, a decoder prefill graph and a decode
graph with a self-attention KV cache and cross-attention K/V computed once, and greedy
generation over them (``circleops convert DIR --graphs encoder,prefill,decode``,
``circleops generate DIR --audio clip.wav``).

    from circleops.recipes import speech
    from circleops.generation.speech import SpeechGenerator
    speech.convert_speech("whisper-tiny/", "asr/", target="onert", verify=True)
    gen = SpeechGenerator("asr/")
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

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from circleops.errors import CircleOpsError, OutputError, TargetError, VerifyError
from circleops.generation.speech import load_processor
from circleops.package.manifest import graph_runtimes
from circleops.package.speech_manifest import PROCESSOR_DIR, SPEECH_GRAPHS, SpeechManifest, io_names, speech_model_type
from circleops.targets import PROFILES

# the longest forced start: <|startoftranscript|> <|lang|> <|task|> <|notimestamps|>
PREFILL_LEN = 4


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



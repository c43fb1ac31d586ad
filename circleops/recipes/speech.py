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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from circleops.errors import OutputError, TargetError
from circleops.generation.speech import load_processor
from circleops.options import ConvertOptions
from circleops.package import step as package_step
from circleops.package.report import GraphsReport
from circleops.package.speech_manifest import PROCESSOR_DIR, SPEECH_GRAPHS, SpeechManifest, io_names, speech_model_type
from circleops.package.step import Graph
from circleops.recipes.base import Recipe, save_generation_config

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


# --------------------------------------------------------------------------- the recipe

class SpeechRecipe(Recipe):
    """A Whisper model's encoder, prefill and decode graphs (see the module docstring), its
    decoding rules (generation_config's start, language and task tokens, suppressed tokens)
    in the manifest's ``speech`` section, and its processor (feature extractor + tokenizer)
    saved in ``processor/``. Options: ``max_cache_len`` (cut to max_target_positions),
    ``verify``, ``tolerance``, ``threads`` and the target; fp32 only, nothing to quantize or fuse."""

    kind = "speech"
    graph_names = SPEECH_GRAPHS
    compared = ""  # every output of each graph, not only logits

    def __init__(self, model: Any, options: ConvertOptions | None = None, *, processor: Any = None,
                 source: str = ""):
        super().__init__(model, options, tokenizer=None, source=source)
        self.processor = processor

    def dtype(self) -> Any:
        import torch

        return torch.float32

    @classmethod
    def check_options(cls, options: ConvertOptions, source: str | None = None) -> None:
        o = options
        parse_speech_graphs(o.graphs if o.graphs is not None else SPEECH_GRAPHS)
        if o.config is not None:
            raise TargetError("--graphs encoder,prefill,decode needs the Whisper directory as MODEL (config.json, "
                              "safetensors, generation_config.json and the processor files); --config is not "
                              "supported for speech graphs.")
        refused = [flag for flag, given in (("--quantize", o.quantize), ("--dtype", o.dtype not in (None, "fp32")
                                                                          and str(o.dtype) != "torch.float32"),
                                            ("--seq-len", o.seq_len is not None),
                                            ("--fuse", o.fuse not in ("auto", "adapters"))) if given]
        if refused:
            raise TargetError(f"{', '.join(refused)} do(es) not apply to speech graphs yet (fp32, the prefill is the "
                              f"{PREFILL_LEN} start tokens, nothing to fuse: LayerNorm and biased attention); drop "
                              f"{'them' if len(refused) > 1 else 'it'}.")

    @classmethod
    def from_source(cls, model: str | None, options: ConvertOptions) -> "SpeechRecipe":
        module, processor, source = _load(model, None, "")
        return cls(module, options, processor=processor, source=source)

    def check(self, opts: Any) -> None:
        o = self.options
        self.check_options(o)
        config = getattr(self.model, "config", None)
        if getattr(config, "model_type", None) != "whisper":
            raise TargetError(f"{self.source or type(self.model).__name__} is not a Whisper model (model_type "
                              f"{getattr(config, 'model_type', None)!r}): the speech graphs are written for "
                              f"WhisperForConditionalGeneration.")
        self.model = self.model.eval().float()
        self.shapes = _shapes(config, o.max_cache_len)
        if self.shapes.cache_len <= PREFILL_LEN:
            raise TargetError(f"--max-cache-len {o.max_cache_len} leaves no room to generate after the {PREFILL_LEN} "
                              f"start tokens; use a larger value (the model allows {config.max_target_positions}).")
        self.modules = dict(zip(SPEECH_GRAPHS, (cls(self.model) for cls in _torch_modules())))
        self.args = {g: example_args(g, self.shapes) for g in SPEECH_GRAPHS}

    def references(self) -> dict[str, tuple[list, list]]:
        return references(self.modules, self.args, self.decoding())

    def graphs(self, opts: Any, parts: Sequence[tuple[int, int]]) -> list[Graph]:
        # rows: what each graph's matmuls run (its thread count), as circleops.generation.speech plans them
        frames = self.shapes.enc_len
        return [Graph(g, self.modules[g], self.args[g], *io_names(g, self.shapes.num_layers), rows=rows)
                for g, rows in zip(SPEECH_GRAPHS, (frames, frames, 1))]

    def decoding(self) -> dict[str, Any]:
        """The manifest's decoding rules: generation_config's (else config's) start, end, pad,
        language and task tokens, suppressed tokens; the EOS ids by the one rule."""
        cfg, gen = self.model.config, getattr(self.model, "generation_config", None)

        def get(name: str, default: Any = None) -> Any:
            value = getattr(gen, name, None) if gen is not None else None
            return value if value is not None else getattr(cfg, name, default)

        eos = self.eos_token_ids()
        return dict(decoder_start_token_id=int(get("decoder_start_token_id")), eos_token_ids=eos,
                    pad_token_id=int(get("pad_token_id", eos[0] if eos else 0)),
                    max_target_positions=int(cfg.max_target_positions),
                    is_multilingual=bool(get("is_multilingual", False)),
                    lang_to_id={str(k): int(v) for k, v in (get("lang_to_id") or {}).items()},
                    task_to_id={str(k): int(v) for k, v in (get("task_to_id") or {}).items()},
                    no_timestamps_token_id=get("no_timestamps_token_id"),
                    forced_decoder_ids=[list(pair) for pair in get("forced_decoder_ids") or []],
                    suppress_tokens=[int(t) for t in get("suppress_tokens") or []],
                    begin_suppress_tokens=[int(t) for t in get("begin_suppress_tokens") or []])

    def manifest(self, directory: Path, opts: Any, plan: Any, infos: dict[str, Any]) -> SpeechManifest:
        s = self.shapes
        processor = None
        if self.processor is not None:
            try:
                self.processor.save_pretrained(str(directory / PROCESSOR_DIR))
            except OSError as err:
                raise OutputError(f"cannot write the processor into {directory}: {err.strerror or err}.") from None
            processor = PROCESSOR_DIR
        save_generation_config(self.model, directory)
        return SpeechManifest(
            directory=directory, target=opts.target, dtype="fp32", files={g: plan.file(g) for g in SPEECH_GRAPHS},
            signatures={g: infos[g].signature for g in SPEECH_GRAPHS}, num_layers=s.num_layers,
            cache_shape=[1, s.heads, s.cache_len, s.head_dim], cross_shape=[1, s.heads, s.enc_len, s.head_dim],
            input_features=[1, s.mel, s.frames], prefill_len=PREFILL_LEN, vocab_size=s.vocab, processor=processor,
            source=self.source, num_threads=opts.threads, signature_api=plan.signature_api, **self.decoding())

    def compare(self, manifest: SpeechManifest, runtime: str, refs: dict) -> dict[str, tuple[float, float]]:
        return compare(manifest, runtime, refs)

    def describe(self, m: SpeechManifest) -> dict[str, Any]:
        layers = 2 * m.num_layers
        return {"manifest_line": f"prefill of {m.prefill_len} start tokens, self-attention cache {m.cache_shape} x "
                                 f"{layers}, cross-attention K/V {m.cross_shape} x {layers} (computed once per clip by "
                                 f"the prefill), processor {m.processor or 'none'}",
                "next_args": "--audio clip.wav"}


def convert_speech(model: Any, out_dir: str | os.PathLike, options: ConvertOptions | None = None, *,
                   processor: Any = None, source: str = "", progress: Callable[[str], None] | None = None,
                   **fields: Any) -> GraphsReport:
    """Write the encoder, prefill and decode graphs of ``model`` (a
    WhisperForConditionalGeneration, or the path of its HF directory) into ``out_dir``, with
    ``manifest.json``, ``generation_config.json`` and the processor (feature extractor +
    tokenizer; loaded from the directory when ``model`` is a path) in ``out_dir/processor``:
    the :class:`SpeechRecipe` through the package step (circleops.package.step.run).

    The options are ``options`` (circleops.options.ConvertOptions) or the same names as
    keyword arguments (``target`` "onert" and ``max_cache_len`` 448 by default here):
    ``max_cache_len``: self-attention cache slots (at most the model's
    max_target_positions, which it is cut to). ``verify``: run each written graph (True: the
    target's runtime, or name one) against the model's own forward on random features and
    start tokens; VerifyError above ``tolerance`` (default 1e-3) x max(1, max|output|).
    Nothing is changed in ``out_dir`` unless every graph was written (and verified).
    """
    opts = ConvertOptions.of(options, fields, "convert_speech", target="onert", max_cache_len=448)
    if isinstance(model, (str, os.PathLike)):
        model, processor, source = _load(model, processor, source)
    return package_step.run(SpeechRecipe(model, opts, processor=processor, source=source), out_dir, progress)


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


# --------------------------------------------------------------------------- the comparison

def references(modules: dict[str, Any], args: dict[str, tuple], decoding: dict[str, Any]) -> dict[str, tuple[list, list]]:
    """Each graph's inputs and torch outputs: the encoder on random features, the prefill on
    the start tokens over those states, one decode step after it over the prefill's own rows
    and cross K/V (graph -> (inputs, outputs))."""
    import torch

    first = [decoding["decoder_start_token_id"], *list(decoding["lang_to_id"].values())[:1],
             *list(decoding["task_to_id"].values())[:1]]
    ids = torch.tensor([(first + [decoding["eos_token_ids"][0]] * PREFILL_LEN)[:PREFILL_LEN]])
    features = args["encoder"][0]
    n = modules["decode"].decoder_layers
    with torch.no_grad():
        states = modules["encoder"](features)
        pre = modules["prefill"](ids, torch.tensor([PREFILL_LEN - 1]), states)
        cache_len = args["decode"][2].shape[2]
        caches = [torch.nn.functional.pad(r, (0, 0, 0, cache_len - PREFILL_LEN)) for r in pre[1:2 * n + 1]]
        token = torch.tensor([[int(pre[0][0, 0].argmax())]])
        dec = modules["decode"](token, torch.tensor([PREFILL_LEN]), *caches, *pre[2 * n + 1:])
    return {"encoder": ([features], [states]), "prefill": ([ids, torch.tensor([PREFILL_LEN - 1]), states], list(pre)),
            "decode": ([token, torch.tensor([PREFILL_LEN]), *caches, *pre[2 * n + 1:]], list(dec))}


def compare(manifest: SpeechManifest, runtime: str, runs: dict[str, tuple[list, list]]) -> dict[str, tuple[float, float]]:
    """Graph -> (max abs error over its outputs, max |torch output|): each written graph on
    ``runtime`` against its torch module (:func:`references`)."""
    import numpy as np

    from circleops.generation.sessions import open_graph

    errors = {}
    for g, (inputs, want) in runs.items():
        got = open_graph(manifest, g, runtime, isolated=True).run([np.asarray(t.numpy()) for t in inputs])
        err = max(float(np.abs(np.asarray(a) - w.numpy()).max()) for a, w in zip(got, want))
        errors[g] = (err, max(float(w.abs().max()) for w in want))
    return errors

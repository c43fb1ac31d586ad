"""Text-to-text encoder-decoder models (``text2text-generation``: T5 / Flan-T5, BART, mBART,
Marian) as an encoder graph, decoder prefill graphs and a decoder decode graph, for
``circleops generate DIR --prompt "translate English to German: ..."``.

    circleops convert t5-small/ --graphs encoder,prefill,decode --target onert -o t5/ --verify
    circleops generate t5/ --prompt "translate English to German: The house is small."

    from circleops.recipes import text2text
    model, tokenizer = text2text.load("t5-small/")
    text2text.convert_text2text(model, "t5/", tokenizer=tokenizer, target="onert", verify=True)

The graphs are the encoder-decoder core's (circleops.adapters.seq2seq: one family row per
model type; Whisper's speech graphs are another row of it) and are described in
circleops.package.text2text_manifest: the encoder runs once per source and computes every
decoder layer's cross-attention K/V; the prefill graphs write a decoder prompt (the start
token, or a longer decoder prefix) into the self-attention caches in chunks; the decode graph
runs once per new token. The caches are [1, H, C, D] and the graphs return only the new rows
(the generation core writes them: "rows", layout circleops.options.HEADS_ROWS).

Options (circleops.options.ConvertOptions): ``graphs`` (all three), ``seq_len`` (the decoder
prefill lengths; default 8: a decoder prompt is one start token unless a prefix is given),
``max_cache_len`` (decoder tokens: prompt + generated; cut to the model's positions),
``input_shape={"input_ids": (1, T)}`` (``--input-shape input_ids=1xT``: the longest source,
default 128, cut to the model's positions), ``quantize`` (a weight-only format: every
graph's linears, the encoder's too, as llama.cpp stores T5: the decoder's cross-attention
K/V projections run in the encoder graph), ``verify``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from circleops.errors import ModelLoadError, TargetError
from circleops.options import HEADS_ROWS, ConvertOptions
from circleops.package import step as package_step
from circleops.package.manifest import Manifest, prefill_graph_name
from circleops.package.report import GraphsReport
from circleops.package.step import Graph
from circleops.package.text2text_manifest import (ENCODER_GRAPH, SOURCE_IDS, TEXT2TEXT_GRAPHS,
                                                  TEXT2TEXT_MODEL_TYPES, Text2TextSpec, io_names,
                                                  text2text_model_type)
from circleops.recipes.base import Recipe, pad_token_id, refuse_float_dtype, save_generation_config

DEFAULT_SOURCE_LEN = 128
# a decoder prompt is the start token (a prefix of a few more at most): one short prefill graph
DEFAULT_DECODER_PREFILL = (8,)


# --------------------------------------------------------------------------- which models, loading

def load(model: str | os.PathLike | None, *, config: str | os.PathLike | None = None,
         seed: int = 0, allow_random_init: bool = False) -> tuple[Any, Any]:
    """(the model, its tokenizer or None) from a directory (config.json + safetensors, as
    ``save_pretrained`` writes it; its generation_config.json and tokenizer beside) or, with
    ``config``, random weights from a config.json: the one loader (circleops.sources.models.load,
    every weight in the files unless ``allow_random_init``) with the family's class. The tokenizer is None when transformers
    cannot build it here (Marian's needs sentencepiece): generate then takes --token-ids."""
    import transformers

    from circleops.sources import models

    kind = text2text_model_type(model, config)
    if kind is None:
        raise ModelLoadError(f"{config or model} is not a text-to-text model circleops knows (model_type "
                             f"{', '.join(TEXT2TEXT_MODEL_TYPES)}).")
    cls = getattr(transformers, TEXT2TEXT_MODEL_TYPES[kind])
    loaded = models.load(None if config else str(model), config=str(config) if config else None, seed=seed,
                         allow_random_init=allow_random_init, model_class=lambda *a: cls)
    module = loaded.module
    if not config and (Path(model) / "generation_config.json").is_file():  # the decoding rules live there
        module.generation_config = transformers.GenerationConfig.from_pretrained(str(model), trust_remote_code=False)
    return module.eval(), None if config else load_tokenizer(Path(model))


def load_tokenizer(path: Path) -> Any:
    """The tokenizer saved in ``path``, or None when there is none or transformers cannot build it."""
    from circleops.generation.tokenizers import hf_tokenizer
    from circleops.inputs.remote_code import refuse_remote_code

    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "spiece.model",
                                              "source.spm", "vocab.json")):
        return None
    refuse_remote_code(path)  # a refusal is not "no tokenizer"
    try:
        return hf_tokenizer(path)
    except ModelLoadError:
        return None  # e.g. MarianTokenizer without sentencepiece: the graphs still convert


# --------------------------------------------------------------------------- the recipe

def parse_graphs(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"encoder,prefill,decode"`` -> the three names; anything else is refused (generation
    needs the three: the encoder once per source, then the decoder's prefill and decode)."""
    if text is None:
        return TEXT2TEXT_GRAPHS
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    if sorted(names) != sorted(TEXT2TEXT_GRAPHS):
        raise TargetError(f"a text-to-text model's --graphs is {','.join(TEXT2TEXT_GRAPHS)} (all three: generate runs "
                          f"the encoder once per source, then the decoder's prefill and decode steps); got "
                          f"{','.join(names) or 'nothing'}.")
    return TEXT2TEXT_GRAPHS


def source_length(options: ConvertOptions, limit: int | None) -> int:
    """The encoder's source length: ``input_shape["input_ids"]`` = (1, T), else
    DEFAULT_SOURCE_LEN cut to the model's positions ``limit``."""
    shapes = dict(options.input_shape or {})
    unknown = [n for n in shapes if n != SOURCE_IDS]
    shape = tuple(shapes.get(SOURCE_IDS) or ())
    if unknown or (shape and (len(shape) != 2 or shape[0] != 1 or shape[1] < 1)):
        raise TargetError(f"a text-to-text model's --input-shape is {SOURCE_IDS}=1xT (T: the longest source, in "
                          f"tokens); got {', '.join(f'{n}={shapes[n]}' for n in shapes)}.")
    length = int(shape[1]) if shape else min(DEFAULT_SOURCE_LEN, limit or DEFAULT_SOURCE_LEN)
    if limit is not None and length > limit:
        raise TargetError(f"--input-shape {SOURCE_IDS}=1x{length}: the model's encoder takes at most {limit} "
                          f"positions (max_position_embeddings); choose T <= {limit}.")
    return length


class Text2TextRecipe(Recipe):
    """An encoder-decoder text model's encoder, decoder prefill (one per length) and decode
    graphs (see the module docstring); ``tokenizer`` is saved with them."""

    kind = "text2text"
    graph_names = TEXT2TEXT_GRAPHS
    compared = ""  # the encoder's cross K/V and the decoder's logits

    @classmethod
    def check_options(cls, options: ConvertOptions, source: str | None = None) -> None:
        """What no model can give, before the model loads: the graph names, fp32."""
        parse_graphs(options.graphs)
        refuse_float_dtype(options, "a text-to-text model", "--quantize makes the decoder's weights smaller")

    @classmethod
    def from_source(cls, model: str | None, options: ConvertOptions) -> "Text2TextRecipe":
        module, tokenizer = load(model, config=options.config, seed=options.seed,
                                 allow_random_init=options.allow_random_init)
        return cls(module, options, tokenizer=tokenizer, source=str(options.config or model))

    def dtype(self) -> Any:
        import torch

        return torch.float32

    def check(self, opts: Any) -> None:
        from circleops.adapters.seq2seq import TEXT_FAMILIES, family_of
        from circleops.recipes.llm import check_lengths, prefill_lengths

        o, model = self.options, self.model
        self.check_options(o, self.source)
        fam = family_of(model)
        if fam not in TEXT_FAMILIES:
            raise TargetError(f"{self.source or type(model).__name__} is a {fam.name} model: its graphs are "
                              f"--graphs encoder,prefill,decode of circleops.recipes.speech, not text-to-text.")
        self.model = model.eval().float()
        limit = getattr(model.config, "max_position_embeddings", None)  # None: T5's relative positions
        self.source_len = source_length(o, limit)
        self.lengths = prefill_lengths(DEFAULT_DECODER_PREFILL if o.seq_len is None else o.seq_len)
        # the decoder's cache, cut to its positions as Whisper's is (the option's default is an LLM's)
        self.max_cache_len = min(o.max_cache_len, limit) if limit else o.max_cache_len
        check_lengths(self.lengths[0], self.max_cache_len, None, self.source or "the model")

    def weights_module(self) -> Any:
        from circleops.adapters.seq2seq import CalibrationLM

        return CalibrationLM(self.model.eval())

    def references(self) -> "References":
        return references(self.model, self.lengths, self.source_len)

    def graphs(self, opts: Any, parts: Sequence[tuple[int, int]]) -> list[Graph]:
        from circleops.adapters.seq2seq import Seq2SeqDecoderStep, Seq2SeqEncoder

        encoder = Seq2SeqEncoder(self.model, self.source_len)
        prefill = Seq2SeqDecoderStep(self.model, self.max_cache_len, one_row=True)
        decode = Seq2SeqDecoderStep(self.model, self.max_cache_len)
        self.shapes = shapes = step_shapes(decode, self.source_len)
        n = decode.decoder_layers
        graphs = [Graph(ENCODER_GRAPH, encoder, example_args(ENCODER_GRAPH, shapes, n),
                        *io_names(ENCODER_GRAPH, n), rows=self.source_len)]
        for length in self.lengths:
            graphs.append(Graph(prefill_graph_name(length, self.lengths), prefill,
                                example_args("prefill", shapes, n, length), *io_names("prefill", n), rows=length))
        graphs.append(Graph("decode", decode, example_args("decode", shapes, n, self.lengths[0]),
                            *io_names("decode", n), rows=1))
        self.graph_list = [g.name for g in graphs]
        self.num_layers = n
        return graphs

    def spec(self) -> Text2TextSpec:
        """The manifest's text2text section: the encoder, the source length, the cross K/V
        and the decoding rules of the model's generation config."""
        return Text2TextSpec(encoder=ENCODER_GRAPH, source_len=self.source_len, cross_shape=list(self.shapes.cross),
                             decoder_start_token_id=int(_generation(self.model, "decoder_start_token_id")),
                             family=str(self.model.config.model_type), **decoding_rules(self.model))

    def manifest(self, directory: Path, opts: Any, plan: Any, infos: dict[str, Any]) -> Manifest:
        from circleops.recipes.llm import positions_of, save_tokenizer

        n, files = self.num_layers, {g: plan.file(g) for g in self.graph_list}
        tokenizer_dir = save_tokenizer(self.tokenizer, directory)
        save_generation_config(self.model, directory)
        eos = self.eos_token_ids()
        ins, outs = io_names("decode", n)
        _, h, c, d = self.shapes.cache
        return Manifest(
            directory=directory, target=opts.target, dtype="fp32", files=files,
            signatures={g: infos[g].signature for g in files}, prefill_len=self.lengths[0],
            prefill_lens=list(self.lengths), prefill_inputs=io_names("prefill", n)[0], max_cache_len=self.max_cache_len,
            num_layers=n, cache_shape=[1, c, h, d], cache_layout=HEADS_ROWS, cache_update="rows",
            vocab_size=int(self.model.config.vocab_size), inputs=ins, outputs=outs, eos_token_ids=eos,
            pad_token_id=pad_token_id(self.model.config, eos), tokenizer=tokenizer_dir, source=self.source,
            quantize=opts.quantize, num_threads=opts.threads, text2text=self.spec().to_json(),
            signature_api=plan.signature_api, max_positions=positions_of(self.model.config, self.max_cache_len))

    def compare(self, manifest: Manifest, runtime: str, refs: "References") -> dict[str, tuple[float, float]]:
        return compare(manifest, runtime, refs)

    def describe(self, manifest: Manifest) -> dict[str, Any]:
        m = manifest
        line = (f"source up to {self.source_len} tokens, decoder prefill length{'s' if len(self.lengths) > 1 else ''} "
                f"{', '.join(map(str, self.lengths))}, cache length {m.max_cache_len}, tokenizer "
                f"{m.tokenizer or 'none'}, eos ids {m.eos_token_ids}")
        return {"manifest_line": line, "next_args": '--prompt "..."' if m.tokenizer else "--token-ids 1,2,3"}


def convert_text2text(model: Any, out_dir: str | os.PathLike, options: ConvertOptions | None = None, *,
                      tokenizer: Any = None, source: str = "", progress: package_step.Progress | None = None,
                      **fields: Any) -> GraphsReport:
    """Write the encoder, decoder prefill and decode graphs of ``model`` (a T5, BART, mBART or
    Marian model of transformers) into ``out_dir`` with ``manifest.json`` (its ``text2text``
    section), generation_config.json and (when given) the tokenizer: the
    :class:`Text2TextRecipe` through the package step (circleops.package.step.run).

    The options are ``options`` (circleops.options.ConvertOptions) or the same names as
    keyword arguments (``target`` defaults to "onert" here): ``seq_len`` the decoder prefill
    lengths, ``max_cache_len`` the decoder tokens, ``input_shape={"input_ids": (1, T)}`` the
    longest source, ``quantize`` a weight-only format for the graphs' linears, ``threads``,
    ``verify`` (the written graphs against the model's own forward: the encoder's cross K/V
    of a source, each prefill's logits of a decoder prompt and one decode step after the
    longest; VerifyError above ``tolerance`` x max(1, max|value|)). T5's norms are fused in
    place (circleops.unfuse restores them).
    """
    opts = ConvertOptions.of(options, fields, "convert_text2text", target="onert")
    return package_step.run(Text2TextRecipe(model, opts, tokenizer=tokenizer, source=source), out_dir, progress)


# --------------------------------------------------------------------------- shapes and inputs

@dataclass(frozen=True)
class StepShapes:
    cache: tuple[int, int, int, int]  # [1, H, C, D]
    cross: tuple[int, int, int, int]  # [1, H, T, D]


def step_shapes(step: Any, source_len: int) -> StepShapes:
    _, h, c, d = step.empty_caches()[0].shape
    return StepShapes((1, h, c, d), (1, h, source_len, d))


def example_args(graph: str, s: StepShapes, num_layers: int, length: int = 1) -> tuple:
    """Export inputs of a graph: zero ids and caches. One tensor per input: torch.export makes
    inputs given the same tensor object one aliased value."""
    import torch

    t = s.cross[2]
    if graph == ENCODER_GRAPH:
        return torch.zeros((1, t), dtype=torch.int64), torch.tensor([t])
    caches = [torch.zeros(s.cache) for _ in range(2 * num_layers)]
    cross = [torch.zeros(s.cross) for _ in range(2 * num_layers)]
    if graph == "prefill":
        return (torch.zeros((1, length), dtype=torch.int64), torch.tensor([0]), torch.tensor([length - 1]),
                torch.tensor([t]), *caches, *cross)
    return (torch.zeros((1, 1), dtype=torch.int64), torch.tensor([length]), torch.tensor([t]), *caches, *cross)


def _generation(model: Any, name: str, default: Any = None) -> Any:
    """A decoding setting: the generation config's, else the model config's."""
    gen = getattr(model, "generation_config", None)
    value = getattr(gen, name, None) if gen is not None else None
    return value if value is not None else getattr(model.config, name, default)


def decoding_rules(model: Any) -> dict[str, Any]:
    """The logits processors transformers' greedy ``generate`` builds from the model's
    generation config, as the manifest's fields: forced first and last tokens, suppressed
    tokens (``suppress_tokens`` and one-token ``bad_words_ids``), min_length and
    no_repeat_ngram_size."""
    bad = [w[0] for w in (_generation(model, "bad_words_ids") or []) if isinstance(w, (list, tuple)) and len(w) == 1]
    suppress = sorted({int(t) for t in [*(_generation(model, "suppress_tokens") or []), *bad]})
    bos, eos = _generation(model, "forced_bos_token_id"), _generation(model, "forced_eos_token_id")
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return {"forced_bos_token_id": None if bos is None else int(bos), "forced_eos_token_id": None if eos is None
            else int(eos), "suppress_tokens": suppress, "min_length": int(_generation(model, "min_length", 0) or 0),
            "no_repeat_ngram_size": int(_generation(model, "no_repeat_ngram_size", 0) or 0)}


# --------------------------------------------------------------------------- verify

@dataclass
class References:
    source: list[int]  # source ids (fewer than T)
    decoder: list[int]  # decoder ids: the start token, then P
    logits: Any  # [P + 1, V]: the model's logits of every decoder prefix
    cross: list[Any]  # every decoder layer's cross K then V [1, H, len(source), D]


def references(model: Any, lengths: Sequence[int], source_len: int) -> References:
    """The model's own forward (no cache) on a source of 3/4 T tokens and a decoder prompt of
    the start token and max(1, longest // 2) more: every decoder prefix's logits (the decoder
    is causal) and every layer's cross K/V of the encoder's states, by the layers' own
    projections."""
    import torch

    from circleops.adapters.seq2seq import family_of, split_heads
    from circleops.sources.models import example_token_ids

    vocab = int(model.config.vocab_size)
    src = example_token_ids(max(1, 3 * source_len // 4), vocab, seed=1)
    p = max(1, max(lengths) // 2)
    dec = torch.cat([torch.tensor([[int(_generation(model, "decoder_start_token_id"))]]),
                     example_token_ids(p, vocab, seed=2)], 1)
    fam = family_of(model)
    with torch.no_grad():
        out = model(input_ids=src, decoder_input_ids=dec, use_cache=False)
        states = out.encoder_last_hidden_state
        layers = fam.stack_layers(fam.stack(model, "decoder"))
        attn = [_module(layer, fam.cross_attn) for layer in layers]
        heads = [int(getattr(a, "num_heads", None) or getattr(a, "n_heads")) for a in attn]
        ks = [split_heads(getattr(a, fam.proj[1])(states), h) for a, h in zip(attn, heads)]
        vs = [split_heads(getattr(a, fam.proj[2])(states), h) for a, h in zip(attn, heads)]
    return References(src[0].tolist(), dec[0].tolist(), out.logits[0].float().numpy(), [x.numpy() for x in ks + vs])


def _module(layer: Any, dotted: str) -> Any:
    from circleops.adapters.seq2seq import path

    return path(layer, dotted)


def compare(manifest: Manifest, runtime: str, refs: References) -> dict[str, tuple[float, float]]:
    """Graph -> (max abs error, max |reference|): the encoder's cross K/V of the source (its
    real positions), each prefill graph of length L on the first max(1, L // 2) decoder
    tokens from pos 0 (the logits of the last), then one decode step after the longest
    prefill, on the caches it wrote. One runtime child at a time (isolated sessions)."""
    import numpy as np

    from circleops.generation.caches import store_caches, zero_caches
    from circleops.generation.sessions import open_graph

    spec = Text2TextSpec.from_json(manifest.text2text, manifest.directory, manifest.vocab_size)
    n = len(refs.source)
    src = np.full((1, spec.source_len), manifest.pad_token_id, np.int64)
    src[0, :n] = refs.source
    length = np.array([n], np.int64)
    cross = open_graph(manifest, spec.encoder, runtime, isolated=True).run([src, length])
    errors = {spec.encoder: max(float(np.abs(c[:, :, :n] - r).max()) for c, r in zip(cross, refs.cross))}
    wants = {spec.encoder: max(float(np.abs(r).max()) for r in refs.cross)}
    cross = [np.ascontiguousarray(c) for c in cross]
    after = None
    for size, g in manifest.prefill_graphs.items():  # longest first
        q = max(1, size // 2)
        ids = np.full((1, size), manifest.pad_token_id, np.int64)
        ids[0, :q] = refs.decoder[:q]
        caches = zero_caches(manifest.cache_shapes)
        outs = open_graph(manifest, g, runtime, isolated=True).run(
            [ids, np.zeros(1, np.int64), np.array([q - 1], np.int64), length, *caches, *cross])
        errors[g], wants[g] = float(np.abs(outs[0][0, 0] - refs.logits[q - 1]).max()), float(np.abs(refs.logits[q - 1]).max())
        if after is None:
            after = (store_caches(caches, outs[1:], 0, "rows", HEADS_ROWS), q)
    caches, q = after
    step = open_graph(manifest, "decode", runtime, isolated=True).run(
        [np.array([[refs.decoder[q]]], np.int64), np.array([q], np.int64), length, *caches, *cross])[0][0, 0]
    errors["decode"], wants["decode"] = float(np.abs(step - refs.logits[q]).max()), float(np.abs(refs.logits[q]).max())
    return {g: (err, wants[g]) for g, err in errors.items()}

"""The torch modules an encoder-decoder model's graphs are exported from, built from one
declarative row per family (:class:`Seq2SeqFamily`): T5 / Flan-T5, BART, mBART, Marian and
Whisper's decoder. One core (adapters/_seq2seq_layers.py) runs every family's layers.

    enc = Seq2SeqEncoder(model, source_len=32)                  # text families
    cross = enc(input_ids_padded [1, 32], n [1])                 # (*cross_k, *cross_v)
    step = Seq2SeqDecoderStep(model, max_len=64, one_row=True)   # a prefill chunk
    logits, *rows = step(ids [1, P], pos [1], row [1], n [1], *k_caches, *v_caches, *cross)

* the encoder graph: the source ids, right-padded to ``source_len`` and masked past ``n``,
  through the encoder, then every decoder layer's cross-attention K and V ``[1, H, T, D]``:
  projected once per source, never again per token;
* a decoder step (prefill chunk of P tokens with ``row``, or a one-token decode): the new
  tokens at slots ``pos .. pos+P-1`` over the self-attention caches ``[1, H, C, D]`` (slots >=
  ``pos`` are stale and masked; the caller writes the returned rows ``[1, H, P, D]`` there,
  the "rows" cache update of circleops.graphs) and the cross K/V;
* positions: a table (BART/mBART learned with their offset of 2, Marian's sinusoids,
  Whisper's) indexed at ``pos + i``, or T5's relative-position bias, its buckets computed
  once from distances by the model's own bucket function and gathered per step;
* T5's RMS-style ``T5LayerNorm`` runs as circle.rms_norm (the model's modules are swapped
  in place as :func:`circleops.fuse` does; :func:`circleops.unfuse` restores them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from circleops.adapters import _rmsnorm
from circleops.adapters._cached_attention import own_mask
from circleops.adapters._instance import swap_forward
from circleops.adapters._seq2seq_layers import (LayerRunner, bias_from_buckets, key_mask, path, relative_buckets,
                                                split_heads)
from circleops.errors import CircleOpsError

TABLE, RELATIVE = "table", "relative"
BART_PROJ = ("q_proj", "k_proj", "v_proj", "out_proj")


@dataclass(frozen=True)
class Seq2SeqFamily:
    """One encoder-decoder family: dotted attribute paths from the transformers model (the
    stacks), from a stack (its layers, norms, positions) and from a layer (its sub-layers)."""

    name: str  # "t5"
    classes: dict[str, str]  # config model_type -> the transformers class
    encoder: str = "model.encoder"
    decoder: str = "model.decoder"
    layers: str = "layers"  # a stack's layer list
    self_attn: str = "self_attn"
    self_norm: str = "self_attn_layer_norm"
    cross_attn: str = "encoder_attn"
    cross_norm: str = "encoder_attn_layer_norm"
    ffn: tuple[str, ...] = ("fc1", "activation_fn", "fc2")  # called in turn
    ffn_norm: str = "final_layer_norm"
    proj: tuple[str, str, str, str] = BART_PROJ  # q, k, v, out projections of an attention module
    pre_norm: bool = False
    positions: str = TABLE  # TABLE: stack.embed_positions.weight[p + offset]; RELATIVE: T5's bias
    relative_bias: Optional[str] = None  # RELATIVE: the bias table's path in a stack
    embed_scale: Optional[str] = None  # a stack attribute scaling the token embeddings (Marian)
    embed_norm: Optional[str] = None  # a stack norm after the embeddings (BART's layernorm_embedding)
    final_norm: Optional[str] = None  # a stack norm after the layers (T5, mBART, Whisper)
    head: str = "lm_head"
    logits_bias: Optional[str] = "final_logits_bias"  # a model buffer added to the logits
    rms_norms: tuple[str, ...] = ()  # RMS-norm classes run as circle.rms_norm
    text_encoder: bool = True  # False: the encoder takes other inputs (Whisper's features)

    def stack(self, model: Any, which: str) -> torch.nn.Module:
        return path(model, self.encoder if which == "encoder" else self.decoder)

    def stack_layers(self, stack: torch.nn.Module) -> torch.nn.ModuleList:
        return path(stack, self.layers)

    def embed(self, stack: torch.nn.Module, ids: Tensor, positions: Tensor) -> Tensor:
        """Token embeddings (scaled), plus table positions (``positions`` [S]), then the
        embedding norm."""
        h = stack.embed_tokens(ids)
        if self.embed_scale is not None:
            h = h * getattr(stack, self.embed_scale)
        if self.positions == TABLE:
            table = stack.embed_positions
            index = positions
            if getattr(table, "offset", 0):  # BART's learned positions start at row 2
                index = index + int(table.offset)
            h = h + torch.index_select(table.weight, 0, index)[None].to(h.dtype)
        return path(stack, self.embed_norm)(h) if self.embed_norm else h

    def finish(self, stack: torch.nn.Module, h: Tensor) -> Tensor:
        return path(stack, self.final_norm)(h) if self.final_norm else h

    def logits(self, model: Any, h: Tensor) -> Tensor:
        """The head over the decoder's last states: T5's output scale when its head is tied
        (config.scale_decoder_outputs), the final logits bias of the BART family."""
        if getattr(model.config, "scale_decoder_outputs", False):
            h = h * (model.config.d_model ** -0.5)
        logits = path(model, self.head)(h)
        if self.logits_bias is not None:
            logits = logits + getattr(model, self.logits_bias).to(logits.dtype)
        return logits


T5_LAYER = dict(self_attn="layer.0.SelfAttention", self_norm="layer.0.layer_norm", cross_attn="layer.1.EncDecAttention",
                cross_norm="layer.1.layer_norm", ffn=("layer.-1.DenseReluDense",), ffn_norm="layer.-1.layer_norm",
                proj=("q", "k", "v", "o"))
T5 = Seq2SeqFamily(
    name="t5", classes={"t5": "T5ForConditionalGeneration"}, encoder="encoder", decoder="decoder", layers="block",
    pre_norm=True, positions=RELATIVE, relative_bias="block.0.layer.0.SelfAttention.relative_attention_bias",
    final_norm="final_layer_norm", logits_bias=None, rms_norms=("T5LayerNorm",), **T5_LAYER)
BART = Seq2SeqFamily(name="bart", classes={"bart": "BartForConditionalGeneration"}, embed_norm="layernorm_embedding")
MBART = Seq2SeqFamily(name="mbart", classes={"mbart": "MBartForConditionalGeneration"}, pre_norm=True,
                      embed_norm="layernorm_embedding", final_norm="layer_norm")
MARIAN = Seq2SeqFamily(name="marian", classes={"marian": "MarianMTModel"}, embed_scale="embed_scale")
WHISPER = Seq2SeqFamily(name="whisper", classes={"whisper": "WhisperForConditionalGeneration"}, pre_norm=True,
                        final_norm="layer_norm", head="proj_out", logits_bias=None, text_encoder=False)
FAMILIES: tuple[Seq2SeqFamily, ...] = (T5, BART, MBART, MARIAN, WHISPER)
TEXT_FAMILIES: tuple[Seq2SeqFamily, ...] = tuple(f for f in FAMILIES if f.text_encoder)
BY_MODEL_TYPE: dict[str, Seq2SeqFamily] = {t: f for f in FAMILIES for t in f.classes}


def family_of(model: Any) -> Seq2SeqFamily:
    """The family of a transformers encoder-decoder model; a CircleOpsError if none."""
    fam = BY_MODEL_TYPE.get(str(getattr(model.config, "model_type", "")))
    if fam is None:
        known = ", ".join(sorted(BY_MODEL_TYPE))
        raise CircleOpsError(f"{type(model).__name__} (model_type {model.config.model_type!r}) is not an "
                             f"encoder-decoder family circleops writes graphs for ({known}).")
    return fam


def fuse_norms(model: torch.nn.Module, fam: Seq2SeqFamily) -> torch.nn.Module:
    """The family's RMS norms as circle.rms_norm (T5LayerNorm: normalized in fp32, cast,
    then the weight: Llama's form), in place; circleops.unfuse(model) restores them."""
    for sub in model.modules():
        name = type(sub).__name__
        if name in fam.rms_norms and "forward" not in sub.__dict__:
            swap_forward(sub, _rmsnorm.norm_forward(_rmsnorm.LLAMA, name))
    return model


class _Step(torch.nn.Module):
    """What the encoder and the decoder steps share: the model (registered as ``model``,
    so every graph names its weights alike), its family row and the layer core."""

    def __init__(self, model: Any):
        super().__init__()
        self.fam = family_of(model)
        if model.training:
            raise CircleOpsError(f"{type(model).__name__} is in training mode (dropout): call model.eval() first.")
        self.model = fuse_norms(model, self.fam)
        self.runner = LayerRunner(self.fam)
        self.decoder_layers = len(self.fam.stack_layers(self.fam.stack(model, "decoder")))

    def cross_kv(self, states: Tensor) -> list[Tensor]:
        """Every decoder layer's cross-attention K then V [1, H, T, D] of encoder ``states``."""
        layers = self.fam.stack_layers(self.fam.stack(self.model, "decoder"))
        pairs = [self.runner.cross_attention(layer).keys_values(states) for layer in layers]
        return [k for k, _ in pairs] + [v for _, v in pairs]


class Seq2SeqEncoder(_Step):
    """``forward(input_ids [1, T], source_len [1])`` -> every decoder layer's cross K then V
    ``[1, H, T, D]``: the source right-padded to T (any id), the padding masked."""

    def __init__(self, model: Any, source_len: int):
        super().__init__(model)
        if not self.fam.text_encoder:
            raise CircleOpsError(f"{self.fam.name}'s encoder does not take token ids (its graphs are circleops.recipes.speech's).")
        self.source_len = int(source_len)
        if self.fam.positions == RELATIVE:  # bidirectional buckets over the T source positions
            i = torch.arange(self.source_len)
            table = path(self.fam.stack(model, "encoder"), self.fam.relative_bias.rsplit(".", 1)[0])
            self.register_buffer("buckets", relative_buckets(i[None, :] - i[:, None], table, True), persistent=False)

    def forward(self, input_ids: Tensor, source_len: Tensor) -> tuple[Tensor, ...]:
        fam, stack = self.fam, self.fam.stack(self.model, "encoder")
        t = input_ids.shape[1]
        h = fam.embed(stack, input_ids, torch.arange(t, device=input_ids.device))
        mask = key_mask(source_len, t, h.dtype)
        bias = bias_from_buckets(path(stack, fam.relative_bias), self.buckets) if fam.positions == RELATIVE else None
        for layer in fam.stack_layers(stack):
            h = self.runner.encoder_layer(layer, h, mask, bias)
        return tuple(self.cross_kv(fam.finish(stack, h)))


class Seq2SeqDecoderStep(_Step):
    """A decoder step over static self-attention caches:
    ``forward(input_ids [1, S], pos [1], [row [1],] [source_len [1],] *k_caches, *v_caches,
    *cross_k, *cross_v)`` -> ``(logits [1, S or 1, V], *k_rows, *v_rows)``, rows [1, H, S, D].

    ``one_row``: the logits of token ``row`` only (a prefill chunk: generation needs the last
    prompt token's). ``source_mask``: the cross-attention hides source positions >=
    ``source_len`` (a padded text source; Whisper's 1500 frames have no padding)."""

    def __init__(self, model: Any, max_len: int, *, one_row: bool = False, source_mask: bool = True):
        super().__init__(model)
        self.max_len, self.one_row, self.source_mask = int(max_len), bool(one_row), bool(source_mask)
        if self.fam.positions == RELATIVE:  # causal buckets of the distances 0 .. C
            table = path(self.fam.stack(model, "decoder"), self.fam.relative_bias.rsplit(".", 1)[0])
            self.register_buffer("buckets", relative_buckets(-torch.arange(self.max_len + 1), table, False),
                                 persistent=False)

    def empty_caches(self) -> list[Tensor]:
        """Zero k caches then zero v caches [1, H, C, D], one per decoder layer."""
        layer = self.fam.stack_layers(self.fam.stack(self.model, "decoder"))[0]
        a = self.runner.self_attention(layer)
        d = a.k.weight.shape[0] // a.heads
        return [torch.zeros(1, a.heads, self.max_len, d) for _ in range(2 * self.decoder_layers)]

    def forward(self, input_ids: Tensor, pos: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        rest = list(rest)
        row = rest.pop(0) if self.one_row else None
        source_len = rest.pop(0) if self.source_mask else None
        n = self.decoder_layers
        if len(rest) != 4 * n:
            raise CircleOpsError(f"Seq2SeqDecoderStep: expected {4 * n} caches (k, v, cross k, cross v for {n} "
                                 f"layers), got {len(rest)}.")
        return self.run(input_ids, pos, rest[:2 * n], rest[2 * n:], row, source_len)

    def run(self, input_ids: Tensor, pos: Tensor, caches: list[Tensor] | None, cross: list[Tensor],
            row: Optional[Tensor] = None, source_len: Optional[Tensor] = None) -> tuple[Tensor, ...]:
        """:meth:`forward` with the caches and the cross K/V as lists; ``caches`` None: no
        cache (the tokens start at slot 0: Whisper's prefill)."""
        fam, stack, n = self.fam, self.fam.stack(self.model, "decoder"), self.decoder_layers
        s = input_ids.shape[1]
        p = pos.to(torch.int64)  # [1]
        positions = p if s == 1 else p + torch.arange(s, device=input_ids.device)  # [S]
        h = fam.embed(stack, input_ids, positions)
        mask = self._mask(p, s, h.dtype, caches[0].shape[2] if caches is not None else None)
        bias = self._bias(stack, positions, caches is not None) if fam.positions == RELATIVE else None
        cross_mask = key_mask(source_len, cross[0].shape[2], h.dtype) if source_len is not None else None
        ks, vs = [], []
        for i, layer in enumerate(fam.stack_layers(stack)):
            past = (caches[i], caches[n + i]) if caches is not None else None
            h, k, v = self.runner.decoder_layer(layer, h, past, mask=mask, bias=bias, cross=(cross[i], cross[n + i]),
                                                cross_mask=cross_mask)
            ks.append(k), vs.append(v)
        h = fam.finish(stack, h)
        if row is not None:
            h = torch.index_select(h, 1, row.reshape(1).to(torch.int64))
        return (fam.logits(self.model, h), *ks, *vs)

    def _mask(self, pos: Tensor, s: int, dtype: torch.dtype, length: Optional[int]) -> Tensor:
        """[1, 1, S, C + S]: the C = ``length`` cache slots before ``pos``, then the new tokens
        causally (floats: onert's CONCATENATION takes no booleans); [1, 1, S, S] without a
        cache (``length`` None)."""
        cached = length is not None
        own = own_mask(s, dtype, device=pos.device)
        if not cached:
            return own
        slots = torch.arange(length, device=pos.device)
        stale = slots >= pos  # written by no earlier step
        cache = torch.zeros(length, dtype=dtype, device=slots.device).masked_fill(stale, torch.finfo(dtype).min)
        if s == 1:  # one token sees itself: [C + 1], broadcast over the scores
            return torch.cat([cache, torch.zeros(1, dtype=dtype, device=slots.device)])
        return torch.cat([cache[None, None, None].expand(1, 1, s, length), own], dim=-1)

    def _bias(self, stack: torch.nn.Module, positions: Tensor, cached: bool) -> Tensor:
        """T5's causal relative-position bias [1, H, S, C + S] (keys: the cache slots, then the
        new tokens): bucket(max(query - key, 0)), gathered from the buckets of 0 .. C."""
        q = positions
        keys = torch.cat([torch.arange(self.max_len, device=q.device), q]) if cached else q
        distance = torch.clamp(q[:, None] - keys[None, :], min=0, max=self.max_len)
        buckets = torch.index_select(self.buckets, 0, distance.reshape(-1)).reshape(distance.shape)
        return bias_from_buckets(path(stack, self.fam.relative_bias), buckets)


class CrossFromStates(torch.nn.Module):
    """Whisper's prefill form: ``forward(input_ids [1, P], logits_row [1], encoder_hidden_states)``
    -> (logits [1, 1, V], *k_rows, *v_rows, *cross_k, *cross_v): the tokens from slot 0 (no
    cache), with every layer's cross K/V projected from the encoder states here."""

    def __init__(self, step: Seq2SeqDecoderStep):
        super().__init__()
        self.model = step.model
        self._step = [step]  # not a submodule: its parameters are self.model's

    def forward(self, input_ids: Tensor, logits_row: Tensor, encoder_hidden_states: Tensor) -> tuple[Tensor, ...]:
        step = self._step[0]
        cross = step.cross_kv(encoder_hidden_states)
        return (*step.run(input_ids, torch.zeros(1, dtype=torch.int64), None, cross, logits_row), *cross)


class CalibrationLM(torch.nn.Module):
    """An encoder-decoder text model as the causal LM a weight format's calibration runs
    (circleops.quantize: input importances, SmoothQuant's maxima): ``forward(input_ids)``
    encodes the text and decodes it teacher-forced (the start token, then the text shifted
    right), so every linear of the encoder and the decoder sees it. It holds the model's own
    modules: the formats quantize their weights."""

    def __init__(self, model: Any):
        super().__init__()
        self.model = model
        self.config = model.config
        self.generation_config = getattr(model, "generation_config", None)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    def forward(self, input_ids: Tensor, **kwargs: Any) -> Any:
        gen = self.generation_config
        start = getattr(gen, "decoder_start_token_id", None) if gen is not None else None
        start = int(start if start is not None else self.config.decoder_start_token_id)
        decoder = torch.cat([torch.full_like(input_ids[:, :1], start), input_ids[:, :-1]], dim=1)
        return self.model(input_ids=input_ids, decoder_input_ids=decoder, use_cache=False)

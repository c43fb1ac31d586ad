"""The manifest's ``text2text`` section of an encoder-decoder text model's directory (T5,
BART, mBART, Marian): what ``circleops convert DIR --graphs encoder,prefill,decode``
(circleops.recipes.text2text) writes and ``circleops generate DIR --prompt`` (circleops.generation.text2text)
reads. The rest of the manifest is the text one (circleops.package.manifest: the decoder's
prefill and decode graphs, its self-attention cache, the tokens); this section holds the
encoder graph, the source length, the cross-attention K/V's shape and the decoding rules
transformers' ``generate`` applies to the model (its generation config), each checked on reading.

The graphs (H heads of D, L decoder layers, T = ``source_len``, C = the cache length):

* ``encoder``: ``input_ids [1, T]`` (the source, right-padded; any id past ``source_len``)
  and ``source_len [1]`` -> every decoder layer's cross-attention ``cross_k_i`` / ``cross_v_i``
  ``[1, H, T, D]``, computed once per source;
* ``prefill`` (one per length P): ``input_ids [1, P]``, ``pos [1]``, ``logits_row [1]``,
  ``source_len [1]``, the caches ``k_cache_i`` / ``v_cache_i [1, H, C, D]`` and the cross K/V ->
  ``logits [1, 1, V]`` and the chunk's rows ``k_new_i`` / ``v_new_i [1, H, P, D]``;
* ``decode``: the same for one token, without ``logits_row``.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from circleops.errors import CircleOpsError, ModelLoadError
from circleops.inputs.token_ids import check_token_ids
from circleops.inputs.user_files import read_json

ENCODER_GRAPH = "encoder"
TEXT2TEXT_GRAPHS = (ENCODER_GRAPH, "prefill", "decode")
SOURCE_IDS = "input_ids"
SOURCE_LEN = "source_len"  # the source's real length: the encoder and cross-attention hide the padding after it
TASK = "text2text-generation"  # the transformers pipeline task these graphs serve
# model_type -> transformers class, of the text rows of circleops.adapters.seq2seq (names here:
# recognising a directory must not import torch)
TEXT2TEXT_MODEL_TYPES = {"t5": "T5ForConditionalGeneration", "bart": "BartForConditionalGeneration",
                         "mbart": "MBartForConditionalGeneration", "marian": "MarianMTModel"}


def text2text_model_type(model: str | os.PathLike | None = None, config: str | os.PathLike | None = None) -> str | None:
    """The model_type of a text-to-text model directory (or config.json) circleops converts
    with ``--graphs encoder,prefill,decode``; None for anything else."""
    path = Path(config) if config else Path(model) / "config.json" if model else None
    if path is None or not path.is_file():
        return None
    try:
        cfg = read_json(path)
    except CircleOpsError:  # not JSON, or damaged: not ours (read again, with the error, later)
        return None
    kind = cfg.get("model_type") if isinstance(cfg, dict) else None
    return kind if kind in TEXT2TEXT_MODEL_TYPES else None


def cross_names(num_layers: int) -> list[str]:
    """The cross-attention K/V names: every layer's K, then every layer's V."""
    return [f"cross_{kv}_{i}" for kv in "kv" for i in range(num_layers)]


def io_names(graph: str, num_layers: int) -> tuple[list[str], list[str]]:
    """The inputs and outputs of a text-to-text graph ("encoder", "prefill" or "decode"), in order."""
    cross = cross_names(num_layers)
    if graph == ENCODER_GRAPH:
        return [SOURCE_IDS, SOURCE_LEN], cross
    caches = [f"{kv}_cache_{i}" for kv in "kv" for i in range(num_layers)]
    rows = [f"{kv}_new_{i}" for kv in "kv" for i in range(num_layers)]
    head = ["input_ids", "pos", "logits_row"] if graph == "prefill" else ["input_ids", "pos"]
    return [*head, SOURCE_LEN, *caches, *cross], ["logits", *rows]


@dataclass
class Text2TextSpec:
    """The manifest's ``text2text`` section."""

    encoder: str  # the encoder graph (a key of the manifest's files)
    source_len: int  # T: the longest source, in tokens
    cross_shape: list[int]  # [1, H, T, D]: each cross-attention K and V
    decoder_start_token_id: int  # the decoder's first token
    family: str = ""  # model_type
    # transformers' logits processors for this model's greedy generate (its generation config)
    forced_bos_token_id: int | None = None  # the first generated token (mBART's target language)
    forced_eos_token_id: int | None = None  # the token at the last step (max_new_tokens)
    suppress_tokens: list[int] = field(default_factory=list)  # never generated (one-token bad_words_ids)
    min_length: int = 0  # no EOS before the decoder sequence is this long
    no_repeat_ngram_size: int = 0  # no n-gram of this size twice in the decoder sequence

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, where: Path, vocab_size: int) -> "Text2TextSpec":
        """The section of a manifest at ``where``, every value checked (ModelLoadError)."""
        again = "Convert again with --graphs encoder,prefill,decode."
        try:
            if not isinstance(data, dict):
                raise TypeError("not a mapping")
            spec = cls(encoder=str(data["encoder"]), source_len=_int(data["source_len"]),
                       cross_shape=[_int(n) for n in data["cross_shape"]],
                       decoder_start_token_id=_int(data["decoder_start_token_id"]), family=str(data.get("family", "")),
                       forced_bos_token_id=_optional(data.get("forced_bos_token_id")),
                       forced_eos_token_id=_optional(data.get("forced_eos_token_id")),
                       suppress_tokens=[_int(t) for t in data.get("suppress_tokens") or []],
                       min_length=_int(data.get("min_length", 0)),
                       no_repeat_ngram_size=_int(data.get("no_repeat_ngram_size", 0)))
        except (KeyError, TypeError, ValueError, OverflowError) as err:
            raise ModelLoadError(f"{where}: the text2text section is incomplete ({type(err).__name__}: {err}). "
                                 f"{again}") from None
        if len(spec.cross_shape) != 4 or min(spec.cross_shape) < 1 or spec.cross_shape[2] != spec.source_len \
                or spec.min_length < 0 or spec.no_repeat_ngram_size < 0:
            raise ModelLoadError(f"{where}: the text2text section's sizes are wrong (cross_shape {spec.cross_shape} "
                                 f"must be [1, H, source_len, D] with source_len {spec.source_len}). {again}")
        ids = [spec.decoder_start_token_id, *spec.suppress_tokens,
               *(t for t in (spec.forced_bos_token_id, spec.forced_eos_token_id) if t is not None)]
        check_token_ids(ids, vocab_size, f"{where}: the text2text section's token ids", fix=again)
        return spec


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    return value


def _optional(value: Any) -> int | None:
    return None if value is None else _int(value)

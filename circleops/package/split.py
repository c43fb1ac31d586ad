"""A model past one file's size limit as consecutive files: a layer range per file.

onert reads no weights stored after the flatbuffer (SIGSEGV, FACTS.md), so no onert file
passes 2 GiB: a Llama-3.2-1B in fp32 (4.9 GB) cannot be one file. ``convert --graphs``
then writes each generation graph as parts (:class:`circleops.adapters.decode.DecoderPart`):
the first looks up the embeddings and runs the first layers, each later one takes the hidden
state [1, S, hidden] the previous returned, the last also holds the final norm and the
lm_head and returns the logits. Each part takes only its own layers' KV caches.
:class:`circleops.runtime.chain.ChainSession` runs them as the one graph they replace.

The layer ranges are planned here from the weights' bytes in the file's format, before
anything is exported (a model that cannot be split, one layer alone too large, is refused
before any work). No onert file can read another's buffers, so a tied embedding / lm_head
table (1 GB in fp32 for a 128256 x 2048 table) would be stored twice, in the first part and
in the last. Where the head stores the table's own values (fp32, an ``nn.Embedding`` or Gemma's, whose
rows are scaled by sqrt(hidden): :attr:`PartBytes.host_table`), it is stored once, as the last
part's lm_head: the first part takes the table's rows [1, S, hidden] (and scales them, Gemma's
rows) and the generator looks the token ids' rows up in that weight
(circleops.runtime.chain.HeadEmbedding; the manifest's ``part_embedding`` "head").
Where the format stores a tied head at another type than the table (w8: an fp32 table beside
the head's INT8; q4_0: Q4_0 beside Q8_0; q8_0: fp32 beside Q8_0), a file for onert stored both
(onert 0.1.0 GATHERs neither an INT8 nor a Q8_0 table): there the table is not written at all
(:attr:`PartBytes.head_rows`), split or not: the graphs (a split one's first part) take the
rows, which the generator dequantizes from the head's weight (INT8 rows times their scales,
Q8_0 blocks), and verify's torch reference looks its embeddings up in those same rows. Other
targets keep the table beside the head (an NPU compiler wants the GATHER in the graph).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from circleops.errors import TargetError

# The share of a file's limit the weights may fill: the rest is for the flatbuffer's graph
# tables (kilobytes), buffer alignment and an estimate that is per tensor, not per file.
WEIGHT_SHARE = 0.97
TABLE_BYTES = 64 << 10  # and this much for the graph tables themselves (a tiny model's ~14 kB)


@dataclass(frozen=True)
class PartBytes:
    """The weight bytes a part would hold: the embedding table (first part), each layer,
    and the final norm + lm_head (last part), in the file's format."""

    embedding: int
    layers: tuple[int, ...]
    head: int
    tied: bool  # the lm_head is the embedding table, stored once (when there is one part)
    # a split model's first part looks up no table: the lm_head holds the table's values
    # (tied, fp32, rows_embedding: the rows, or Gemma's scaled by the part) and the generator
    # reads the rows from it
    host_table: bool = False
    quantize: str | None = None  # the format the bytes are of (None: fp32)
    # the table is not stored at all, split or not (``embedding`` 0): the tied head is at another
    # type than the format stores tables (w8, q4_0, q8_0 for onert), and the generator reads the
    # rows from the head's quantized weight; ``host_table`` is then true too
    head_rows: bool = False

    @property
    def whole(self) -> int:
        return self.embedding + sum(self.layers) + (0 if self.tied else self.head)


def _tensor_bytes(numel: int, shape: Sequence[int], tensor_type: str | None) -> int:
    """Bytes of a weight of ``shape`` stored as ``tensor_type`` (None: fp32)."""
    from circleops.dtypes import GGML_BLOCKS

    if tensor_type in GGML_BLOCKS:
        per_block, block_bytes = GGML_BLOCKS[tensor_type]
        if shape and shape[-1] % per_block == 0:
            return -(-numel // per_block) * block_bytes
        return 4 * numel
    if tensor_type == "INT8":
        return numel + 4 * (shape[0] if shape else 1)  # per-channel scales
    return 4 * numel


def _format_types(quantize: str | None) -> tuple[str | None, str | None, str | None]:
    """(linear, embedding table, lm_head) tensor types of format ``quantize`` (None: fp32)."""
    from circleops.quantize import formats

    fmt = formats.get(quantize) if quantize else None
    if fmt is None or fmt.kind != formats.WEIGHTS:
        return None, None, None  # fp32; integer graphs are not written as generation graphs
    linear = fmt.tensor_type
    return linear, (fmt.table_type or linear) if fmt.embedding else None, fmt.head_type or linear


def head_rows_target(target: str | None) -> bool:
    """Whether ``target``'s generation graphs take a tied table's rows from the quantized head
    (:attr:`PartBytes.head_rows`): onert's, whose runtime GATHERs neither the head's INT8 nor
    its Q8_0 (FACTS.md), so the table was a second copy beside the head."""
    from circleops.targets import PROFILES

    return target in PROFILES and PROFILES[target].runtime == "onert"


def _sizes(embed: tuple[int, ...], layers: Sequence[Sequence[tuple[int, ...]]], norm: Sequence[tuple[int, ...]],
           head: tuple[int, ...], *, one_table: bool, rows: bool, quantize: str | None,
           head_table: bool = False) -> PartBytes:
    """The PartBytes of weights of these shapes: ``one_table``, the lm_head is the embedding
    table; ``rows``, the embedding is the table's rows (scaled or not: rows_embedding);
    ``head_table``, a tied table the format stores at another type than the head is read from
    the head instead (:func:`head_rows_target`)."""
    linear, embed_type, head_type = _format_types(quantize)

    def shape_bytes(shape: tuple[int, ...], two_d: str | None) -> int:
        numel = 1
        for d in shape:
            numel *= d
        return _tensor_bytes(numel, shape, two_d if len(shape) == 2 else None)

    # a tied head is one copy only where the table and the head are stored alike: w8 keeps
    # the table fp32 and the head int8, q4_0 the table Q4_0 and the head Q8_0 (the 1B shape's
    # w8 file: 2.29 GB against an estimate of 2.03, refused by the writer after the work)
    tied = one_table and embed_type == head_type
    head_rows = head_table and one_table and rows and not tied and quantize is not None
    return PartBytes(
        embedding=0 if head_rows else shape_bytes(embed, embed_type),
        layers=tuple(sum(shape_bytes(p, linear) for p in layer) for layer in layers),
        head=sum(shape_bytes(p, None) for p in norm) + shape_bytes(head, head_type),
        tied=tied, host_table=(tied and embed_type is None and rows) or head_rows, quantize=quantize,
        head_rows=head_rows)


def part_bytes(model: Any, quantize: str | None = None, target: str | None = None) -> PartBytes:
    """The weight bytes of ``model``'s parts in format ``quantize`` (None: fp32): linears
    (2-D weights of a layer) at the format's tensor type, the embedding table too when the
    format stores it so (none where ``target`` reads a tied table from the head:
    :func:`head_rows_target`), the lm_head at the format's head type; the rest fp32. An
    estimate from the parameters' shapes (no weight is read); the writer checks each file exactly."""
    from circleops.adapters.decode import rows_embedding

    base, head = model.model, model.lm_head
    embed = base.embed_tokens.weight
    # the rows, or the rows times a scalar (Gemma's sqrt(hidden), which the first part applies)
    return _sizes(tuple(embed.shape), [[tuple(p.shape) for p in layer.parameters()] for layer in base.layers],
                  [tuple(p.shape) for p in base.norm.parameters()], tuple(head.weight.shape),
                  one_table=head.weight is embed, rows=rows_embedding(base.embed_tokens), quantize=quantize,
                  # the head's product must give the logits (Gemma 2's final softcap follows it)
                  head_table=head_rows_target(target) and getattr(model.config, "final_logit_softcapping", None) is None)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")  # a decoder layer's parameter, by transformers' name


def named_part_bytes(shapes: Mapping[str, Sequence[int]], tied: bool, quantize: str | None = None,
                     target: str | None = None) -> PartBytes | None:
    """The weight bytes of the parts of a causal LM whose parameters have these ``shapes``
    (transformers' names: ``model.embed_tokens.weight``, ``model.layers.N.*``,
    ``model.norm.*``, ``lm_head.weight`` unless ``tied``), before the model exists: the
    safetensors headers, or circleops.sources.sizes.dense_shapes of a config. A lower bound
    of :func:`part_bytes` (the first part counted without the table wherever it may be), so a
    plan it cannot make is refused rightly before any work. None where the names are not a
    decoder's (a VLM's, a MoE checkpoint's own layout: the plan on the loaded model decides)."""
    layers: dict[int, list[tuple[int, ...]]] = {}
    norm: list[tuple[int, ...]] = []
    embed = shapes.get("model.embed_tokens.weight")
    for name, shape in shapes.items():
        m = _LAYER.match(name)
        if m:
            layers.setdefault(int(m.group(1)), []).append(tuple(int(d) for d in shape))
        elif name.startswith("model.norm."):
            norm.append(tuple(int(d) for d in shape))
    head = embed if tied else shapes.get("lm_head.weight")
    if embed is None or head is None or not layers or sorted(layers) != list(range(len(layers))):
        return None
    return _sizes(tuple(embed), [layers[i] for i in range(len(layers))], norm, tuple(head), one_table=tied,
                  rows=True, quantize=quantize, head_table=head_rows_target(target))


def plan_parts(sizes: PartBytes, limit: int | None) -> list[tuple[int, int]]:
    """Consecutive layer ranges (start, stop) whose parts' weights each fit ``limit`` bytes
    (None: no limit, one part), the first part also holding the embedding table, the last
    the lm_head; as few parts as the greedy fill from the first layer gives. One range when
    the whole model fits. TargetError when a part with one layer cannot fit."""
    n = len(sizes.layers)
    budget = None if limit is None else int(limit * WEIGHT_SHARE) - TABLE_BYTES
    if budget is None or sizes.whole <= budget:
        return [(0, n)]
    ranges: list[tuple[int, int]] = []
    start, used = 0, 0 if sizes.host_table else sizes.embedding
    for i, layer in enumerate(sizes.layers):
        tail = sizes.head if i == n - 1 else 0
        if used + layer + tail > budget and i > start:
            ranges.append((start, i))
            start, used = i, 0
        used += layer
        if used + tail > budget:
            what = ("the embedding table and layer 0" if i == 0 and not sizes.host_table else
                    "layer {0} with the lm_head".format(i) if tail else f"layer {i}")
            smaller = ("Quantize it (--quantize q4_0, q8_0 or w8)" if sizes.quantize is None else
                       f"Already {sizes.quantize}: use a smaller format (q4_0 is the smallest onert runs)"
                       if sizes.quantize != "q4_0" else "Already q4_0, the smallest format onert runs: raise "
                       "--max-file-bytes (onert's limit is 2 GiB)")
            raise TargetError(f"the model cannot be split into files of at most {limit} bytes: {what} alone take "
                              f"{used + tail} bytes of weights. {smaller}, or use --target circle or tflite, whose "
                              f"files may pass 2 GiB.")
    ranges.append((start, n))
    return ranges


def check_part_size(ir_model: Any, limit: int | None, name: str) -> None:
    """TargetError when a written part would pass ``limit`` after all (the plan is an estimate
    from the parameters; the constants of the lowered part are exact)."""
    from circleops.serialize.writer import constant_bytes

    if limit is None:
        return
    needed = constant_bytes(ir_model) + TABLE_BYTES
    if needed > limit:
        raise TargetError(f"{name} would hold {needed} bytes, more than the {limit} a file may (the split plan "
                          f"estimated less); nothing was written. Quantize the model, or report it.")


def part_graph_name(graph: str, part: int) -> str:
    """The name of part ``part`` of ``graph`` among the programs a convert lowers."""
    return f"{graph}.part{part}"


def part_file_name(graph: str, part: int, fmt: str, one_file_per_graph: bool) -> str:
    """The file of part ``part`` of ``graph``: its own (``decode.part1.circle``) or, where a
    file holds a signature per graph, the part's file shared by every graph (``part1.circle``)."""
    return f"{graph}.part{part}.{fmt}" if one_file_per_graph else f"part{part}.{fmt}"


def part_io_names(graph_kind: str, start: int, stop: int, num_layers: int,
                  cache_update: str = "rows", host_table: bool = False) -> tuple[list[str], list[str]]:
    """Inputs and outputs of the part of layers start..stop-1 of a ``graph_kind`` ("prefill"
    or "decode") graph: ``input_ids`` (first part, unless ``host_table``: the embeddings,
    ``hidden_in``) or ``hidden_in``, ``pos``, ``logits_row`` (a prefill's last part), the
    part's caches; ``logits`` (last part) or ``hidden``, the part's new cache rows (or whole
    caches for cache_update "full")."""
    layers = range(start, stop)
    ins = ["input_ids" if start == 0 and not host_table else "hidden_in", "pos"]
    if graph_kind == "prefill" and stop == num_layers:
        ins.append("logits_row")
    ins += [f"k_cache_{i}" for i in layers] + [f"v_cache_{i}" for i in layers]
    if cache_update == "rows":
        rows = [f"k_new_{i}" for i in layers] + [f"v_new_{i}" for i in layers]
    else:
        rows = [f"new_k_cache_{i}" for i in layers] + [f"new_v_cache_{i}" for i in layers]
    return ins, ["logits" if stop == num_layers else "hidden", *rows]


def part_module(step: Any, graph_kind: str, start: int, stop: int, host_table: bool = False) -> Any:
    """The torch module of one part (a prefill's last part computes one row's logits;
    ``host_table``: the first part takes the embeddings)."""
    from circleops.adapters.decode import DecoderPart

    return DecoderPart(step, start, stop, one_row=graph_kind == "prefill", embedded=host_table)


def part_example_args(step: Any, graph_kind: str, length: int, start: int, stop: int,
                      host_table: bool = False) -> tuple:
    """Export inputs of a part: token ids (the first part, unless ``host_table``) or a zero
    hidden state, pos, (a prefill's last part: the logits row,) the part's zero caches."""
    import torch

    s = length if graph_kind == "prefill" else 1
    caches = step.empty_caches()
    n = step.num_layers
    mine = caches[start:stop] + caches[n + start:n + stop]
    if start == 0 and not host_table:
        x = torch.zeros((1, s), dtype=torch.int64)
    else:
        hidden = int(step.model.config.hidden_size)
        x = torch.zeros((1, s, hidden), dtype=caches[0].dtype)
    pos = torch.tensor([0 if graph_kind == "prefill" else length], dtype=torch.int64)
    row = [torch.tensor([s - 1], dtype=torch.int64)] if graph_kind == "prefill" and stop == n else []
    return (x, pos, *row, *mine)

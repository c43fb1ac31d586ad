"""The layers of an encoder-decoder transformer over explicit caches, as one core for every
family row of :mod:`circleops.adapters.seq2seq` (Whisper, T5, BART, mBART, Marian).

Each sub-layer is "attention or feed-forward, then a residual" with the norm before (T5,
Whisper, mBART: ``pre_norm``) or after (BART, Marian). The attention is written as matmuls
and a softmax, not circle.attention: its contract projects K and V from the same ``x`` as Q
(cross-attention takes them from the encoder), has no projection biases (BART's have them),
always applies RoPE and always scales by 1/sqrt(D) (T5 does not scale and adds a relative
position bias). The layers' own modules (projections, norms, activations) are called, so the
arithmetic is transformers'; only the order of the attention steps is ours.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor


def path(obj: Any, dotted: str) -> Any:
    """``obj.a.b.0.c``; a numeric part indexes (``block.-1`` is the last block)."""
    for part in dotted.split("."):
        obj = obj[int(part)] if part.lstrip("-").isdigit() else getattr(obj, part)
    return obj


def split_heads(x: Tensor, heads: int) -> Tensor:
    """[1, S, H*D] -> [1, H, S, D]."""
    b, s, e = x.shape
    return x.view(b, s, heads, e // heads).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """[1, H, S, D] -> [1, S, H*D]."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, h * d)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, bias: Optional[Tensor] = None) -> Tensor:
    """softmax(q k^T + bias + mask) v; q is already scaled (T5: not at all)."""
    scores = torch.matmul(q, k.transpose(-1, -2))
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1), v)


class Attention:
    """One attention module of a layer, through the family's projection names."""

    def __init__(self, module: torch.nn.Module, names: Sequence[str]):
        self.module = module
        self.q, self.k, self.v, self.o = (getattr(module, n) for n in names)
        self.heads = int(getattr(module, "num_heads", None) or getattr(module, "n_heads"))
        scaling = getattr(module, "scaling", 1.0)
        self.scaling = None if scaling == 1.0 else float(scaling)  # T5 does not scale

    def query(self, x: Tensor) -> Tensor:
        q = self.q(x)
        return split_heads(q * self.scaling if self.scaling is not None else q, self.heads)

    def keys_values(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return split_heads(self.k(x), self.heads), split_heads(self.v(x), self.heads)

    def out(self, x: Tensor) -> Tensor:
        return self.o(merge_heads(x))


def residual(pre_norm: bool, h: Tensor, norm: torch.nn.Module, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """``h + fn(norm(h))`` (pre-norm) or ``norm(h + fn(h))`` (post-norm)."""
    return h + fn(norm(h)) if pre_norm else norm(h + fn(h))


def feed_forward(layer: torch.nn.Module, chain: Sequence[str], x: Tensor) -> Tensor:
    """The layer's feed-forward: each of ``chain`` (modules or functions of the layer) in turn."""
    for name in chain:
        x = path(layer, name)(x)
    return x


class LayerRunner:
    """Runs one family's layers: ``fam`` is the row (attribute paths and flags)."""

    def __init__(self, fam: Any):
        self.fam = fam

    def self_attention(self, layer: torch.nn.Module) -> Attention:
        return Attention(path(layer, self.fam.self_attn), self.fam.proj)

    def cross_attention(self, layer: torch.nn.Module) -> Attention:
        return Attention(path(layer, self.fam.cross_attn), self.fam.proj)

    def encoder_layer(self, layer: torch.nn.Module, h: Tensor, mask: Tensor, bias: Optional[Tensor]) -> Tensor:
        """One encoder layer: bidirectional self-attention over the whole (padded) source."""
        fam, a = self.fam, self.self_attention(layer)

        def attn(x: Tensor) -> Tensor:
            return a.out(attend(a.query(x), *a.keys_values(x), mask, bias))

        h = residual(fam.pre_norm, h, path(layer, fam.self_norm), attn)
        return residual(fam.pre_norm, h, path(layer, fam.ffn_norm), lambda x: feed_forward(layer, fam.ffn, x))

    def decoder_layer(self, layer: torch.nn.Module, h: Tensor, past: Optional[tuple[Tensor, Tensor]], *,
                      mask: Optional[Tensor], bias: Optional[Tensor], cross: tuple[Tensor, Tensor],
                      cross_mask: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """One decoder layer over the new tokens ``h`` [1, S, E]: causal self-attention over
        ``past`` (k, v caches [1, H, C, D], or None: no cache) and the new tokens under
        ``mask`` [.., S, C + S] (+ ``bias``: T5's relative positions), then cross-attention to
        ``cross`` (k, v [1, H, T, D]) under ``cross_mask``. Returns (h, the new k, v rows)."""
        fam, a, c = self.fam, self.self_attention(layer), self.cross_attention(layer)
        rows: list[Tensor] = []

        def self_attn(x: Tensor) -> Tensor:
            k, v = a.keys_values(x)
            rows.extend((k, v))
            if past is not None:
                k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
            return a.out(attend(a.query(x), k, v, mask, bias))

        h = residual(fam.pre_norm, h, path(layer, fam.self_norm), self_attn)
        h = residual(fam.pre_norm, h, path(layer, fam.cross_norm),
                     lambda x: c.out(attend(c.query(x), cross[0], cross[1], cross_mask)))
        h = residual(fam.pre_norm, h, path(layer, fam.ffn_norm), lambda x: feed_forward(layer, fam.ffn, x))
        return h, rows[0], rows[1]


def key_mask(length: Tensor, size: int, dtype: torch.dtype) -> Tensor:
    """The additive mask [1, 1, 1, size] hiding key positions >= ``length`` (int64 [1]): the
    source's padding."""
    j = torch.arange(size, device=length.device)
    hidden = j >= length.reshape(1).to(torch.int64)
    return torch.zeros(size, dtype=dtype, device=length.device).masked_fill(hidden, torch.finfo(dtype).min)[None, None, None]


def relative_buckets(relative: Tensor, module: torch.nn.Module, bidirectional: bool) -> Tensor:
    """T5's bucket of each relative position (memory - query), by the model's own function."""
    return module._relative_position_bucket(relative, bidirectional=bidirectional,
                                            num_buckets=module.relative_attention_num_buckets,
                                            max_distance=module.relative_attention_max_distance)


def bias_from_buckets(table: torch.nn.Embedding, buckets: Tensor) -> Tensor:
    """The relative-position bias [1, H, Q, K] of buckets [Q, K] (T5's compute_bias)."""
    q, k = buckets.shape
    values = torch.index_select(table.weight, 0, buckets.reshape(-1)).reshape(q, k, -1)
    return values.permute(2, 0, 1).unsqueeze(0)

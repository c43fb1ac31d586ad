"""Qwen2-VL / Qwen2.5-VL images with static shapes: the vision tower over one image's patches
padded to a fixed count, and the host-side integer bookkeeping transformers does around it
(the 2-D rotary positions, Qwen2.5's window order, the attention segments, and the text
model's 3-D M-RoPE positions of a prompt, get_rope_index's).

transformers runs the tower on every image's patches at once and splits attention by
``cu_seqlens`` (per image) and ``cu_window_seqlens`` (Qwen2.5's windows of merge units) with
data-dependent lengths. Here those are inputs: each patch's segment for the full-attention
blocks and for the window blocks (a patch sees the patches of its own segment: the same
sets transformers' splits give), the window permutation of the merge units and its inverse,
and the rotary positions. The graph is then one static shape for any image up to
``max_patches``; its padding is a segment of its own, and its merged rows are dropped.
Attention is written out (circle.attention's contract is causal-cache attention); q and k
rotate by circle.rope, the RMS norms (Qwen2.5) are circle.rms_norm once the model is fused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

import circleops.ops  # noqa: F401  (registers torch.ops.circle.*)


@dataclass
class VisionIndex:
    """One image's integer inputs of :class:`QwenVisionTower`, padded to ``max_patches``."""

    rope: Tensor  # [N, 2] int64: each patch's (row, column) rotary position, transformers' order
    window_index: Tensor  # [N/U] int64: merge units in window order (identity without windows)
    reverse_index: Tensor  # [N/U] int64: its inverse (the merged rows back in image order)
    full_segment: Tensor  # [N] int64, window order: 0 for the image, 1 for padding
    window_segment: Tensor  # [N] int64, window order: each patch's window (padding: its own)
    patches: int  # the image's real patch count
    tokens: int  # its merged rows (image tokens)

    def inputs(self) -> tuple[Tensor, ...]:
        return self.rope, self.window_index, self.reverse_index, self.full_segment, self.window_segment


def vision_index(visual: Any, grid_thw: Sequence[int], max_patches: int) -> VisionIndex:
    """The integer inputs for one image of grid ``(t, h, w)`` (patches), computed by
    transformers' own vision helpers on that grid, padded to ``max_patches``."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

    merge = int(visual.spatial_merge_size)
    unit = merge * merge
    grid = torch.tensor([list(grid_thw)], dtype=torch.int64)
    n = int(grid.prod())
    if n > max_patches or max_patches % unit:
        raise ValueError(f"an image of {n} patches does not fit a vision graph of {max_patches} patches")
    rope = get_vision_position_ids(grid, merge)
    units, pad_units = n // unit, (max_patches - n) // unit
    if getattr(visual, "fullatt_block_indexes", None) is not None:  # Qwen2.5: windows of merge units
        window_index, cu = get_vision_window_index(grid, spatial_merge_size=merge, window_size=visual.window_size,
                                                   patch_size=visual.patch_size)
        window_segment = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
    else:
        window_index, window_segment = torch.arange(units), torch.zeros(n, dtype=torch.int64)
    window_index = torch.cat([window_index.to(torch.int64), torch.arange(units, units + pad_units)])
    assert int(get_vision_cu_seqlens(grid)[-1]) == n  # one image: one full-attention segment
    pad = max_patches - n
    rope = torch.cat([rope.reshape(n, 2).to(torch.int64), torch.zeros(pad, 2, dtype=torch.int64)])
    full = torch.cat([torch.zeros(n, dtype=torch.int64), torch.ones(pad, dtype=torch.int64)])
    window = torch.cat([window_segment.to(torch.int64), torch.full((pad,), -1, dtype=torch.int64)])
    return VisionIndex(rope, window_index, torch.argsort(window_index), full, window, n, units)


def _segment_mask(segment: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive [1, 1, N, N]: patch i sees patch j iff they are in one segment."""
    same = segment[:, None] == segment[None, :]
    return torch.zeros(same.shape, dtype=dtype).masked_fill(~same, torch.finfo(dtype).min)[None, None]


class QwenVisionTower(torch.nn.Module):
    """``forward(patches [N, C*T*P*P], rope [N, 2], window_index [N/U], reverse_index [N/U],
    full_segment [N], window_segment [N])`` -> the image's merged rows [N/U, hidden] in image
    order (transformers' ``get_image_features`` for that image, padding rows at the end)."""

    def __init__(self, vlm: Any):
        super().__init__()
        self.visual = vlm.model.visual
        self.unit = int(self.visual.spatial_merge_size) ** 2
        full = getattr(self.visual, "fullatt_block_indexes", None)
        self.full_blocks = set(range(len(self.visual.blocks))) if full is None else set(full)

    def _unit_order(self, x: Tensor, index: Tensor) -> Tensor:
        """Rows of ``x`` [N, ...] permuted by merge unit: unit ``index[k]`` to place k."""
        n = x.shape[0]
        units = x.reshape(n // self.unit, self.unit, -1)
        return torch.index_select(units, 0, index).reshape(n, *x.shape[1:])

    def forward(self, patches: Tensor, rope: Tensor, window_index: Tensor, reverse_index: Tensor,
                full_segment: Tensor, window_segment: Tensor) -> Tensor:
        v = self.visual
        h = self._unit_order(v.patch_embed(patches), window_index)
        cos, sin = v.rotary_pos_emb(h, rope)
        cos, sin = self._unit_order(cos, window_index)[None], self._unit_order(sin, window_index)[None]  # [1, N, D]
        masks = {True: _segment_mask(full_segment, h.dtype), False: _segment_mask(window_segment, h.dtype)}
        for i, block in enumerate(v.blocks):
            h = h + self._attention(block.attn, block.norm1(h), cos, sin, masks[i in self.full_blocks])
            h = h + block.mlp(block.norm2(h))
        return torch.index_select(v.merger(h), 0, reverse_index)

    @staticmethod
    def _attention(attn: Any, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        n = x.shape[0]
        qkv = attn.qkv(x).reshape(n, 3, attn.num_heads, -1).permute(1, 2, 0, 3)  # [3, H, N, D]
        q, k, v = qkv[0][None], qkv[1][None], qkv[2][None]
        q = torch.ops.circle.rope(q, cos, sin, "gpt_neox")
        k = torch.ops.circle.rope(k, cos, sin, "gpt_neox")
        scores = torch.matmul(q, k.transpose(-1, -2)) * attn.scaling + mask
        out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [1, H, N, D]
        return attn.proj(out[0].transpose(0, 1).reshape(n, -1))


def mrope_positions(ids: Sequence[int], image_token_id: int, grids: Sequence[Sequence[int]],
                    spatial_merge_size: int) -> tuple[list[list[int]], int]:
    """The prompt's 3-D rotary positions [3][S] and the decode delta, as transformers'
    ``get_rope_index`` computes them for images: text tokens count on from the last position;
    an image's tokens (one run per image, in ``grids`` order) take (start, start + row,
    start + column) over its merged grid, and the next position is start + max(rows, cols)."""
    out: list[list[int]] = [[], [], []]
    pos, i, image = 0, 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            for axis in out:
                axis.append(pos)
            pos, i = pos + 1, i + 1
            continue
        t, h, w = (int(x) for x in grids[image])
        rows, cols = h // spatial_merge_size, w // spatial_merge_size
        for tt in range(t):
            for r in range(rows):
                for c in range(cols):
                    out[0].append(pos + tt), out[1].append(pos + r), out[2].append(pos + c)
        i += t * rows * cols
        pos += max(rows, cols)
        image += 1
    return out, (max(max(a) for a in out) + 1 - len(ids)) if ids else 0

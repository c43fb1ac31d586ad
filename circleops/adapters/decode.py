"""A decoder step with an explicit static KV cache, ready for torch.export.

    step = DecoderWithCache(model, max_len=64)
    caches = step.empty_caches()
    logits, *caches = step(input_ids, torch.tensor([0]), *caches)          # prefill, S = N
    logits, *caches = step(next_id, torch.tensor([N]), *caches)            # decode, S = 1

    ep = torch.export.export(step, (input_ids, pos, *caches))              # one graph per S

Every attention layer becomes one circle.attention taking its caches in ONE's layout
[1, C, Hkv, D] (C = max_len) and returning them updated; the additive mask and the RoPE
cos/sin are computed inside from ``pos``, so the exported graph's inputs are just the
token ids, the position and the caches. Families whose attention the Circle ATTENTION
contract cannot express (biases, q/k norms, soft-capping, sliding windows, other score
scales, partial rotary) are refused with a :class:`~circleops.errors.CircleOpsError`
naming the layers and reasons; they are not run decomposed here.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from circleops.adapters._attention import KV_KWARG, StaticKV, attention_blockers, projection_weights
from circleops.adapters._instance import fuse
from circleops.errors import CircleOpsError
from circleops.options import CACHE_LAYOUTS, CACHE_UPDATES, HEAD_MAJOR, SLOT_MAJOR


def _parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    base, lm_head = getattr(model, "model", None), getattr(model, "lm_head", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or lm_head is None or not all(hasattr(base, n) for n in needed):
        raise CircleOpsError(
            f"DecoderWithCache needs a Hugging Face *ForCausalLM (model.model with {', '.join(needed)}, and "
            f"model.lm_head); got {type(model).__name__}. Pass the causal-LM model, not its base model.")
    return base, lm_head


class DecoderWithCache(torch.nn.Module):
    """One prefill or decode step of a causal LM over explicit static caches.

    ``forward(input_ids [1, S], pos int64 [1], *k_caches, *v_caches)`` returns
    ``(logits [1, S, V], *new_k_caches, *new_v_caches)``; each cache is [1, C, Hkv, D]
    with C = ``max_len``, and the S new tokens are written at slots pos .. pos+S-1.
    With ``cache_update="rows"`` the caches are only read (slots >= pos are masked: they
    are stale) and the step returns the S new rows ``(logits, *k_rows, *v_rows)``, each
    [1, S, Hkv, D], which the caller writes at slots pos .. pos+S-1 of its caches (in
    place, as llama.cpp does: a decode step then reads each cache once and writes one row).
    ``cache_layout`` HEAD_MAJOR (with "rows" only) takes k caches [1, Hkv, C, D] and v
    caches [1, Hkv, D, C]: what the attention's matrix products read without a transpose.

    The model's modules are fused in place (as :func:`circleops.fuse` does; undo with
    :func:`circleops.unfuse`); run HF's own ``generate`` on it still works, decomposed.
    """

    def __init__(self, model: torch.nn.Module, max_len: int, cache_update: str = "full",
                 cache_layout: str = SLOT_MAJOR):
        super().__init__()
        base, _ = _parts(model)
        config = model.config
        if max_len < 1:
            raise CircleOpsError(f"DecoderWithCache: max_len must be at least 1, got {max_len}.")
        if cache_update not in CACHE_UPDATES:
            raise CircleOpsError(f"DecoderWithCache: cache_update must be one of {', '.join(CACHE_UPDATES)}, got "
                                 f"{cache_update!r}.")
        if cache_layout not in CACHE_LAYOUTS or (cache_layout == HEAD_MAJOR and cache_update != "rows"):
            raise CircleOpsError(f"DecoderWithCache: cache_layout must be {SLOT_MAJOR!r}, or {HEAD_MAJOR!r} with "
                                 f"cache_update='rows' (whole updated caches come out slot-major); got "
                                 f"{cache_layout!r}.")
        blocked = []
        for i, layer in enumerate(base.layers):
            attn = getattr(layer, "self_attn", None)
            reasons = ["no self_attn module"] if attn is None else attention_blockers(attn)
            if reasons:
                blocked.append(f"layer {i} ({type(attn).__name__}): {'; '.join(reasons)}")
        if getattr(config, "final_logit_softcapping", None) is not None:
            blocked.append(f"final logit soft-capping at {config.final_logit_softcapping}")
        if blocked:
            raise CircleOpsError(
                f"DecoderWithCache: {type(model).__name__}'s attention cannot be expressed as circle.attention "
                f"(the Circle ATTENTION contract), so it has no explicit-cache decode graph: {' | '.join(blocked)}. "
                "Export its plain forward with circleops.adapters.patched_modules() instead (attention stays "
                "decomposed there).")
        self.model = fuse(model)
        self.max_len = int(max_len)
        self.cache_update = cache_update
        self.cache_layout = cache_layout
        self.num_layers = len(base.layers)
        attn = base.layers[0].self_attn
        _, wk, _ = projection_weights(attn)
        self.head_dim = int(attn.head_dim)
        self.kv_heads = int(wk.shape[0]) // self.head_dim

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        """[1, C, Hkv, D], ONE's cache layout."""
        return (1, self.max_len, self.kv_heads, self.head_dim)

    @property
    def cache_shapes(self) -> list[tuple[int, ...]]:
        """The shape of each cache argument, k caches then v caches, in ``cache_layout``."""
        _, c, h, d = self.cache_shape
        k, v = ((1, h, c, d), (1, h, d, c)) if self.cache_layout == HEAD_MAJOR else (self.cache_shape,) * 2
        return [k] * self.num_layers + [v] * self.num_layers

    def empty_caches(self, dtype: torch.dtype | None = None) -> list[Tensor]:
        """Zero k caches then zero v caches, one per layer (2 × num_layers tensors)."""
        ref = next(self.model.parameters())
        return [torch.zeros(shape, dtype=dtype or ref.dtype, device=ref.device) for shape in self.cache_shapes]

    def forward(self, input_ids: Tensor, pos: Tensor, *caches: Tensor) -> tuple[Tensor, ...]:
        return self.run(input_ids, pos, caches)

    def run(self, input_ids: Tensor, pos: Tensor, caches: Sequence[Tensor],
             row: Tensor | None = None, inputs_embeds: Tensor | None = None,
             prefix_len: Tensor | None = None) -> tuple[Tensor, ...]:
        """:meth:`forward`; with ``row`` (int64 [1], an index into the S new tokens) the
        logits of that row only, [1, 1, V]: the final norm and the lm_head run on one row.
        ``inputs_embeds`` [1, S, hidden]: the tokens' embeddings, given instead of looked up
        (a vision-language model's prefill merges image embeddings in: circleops.vlm).
        ``prefix_len`` (int64 [1]): a prefix-LM's mask (PaliGemma): the first ``prefix_len``
        positions (image and prompt) see each other both ways, the rest causally; 0 is causal."""
        n = self.num_layers
        if len(caches) != 2 * n:
            raise CircleOpsError(f"DecoderWithCache: expected {2 * n} caches ({n} k then {n} v), got {len(caches)}.")
        base, lm_head = _parts(self.model)
        s = input_ids.shape[1]
        positions = pos.reshape(1, 1).to(torch.int64) + torch.arange(s, device=input_ids.device)[None]  # [1, S]
        hidden = base.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = base.rotary_emb(hidden, positions)
        slots = torch.arange(self.max_len, device=input_ids.device)
        if self.cache_update == "rows":
            # slot c of the input caches is visible iff c < pos: the new tokens' own keys come
            # as rows (attended causally by the op), and slots from pos on are stale
            visible = slots[None, :] < pos.reshape(1, 1).to(torch.int64)  # [1, C], the same for every row
        else:
            # slot c is visible to new token i iff c <= pos + i: written already, or now
            visible = slots[None, :] <= positions[0, :, None]  # [S, C]
        if prefix_len is not None:
            visible = _prefix_visible(visible, slots, positions[0], prefix_len, self.cache_update)
        mask = torch.zeros(visible.shape, dtype=hidden.dtype, device=hidden.device)
        mask = mask.masked_fill(~visible, torch.finfo(hidden.dtype).min)[None, None]  # [1, 1, S or 1, C]
        k_caches, v_caches = list(caches[:n]), list(caches[n:])
        if self.cache_layout == HEAD_MAJOR:
            # views in circle.attention's [1, C, Hkv, D]: the attention's own transposes to
            # [1, Hkv, C, D] and [1, Hkv, D, C] cancel them when lowered, so none is copied
            k_caches = [k.transpose(1, 2) for k in k_caches]
            v_caches = [v.permute(0, 3, 1, 2) for v in v_caches]
        kv = StaticKV(k_caches, v_caches, pos, self.cache_update)
        for layer in base.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=(cos, sin), position_ids=positions,
                           **{KV_KWARG: kv})
        if row is not None:
            hidden = hidden.index_select(1, row.reshape(1).to(torch.int64))
        logits = lm_head(base.norm(hidden))
        return (logits, *kv.k, *kv.v)


def _prefix_visible(visible: Tensor, slots: Tensor, positions: Tensor, prefix_len: Tensor,
                    cache_update: str) -> Tensor:
    """``visible`` with a prefix-LM's prefix: key position j is visible to query position i
    iff it was (causal) or j < prefix_len (HF's ``token_type_ids == 0`` block: the image and
    prompt attend to each other both ways). "full" [S, C]: the prefix slots this run writes
    (the last position bounds them: a slot not written yet stays hidden). "rows" [S, C + S]:
    the input slots before pos, then the S new tokens among themselves (circle.attention's
    C + S mask), built over one index k (no bool CONCATENATION or BROADCAST_TO: onert has
    neither)."""
    p = prefix_len.reshape(1, 1).to(torch.int64)
    if cache_update != "rows":
        return visible | ((slots[None, :] < p) & (slots[None, :] <= positions[-1]))
    c, s = slots.shape[0], positions.shape[0]
    j = torch.arange(c + s, device=slots.device)[None, :] - c  # [1, C + S]: < 0 a cache slot, else a new token
    i = torch.arange(s, device=slots.device)[:, None]  # [S, 1]
    pos = positions[:1].reshape(1, 1)
    cached = (j + c) < pos  # slot < pos (pos < C, so a cache column)
    own = (j >= 0) & ((j <= i) | ((j + pos) < p))
    return cached | own


class OneRowPrefill(torch.nn.Module):
    """A prefill of ``step`` (a :class:`DecoderWithCache`) that computes the logits of one
    row: ``forward(input_ids [1, S], pos [1], row [1], *caches)`` returns ``(logits [1, 1, V],
    *new_caches)``, the logits of token ``row`` of the S. Generation needs only the last
    prompt token's logits, and the lm_head (vocab x hidden: ~23 % of SmolLM2's multiply-adds
    per token) on every row of a chunk would be waste."""

    def __init__(self, step: DecoderWithCache):
        super().__init__()
        self.model = step.model  # registered under the decode step's name: the same parameter names
        self._run = step.run

    def forward(self, input_ids: Tensor, pos: Tensor, row: Tensor, *caches: Tensor) -> tuple[Tensor, ...]:
        return self._run(input_ids, pos, caches, row)

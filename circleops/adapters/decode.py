"""A decoder step with an explicit static KV cache, ready for torch.export.

    step = DecoderWithCache(model, max_len=64)
    caches = step.empty_caches()
    logits, *caches = step(input_ids, torch.tensor([0]), *caches)          # prefill, S = N
    logits, *caches = step(next_id, torch.tensor([N]), *caches)            # decode, S = 1

    ep = torch.export.export(step, (input_ids, pos, *caches))              # one graph per S

Every attention layer circle.attention can express becomes one circle.attention taking its
caches in ONE's layout [1, C, Hkv, D] (C = max_len) and returning them updated; the additive
mask and the RoPE cos/sin are computed inside from ``pos`` (integer graphs: gathered by ``pos``
from constant tables, ``rope_tables``), so the exported graph's inputs are
just the token ids, the position and the caches. A layer the Circle ATTENTION contract cannot
express (q/k/v biases, q/k norms, soft-capping, sliding windows, another score scale, partial
rotary: Qwen2/2.5, Qwen3, OLMo2, Gemma 2/3) computes its attention decomposed over the same
cache inputs and outputs (adapters/_cached_attention.py), with its q/k norms and RoPE still
circle.rms_norm and circle.rope; :meth:`DecoderWithCache.attention_note` says which layers and
why. What no cache graph can compute (bidirectional attention, an attention class without an
adapter, model-level scales such as Granite's) is refused with a
:class:`~circleops.errors.CircleOpsError` naming the layers and reasons.
"""
from __future__ import annotations

import inspect
from typing import Sequence

import torch
from torch import Tensor

from circleops.adapters._attention import attention_blockers, projection_weights, takes_explicit_caches
from circleops.adapters._cached_attention import (KV_KWARG, StaticKV, cache_blockers, layer_window, own_mask,
                                                  slot_mask)
from circleops.adapters._instance import fuse, is_fused, unfuse
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


# config attributes by which a model's own forward (not its decoder layers) scales the
# embeddings or the logits; DecoderWithCache reproduces neither (Granite's)
_MODEL_LEVEL_SCALES = ("embedding_multiplier", "logits_scaling")


def _model_level_blockers(config) -> list[str]:
    return [f"{name} {getattr(config, name)}" for name in _MODEL_LEVEL_SCALES
            if getattr(config, name, None) not in (None, 1, 1.0)]


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

    ``rope_tables``: the RoPE cos/sin are rows of constant tables (one row per cache slot,
    computed here by the model's own rotary embedding) gathered by position, instead of
    computed in the graph from ``pos``. What an integer (PT2E) graph needs: computed in the
    graph, the positions and the angles are activations that calibration gives a range, and a
    position past the calibrated ones saturates (wrong cos/sin); a gathered table row is the
    exact cos/sin of its slot, quantized in [-1, 1] whatever the position.
    """

    def __init__(self, model: torch.nn.Module, max_len: int, cache_update: str = "full",
                 cache_layout: str = SLOT_MAJOR, rope_tables: bool = False):
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
        unsupported = _model_level_blockers(config)
        if unsupported:
            raise CircleOpsError(
                f"DecoderWithCache: {type(model).__name__} computes {'; '.join(unsupported)} outside its decoder "
                "layers, which the explicit-cache step does not reproduce, so it has no prefill/decode graphs. "
                "Convert its plain forward (circleops.convert) instead.")
        was_fused = is_fused(model)
        self.model = fuse(model)
        blocked, self.decomposed = [], {}
        for i, layer in enumerate(base.layers):
            attn = getattr(layer, "self_attn", None)
            if attn is None or not takes_explicit_caches(attn):
                what = "no self_attn module" if attn is None else "no circleops attention adapter for this class"
                blocked.append(f"layer {i} ({type(attn).__name__}): {what}")
                continue
            hard = cache_blockers(attn)
            if hard:
                blocked.append(f"layer {i} ({type(attn).__name__}): {'; '.join(hard)}")
            reasons = attention_blockers(attn)
            if reasons:  # computed decomposed over the same caches (adapters/_cached_attention.py)
                self.decomposed[i] = reasons
        if blocked:
            if not was_fused:
                unfuse(model)  # refused: the caller's model as it came
            raise CircleOpsError(
                f"DecoderWithCache: {type(model).__name__} has no explicit-cache decode graph: {' | '.join(blocked)}. "
                "Export its plain forward with circleops.adapters.patched_modules() instead.")
        self.max_len = int(max_len)
        self.cache_update = cache_update
        self.cache_layout = cache_layout
        self.num_layers = len(base.layers)
        self.windows = [layer_window(layer.self_attn) if i in self.decomposed else None
                        for i, layer in enumerate(base.layers)]
        # Gemma3 computes cos/sin per layer type (a local rope base for its sliding layers)
        types = getattr(config, "layer_types", None)
        per_type = "layer_type" in inspect.signature(base.rotary_emb.forward).parameters
        self.rope_types = list(types[:self.num_layers]) if per_type and types else None
        # type -> (cos, sin) [C, R] of every cache slot, gathered by position (rope_tables)
        self.rope_table = _rope_table(base, self.max_len, self.rope_types) if rope_tables else None
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        attn = base.layers[0].self_attn
        _, wk, _ = projection_weights(attn)
        self.head_dim = int(attn.head_dim)
        self.kv_heads = int(wk.shape[0]) // self.head_dim

    def _rope(self, base: torch.nn.Module, hidden: Tensor, positions: Tensor, layers: range) -> list:
        """The (cos, sin) of each of ``layers`` (indexed from 0 by layer), [1, S, R] each:
        the rows of the tables at ``positions`` (``rope_tables``), else the model's rotary
        embedding computed from them."""
        if self.rope_table is not None:
            used = dict.fromkeys(None if self.rope_types is None else self.rope_types[i] for i in layers)
            # in the model's dtype already: no cast between the GATHER and its consumer
            gathered = {t: tuple(torch.nn.functional.embedding(positions, table) for table in self.rope_table[t])
                        for t in used}
            return [gathered[None if self.rope_types is None else self.rope_types[i]] if i in layers else None
                    for i in range(layers.stop)]
        if self.rope_types is None:
            return [base.rotary_emb(hidden, positions)] * layers.stop
        tables = {t: base.rotary_emb(hidden, positions, t)
                  for t in dict.fromkeys(self.rope_types[i] for i in layers)}
        return [tables[self.rope_types[i]] if i in layers else None for i in range(layers.stop)]

    def attention_note(self) -> str | None:
        """One line saying which layers' attention is decomposed, and why; None when every
        layer is one circle.attention."""
        if not self.decomposed:
            return None
        cls = type(_parts(self.model)[0].layers[next(iter(self.decomposed))].self_attn).__name__
        layers: dict[str, list[int]] = {}
        for i, reasons in self.decomposed.items():
            for r in reasons:
                layers.setdefault(r.split(" (")[0], []).append(i)
        every = len(self.decomposed) == self.num_layers

        def where(ids: list[int]) -> str:
            return "" if every and len(ids) == self.num_layers else f" [layer{'s' if len(ids) > 1 else ''} " \
                f"{', '.join(map(str, ids))}]"

        count = f"all {self.num_layers}" if every else f"{len(self.decomposed)} of {self.num_layers}"
        return (f"{cls} decomposed in {count} layers (RMS_NORM, ROPE stay fused): "
                + "; ".join(f"{r}{where(ids)}" for r, ids in layers.items()))

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
             prefix_len: Tensor | None = None, *, blocks: Tensor | None = None,
             rope_positions: Tensor | None = None) -> tuple[Tensor, ...]:
        """:meth:`forward`; with ``row`` (int64 [1], an index into the S new tokens) the
        logits of that row only, [1, 1, V]: the final norm and the lm_head run on one row.
        ``inputs_embeds`` [1, S, hidden]: the tokens' embeddings, given instead of looked up
        (a vision-language model's prefill merges image embeddings in: circleops.recipes.vlm).
        ``prefix_len`` (int64 [1]): a prefix-LM's mask (PaliGemma): the first ``prefix_len``
        positions (image and prompt) see each other both ways, the rest causally; 0 is causal.
        ``blocks`` (int64 [S]): Gemma 3's image blocks: new tokens of one block id >= 0 see
        each other both ways (the rest causally, every layer's sliding window still applying),
        -1 a text token; a block lies within one run. ``rope_positions`` ([3, 1, S]): the
        rotary positions when they are not the cache slots (Qwen2-VL's M-RoPE: t, h, w)."""
        n = self.num_layers
        if len(caches) != 2 * n:
            raise CircleOpsError(f"DecoderWithCache: expected {2 * n} caches ({n} k then {n} v), got {len(caches)}.")
        base, lm_head = _parts(self.model)
        s = input_ids.shape[1]
        positions = pos.reshape(1, 1).to(torch.int64) + torch.arange(s, device=input_ids.device)[None]  # [1, S]
        hidden = base.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if rope_positions is not None:
            rope = [base.rotary_emb(hidden, rope_positions)] * n
        else:
            rope = self._rope(base, hidden, positions, range(n))
        masks = self._masks(pos, positions, hidden.dtype, prefix_len) if blocks is None else \
            self._block_masks(pos, positions, hidden.dtype, blocks)
        k_caches, v_caches = list(caches[:n]), list(caches[n:])
        if self.cache_layout == HEAD_MAJOR:
            # views in circle.attention's [1, C, Hkv, D]: the attention's own transposes to
            # [1, Hkv, C, D] and [1, Hkv, D, C] cancel them when lowered, so none is copied
            k_caches = [k.transpose(1, 2) for k in k_caches]
            v_caches = [v.permute(0, 3, 1, 2) for v in v_caches]
        kv = StaticKV(k_caches, v_caches, pos, self.cache_update)
        for i, layer in enumerate(base.layers):
            hidden = layer(hidden, attention_mask=masks[i], position_embeddings=rope[i], position_ids=positions,
                           **{KV_KWARG: kv})
        if row is not None:
            hidden = hidden.index_select(1, row.reshape(1).to(torch.int64))
        logits = lm_head(base.norm(hidden))
        if self.final_softcap is not None:  # Gemma 2/3, in transformers' order
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return (logits, *kv.k, *kv.v)

    def _masks(self, pos: Tensor, positions: Tensor, dtype: torch.dtype,
               prefix_len: Tensor | None = None) -> list[Tensor]:
        """Each layer's additive mask, computed once per distinct window: [1, 1, S or 1, C]
        over the cache slots (circle.attention's, and the decomposed "full" form's); a
        decomposed layer in the "rows" form of S > 1 rows also gets the [.., S, S] part among
        the new tokens after it (its sliding window applies there too). With ``prefix_len``
        (a prefix-LM) one mask serves every layer: [.., S, C + S] in the "rows" form."""
        s = positions.shape[1]
        slots = torch.arange(self.max_len, device=positions.device)
        if prefix_len is not None:
            if any(w is not None for w in self.windows):
                raise CircleOpsError(
                    "DecoderWithCache: a prefix-LM mask (prefix_len) with sliding-window layers is not supported; "
                    "convert a model whose text layers attend to the whole cache.")
            if self.cache_update == "rows":  # slots before pos; the new tokens come as rows
                visible = slots[None, :] < pos.reshape(1, 1).to(torch.int64)  # [1, C]
            else:  # slot c is visible to new token i iff c <= pos + i: written already, or now
                visible = slots[None, :] <= positions[0, :, None]  # [S, C]
            visible = _prefix_visible(visible, slots, positions[0], prefix_len, self.cache_update)
            mask = torch.zeros(visible.shape, dtype=dtype, device=slots.device)
            return [mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]] * len(self.windows)
        made: dict[tuple[bool, int | None], Tensor] = {}
        out = []
        for i, window in enumerate(self.windows):
            key = (i in self.decomposed and self.cache_update == "rows" and s > 1, window)
            if key not in made:
                mask = slot_mask(pos, positions, slots, self.cache_update, dtype, window)
                if key[0]:
                    mask = torch.cat((mask.expand(1, 1, s, self.max_len), own_mask(s, dtype, window, slots.device)), -1)
                made[key] = mask
            out.append(made[key])
        return out


    def _block_masks(self, pos: Tensor, positions: Tensor, dtype: torch.dtype, blocks: Tensor) -> list[Tensor]:
        """Each layer's additive mask with image blocks (transformers' Gemma 3 masks: full
        layers causal OR same block; sliding layers that AND the window): "full" [1, 1, S, C]
        over the cache slots (the new tokens are in slots pos .. pos+S-1); "rows" [1, 1, S,
        C + S], the cache slots then the new tokens (every layer decomposed: circle.attention's
        rows form keeps its own causal part)."""
        if self.cache_update == "rows" and len(self.decomposed) != self.num_layers:
            raise CircleOpsError("DecoderWithCache: image blocks (bidirectional attention over an image) need every "
                                 "layer's attention decomposed; this model fuses some into circle.attention.")
        s, c = positions.shape[1], self.max_len
        q = positions[0]  # [S]
        b = blocks.reshape(-1).to(torch.int64)
        slots = torch.arange(c, device=q.device)
        i = torch.arange(s, device=q.device)
        p = pos.reshape(1).to(torch.int64)
        if self.cache_update == "rows":  # over one index k: no bool CONCATENATION (onert has none)
            k = torch.arange(c + s, device=q.device)
            j = k - c  # < 0: cache slot k; else new token j
            new = j >= 0
            keys = torch.where(new, p + j, k)
            key_blocks = torch.where(new, torch.index_select(b, 0, j.clamp(0, s - 1)), -2)
            causal = (new[None, :] & (j[None, :] <= i[:, None])) | (~new & (k < p))[None, :]  # [S, C + S]
        else:
            keys, j = slots, slots - p
            written = (j >= 0) & (j < s)
            key_blocks = torch.where(written, torch.index_select(b, 0, j.clamp(0, s - 1)), -2)
            causal = slots[None, :] <= q[:, None]  # [S, C]
        both = causal | ((key_blocks[None, :] == b[:, None]) & (b[:, None] >= 0))
        made: dict[int | None, Tensor] = {}
        for window in self.windows:
            if window not in made:
                visible = both if window is None else both & (keys[None, :] > q[:, None] - window)
                mask = torch.zeros(visible.shape, dtype=dtype, device=q.device)
                made[window] = mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]
        return [made[w] for w in self.windows]


def _rope_table(base: torch.nn.Module, max_len: int, types: Sequence[str] | None) -> dict:
    """type (None without per-layer types) -> (cos, sin) [C, R] of positions 0 .. C-1, as the
    model's rotary embedding computes them (elementwise per position: the same values a step
    computes from its own positions)."""
    ref = next(base.parameters())
    positions = torch.arange(max_len, device=ref.device)[None]
    x = torch.zeros(1, 1, 1, dtype=ref.dtype, device=ref.device)  # the rotary embedding reads its dtype
    out = {}
    with torch.no_grad():
        for t in (dict.fromkeys(types) if types is not None else [None]):
            cos, sin = base.rotary_emb(x, positions) if t is None else base.rotary_emb(x, positions, t)
            out[t] = (cos[0].contiguous(), sin[0].contiguous())
    return out


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


# transformers' embeddings whose forward is nn.Embedding's (the table's rows) times the scalar
# buffer ``embed_scale`` (Gemma 1/2/3: sqrt(hidden)); read by name, as the forward is theirs
SCALED_EMBEDDINGS = ("GemmaTextScaledWordEmbedding", "Gemma2TextScaledWordEmbedding",
                     "Gemma3TextScaledWordEmbedding")


def rows_embedding(embed: torch.nn.Module) -> bool:
    """Whether ``embed``'s output is its weight's rows, or those times a scalar
    (:data:`SCALED_EMBEDDINGS`): a split model's first part can then take the rows, looked up
    by the generator in the tied lm_head (circleops.package.split), and scale them itself."""
    kind = type(embed)
    return kind is torch.nn.Embedding or (kind.__name__ in SCALED_EMBEDDINGS and kind.__bases__ == (torch.nn.Embedding,)
                                          and isinstance(getattr(embed, "embed_scale", None), Tensor))


def scale_rows(embed: torch.nn.Module, rows: Tensor) -> Tensor:
    """``embed``'s output for the token ids whose table rows are ``rows``: the rows, times its
    ``embed_scale`` in the table's dtype as transformers' scaled embeddings compute it."""
    scale = getattr(embed, "embed_scale", None) if type(embed) is not torch.nn.Embedding else None
    return rows if scale is None else rows * scale.to(embed.weight.dtype)


class DecoderPart(torch.nn.Module):
    """Layers ``start..stop-1`` of ``step`` (a :class:`DecoderWithCache`): one file of a model
    split into consecutive files (circleops.package.split; onert reads no file past 2 GiB).

    ``forward(x, pos, [row,] *caches)``: ``x`` is the token ids [1, S] in the first part
    (which looks up the embeddings; ``embedded``: the table's rows of the ids, looked up by the
    caller, which the part scales as the model's embedding does: :func:`scale_rows`),
    else the hidden state [1, S, hidden] the previous part
    returned; ``caches`` are the k caches then the v caches of this part's layers only. It
    returns ``(y, *k_rows_or_caches, *v_...)``: ``y`` the hidden state after ``stop - 1``, or,
    in the last part, the logits (of row ``row`` only when the part takes ``one_row``).
    Each part computes its own masks and RoPE tables from ``pos`` (a few kB of work)."""

    def __init__(self, step: DecoderWithCache, start: int, stop: int, *, one_row: bool = False,
                 embedded: bool = False):
        super().__init__()
        if not 0 <= start < stop <= step.num_layers:
            raise CircleOpsError(f"DecoderPart: layers {start}..{stop - 1} are not a range of the model's "
                                 f"{step.num_layers} layers.")
        self.model = step.model  # the step's parameter names: parts share the model's weights
        object.__setattr__(self, "_step", step)  # not a submodule: its parameters are self.model's
        self.start, self.stop = int(start), int(stop)
        self.first, self.last = start == 0, stop == step.num_layers
        self.one_row = bool(one_row and self.last)
        # the first part takes the embeddings (the generator looks them up in the tied lm_head
        # of the last part: the table stored once, circleops.package.split)
        self.embedded = bool(embedded)

    def forward(self, x: Tensor, pos: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        step, n = self._step, self.stop - self.start
        row, caches = (rest[0], rest[1:]) if self.one_row else (None, rest)
        if len(caches) != 2 * n:
            raise CircleOpsError(f"DecoderPart: expected {2 * n} caches ({n} k then {n} v), got {len(caches)}.")
        base, lm_head = _parts(step.model)
        s = x.shape[1]
        positions = pos.reshape(1, 1).to(torch.int64) + torch.arange(s, device=x.device)[None]
        if self.first:  # ids, or (embedded) the table's rows: Gemma's sqrt(hidden) applied here
            hidden = scale_rows(base.embed_tokens, x) if self.embedded else base.embed_tokens(x)
        else:
            hidden = x
        layers = range(self.start, self.stop)
        rope = step._rope(base, hidden, positions, layers)
        masks = step._masks(pos, positions, hidden.dtype)
        k_caches: list = [None] * step.num_layers
        v_caches: list = [None] * step.num_layers
        for j, i in enumerate(layers):
            k, v = caches[j], caches[n + j]
            if step.cache_layout == HEAD_MAJOR:  # as DecoderWithCache.run: views, cancelled when lowered
                k, v = k.transpose(1, 2), v.permute(0, 3, 1, 2)
            k_caches[i], v_caches[i] = k, v
        kv = StaticKV(k_caches, v_caches, pos, step.cache_update)
        for i in layers:
            hidden = base.layers[i](hidden, attention_mask=masks[i], position_embeddings=rope[i],
                                    position_ids=positions, **{KV_KWARG: kv})
        if self.last:
            if row is not None:
                hidden = hidden.index_select(1, row.reshape(1).to(torch.int64))
            hidden = lm_head(base.norm(hidden))
            if step.final_softcap is not None:
                hidden = torch.tanh(hidden / step.final_softcap) * step.final_softcap
        return (hidden, *kv.k[self.start:self.stop], *kv.v[self.start:self.stop])

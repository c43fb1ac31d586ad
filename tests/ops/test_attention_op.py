"""circle::attention against HF LlamaAttention (eager) with its own DynamicCache, and the
KV-cache update semantics of the contract."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama import modeling_llama

from circleops.ops._common import OpArgumentError
from circleops.ops.attention import causal_mask

attention = torch.ops.circle.attention
BATCH, PROMPT, CACHE, DECODE_STEPS = 2, 7, 16, 3


@pytest.fixture(scope="module")
def llama():
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=CACHE)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = modeling_llama.LlamaAttention(config, layer_idx=0).eval()
    return config, attn, modeling_llama.LlamaRotaryEmbedding(config)


def _weights(attn):
    return [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight]


def _hf_mask(s, kv_len, start):
    # HF's additive 4-D mask for s new tokens at positions start.. over kv_len cached keys
    visible = torch.arange(kv_len)[None, :] <= (start + torch.arange(s))[:, None]
    return torch.zeros(s, kv_len).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None].expand(BATCH, 1, s, kv_len)


@torch.no_grad()
def test_prefill_then_decode_matches_hf_with_dynamic_cache(llama):
    config, attn, rotary = llama
    cache = transformers.DynamicCache(config=config)
    k_cache = torch.zeros(BATCH, CACHE, 2, 16)
    v_cache = torch.zeros(BATCH, CACHE, 2, 16)
    g = torch.Generator().manual_seed(1)
    start = 0
    for s in [PROMPT] + [1] * DECODE_STEPS:  # a prefill, then decode steps, one token each
        x = torch.randn(BATCH, s, 64, generator=g)
        cos, sin = rotary(x, (start + torch.arange(s))[None].expand(BATCH, s))
        want, _ = attn(x, (cos, sin), _hf_mask(s, start + s, start), cache=cache)
        got, k_cache, v_cache = attention(x, *_weights(attn), cos, sin, causal_mask(s, CACHE, start),
                                          k_cache, v_cache, torch.tensor([start]))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        # the caches hold what HF's cache holds ([B, H, S, D] there, slot-major here), zeros after
        hf_keys, hf_values = cache.layers[0].keys, cache.layers[0].values
        assert torch.equal(k_cache[:, :start + s], hf_keys.transpose(1, 2))
        assert torch.equal(v_cache[:, :start + s], hf_values.transpose(1, 2))
        assert not k_cache[:, start + s:].any() and not v_cache[:, start + s:].any()
        start += s


def _layer(s, c=8, hq=4, hkv=2, d=4, e=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    angles = torch.rand(s, d // 2, generator=g) * 10
    angles = torch.cat((angles, angles), -1)
    return dict(x=r(1, s, e), wq=r(hq * d, e), wk=r(hkv * d, e), wv=r(hkv * d, e), wo=r(e, hq * d),
                cos=angles.cos(), sin=angles.sin(), k_cache=r(1, c, hkv, d), v_cache=r(1, c, hkv, d))


def _call(layer, mask, pos):
    t = layer
    return attention(t["x"], t["wq"], t["wk"], t["wv"], t["wo"], t["cos"], t["sin"], mask, t["k_cache"], t["v_cache"], pos)


def test_cache_update_writes_pos_onward_and_drops_writes_past_the_end():
    c = 8
    layer = _layer(s=3, c=c)
    before = {k: v.clone() for k, v in layer.items()}
    pos = c - 2
    _, k_new, v_new = _call(layer, torch.zeros(3, c), torch.tensor([pos]))
    values = (layer["x"] @ layer["wv"].T).view(1, 3, 2, 4)
    assert torch.equal(v_new[:, pos:], values[:, :2]), "tokens 0 and 1 land in the last two slots"
    assert torch.equal(v_new[:, :pos], layer["v_cache"][:, :pos]) and torch.equal(k_new[:, :pos], layer["k_cache"][:, :pos])
    assert not torch.equal(k_new[:, pos:], layer["k_cache"][:, pos:])
    for k, v in before.items():  # functional: the inputs are not modified
        assert torch.equal(layer[k], v)


def test_new_tokens_attend_to_themselves_through_the_updated_cache():
    # Only the slot just written is visible: the output is then v_new·woᵀ for each head,
    # which holds only if the write happens before attending.
    c, d = 8, 4
    layer = _layer(s=1, c=c, hq=2, hkv=2)
    mask = torch.full((1, c), float("-inf"))
    mask[0, 5] = 0.0
    out, _, _ = _call(layer, mask, torch.tensor([5]))
    values = layer["x"] @ layer["wv"].T
    torch.testing.assert_close(out, values @ layer["wo"].T)


def test_int32_pos_equals_int64():
    layer = _layer(s=2)
    mask = causal_mask(2, 8, 3)
    for a, b in zip(_call(layer, mask, torch.tensor([3])), _call(layer, mask, torch.tensor([3], dtype=torch.int32))):
        assert torch.equal(a, b)


def test_gqa_shares_each_kv_head_with_its_query_group():
    # Hq=4 over Hkv=2 equals Hkv=4 with each kv head (and its cache) repeated, as HF's repeat_kv does.
    layer = _layer(s=2, hq=4, hkv=2)
    mask = causal_mask(2, 8, 1)
    grouped, _, _ = _call(layer, mask, torch.tensor([1]))
    full = dict(layer)
    full["wk"] = layer["wk"].view(2, 4, 16).repeat_interleave(2, 0).reshape(16, 16)
    full["wv"] = layer["wv"].view(2, 4, 16).repeat_interleave(2, 0).reshape(16, 16)
    full["k_cache"] = layer["k_cache"].repeat_interleave(2, 2)
    full["v_cache"] = layer["v_cache"].repeat_interleave(2, 2)
    expanded, _, _ = _call(full, mask, torch.tensor([1]))
    torch.testing.assert_close(grouped, expanded, rtol=1e-6, atol=1e-6)


def test_shape_errors_name_the_input():
    layer = _layer(s=2)
    layer["wk"] = torch.randn(12, 16)
    with pytest.raises(OpArgumentError, match=r"wk must be \[8, 16\], got \[12, 16\]"):
        _call(layer, torch.zeros(2, 8), torch.tensor([0]))
    with pytest.raises(OpArgumentError, match="mask.s last dim must be the cache size 8"):
        _call(_layer(s=2), torch.zeros(2, 5), torch.tensor([0]))


@pytest.mark.parametrize("s,pos,hkv", [(1, 5, 2), (1, 0, 1), (3, 2, 2), (4, 4, 1)])
def test_rows_form_equals_the_full_form(s, pos, hkv):
    """cache_update="rows": the same output as "full" (whose mask shows the slots just
    written), without the whole caches: the new rows are the k/v "full" writes at pos, and
    the stale slots >= pos of the input caches (random here) are never attended."""
    c = 8
    layer = _layer(s=s, c=c, hkv=hkv, seed=s + pos)
    full, k_full, v_full = _call(layer, causal_mask(s, c, pos), torch.tensor([pos]))
    t = layer
    rows, k_rows, v_rows = attention(t["x"], t["wq"], t["wk"], t["wv"], t["wo"], t["cos"], t["sin"],
                                     causal_mask(s, c, pos, cache_update="rows"), t["k_cache"], t["v_cache"],
                                     torch.tensor([pos]), cache_update="rows")
    torch.testing.assert_close(rows, full, rtol=1e-5, atol=1e-5)
    assert k_rows.shape == v_rows.shape == (1, s, hkv, 4)
    assert torch.equal(k_rows, k_full[:, pos:pos + s]) and torch.equal(v_rows, v_full[:, pos:pos + s])


def test_rows_form_never_reads_the_stale_slots():
    c = 8
    layer = _layer(s=1, c=c)
    mask = causal_mask(1, c, 3, cache_update="rows")
    want = _call_rows(layer, mask, 3)
    layer["k_cache"][:, 3:] = 1e4  # stale values where the new token and later ones go (a rolled-back chat)
    layer["v_cache"][:, 3:] = -1e4
    torch.testing.assert_close(_call_rows(layer, mask, 3), want, rtol=0, atol=0)


def _call_rows(t, mask, pos):
    return attention(t["x"], t["wq"], t["wk"], t["wv"], t["wo"], t["cos"], t["sin"], mask, t["k_cache"], t["v_cache"],
                     torch.tensor([pos]), cache_update="rows")[0]


@torch.no_grad()
@pytest.mark.parametrize("s,pos,prefix", [(4, 0, 3), (3, 2, 4), (4, 2, 0)])
def test_rows_form_with_a_mask_over_the_new_tokens_equals_the_full_form(s, pos, prefix):
    """cache_update="rows" with a [S, C + S] mask: its last S columns order the new tokens
    (a prefix-LM: positions < prefix see each other both ways), the same output as "full"
    whose [S, C] mask shows the same slots; a causal last S columns is the [S, C] form."""
    c = 8
    layer = _layer(s=s, c=c, seed=s + pos + prefix)
    q, k = pos + torch.arange(s)[:, None], torch.arange(c)[None, :]
    low = torch.finfo(torch.float32).min
    full_visible = (k <= q) | ((k < prefix) & (k < pos + s))
    full = _call(layer, torch.zeros(s, c).masked_fill(~full_visible, low), torch.tensor([pos]))[0]
    own = pos + torch.arange(s)[None, :]
    rows_visible = torch.cat([k.expand(s, c) < pos, (own <= q) | (own < prefix)], dim=-1)
    rows = _call_rows(layer, torch.zeros(s, c + s).masked_fill(~rows_visible, low), pos)
    torch.testing.assert_close(rows, full, rtol=1e-5, atol=1e-5)
    causal = torch.cat([causal_mask(s, c, pos, cache_update="rows"),
                        torch.zeros(s, s).masked_fill(~(own <= q), low)], dim=-1)
    torch.testing.assert_close(_call_rows(layer, causal, pos),
                               _call_rows(layer, causal_mask(s, c, pos, cache_update="rows"), pos), rtol=0, atol=1e-6)
    if prefix > pos:  # the prefix reaches into the new tokens: bidirectional differs from causal
        assert not torch.allclose(rows, _call_rows(layer, causal, pos), atol=1e-3)

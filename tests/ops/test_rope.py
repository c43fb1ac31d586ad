"""circle::rope against Hugging Face's own rotary code: GPT-NeoX (rotate_half) layout,
GPT-J interleaved mode, partial rotary, positions past 2048."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.glm import modeling_glm
from transformers.models.gptj import modeling_gptj
from transformers.models.llama import modeling_llama
from transformers.models.phi import modeling_phi

from circleops.ops._common import OpArgumentError

rope = torch.ops.circle.rope
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEADS, HEAD_DIM = 4, 32
# prefill from 0, a window past 2048, and scattered long-context positions
POSITIONS = {
    "prefill": torch.arange(0, 9),
    "past_2048": torch.arange(4091, 4100),
    "scattered": torch.tensor([0, 2047, 2048, 2049, 8191, 16384, 32767, 65000, 131071]),
}


def _qk(dtype, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, HEADS, seq, HEAD_DIM, generator=g).to(dtype),
            torch.randn(2, HEADS // 2, seq, HEAD_DIM, generator=g).to(dtype))


def _position_ids(name):
    p = POSITIONS[name]
    return torch.stack((p, p.flip(0)))  # batch of 2 with different positions per row


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_gpt_neox_bit_equal_to_llama(dtype, positions):
    config = transformers.LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, max_position_embeddings=2048)
    q, k = _qk(dtype, 9)
    cos, sin = modeling_llama.LlamaRotaryEmbedding(config)(q, _position_ids(positions))
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(rope(q, cos, sin), want_q) and torch.equal(rope(k, cos, sin), want_k)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_partial_rotary_bit_equal_to_phi(dtype):
    config = transformers.PhiConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, partial_rotary_factor=0.5)
    q, k = _qk(dtype, 9)
    cos, sin = modeling_phi.PhiRotaryEmbedding(config)(q, _position_ids("past_2048"))
    r = cos.shape[-1]
    assert r == HEAD_DIM // 2
    # PhiAttention.forward: rotate the first rotary_ndims channels, pass the rest through
    q_rot, k_rot = modeling_phi.apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin)
    want_q, want_k = torch.cat((q_rot, q[..., r:]), -1), torch.cat((k_rot, k[..., r:]), -1)
    assert torch.equal(rope(q, cos, sin), want_q) and torch.equal(rope(k, cos, sin), want_k)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_gpt_j_interleaved_bit_equal_to_glm(dtype):
    # GLM: interleaved pairs (2i, 2i+1) on the first half of the head (partial rotary)
    config = transformers.GlmConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, head_dim=HEAD_DIM)
    q, k = _qk(dtype, 9)
    cos, sin = modeling_glm.GlmRotaryEmbedding(config)(q, _position_ids("scattered"))
    want_q, want_k = modeling_glm.apply_rotary_pos_emb(q, k, cos, sin)
    half = cos.shape[-1] // 2
    cos_j, sin_j = cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)
    assert torch.equal(rope(q, cos_j, sin_j, "gpt_j"), want_q) and torch.equal(rope(k, cos_j, sin_j, "gpt_j"), want_k)


def test_gpt_j_bit_equal_to_gptj():
    # GPT-J itself: x is [B, S, H, D] there, tables from its sinusoidal buffer, rotary_dim < head dim
    rotary_dim = 16
    table = modeling_gptj.create_sinusoidal_positions(8192, rotary_dim)
    position_ids = _position_ids("past_2048")
    sin, cos = torch.split(table[position_ids], rotary_dim // 2, dim=-1)
    x = torch.randn(2, 9, HEADS, HEAD_DIM)
    x_rot = modeling_gptj.apply_rotary_pos_emb(x[..., :rotary_dim], sin, cos)
    want = torch.cat((x_rot, x[..., rotary_dim:]), -1).transpose(1, 2)
    got = rope(x.transpose(1, 2), cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1), "gpt_j")
    assert torch.equal(got, want)


def test_table_layouts_agree():
    q, _ = _qk(torch.float32, 5)
    angles = torch.arange(5.0)[:, None] * torch.rand(HEAD_DIM // 2)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    base = rope(q, cos, sin)
    assert torch.equal(rope(q, cos[None].expand(2, -1, -1), sin[None].expand(2, -1, -1)), base)
    assert torch.equal(rope(q, cos[None, None], sin[None, None]), base)
    assert not torch.equal(rope(q, cos, sin, "gpt_j"), base)


def test_rotation_preserves_pair_norms():
    # a rotation: each (i, i + R/2) pair keeps its length
    q, _ = _qk(torch.float64, 5)
    angles = torch.rand(5, HEAD_DIM // 2, dtype=torch.float64) * 100
    y = rope(q, torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin())
    h = HEAD_DIM // 2
    torch.testing.assert_close(q[..., :h] ** 2 + q[..., h:] ** 2, y[..., :h] ** 2 + y[..., h:] ** 2)


def test_bad_tables_are_clear_errors():
    q, _ = _qk(torch.float32, 5)
    with pytest.raises(OpArgumentError, match="rotary dims 40"):
        rope(q, torch.ones(5, 40), torch.ones(5, 40))
    with pytest.raises(OpArgumentError, match=r"x must be \[B, H, S, D\]"):
        rope(q[0], torch.ones(5, 8), torch.ones(5, 8))

"""The model families circleops supports, as small random-weight configs.

Tests parametrize over FAMILIES, so adding a family here adds its adapter, lowering,
runtime and TFLite tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    # Sharp, position-sensitive test models (issue 25). HF's default init (std 0.02) leaves
    # attention nearly uniform: dropping RoPE, a 1/d attention scale or a x10 epsilon moved
    # the tiny Llama's logits by ~6e-3 and no greedy token. With std 0.2 the attention
    # scores are O(1-10) (softmax picks positions), and an epsilon of 1e-2 is of the order
    # of the embeddings' mean square (0.04), so each of those mistakes, and a causal mask
    # error, moves the logits by 5-9 (max |logit| ~7) and changes most greedy tokens
    # (tests/test_families.py keeps that true). Same sizes: no slower tests.
    initializer_range=0.2,
    rms_norm_eps=1e-2,
)


@dataclass(frozen=True)
class Family:
    name: str
    config_cls: str  # transformers class names, resolved lazily
    model_cls: str
    overrides: dict[str, Any]
    # attention layers the Circle ATTENTION contract cannot express (biases, q/k norms,
    # soft-capping, sliding windows) stay decomposed: the attention adapter must say so.
    attention_fusable: bool = True
    # prefill/decode graphs (DecoderWithCache): attention circle.attention cannot express is
    # computed decomposed over the same caches; only attention no adapter knows is refused
    decode_graphs: bool = True

    def config(self, **kw: Any):
        import transformers

        cfg = getattr(transformers, self.config_cls)(**{**COMMON, **self.overrides, **kw})
        cfg._attn_implementation = "eager"
        # exported graphs take explicit caches; build(use_cache=True) gives HF's default, as a
        # user's model has it (tests/adapters/test_adapters_export_idiom.py)
        cfg.use_cache = kw.get("use_cache", False)
        return cfg

    def build(self, dtype: torch.dtype = torch.float32, seed: int = 0, **kw: Any) -> torch.nn.Module:
        import transformers

        torch.manual_seed(seed)
        model = getattr(transformers, self.model_cls)(self.config(**kw))
        # Random init leaves norm weights at 1 (or 0 for Gemma); perturb them so a
        # wrong weight multiply cannot pass unnoticed.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
        return model.to(dtype).eval()


# Gemma 2/3 as their real configs are, shrunk so that each quirk moves the greedy tokens (checked
# by tests/generate/test_cached_families.py): one sliding layer (a window of 4 tokens: an 11-token
# prompt crosses it, and a window of 3 or 5 gives other tokens), one full layer; a score scale
# 1/sqrt(8) that is not 1/sqrt(head_dim); soft-capping that bites on scores and logits of a few
# units (the real 50 and 30 would not).
_GEMMA_WINDOWS = {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"],
                  "query_pre_attn_scalar": 8}

FAMILIES: list[Family] = [
    Family("llama", "LlamaConfig", "LlamaForCausalLM", {}),
    Family("mistral", "MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", {}, attention_fusable=False),  # q/k/v biases
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, attention_fusable=False),  # q/k norms
    Family("phi3", "Phi3Config", "Phi3ForCausalLM", {}),
    Family("olmo2", "Olmo2Config", "Olmo2ForCausalLM", {}, attention_fusable=False),  # q/k norms
    Family("gemma", "GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, **_GEMMA_WINDOWS, "attn_logit_softcapping": 2.0,
                                                           "final_logit_softcapping": 5.0},
           attention_fusable=False),  # soft-capping, sliding windows, score scale
    Family("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, **_GEMMA_WINDOWS},
           attention_fusable=False),  # q/k norms, sliding windows, score scale
]

# Mixture-of-experts families (transformers 5's experts classes, routed to dense dispatch by
# the adapters): tested by tests/onert/test_onert_moe.py, not by every FAMILIES test.
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
MOE_FAMILIES: list[Family] = [
    Family("mixtral", "MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                             "sliding_window": None}),
    Family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
           {**_MOE, "num_experts": 4, "shared_expert_intermediate_size": 64}, attention_fusable=False),
    Family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**_MOE, "num_experts": 4, "head_dim": 16},
           attention_fusable=False),
    Family("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2},
           attention_fusable=False),
    Family("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
           {**_MOE, "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
            "n_shared_experts": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "num_key_value_heads": 4, "rope_scaling": None},
           attention_fusable=False, decode_graphs=False),  # multi-head latent attention
    Family("gpt_oss", "GptOssConfig", "GptOssForCausalLM",
           {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"]}, attention_fusable=False,
           decode_graphs=False),  # attention sinks
]

BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES + MOE_FAMILIES}


def example_ids(seq_len: int = 8, vocab: int = COMMON["vocab_size"], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, seq_len), generator=g)

"""DeepSeek-V3: RMSNorm fused, experts as dense dispatch; MLA attention and its RoPE stay decomposed."""
from circleops.adapters import _rmsnorm
from circleops.adapters._family import Family

FAMILY = Family(
    name="deepseek_v3",
    module="transformers.models.deepseek_v3.modeling_deepseek_v3",
    norm_classes=("DeepseekV3RMSNorm",),
    norm_style=_rmsnorm.LLAMA,
    attention_class="DeepseekV3Attention",
    experts_class="DeepseekV3Experts",
    attention_adapter=False,  # multi-head latent attention
    rope_adapter=False,  # interleaved RoPE on the rope part of each head only
)

(patched_deepseek_v3_rmsnorm, patched_deepseek_v3_rope,
 patched_deepseek_v3_attention, patched_deepseek_v3_modules) = FAMILY.context_managers()

"""gpt-oss: RMSNorm (weight multiply in fp32) fused, experts as dense dispatch; attention with sinks stays decomposed."""
from circleops.adapters import _rmsnorm
from circleops.adapters._family import Family

FAMILY = Family(
    name="gpt_oss",
    module="transformers.models.gpt_oss.modeling_gpt_oss",
    norm_classes=("GptOssRMSNorm",),
    norm_style=_rmsnorm.OLMO2,
    attention_class="GptOssAttention",
    experts_class="GptOssExperts",
    attention_adapter=False,  # attention sinks
    rope_adapter=False,  # half-width cos/sin tables
)

(patched_gpt_oss_rmsnorm, patched_gpt_oss_rope,
 patched_gpt_oss_attention, patched_gpt_oss_modules) = FAMILY.context_managers()

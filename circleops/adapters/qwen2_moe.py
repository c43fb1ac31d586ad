"""Qwen2-MoE: experts as dense dispatch; q/k/v biases keep attention decomposed."""
from circleops.adapters import _rmsnorm
from circleops.adapters._family import Family

FAMILY = Family(
    name="qwen2_moe",
    module="transformers.models.qwen2_moe.modeling_qwen2_moe",
    norm_classes=("Qwen2MoeRMSNorm",),
    norm_style=_rmsnorm.LLAMA,
    attention_class="Qwen2MoeAttention",
    experts_class="Qwen2MoeExperts",
)

(patched_qwen2_moe_rmsnorm, patched_qwen2_moe_rope,
 patched_qwen2_moe_attention, patched_qwen2_moe_modules) = FAMILY.context_managers()

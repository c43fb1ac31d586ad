"""Qwen3-MoE: experts as dense dispatch; per-head q/k norms keep attention decomposed."""
from circleops.adapters import _rmsnorm
from circleops.adapters._family import Family

FAMILY = Family(
    name="qwen3_moe",
    module="transformers.models.qwen3_moe.modeling_qwen3_moe",
    norm_classes=("Qwen3MoeRMSNorm",),
    norm_style=_rmsnorm.LLAMA,
    attention_class="Qwen3MoeAttention",
    experts_class="Qwen3MoeExperts",
)

(patched_qwen3_moe_rmsnorm, patched_qwen3_moe_rope,
 patched_qwen3_moe_attention, patched_qwen3_moe_modules) = FAMILY.context_managers()

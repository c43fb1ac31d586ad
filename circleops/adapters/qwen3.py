"""Qwen3; per-head q/k norms (Qwen3RMSNorm too) keep attention decomposed."""
from circleops.adapters import _rmsnorm
from circleops.adapters._family import Family

FAMILY = Family(
    name="qwen3",
    module="transformers.models.qwen3.modeling_qwen3",
    norm_classes=("Qwen3RMSNorm",),
    norm_style=_rmsnorm.LLAMA,
    attention_class="Qwen3Attention",
)

(patched_qwen3_rmsnorm, patched_qwen3_rope,
 patched_qwen3_attention, patched_qwen3_modules) = FAMILY.context_managers()

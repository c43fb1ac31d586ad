"""Qwen2; its q/k/v biases keep attention decomposed."""
from circleops.adapters import _rmsnorm
from circleops.adapters._family import Family

FAMILY = Family(
    name="qwen2",
    module="transformers.models.qwen2.modeling_qwen2",
    norm_classes=("Qwen2RMSNorm",),
    norm_style=_rmsnorm.LLAMA,
    attention_class="Qwen2Attention",
)

(patched_qwen2_rmsnorm, patched_qwen2_rope,
 patched_qwen2_attention, patched_qwen2_modules) = FAMILY.context_managers()

"""Qwen2.5-VL (text model): M-RoPE (its rotary embedding composes the t/h/w sections into one
cos/sin table, so q/k rotate by circle.rope); q/k/v biases keep attention decomposed."""
from circleops.adapters import _rmsnorm
from circleops.adapters._family import Family

FAMILY = Family(
    name="qwen2_5_vl",
    module="transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    norm_classes=("Qwen2_5_VLRMSNorm",),
    norm_style=_rmsnorm.LLAMA,
    attention_class="Qwen2_5_VLAttention",
    model_class="Qwen2_5_VLTextModel",
)

(patched_qwen2_5_vl_rmsnorm, patched_qwen2_5_vl_rope,
 patched_qwen2_5_vl_attention, patched_qwen2_5_vl_modules) = FAMILY.context_managers()

"""Gemma3 (text): per-head q/k norms, sliding layers and query_pre_attn_scalar keep attention decomposed."""
from circleops.adapters import _rmsnorm
from circleops.adapters._family import Family

FAMILY = Family(
    name="gemma3",
    module="transformers.models.gemma3.modeling_gemma3",
    norm_classes=("Gemma3RMSNorm",),
    norm_style=_rmsnorm.GEMMA,
    attention_class="Gemma3Attention",
    model_class="Gemma3TextModel",
)

(patched_gemma3_rmsnorm, patched_gemma3_rope,
 patched_gemma3_attention, patched_gemma3_modules) = FAMILY.context_managers()

"""Gemma2: logit soft-capping, sliding layers and query_pre_attn_scalar keep attention decomposed."""
from circleops.adapters import _rmsnorm
from circleops.adapters._family import Family

FAMILY = Family(
    name="gemma2",
    module="transformers.models.gemma2.modeling_gemma2",
    norm_classes=("Gemma2RMSNorm",),
    norm_style=_rmsnorm.GEMMA,
    attention_class="Gemma2Attention",
)

(patched_gemma2_rmsnorm, patched_gemma2_rope,
 patched_gemma2_attention, patched_gemma2_modules) = FAMILY.context_managers()

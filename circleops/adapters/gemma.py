"""Gemma: weight stored as the offset from 1, multiply in fp32."""
from circleops.adapters import _rmsnorm
from circleops.adapters._family import Family

FAMILY = Family(
    name="gemma",
    module="transformers.models.gemma.modeling_gemma",
    norm_classes=("GemmaRMSNorm",),
    norm_style=_rmsnorm.GEMMA,
    attention_class="GemmaAttention",
)

(patched_gemma_rmsnorm, patched_gemma_rope,
 patched_gemma_attention, patched_gemma_modules) = FAMILY.context_managers()

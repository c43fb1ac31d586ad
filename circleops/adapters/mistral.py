"""Mistral; layers with a sliding window keep their attention decomposed."""
from circleops.adapters import _rmsnorm
from circleops.adapters._family import Family

FAMILY = Family(
    name="mistral",
    module="transformers.models.mistral.modeling_mistral",
    norm_classes=("MistralRMSNorm",),
    norm_style=_rmsnorm.LLAMA,
    attention_class="MistralAttention",
)

(patched_mistral_rmsnorm, patched_mistral_rope,
 patched_mistral_attention, patched_mistral_modules) = FAMILY.context_managers()

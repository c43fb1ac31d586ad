"""Mixtral (mixture of experts): experts as dense dispatch."""
from circleops.adapters import _rmsnorm
from circleops.adapters._family import Family

FAMILY = Family(
    name="mixtral",
    module="transformers.models.mixtral.modeling_mixtral",
    norm_classes=("MixtralRMSNorm",),
    norm_style=_rmsnorm.LLAMA,
    attention_class="MixtralAttention",
    experts_class="MixtralExperts",
)

(patched_mixtral_rmsnorm, patched_mixtral_rope,
 patched_mixtral_attention, patched_mixtral_modules) = FAMILY.context_managers()

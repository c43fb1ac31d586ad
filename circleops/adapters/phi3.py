"""Phi3: fused qkv_proj (split for circle.attention); partial rotary keeps attention decomposed."""
from circleops.adapters import _rmsnorm
from circleops.adapters._family import Family

FAMILY = Family(
    name="phi3",
    module="transformers.models.phi3.modeling_phi3",
    norm_classes=("Phi3RMSNorm",),
    norm_style=_rmsnorm.LLAMA,
    attention_class="Phi3Attention",
)

(patched_phi3_rmsnorm, patched_phi3_rope,
 patched_phi3_attention, patched_phi3_modules) = FAMILY.context_managers()

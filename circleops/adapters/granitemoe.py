"""GraniteMoE: experts as dense dispatch; its attention multiplier keeps attention decomposed."""
from circleops.adapters import _rmsnorm
from circleops.adapters._family import Family

FAMILY = Family(
    name="granitemoe",
    module="transformers.models.granitemoe.modeling_granitemoe",
    norm_classes=("GraniteMoeRMSNorm",),
    norm_style=_rmsnorm.LLAMA,
    attention_class="GraniteMoeAttention",
    experts_class="GraniteMoeExperts",
)

(patched_granitemoe_rmsnorm, patched_granitemoe_rope,
 patched_granitemoe_attention, patched_granitemoe_modules) = FAMILY.context_managers()

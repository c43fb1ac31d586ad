"""OLMo2: weight multiply in fp32; q/k norms over all heads keep attention decomposed."""
from circleops.adapters import _rmsnorm
from circleops.adapters._family import Family

FAMILY = Family(
    name="olmo2",
    module="transformers.models.olmo2.modeling_olmo2",
    norm_classes=("Olmo2RMSNorm",),
    norm_style=_rmsnorm.OLMO2,
    attention_class="Olmo2Attention",
    rope_cast_back=True,  # its apply_rotary_pos_emb ends with .to(q.dtype)
)

(patched_olmo2_rmsnorm, patched_olmo2_rope,
 patched_olmo2_attention, patched_olmo2_modules) = FAMILY.context_managers()

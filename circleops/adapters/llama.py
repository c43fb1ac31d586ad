"""Llama 1/2/3 (and SmolLM2, TinyLlama)."""
from circleops.adapters import _rmsnorm
from circleops.adapters._family import Family

FAMILY = Family(
    name="llama",
    module="transformers.models.llama.modeling_llama",
    norm_classes=("LlamaRMSNorm",),
    norm_style=_rmsnorm.LLAMA,
    attention_class="LlamaAttention",
)

(patched_llama_rmsnorm, patched_llama_rope,
 patched_llama_attention, patched_llama_modules) = FAMILY.context_managers()

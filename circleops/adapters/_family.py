"""A model family as a declarative table row, and the context managers built from it.

A :class:`Family` names (as strings, so nothing is imported before use) the HF modeling
module, its RMSNorm classes and how they compute, and its attention class. From that
row come ``patched_<family>_rmsnorm()``, ``_rope()``, ``_attention()`` and
``_modules()``; adding a family is one file with one row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from circleops.adapters._attention import attention_forward
from circleops.adapters._experts import dense_experts_forward
from circleops.adapters.dynamic_cache import no_cache_by_default
from circleops.adapters._patching import Patch, PatchSession
from circleops.adapters._rmsnorm import NormStyle, norm_forward
from circleops.adapters._rope import rope_function

ROPE_FUNCTION = "apply_rotary_pos_emb"


@dataclass(frozen=True)
class Family:
    name: str  # "llama"
    module: str  # "transformers.models.llama.modeling_llama"
    norm_classes: tuple[str, ...]  # RMSNorm classes (q/k norms included, same class)
    norm_style: NormStyle
    attention_class: str
    rope_cast_back: bool = False  # the family's apply_rotary_pos_emb casts back to q/k dtype
    model_class: str = ""  # the decoder model ("LlamaModel"); default: attention_class with Model
    experts_class: str = ""  # MoE experts (use_experts_implementation): routed to dense dispatch
    attention_adapter: bool = True  # False: an attention circle.attention cannot express (MLA, sinks)
    rope_adapter: bool = True  # False: apply_rotary_pos_emb is not rotate_half over [.., S, D] tables

    @property
    def decoder_class(self) -> str:
        return self.model_class or self.attention_class.replace("Attention", "Model")

    @property
    def rope_label(self) -> str:
        return f"{self.module.rsplit('.', 1)[-1]}.{ROPE_FUNCTION}"

    def norm_patches(self) -> list[Patch]:
        return [Patch(self.module, cls, "forward", label=cls, group=self.name,
                      build=lambda original, cls=cls: norm_forward(self.norm_style, cls))
                for cls in self.norm_classes]

    def rope_patches(self) -> list[Patch]:
        if not self.rope_adapter:
            return []
        return [Patch(self.module, None, ROPE_FUNCTION, label=self.rope_label, group=self.name,
                      build=lambda original: rope_function(self.rope_label, original, self.rope_cast_back))]

    def attention_patches(self) -> list[Patch]:
        if not self.attention_adapter:
            return []
        return [Patch(self.module, self.attention_class, "forward", label=self.attention_class, group=self.name,
                      build=lambda original: attention_forward(self.attention_class, self.rope_label, original))]

    def experts_patches(self) -> list[Patch]:
        """Experts as dense dispatch (static shapes; see _experts.py); none for dense models."""
        if not self.experts_class:
            return []
        return [Patch(self.module, self.experts_class, "forward", label=self.experts_class, group=self.name,
                      build=lambda original: dense_experts_forward(self.experts_class))]

    def cache_patches(self) -> list[Patch]:
        """The decoder model runs without an HF DynamicCache unless asked for one, so that
        ``torch.export.export(model, (input_ids,))`` works as written (see circleops/adapters/dynamic_cache.py)."""
        return [Patch(self.module, self.decoder_class, "forward", label=self.decoder_class, group=self.name,
                      build=no_cache_by_default, tracked=False)]

    def patches(self, *, rmsnorm: bool = True, rope: bool = True, attention: bool = True) -> list[Patch]:
        return (self.cache_patches() + self.experts_patches() + (self.norm_patches() if rmsnorm else [])
                + (self.rope_patches() if rope else []) + (self.attention_patches() if attention else []))

    def context_managers(self) -> tuple[Callable[[], PatchSession], ...]:
        """The four public context-manager factories of this family, named
        ``patched_<name>_rmsnorm / _rope / _attention / _modules``."""
        n = self.name

        def rmsnorm() -> PatchSession:
            return PatchSession(f"patched_{n}_rmsnorm", self.cache_patches() + self.norm_patches())

        def rope() -> PatchSession:
            return PatchSession(f"patched_{n}_rope", self.cache_patches() + self.rope_patches())

        def attention() -> PatchSession:
            return PatchSession(f"patched_{n}_attention", self.cache_patches() + self.attention_patches())

        def modules(attention: bool = True) -> PatchSession:
            return PatchSession(f"patched_{n}_modules", self.patches(attention=attention))

        docs = {
            rmsnorm: f"Route every {', '.join(self.norm_classes)} call to circle.rms_norm while active.",
            rope: f"Route {self.rope_label} (q and k rotary) to circle.rope while active.",
            attention: (f"Route each {self.attention_class} layer to one circle.attention where the Circle "
                        "ATTENTION contract expresses it; others stay decomposed (see the session's decisions)."),
            modules: (f"All {n} adapters at once: RMSNorm, RoPE and (unless attention=False) attention. "
                      "Export inside the `with`."),
        }
        for fn, kind in ((rmsnorm, "rmsnorm"), (rope, "rope"), (attention, "attention"), (modules, "modules")):
            fn.__name__ = fn.__qualname__ = f"patched_{n}_{kind}"
            fn.__doc__ = docs[fn]
        return rmsnorm, rope, attention, modules

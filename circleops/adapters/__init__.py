"""Adapters: route Hugging Face modules to the fused circle ops for torch.export.

    from circleops.adapters import patched_llama_modules
    with patched_llama_modules():
        ep = torch.export.export(model, (input_ids,))

Each family (one file here with one :class:`~circleops.adapters._family.Family` row named
``FAMILY``, found by :data:`FAMILIES` without any other edit) gives
``patched_<family>_rmsnorm()``, ``_rope()``, ``_attention()`` and ``_modules()``;
:func:`patched_modules` covers every family at once. :func:`fuse` / :func:`unfuse` do the
same to one model instance, for good. Importing this package does not import
transformers; a family's modeling module is imported when its patch is entered.
"""
from __future__ import annotations

import importlib
import pkgutil

from circleops.adapters.dynamic_cache import register_when_imported
from circleops.adapters._attention import StaticKV, attention_blockers
from circleops.adapters._family import Family
from circleops.adapters._instance import fuse, is_fused, unfuse
from circleops.adapters._experts import dense_experts_implementation
from circleops.adapters._patching import (DECISIONS, AttentionDecision, PatchSession, UnusedPatchWarning, patch_function,
                                          patch_module, patch_modules)
from circleops.adapters.gemma import patched_gemma_attention, patched_gemma_modules, patched_gemma_rmsnorm, patched_gemma_rope
from circleops.adapters.gemma2 import patched_gemma2_attention, patched_gemma2_modules, patched_gemma2_rmsnorm, patched_gemma2_rope
from circleops.adapters.gemma3 import patched_gemma3_attention, patched_gemma3_modules, patched_gemma3_rmsnorm, patched_gemma3_rope
from circleops.adapters.llama import patched_llama_attention, patched_llama_modules, patched_llama_rmsnorm, patched_llama_rope
from circleops.adapters.mistral import patched_mistral_attention, patched_mistral_modules, patched_mistral_rmsnorm, patched_mistral_rope
from circleops.adapters.olmo2 import patched_olmo2_attention, patched_olmo2_modules, patched_olmo2_rmsnorm, patched_olmo2_rope
from circleops.adapters.phi3 import patched_phi3_attention, patched_phi3_modules, patched_phi3_rmsnorm, patched_phi3_rope
from circleops.adapters.qwen2 import patched_qwen2_attention, patched_qwen2_modules, patched_qwen2_rmsnorm, patched_qwen2_rope
from circleops.adapters.qwen3 import patched_qwen3_attention, patched_qwen3_modules, patched_qwen3_rmsnorm, patched_qwen3_rope
from circleops.adapters.mixtral import (patched_mixtral_attention, patched_mixtral_modules, patched_mixtral_rmsnorm,
                                        patched_mixtral_rope)
from circleops.adapters.qwen2_moe import (patched_qwen2_moe_attention, patched_qwen2_moe_modules, patched_qwen2_moe_rmsnorm,
                                          patched_qwen2_moe_rope)
from circleops.adapters.qwen3_moe import (patched_qwen3_moe_attention, patched_qwen3_moe_modules, patched_qwen3_moe_rmsnorm,
                                          patched_qwen3_moe_rope)
from circleops.adapters.granitemoe import (patched_granitemoe_attention, patched_granitemoe_modules, patched_granitemoe_rmsnorm,
                                           patched_granitemoe_rope)
from circleops.adapters.deepseek_v3 import (patched_deepseek_v3_attention, patched_deepseek_v3_modules, patched_deepseek_v3_rmsnorm,
                                            patched_deepseek_v3_rope)
from circleops.adapters.gpt_oss import (patched_gpt_oss_attention, patched_gpt_oss_modules, patched_gpt_oss_rmsnorm,
                                        patched_gpt_oss_rope)
from circleops.adapters.qwen2_vl import (patched_qwen2_vl_attention, patched_qwen2_vl_modules, patched_qwen2_vl_rmsnorm,
                                         patched_qwen2_vl_rope)
from circleops.adapters.qwen2_5_vl import (patched_qwen2_5_vl_attention, patched_qwen2_5_vl_modules,
                                           patched_qwen2_5_vl_rmsnorm, patched_qwen2_5_vl_rope)

register_when_imported()  # DynamicCache as a pytree node once transformers loads it



def _package_families() -> list[Family]:
    """The ``FAMILY`` row of every public module of this package, by module name: a family is
    its file, circleops/adapters/<family>.py (tests/architecture/test_how_to_add.py)."""
    rows = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_") and not info.ispkg:
            row = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
            if isinstance(row, Family):
                rows.append(row)
    return rows


# every family convert, fuse, the fusion report and the graphs know (register_family adds to them)
FAMILIES: list[Family] = _package_families()
BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}


def register_family(family: Family) -> Family:
    """Add a family defined outside this package (a plugin's or a test's): ``patched_modules``,
    ``fuse``, convert and the generation graphs pick it up as they do the package's own. A
    name is registered once (ValueError)."""
    if family.name in BY_NAME:
        raise ValueError(f"a model family named {family.name!r} is already registered")
    FAMILIES.append(family)
    BY_NAME[family.name] = family
    return family


def unregister_family(name: str) -> None:
    """Remove a family :func:`register_family` added (KeyError for an unknown name)."""
    FAMILIES.remove(BY_NAME.pop(name))


def patched_modules(*, attention: bool = True, model=None) -> PatchSession:
    """Every supported family's adapters at once (RMSNorm, RoPE and, unless
    ``attention=False``, attention). Export inside the ``with``.

    With ``model`` (a model built already), only the families whose modeling modules its
    submodules' classes come from: entering the session then imports no other family's
    modeling module (each costs import time; Gemma3's pulls in transformers' image and video
    processors, ~0.5 s)."""
    families = FAMILIES
    if model is not None:
        used = {c.__module__ for m in model.modules() for c in type(m).__mro__}
        families = [f for f in FAMILIES if f.module in used]
    return PatchSession("patched_modules", [p for f in families for p in f.patches(attention=attention)])


def family_of(model) -> Family | None:
    """The supported family whose classes ``model`` is built from, or None."""
    import sys

    for fam in FAMILIES:
        module = sys.modules.get(fam.module)
        if module is None:
            continue
        attention_cls = getattr(module, fam.attention_class)
        if any(type(m) is attention_cls for m in model.modules()):
            return fam
    return None


__all__ = [
    "FAMILIES", "BY_NAME", "Family", "register_family", "unregister_family", "PatchSession", "UnusedPatchWarning", "AttentionDecision", "StaticKV",
    "DECISIONS", "attention_blockers", "dense_experts_implementation", "family_of", "fuse", "unfuse", "is_fused",
    "patched_modules", "patch_module", "patch_modules", "patch_function",
    *[f"patched_{f}_{k}" for f in ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma", "gemma2", "gemma3",
                                   "mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "deepseek_v3", "gpt_oss",
                                   "qwen2_vl", "qwen2_5_vl")
      for k in ("rmsnorm", "rope", "attention", "modules")],
]

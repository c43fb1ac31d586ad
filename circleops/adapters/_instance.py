"""``fuse(model)`` / ``unfuse(model)``: the adapters applied to one model instance, for good.

Instead of patching classes for the length of a ``with``, each matching submodule gets
its own ``forward`` (an instance attribute, so other instances of the class are
untouched). RoPE is a module-level function called from the attention forward, so an
attention layer that stays decomposed gets a copy of its class's forward whose globals
map ``apply_rotary_pos_emb`` to the circle.rope version, and ``ALL_ATTENTION_FUNCTIONS`` to
one that attends over DecoderWithCache's explicit caches when the call carries them
(adapters/_cached_attention.py; any other call gets transformers' own function).
"""
from __future__ import annotations

import functools
import inspect
import sys
import types
from typing import Any, Callable

import torch

from circleops.adapters._attention import attention_forward
from circleops.adapters._cached_attention import CacheAttentionFunctions
from circleops.adapters._experts import dense_experts_forward
from circleops.adapters.dynamic_cache import no_cache_by_default
from circleops.adapters._family import ROPE_FUNCTION, Family
from circleops.adapters._patching import pristine
from circleops.adapters._rmsnorm import norm_forward
from circleops.adapters._rope import rope_function

_SAVED = "_circleops_saved_forward"
ATTENTION_FUNCTIONS = "ALL_ATTENTION_FUNCTIONS"  # transformers' registry, a global of each modeling module
_MISSING = object()


def _loaded_classes(families: list[Family]) -> dict[type, tuple[Family, str]]:
    """class -> (family, "norm" | "attention" | "experts" | "model"), for families whose modeling module is
    already imported (a model of a family can only exist if its module is)."""
    out: dict[type, tuple[Family, str]] = {}
    for fam in families:
        module = sys.modules.get(fam.module)
        if module is None:
            continue
        for name in fam.norm_classes:
            out[getattr(module, name)] = (fam, "norm")
        if fam.attention_adapter or fam.rope_adapter:
            out[getattr(module, fam.attention_class)] = (fam, "attention")
        if fam.experts_class:
            out[getattr(module, fam.experts_class)] = (fam, "experts")
        decoder = getattr(module, fam.decoder_class, None)
        if decoder is not None:
            out[decoder] = (fam, "model")
    return out


def _decomposed_forward(fam: Family, forward: Callable[..., Any], *, rope: bool, cached: bool) -> Callable[..., Any]:
    """A copy of the class's attention forward whose ``apply_rotary_pos_emb`` is circle.rope
    (``rope``) and whose attention function runs over DecoderWithCache's explicit caches when
    called with them (``cached``: adapters._cached_attention)."""
    inner = inspect.unwrap(forward)  # under transformers' deprecate_kwarg wrapper
    module = sys.modules[fam.module]
    globals_ = dict(inner.__globals__)
    if rope:
        globals_[ROPE_FUNCTION] = rope_function(fam.rope_label, pristine(module, ROPE_FUNCTION), fam.rope_cast_back)
    if cached and ATTENTION_FUNCTIONS in globals_:
        globals_[ATTENTION_FUNCTIONS] = CacheAttentionFunctions(globals_[ATTENTION_FUNCTIONS])
    copy = types.FunctionType(inner.__code__, globals_, inner.__name__, inner.__defaults__, inner.__closure__)
    copy.__kwdefaults__ = inner.__kwdefaults__
    copy.__qualname__ = inner.__qualname__

    @functools.wraps(inner)
    def forward_(self, *args, **kwargs):
        if "past_key_values" in kwargs and "cache" not in kwargs:  # what deprecate_kwarg did
            kwargs["cache"] = kwargs.pop("past_key_values")
        return copy(self, *args, **kwargs)

    return forward_


def swap_forward(module: torch.nn.Module, forward: Callable[..., Any]) -> None:
    """Give ``module`` (this instance only) ``forward``; :func:`unfuse` restores its own. What
    :func:`fuse` does to each matching submodule, for families outside the Family table
    (circleops.adapters.seq2seq's T5 norms)."""
    _swap(module, forward)


def _swap(module: torch.nn.Module, forward: Callable[..., Any]) -> None:
    if _SAVED not in module.__dict__:
        module.__dict__[_SAVED] = module.__dict__.get("forward", _MISSING)
    module.__dict__["forward"] = types.MethodType(forward, module)


def fuse(model: torch.nn.Module, *, attention: bool = True) -> torch.nn.Module:
    """Route this model's RMSNorm, RoPE and (if ``attention``) fusable attention layers to
    circle ops, for good; returns the model. :func:`unfuse` restores it.

    Other instances of the same classes are not affected, and no ``with`` is needed:
    export whenever you like. The decoder model runs without an HF cache unless the
    caller passes ``use_cache=True`` or a cache (``generate`` does), so
    ``torch.export.export(model, (input_ids,))`` returns the logits. Attention layers the Circle ATTENTION contract cannot
    express stay decomposed (with circle.rope inside).
    """
    from circleops.adapters import FAMILIES

    classes = _loaded_classes(FAMILIES)
    for _, sub in model.named_modules():
        hit = classes.get(type(sub))
        if hit is None:
            continue
        fam, kind = hit
        cls = type(sub)
        if kind == "norm":
            _swap(sub, norm_forward(fam.norm_style, cls.__name__))
            continue
        if kind == "model":  # no HF DynamicCache unless asked for: export as written works
            _swap(sub, no_cache_by_default(pristine(cls, "forward")))
            continue
        if kind == "experts":
            _swap(sub, dense_experts_forward(cls.__name__))
            continue
        if attention and fam.attention_adapter:
            decomposed = _decomposed_forward(fam, pristine(cls, "forward"), rope=fam.rope_adapter, cached=True)
            _swap(sub, attention_forward(cls.__name__, fam.rope_label, decomposed))
        elif fam.rope_adapter:
            _swap(sub, _decomposed_forward(fam, pristine(cls, "forward"), rope=True, cached=False))
    return model


def unfuse(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`fuse`: every submodule gets back the ``forward`` it had; returns the model."""
    for _, sub in model.named_modules():
        saved = sub.__dict__.pop(_SAVED, None)
        if saved is None:
            continue
        if saved is _MISSING:
            sub.__dict__.pop("forward", None)
        else:
            sub.__dict__["forward"] = saved
    return model


def is_fused(model: torch.nn.Module) -> bool:
    """Whether :func:`fuse` swapped any submodule of ``model``."""
    return any(_SAVED in sub.__dict__ for sub in model.modules())

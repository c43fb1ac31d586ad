"""Hugging Face's ``DynamicCache`` and ``torch.export``: why ``export(model, (input_ids,))``
works as written on transformers 5.

transformers 5 models default to ``config.use_cache=True``: a plain call builds a
``DynamicCache``, returns it, and hands it to every attention layer. That breaks the
export idiom twice: torch.export refuses the cache in the output ("Found <class
'transformers.cache_utils.DynamicCache'> in output, which is not a known type"), and an
attention layer handed an HF cache object cannot become one ``circle.attention`` (its
cache is explicit, see :class:`~circleops.adapters.StaticKV`). So, two things:

- :func:`no_cache_by_default`: while an adapter session is active, and on a model
  :func:`~circleops.adapters.fuse` touched, the family's decoder model (``LlamaModel``...)
  runs without an HF cache unless the caller asks for one (``use_cache=True`` or a cache
  object, as ``generate`` does). The exported program then returns the logits, and
  attention is fused. Calls that pass a cache keep HF's behaviour exactly.
- :func:`register_when_imported`: ``DynamicCache`` becomes a pytree node (the same
  flattening as transformers' ``register_dynamic_cache_export_support``, which would import
  its ExecuTorch integration and torchao), so exporting an unpatched HF model — the pattern
  fusion route — also works and returns the caches as plain tensors. It registers when
  ``transformers.cache_utils`` is imported, so importing circleops still imports nothing
  of transformers.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from itertools import zip_longest
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

CACHE_MODULE = "transformers.cache_utils"


def no_cache_by_default(original: Callable[..., Any]) -> Callable[..., Any]:
    """A decoder-model ``forward`` that runs without an HF cache when the caller passed
    neither ``use_cache`` nor a cache (``config.use_cache`` is not consulted)."""

    def forward(self, *args, **kwargs):
        if (kwargs.get("use_cache") is None and kwargs.get("cache") is None
                and kwargs.get("past_key_values") is None):
            kwargs["use_cache"] = False
        return original(self, *args, **kwargs)

    forward.__name__ = "forward"
    forward.__qualname__ = f"{getattr(original, '__qualname__', 'forward')}[no cache by default]"
    forward.__wrapped__ = original
    return forward


def _flatten(cache) -> tuple[list[torch.Tensor], Any]:
    values, keys = pytree._dict_flatten(_cache_dict(cache))
    return values, [keys, _layout(cache)]


def _flatten_with_keys(cache):
    values, keys = pytree._dict_flatten_with_keys(_cache_dict(cache))
    return values, [keys, _layout(cache)]


def _cache_dict(cache) -> dict[str, list[torch.Tensor]]:
    return {"key_cache": [layer.keys for layer in cache.layers if layer.keys is not None],
            "value_cache": [layer.values for layer in cache.layers if layer.values is not None]}


def _layout(cache) -> list:
    return [getattr(layer, "sliding_window", None) for layer in cache.layers]


def _unflatten(values, context):
    from transformers.cache_utils import DynamicCache

    keys, layout = context
    d = pytree._dict_unflatten(values, keys)
    windows = [torch.tensor([w]) if w is not None else None for w in layout]
    # empty layers hold no tensors: zip to the layout's length, as transformers does
    return DynamicCache(zip_longest(d["key_cache"], d["value_cache"], windows))


def register_cache_pytree(cache_cls: type) -> None:
    """Make ``cache_cls`` (transformers' DynamicCache) a pytree node, once; a registration
    transformers itself made first is kept."""
    if cache_cls in pytree.SUPPORTED_NODES:
        return
    try:
        pytree.register_pytree_node(cache_cls, _flatten, _unflatten,
                                    serialized_type_name=f"{cache_cls.__module__}.{cache_cls.__name__}",
                                    flatten_with_keys_fn=_flatten_with_keys)
    except ValueError as e:  # registered concurrently by transformers' executorch helpers
        if "already registered" not in str(e):
            raise


def _register_from(module) -> None:
    cache_cls = getattr(module, "DynamicCache", None)
    if cache_cls is not None:
        register_cache_pytree(cache_cls)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Registers DynamicCache right after ``transformers.cache_utils`` is executed."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname != CACHE_MODULE or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            try:
                _register_from(module)
            except Exception:  # never break transformers' own import over this
                pass

        spec.loader.exec_module = exec_and_register
        return spec


_FINDER: _RegisterAfterImport | None = None


def register_when_imported() -> None:
    """Register DynamicCache now if transformers' cache module is loaded, else as soon as
    it is (an import hook; nothing is imported here)."""
    global _FINDER
    module = sys.modules.get(CACHE_MODULE)
    if module is not None:
        _register_from(module)
        return
    if _FINDER is None:
        _FINDER = _RegisterAfterImport()
        sys.meta_path.insert(0, _FINDER)

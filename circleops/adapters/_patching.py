"""Reversible, nestable patches of module/class attributes, with a record of what ran.

A :class:`Patch` names an attribute by strings (module path, optional class name,
attribute), so declaring one imports nothing; the target is resolved when a
:class:`PatchSession` is entered. On exit every attribute is put back exactly as it was
(the same function object in the class ``__dict__``, or no entry at all if it was
inherited), exceptions included, and sessions nest.

Usage is counted per patch label by :func:`mark_ran`, which the replacements call. It is
wrapped in ``torch.compiler.assume_constant_result`` so that it really executes while
Dynamo traces (strict ``torch.export``), where a plain Python side effect would only be
simulated and then dropped.
"""
from __future__ import annotations

import functools
import importlib
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

_MISSING = object()

# label -> number of calls of any replacement carrying that label (all sessions together,
# so an inner session's calls count for an outer session patching the same target)
_CALLS: dict[str, int] = {}

# sessions currently entered, innermost last; decisions are recorded into each of them
_ACTIVE: list["PatchSession"] = []


class UnusedPatchWarning(UserWarning):
    """A patch was active but nothing it replaced ran (typically: export after the ``with``)."""


def _mark_ran(label: str) -> int:
    _CALLS[label] = _CALLS.get(label, 0) + 1
    return 0


# Built at import: Dynamo refuses to trace a call of assume_constant_result itself.
_traced_mark_ran = torch.compiler.assume_constant_result(_mark_ran)


def mark_ran(label: str) -> None:
    """Record that the replacement labelled ``label`` ran (also while Dynamo traces)."""
    _traced_mark_ran(label)


@dataclass(frozen=True)
class AttentionDecision:
    """What the attention adapter did with one attention layer."""

    module: str  # class name, e.g. "Qwen2Attention"
    layer: int
    fused: bool
    reason: str = ""  # why it stayed decomposed; empty when fused

    def __str__(self) -> str:
        where = f"{self.module}[layer {self.layer}]"
        return f"{where}: circle.attention" if self.fused else f"{where}: left decomposed: {self.reason}"


# (attention class name, layer index) -> decision, the latest one wins. Read by
# circleops.passes.fusion to explain attention that an exported graph left decomposed.
DECISIONS: dict[tuple[str, int], AttentionDecision] = {}


def _record(module: str, layer: int, fused: bool, reason: str) -> int:
    decision = AttentionDecision(module, layer, fused, reason)
    DECISIONS[(module, layer)] = decision
    for session in _ACTIVE:
        if decision not in session.decisions:
            session.decisions.append(decision)
    return 0


_traced_record = torch.compiler.assume_constant_result(_record)


def record_attention(module: str, layer: int, fused: bool, reason: str = "") -> None:
    """Record an attention adapter decision (also while Dynamo traces)."""
    _traced_record(module, int(layer), bool(fused), reason)


@dataclass(frozen=True)
class Patch:
    """One attribute to replace while a session is active.

    ``build(original)`` returns the replacement; ``original`` is what the attribute held
    when the session was entered (an outer session's replacement when nested).
    """

    module: str  # dotted module path, e.g. "transformers.models.llama.modeling_llama"
    owner: Optional[str]  # class name inside that module, or None for a module-level name
    attr: str
    build: Callable[[Any], Any] = field(compare=False)
    label: str  # what warnings and reports call it; also the usage-count key
    group: str = ""  # family name: unused patches are reported per group
    tracked: bool = True  # False: a helper patch (no cache by default) the unused-warning ignores
    target: Any = field(default=None, compare=False)  # the owner object itself (public patches): no import

    def resolve(self) -> Any:
        if self.target is not None:
            return self.target
        module = importlib.import_module(self.module)
        return module if self.owner is None else getattr(module, self.owner)


def pristine(owner: Any, attr: str) -> Any:
    """``owner.attr`` as it is with no session active (the value the outermost active
    session saved), so instance-level fusing never wraps a session's replacement."""
    for session in _ACTIVE:  # outermost first
        for saved_owner, saved_attr, before, _ in session._saved:
            if saved_owner is owner and saved_attr == attr and before is not _MISSING:
                return before
    return getattr(owner, attr)


class PatchSession:
    """A context manager applying a set of patches; reusable, nestable, exception-safe.

    ``decisions`` lists what the attention adapter did with each layer it saw while the
    session was active.
    """

    def __init__(self, name: str, patches: Iterable[Patch]):
        self.name = name
        self.patches: tuple[Patch, ...] = tuple(patches)
        self.decisions: list[AttentionDecision] = []
        # (owner, attr, value before, our replacement), in the order applied
        self._saved: list[tuple[Any, str, Any, Any]] = []
        self._start: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"<PatchSession {self.name}: {', '.join(p.label for p in self.patches)}>"

    @property
    def active(self) -> bool:
        return self in _ACTIVE

    def __enter__(self) -> "PatchSession":
        if self.active:
            raise RuntimeError(f"{self.name}() is already active; create a new one to nest")
        self._saved = []
        self.decisions = []
        try:
            for patch in self.patches:
                owner = patch.resolve()
                before = owner.__dict__.get(patch.attr, _MISSING)
                current = getattr(owner, patch.attr)
                replacement = patch.build(current)
                self._saved.append((owner, patch.attr, before, replacement))
                setattr(owner, patch.attr, replacement)
        except BaseException:
            self._restore()
            raise
        self._start = {p.label: _CALLS.get(p.label, 0) for p in self.patches}
        _ACTIVE.append(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._restore()
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if exc_type is None:
            self._warn_unused()
        return False

    def _restore(self) -> None:
        # reverse order, so a target patched twice in one session ends as it began
        while self._saved:
            owner, attr, before, mine = self._saved.pop()
            if owner.__dict__.get(attr, _MISSING) is not mine:
                # exited out of order: a later session patched on top of ours and is still
                # active. Splice ours out of its chain so that it restores our `before`.
                for other in _ACTIVE:
                    other._saved = [(o, a, before if (o is owner and a == attr and b is mine) else b, m)
                                    for o, a, b, m in other._saved]
                continue
            if before is _MISSING:
                try:
                    delattr(owner, attr)
                except AttributeError:
                    pass
            else:
                setattr(owner, attr, before)

    def ran(self, label: str) -> bool:
        """Whether the replacement labelled ``label`` ran since this session was entered."""
        return _CALLS.get(label, 0) > self._start.get(label, 0)

    def unused(self) -> list[str]:
        """Labels of patches that never ran, judged per group (family).

        A family none of whose patches ran is unused as a whole; when no family ran at
        all, every label is returned. When some family ran, only the idle patches of
        families that partly ran are returned, so ``patched_modules()`` (every family)
        does not complain about the families the model does not belong to.
        """
        groups: dict[str, list[Patch]] = {}
        for p in self.patches:
            if not p.tracked:
                continue
            groups.setdefault(p.group, []).append(p)
        ran_groups = {g for g, ps in groups.items() if any(self.ran(p.label) for p in ps)}
        if not ran_groups:
            return [p.label for p in self.patches if p.tracked]
        return [p.label for g in ran_groups for p in groups[g] if not self.ran(p.label)]

    def _warn_unused(self) -> None:
        idle = self.unused()
        if idle:
            call = self.name if self.name.endswith(")") else f"{self.name}()"  # patch_module(X) is a call already
            warnings.warn(
                f"{call}: these patched classes/functions never ran while the patch was "
                f"active: {', '.join(idle)}. Export (or run) the model inside the `with` block; "
                "a model built inside it and exported after it closed is not patched "
                "(use circleops.fuse(model) to patch one model for good).",
                UnusedPatchWarning,
                stacklevel=3,
            )


# ------------------------------------------------------------------------ public routing
def _label(owner: Any, attr: str) -> str:
    if isinstance(owner, ModuleType):
        return f"{owner.__name__}.{attr}"
    name = getattr(owner, "__qualname__", None) or type(owner).__qualname__
    return f"{getattr(owner, '__module__', '?')}.{name}.{attr}"


def _counted(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def replacement(*args: Any, **kwargs: Any) -> Any:
        mark_ran(label)
        return fn(*args, **kwargs)

    return replacement


def patch_module(cls: type, forward: Callable[..., Any], *, name: str | None = None) -> PatchSession:
    """Route a module class to your op during export: ``cls.forward`` is ``forward`` while
    the ``with`` block is active, and put back on exit (exceptions included; sessions nest).

        with circleops.patch_module(SwiGLU, lambda self, x: torch.ops.npu.swiglu(self.up(x))):
            ep = torch.export.export(model, (x,))

    Export inside the ``with``: a patch that never ran while active (the model exported
    after the block closed) is reported with an :class:`UnusedPatchWarning` naming it.
    """
    return patch_modules({cls: forward}, name=name or f"patch_module({getattr(cls, '__qualname__', cls)})")


def patch_modules(forwards: Mapping[type, Callable[..., Any]], *, name: str = "patch_modules") -> PatchSession:
    """:func:`patch_module` for several classes in one session (a plugin's adapter set).
    Like the built-in family adapters, the "never exercised" warning names a class only
    when none of them ran (a model rarely uses every class a plugin routes)."""
    patches = []
    for cls, forward in forwards.items():
        if not isinstance(cls, type):
            raise TypeError(f"patch_module: expected a class (torch.nn.Module subclass), got {cls!r}; "
                            "use patch_function for a function or method")
        label = _label(cls, "forward")
        patches.append(Patch(module=cls.__module__, owner=None, attr="forward", label=label, group=label,
                             build=lambda original, label=label, forward=forward: _counted(label, forward),
                             target=cls))
    return PatchSession(name, patches)


def patch_function(owner: Any, attr: str, replacement: Callable[..., Any], *,
                   name: str | None = None) -> PatchSession:
    """Route ``owner.attr`` (a module-level function, a method, a class attribute) to
    ``replacement`` while the ``with`` block is active, with patch_module's guarantees and
    its "never exercised" warning."""
    if not hasattr(owner, attr):
        raise AttributeError(f"patch_function: {owner!r} has no attribute {attr!r} to patch")
    label = _label(owner, attr)
    patch = Patch(module=getattr(owner, "__module__", "") or "", owner=None, attr=attr,
                  build=lambda original: _counted(label, replacement), label=label, group=label, target=owner)
    return PatchSession(name or f"patch_function({label})", [patch])

"""The one op registry: :func:`op` defines a torch op and its per-target contract (an
:class:`OpSpec`), for the built-in ``circle::*`` ops (schema/ops.yaml) and for users' and
vendors' own ops alike.

    @circleops.op("mylib::swiglu(Tensor x, float alpha=1.0) -> Tensor")
    def swiglu(x, alpha=1.0):                  # the reference kernel, in aten ops
        a, b = x.chunk(2, -1)
        return torch.nn.functional.silu(a * alpha) * b

    @swiglu.register_fake
    def _(x, alpha=1.0):
        return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)

How each target writes the op (``circle=``, ``tflite=``; ``OpSpec.form(profile)``):

* circle: ``"custom"`` (default: a Circle CUSTOM op, custom_code = the qualified name or
  ``custom_code=``, custom_options = a flexbuffer map of the schema's non-tensor arguments by
  name), a builtin (a mapping in ops.yaml's ``circle:`` shape: ``{"builtin": "GELU",
  "options": "GeluOptions", "option_fields": {"approximate": "approximate"}}``), or
  ``"decompose"`` (the reference kernel's aten ops).
* a target whose runtime runs no custom kernels (onert: ``CUSTOM`` in its profile's
  ``missing_builtins``) decomposes a CUSTOM op automatically.
* tflite: ``"composite"`` (default: STABLEHLO_COMPOSITE named ``mylib.swiglu`` with the
  non-tensor arguments as attributes and the reference kernel as its decomposition, which
  is what LiteRT runs), ``"custom"`` (a TFLite CUSTOM op) or ``"decompose"``.

Plugins: packages declaring an entry point in group ``circleops.ops`` are imported on the
first registry lookup that misses (:func:`load_plugins`); a plugin that fails to load is
reported as a warning naming it, and skipped.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import warnings
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping

import torch

from circleops.errors import CircleOpsError
from circleops.ops._common import bind, contiguous, register_autocast, register_autograd_from_reference, with_defaults
from circleops.targets import BUILTIN, COMPOSITE, CUSTOM, DECOMPOSED, TargetProfile

PLUGIN_GROUP = "circleops.ops"
AUTOCAST_RULES = ("fp32", "lower_precision", "none")
CIRCLE_FORMS = ("custom", "builtin", "decompose")
TFLITE_FORMS = ("composite", "custom", "decompose")
# namespace -> the circleops module that registers other toolchains' ops of that namespace
# (with the public register_op), imported on the first miss of one of its ops
INTEROP = {"circle_custom": "circleops.interop.tico"}
# namespaces whose ops never come from a plugin: a miss there loads nothing
_TORCH_NAMESPACES = frozenset({"aten", "prims", "higher_order", "quantized_decomposed", "_operator", "quantized"})


class OpDefinitionError(CircleOpsError, ValueError):
    """``circleops.op`` was given a schema or target form it cannot register."""


class UnknownCustomOpError(CircleOpsError):
    """A file holds a CUSTOM op whose custom_code no registered op (or plugin) provides."""


class PluginWarning(UserWarning):
    """A ``circleops.ops`` plugin failed to load; its ops are unavailable, nothing else is."""


def _is_tensor_type(t: Any) -> bool:
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


def _is_tensor_list(t: Any) -> bool:
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.ListType) and isinstance(t.getElementType(), torch.TensorType)


class OpSpec:
    """One registered op: the torch op (calling the spec calls it), its reference kernel,
    and how each target writes it. Returned by :func:`op`; ``REGISTRY`` holds every one.

    * ``spec(*args, **kwargs)``: the torch op (``torch.ops.<ns>.<name>``);
    * ``register_fake(fn)`` / ``register_kernel(fn)``: the output's shape and dtype for
      torch.export (default: the reference kernel run on fake tensors) / a faster eager
      kernel with the reference kernel's exact results (default: the reference kernel);
    * ``reference``: the reference kernel with the schema's defaults (the decomposition,
      the gradient, and what the reference interpreter runs for a CUSTOM op);
    * ``circle`` / ``tflite``: the target forms (dicts; ``form`` is one of
      CIRCLE_FORMS / TFLITE_FORMS), ``form(profile)``: how a target profile writes it.
    """

    def __init__(self, schema: str, reference: Callable[..., Any], contract: Mapping[str, Any], *, provider: str,
                 samples: Callable[[torch.dtype], list] | None):
        """``contract``: the normalized ``circle`` and ``tflite`` forms, ``autocast``, the
        defining ``module`` of a built-in (or None) and any other contract entries."""
        self.schema = schema
        self.qualname = schema.partition("(")[0].strip()
        self.namespace, _, self.name = self.qualname.partition("::")
        extra = {k: v for k, v in contract.items() if k not in ("module", "provider")}
        self.contract: dict[str, Any] = {**extra, "schema": schema, "circle": dict(contract["circle"]),
                                         "tflite": dict(contract["tflite"]), "autocast": contract["autocast"]}
        self.provider = provider
        self.module: ModuleType | None = contract.get("module")
        self._samples = samples
        self._reference = reference
        self._fake: Callable[..., Any] = reference
        self._kernel: Callable[..., Any] | None = None
        self.custom_op: Any = None  # the torch.library CustomOpDef, set by define()
        self.reference: Callable[..., Any] = reference

    def __repr__(self) -> str:
        return f"<circleops op {self.qualname} from {self.provider}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.overload(*args, **kwargs)

    # ---------------------------------------------------------------- torch side
    @property
    def key(self) -> str:
        """The REGISTRY key: the short name for the built-in ``circle`` namespace, else the
        qualified name."""
        return self.name if self.namespace == "circle" else self.qualname

    @property
    def builtin(self) -> bool:
        """Whether this is one of circleops' own ops (schema/ops.yaml)."""
        return self.provider == "circleops"

    @property
    def op(self) -> torch._ops.OpOverloadPacket:
        """``torch.ops.<namespace>.<name>``."""
        return getattr(getattr(torch.ops, self.namespace), self.name)

    @property
    def overload(self) -> torch._ops.OpOverload:
        return self.op.default

    @property
    def arguments(self) -> list[Any]:
        return list(self.overload._schema.arguments)

    @property
    def tensor_args(self) -> list[str]:
        """The schema's tensor arguments (``Tensor``, ``Tensor?``), in order: the op's inputs."""
        return [a.name for a in self.arguments if _is_tensor_type(a.type)]

    @property
    def attribute_args(self) -> list[str]:
        """The schema's non-tensor arguments, in order: custom options / composite attributes."""
        return [a.name for a in self.arguments if not _is_tensor_type(a.type)]

    def register_fake(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The output's shape and dtype for torch.export (FakeTensors in, empty tensors out);
        called with every schema argument, defaults filled in. Decorator; returns ``fn``."""
        self._fake = fn
        return fn

    def register_kernel(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A faster eager kernel; it must give the reference kernel's exact results
        (circleops.testing.check_op checks it). Decorator; returns ``fn``."""
        self._kernel = fn
        return fn

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """A call's arguments by schema name, the schema's defaults filled in."""
        schema = self.overload._schema
        return dict(zip((a.name for a in schema.arguments), bind(schema, args, kwargs)))

    def sample_inputs(self, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
        """``(args, kwargs)`` pairs exercising every attribute, for generic tests."""
        if self._samples is None:
            raise OpDefinitionError(f"{self.qualname} has no sample inputs: pass samples= to circleops.op, "
                                    "or give circleops.testing.check_op the samples")
        return self._samples(dtype)

    # ---------------------------------------------------------------- target side
    @property
    def circle(self) -> dict[str, Any]:
        return self.contract["circle"]

    @property
    def tflite(self) -> dict[str, Any]:
        return self.contract["tflite"]

    @property
    def autocast(self) -> str:
        """What the op does under torch.autocast: "fp32", "lower_precision" or "none"."""
        return self.contract["autocast"]

    @property
    def custom_codes(self) -> set[str]:
        """The custom codes this op is written with (Circle and/or TFLite CUSTOM)."""
        return {f["custom_code"] for f in (self.circle, self.tflite) if f["form"] == "custom"}

    def form(self, profile: TargetProfile) -> str:
        """How ``profile`` writes this op: BUILTIN, CUSTOM, COMPOSITE or DECOMPOSED
        (a BUILTIN can still fall back to the decomposition per node)."""
        if profile.fused_ops == COMPOSITE:  # TFLite: composites, or a CUSTOM op where asked
            how = self.tflite["form"]
            if how == "composite":
                return COMPOSITE
        else:
            how = self.circle["form"]
            if how == "builtin":
                return profile.fused_form(self.circle["builtin"])
        if how == "custom":
            return CUSTOM if profile.runs("CUSTOM") else DECOMPOSED
        return DECOMPOSED

    @property
    def targets(self) -> dict[str, str]:
        """target -> how its profile writes the op (circleops.targets.PROFILES)."""
        from circleops.targets import PROFILES

        return {name: self.form(p) for name, p in PROFILES.items()}


# ------------------------------------------------------------------------ the registry
# key (short name for circle::*, else the qualified name) -> spec, in definition order
REGISTRY: dict[str, OpSpec] = {}
_BY_TARGET: dict[Any, OpSpec] = {}
_BY_CUSTOM_CODE: dict[str, OpSpec] = {}
# custom_code -> the packages whose plugins both claim it (see _contested_by_another_plugin)
CONTESTED: dict[str, list[str]] = {}
# entry point name -> (distribution, error message or None); filled by load_plugins()
PLUGINS: dict[str, tuple[str, str | None]] = {}
_plugins_loaded = False
_loading_plugin: list[str] = []


def _normalize_circle(value: Any, qualname: str, custom_code: str | None, attributes: list[str]) -> dict[str, Any]:
    if value == "custom":
        return {"form": "custom", "custom_code": custom_code or qualname}
    if value in ("decompose", "decomposed"):
        return {"form": "decompose"}
    if isinstance(value, Mapping) and "builtin" in value:
        from circle_schema import circle as circle_fb

        codes = circle_fb.BuiltinOperator.BuiltinOperator
        builtin = value["builtin"]
        if not hasattr(codes, builtin):
            raise OpDefinitionError(f"{qualname}: circle builtin {builtin!r} is not a Circle BuiltinOperator "
                                    "(circle_schema.circle.BuiltinOperator); use circle='custom' for an NPU's own op")
        options = value.get("options")
        if options is not None and not hasattr(circle_fb.BuiltinOptions.BuiltinOptions, options):
            raise OpDefinitionError(f"{qualname}: {options!r} is not a Circle BuiltinOptions table")
        fields = dict(value.get("option_fields", {}))
        bad = [arg for arg in fields.values() if arg not in attributes]
        if bad:
            raise OpDefinitionError(f"{qualname}: option_fields name {bad}, which are not non-tensor "
                                    f"arguments of the schema ({attributes})")
        return {"form": "builtin", **value, "code": value.get("code", getattr(codes, builtin)),
                "option_fields": fields}
    raise OpDefinitionError(f"{qualname}: circle= must be 'custom', 'decompose' or a mapping with a 'builtin' "
                            f"key (schema/ops.yaml's circle: shape), got {value!r}")


def _normalize_tflite(value: Any, qualname: str, custom_code: str | None, attributes: list[str]) -> dict[str, Any]:
    default_name = qualname.replace("::", ".")
    if value == "composite":
        value = {"composite": default_name}
    if value == "custom":
        return {"form": "custom", "custom_code": custom_code or qualname}
    if value in ("decompose", "decomposed"):
        return {"form": "decompose"}
    if isinstance(value, Mapping) and "composite" in value:
        attrs = dict(value.get("attributes", {a: a for a in attributes}))
        bad = [arg for arg in attrs.values() if arg not in attributes]
        if bad:
            raise OpDefinitionError(f"{qualname}: composite attributes name {bad}, which are not non-tensor "
                                    f"arguments of the schema ({attributes})")
        return {"form": "composite", **value, "attributes": attrs}
    raise OpDefinitionError(f"{qualname}: tflite= must be 'composite', 'custom', 'decompose' or a mapping with a "
                            f"'composite' key, got {value!r}")


def op(schema: str, *, custom_code: str | None = None, circle: str | Mapping[str, Any] = "custom",
       tflite: str | Mapping[str, Any] = "composite", autocast: str = "none",
       mutates_args: Iterable[str] = (), samples: Callable[[torch.dtype], list] | None = None,
       contract: Mapping[str, Any] | None = None) -> Callable[[Callable[..., Any]], OpSpec]:
    """Define a torch op from its schema and reference kernel, with how every target writes it.

    The decorated function is the reference kernel, written in aten ops: it is the eager
    kernel, the decomposition, the gradient (autograd runs through it) and what the
    reference interpreter runs. It is called with every schema argument (defaults filled in).

    Args:
        schema: ``"ns::name(Tensor x, float alpha=1.0) -> Tensor"`` (torch schema syntax).
        custom_code: the CUSTOM op's custom_code (default: the qualified name ``ns::name``).
        circle: ``"custom"`` (default), ``"decompose"``, or a builtin mapping
            (``{"builtin": ..., "options": ..., "option_fields": {field: arg}}``).
        tflite: ``"composite"`` (default), ``"custom"``, ``"decompose"``, or
            ``{"composite": name, "attributes": {key: arg}}``.
        autocast: under torch.autocast: ``"none"`` (default), ``"fp32"`` (upcast, as norms)
            or ``"lower_precision"`` (the active autocast dtype, as linear).
        mutates_args: argument names the op writes in place (as torch.library.custom_op).
        samples: ``sample_inputs(dtype) -> [(args, kwargs), ...]`` for circleops.testing.
        contract: extra contract entries kept on the spec (schema/ops.yaml's other keys).

    Returns a decorator; it returns the :class:`OpSpec`, which calls the torch op and has
    ``register_fake`` / ``register_kernel``.
    """
    if not isinstance(schema, str) or "::" not in schema.partition("(")[0] or "(" not in schema:
        raise OpDefinitionError(f"circleops.op: schema must be 'namespace::name(args) -> returns', got {schema!r}")
    try:
        parsed = torch._C.parse_schema(schema)
    except RuntimeError as err:
        raise OpDefinitionError(f"circleops.op: cannot parse the schema {schema!r}: {err}") from None
    if autocast not in AUTOCAST_RULES:
        raise OpDefinitionError(f"{parsed.name}: autocast must be one of {AUTOCAST_RULES}, got {autocast!r}")
    attributes = [a.name for a in parsed.arguments if not _is_tensor_type(a.type) and not _is_tensor_list(a.type)]
    circle_form = _normalize_circle(circle, parsed.name, custom_code, attributes)
    tflite_form = _normalize_tflite(tflite, parsed.name, custom_code, attributes)
    mutates = tuple(mutates_args)

    def decorate(fn: Callable[..., Any]) -> OpSpec:
        qualname = parsed.name
        key = qualname.split("::")[1] if qualname.startswith("circle::") else qualname
        if key in REGISTRY:
            raise OpDefinitionError(f"{qualname} is already defined (by {REGISTRY[key].provider}); an op is "
                                    "defined once: pick another name or namespace")
        provider = _loading_plugin[-1] if _loading_plugin else (contract or {}).get("provider") or \
            getattr(fn, "__module__", None) or "?"
        spec = OpSpec(schema, with_defaults(fn, parsed), {**(contract or {}), "circle": circle_form,
                                                          "tflite": tflite_form, "autocast": autocast},
                      provider=provider, samples=samples)
        if _contested_by_another_plugin(spec):
            return spec  # disabled: neither defined in torch nor registered; the plugin's other ops load
        _check_custom_codes(qualname, circle_form, tflite_form)
        _define(spec, fn, parsed, mutates)
        return _add(key, spec)

    return decorate


def register_op(op: Any, reference: Callable[..., Any], *, custom_code: str | None = None,
                circle: str | Mapping[str, Any] = "custom", tflite: str | Mapping[str, Any] = "composite",
                samples: Callable[[torch.dtype], list] | None = None, provider: str | None = None) -> OpSpec:
    """Register an op that already exists in torch (defined elsewhere with torch.library, e.g.
    by another toolchain) with how each target writes it. ``reference`` is its computation
    in aten (or registered) ops: the decomposition and what the reference interpreter runs
    for a CUSTOM op; the torch op itself (its kernels, fake, autograd) is left as it is.
    The forms are :func:`op`'s. Returns the OpSpec; registering a name twice raises."""
    overload = op.default if isinstance(op, torch._ops.OpOverloadPacket) else op
    if not isinstance(overload, torch._ops.OpOverload):
        raise OpDefinitionError(f"register_op: expected a torch op (torch.ops.ns.name), got {op!r}")
    parsed = overload._schema
    schema = str(parsed)
    if parsed.overload_name:  # the spec's overload is the op's default one
        raise OpDefinitionError(f"register_op: {schema} is the {parsed.overload_name!r} overload; register the "
                                "default overload (torch.ops.ns.name.default)")
    key = parsed.name.split("::")[1] if parsed.name.startswith("circle::") else parsed.name
    if key in REGISTRY:
        raise OpDefinitionError(f"{parsed.name} is already registered (by {REGISTRY[key].provider})")
    attributes = [a.name for a in parsed.arguments if not _is_tensor_type(a.type) and not _is_tensor_list(a.type)]
    circle_form = _normalize_circle(circle, parsed.name, custom_code, attributes)
    tflite_form = _normalize_tflite(tflite, parsed.name, custom_code, attributes)
    spec = OpSpec(schema, with_defaults(reference, parsed), {"circle": circle_form, "tflite": tflite_form,
                                                              "autocast": "none"},
                  provider=(_loading_plugin[-1] if _loading_plugin else None) or provider
                  or getattr(reference, "__module__", None) or "?", samples=samples)
    if _contested_by_another_plugin(spec):
        return spec  # disabled, as for circleops.op
    _check_custom_codes(parsed.name, circle_form, tflite_form)
    return _add(key, spec)


def _check_custom_codes(qualname: str, *forms: Mapping[str, Any]) -> None:
    """A custom_code names one op: the interpreter and NPU compilers look it up by that name."""
    taken = {f["custom_code"]: _BY_CUSTOM_CODE[f["custom_code"]] for f in forms
             if f["form"] == "custom" and f["custom_code"] in _BY_CUSTOM_CODE}
    if taken:
        code, other = next(iter(taken.items()))
        raise OpDefinitionError(f"{qualname}: custom_code {code!r} already names {other.qualname} "
                                f"(from {other.provider}); give this op another custom_code=")


def _contested_by_another_plugin(spec: OpSpec) -> bool:
    """The rule for two plugins claiming one custom_code: the op of the plugin loading now is
    disabled (a PluginWarning names both packages), the plugins' other ops stay, and the code
    is contested: reading or running a file with a CUSTOM op of that code is an error naming
    both packages (:func:`by_custom_code`), since which vendor's kernel it means is unknown.
    Outside plugin loading (an op defined in your own code) a clash stays an OpDefinitionError."""
    if not _loading_plugin:
        return False
    clashes = {code: _BY_CUSTOM_CODE[code] for code in spec.custom_codes if code in _BY_CUSTOM_CODE}
    clashes = {code: other for code, other in clashes.items() if other.provider != spec.provider}
    for code, other in clashes.items():
        CONTESTED.setdefault(code, [other.provider])
        if spec.provider not in CONTESTED[code]:
            CONTESTED[code].append(spec.provider)
        warnings.warn(f"circleops plugins {other.provider} ({other.qualname}) and {spec.provider} ({spec.qualname}) "
                      f"both claim custom_code {code!r}: {spec.qualname} is disabled (the packages' other ops stay), "
                      f"and a file with a CUSTOM op {code!r} is refused until one of them is uninstalled",
                      PluginWarning, stacklevel=4)
    return bool(clashes)


def contested_custom_code(code: str) -> UnknownCustomOpError:
    """The error for a CUSTOM op whose custom_code two plugins claim: it names both packages."""
    packages = CONTESTED[code]
    return UnknownCustomOpError(
        f"CUSTOM op with custom_code {code!r}: the packages {' and '.join(packages)} both provide an op of that code, "
        f"with their own kernels, so which one this file means is unknown. Uninstall one of them (pip uninstall "
        f"{packages[-1]}) to read or run this file.")


def _add(key: str, spec: OpSpec) -> OpSpec:
    """Index ``spec`` under its key, its torch op and its custom codes."""
    REGISTRY[key] = spec
    _BY_TARGET[spec.overload] = spec
    _BY_TARGET[spec.op] = spec
    for code in spec.custom_codes:
        _BY_CUSTOM_CODE.setdefault(code, spec)
    return spec


def _define(spec: OpSpec, reference: Callable[..., Any], parsed: Any, mutates: tuple[str, ...]) -> None:
    """Register the torch op: eager kernel, fake, autograd through the reference kernel,
    the autocast rule."""
    qualname, paren, signature = spec.schema.partition("(")

    def eager(*args: Any, **kwargs: Any) -> Any:
        full = bind(parsed, args, kwargs)
        if spec._kernel is not None:
            return spec._kernel(*full)
        return contiguous(reference(*full))

    def fake(*args: Any, **kwargs: Any) -> Any:
        full = bind(parsed, args, kwargs)
        if spec._fake is reference:
            return contiguous(reference(*full))
        return spec._fake(*full)

    eager.__name__ = eager.__qualname__ = spec.name
    try:
        custom = torch.library.custom_op(qualname.strip(), eager, mutates_args=mutates, schema=paren + signature)
    except (RuntimeError, ValueError) as err:
        raise OpDefinitionError(f"{spec.qualname}: torch.library refused the op: {err}") from None
    custom.register_fake(fake)
    if not mutates:
        register_autograd_from_reference(custom, reference)
    register_autocast(custom, spec.autocast)
    spec.custom_op = custom


# ------------------------------------------------------------------------ lookups
def load_plugins(*, refresh: bool = False) -> dict[str, tuple[str, str | None]]:
    """Import every ``circleops.ops`` entry point once (a module defining ops, or a callable
    that does). A plugin that fails is reported as a :class:`PluginWarning` naming it and
    its package, and skipped. ``refresh``: look at the entry points again (a package
    installed since) and load the ones not loaded yet. Returns PLUGINS: name -> (package,
    error or None)."""
    global _plugins_loaded
    if _plugins_loaded and not refresh:
        return PLUGINS
    _plugins_loaded = True
    for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        if ep.name in PLUGINS:
            continue
        dist = ep.dist.name if getattr(ep, "dist", None) is not None else ep.value.split(":")[0]
        _loading_plugin.append(dist)
        try:
            loaded = ep.load()
            if callable(loaded) and not isinstance(loaded, (ModuleType, OpSpec)):
                loaded()
        except Exception as err:  # noqa: BLE001 - a broken plugin must not break anything else
            PLUGINS[ep.name] = (dist, f"{type(err).__name__}: {err}")
            warnings.warn(f"circleops plugin {ep.name!r} (package {dist}, entry point {ep.value}) failed to load "
                          f"and is skipped: {type(err).__name__}: {err}", PluginWarning, stacklevel=2)
        else:
            PLUGINS[ep.name] = (dist, None)
        finally:
            _loading_plugin.pop()
    return PLUGINS


def _namespace(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace
    return getattr(target, "_qualified_op_name", "::").split("::")[0]


def by_overload(target: Any) -> OpSpec | None:
    """The OpSpec for an FX node target (``torch.ops.ns.x.default`` or the packet), else None."""
    spec = _BY_TARGET.get(target) if _hashable(target) else None
    if spec is not None or not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return spec
    namespace = _namespace(target)
    if namespace in INTEROP:
        importlib.import_module(INTEROP[namespace]).register_defined()
        spec = _BY_TARGET.get(target)
    if spec is None and not _plugins_loaded and namespace not in _TORCH_NAMESPACES:
        load_plugins()
        spec = _BY_TARGET.get(target)
    return spec


def _hashable(target: Any) -> bool:
    try:
        hash(target)
    except TypeError:
        return False
    return True


def lookup(name: str) -> OpSpec | None:
    """The OpSpec named ``name`` (``rms_norm``, ``circle::rms_norm`` or ``mylib::swiglu``),
    loading plugins on a miss; None when nobody defines it."""
    key = name.removeprefix("circle::")
    if key not in REGISTRY:
        load_plugins()
    return REGISTRY.get(key)


def by_custom_code(code: str) -> OpSpec | None:
    """The op written as a CUSTOM op with ``code``, loading plugins on a miss; else None.
    UnknownCustomOpError naming both packages when two plugins claim ``code``."""
    known = _BY_CUSTOM_CODE.get(code)
    if known is None or not known.builtin:  # a plugin's code: another plugin may contest it
        load_plugins()
    if code in CONTESTED:
        raise contested_custom_code(code)
    return _BY_CUSTOM_CODE.get(code)


def unknown_custom_code(code: str) -> UnknownCustomOpError:
    """The error for a CUSTOM op nobody registered: names the code and, when a plugin of the
    same namespace failed to load, that plugin's package."""
    namespace = code.split("::")[0] if "::" in code else code.split(".")[0]
    hint = ""
    for name, (dist, error) in PLUGINS.items():
        if error is not None and name in (namespace, code):
            hint = f" The package {dist} provides it, but its plugin failed to load: {error}."
    if namespace == "circle_custom" and not hint:
        hint = " It is one of TICO's ops: import circleops.interop.tico to register TICO's circle_custom ops."
    known = sorted(_BY_CUSTOM_CODE)
    return UnknownCustomOpError(
        f"CUSTOM op with custom_code {code!r}: no registered op provides it.{hint} Install or import the package "
        f"that defines it (a circleops.ops plugin), or define it with @circleops.op(..., custom_code={code!r}). "
        f"Registered custom codes: {', '.join(known) if known else 'none'}.")


__all__ = ["BUILTIN", "COMPOSITE", "CUSTOM", "DECOMPOSED", "OpDefinitionError", "OpSpec", "PLUGINS", "PLUGIN_GROUP",
           "CONTESTED", "PluginWarning", "REGISTRY", "UnknownCustomOpError", "by_custom_code", "contested_custom_code", "by_overload", "load_plugins",
           "lookup", "op", "register_op", "unknown_custom_code"]

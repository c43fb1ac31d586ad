"""Pattern fusion: find decomposed RMSNorm and rotate_half RoPE in an ExportedProgram and
replace each with one circle op, for models no adapter knows.

    ep = torch.export.export(model, args)
    ep, report = fuse_patterns(ep)
    print(report)

A hand matcher walks the ATen graph (before or after ``run_decompositions``) from an
anchor node outwards:

* RMSNorm, anchored at ``rsqrt``: ``h = x`` or ``x.to(fp32)``; ``rsqrt(mean(h², -1,
  keepdim) + eps)`` with h² as ``pow(h, 2)``, ``h * h`` or ``square(h)``; ``h · rsqrt``
  in either order; then the weight multiply in either order, before the cast back
  (OLMo2, Gemma: multiply ``fp32``) or after it (Llama: ``input_dtype``), the weight
  optionally upcast and offset (Gemma's ``1 + w``).
* RoPE, anchored at the ``cat`` of rotate_half: ``x·cos + cat(-x[..., D/2:],
  x[..., :D/2])·sin``, summands and factors in either order, including the partial form
  ``cat(rope(x[..., :R]), x[..., R:])`` (Phi3).

A match is replaced only if circle op computes the same values bit for bit (same ops in
the same dtypes) and nothing else uses its intermediates; near misses are reported as
left, with the reason. The graph signature is kept valid (placeholders never change;
a renamed graph output is renamed in the signature), so ``ep.module()`` still runs.

Attention is not pattern-fused; the report lists each attention module the graph holds
decomposed and why the attention adapter left it so.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch.fx import Graph, GraphModule, Node

import circleops.ops  # noqa: F401  (registers torch.ops.circle.*)
from circleops.passes._graph import copy_graph

aten = torch.ops.aten

_CASTS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default}
_ASSERTS = {aten._assert_tensor_metadata.default}
_MULS = {aten.mul.Tensor}
_ADDS = {aten.add.Tensor, aten.add.Scalar}
_INT_MAX = 2 ** 62  # slice ends at or past this mean "to the end"


@dataclass(frozen=True)
class FusionEntry:
    """One fused op, or one candidate left alone."""

    kind: str  # "rms_norm", "rope" or "attention"
    where: str  # module path and class, else the graph node
    detail: str  # fused: the op's attributes; left: the reason

    def __str__(self) -> str:
        return f"{self.kind} at {self.where}: {self.detail}"


@dataclass
class FusionReport:
    """What :func:`fuse_patterns` fused and what it left (with the reason).

    ``fused`` also lists circle ops the graph already held (from the adapters), marked
    ``already fused``, so ``count()`` is the total in the returned program.
    """

    fused: list[FusionEntry] = field(default_factory=list)
    left: list[FusionEntry] = field(default_factory=list)

    def count(self, kind: str, *, new_only: bool = False) -> int:
        return sum(1 for e in self.fused if e.kind == kind and not (new_only and e.detail.startswith("already")))

    def __str__(self) -> str:
        kinds = sorted({e.kind for e in self.fused})
        lines = [f"fused: {', '.join(f'{self.count(k)} {k}' for k in kinds) or 'nothing'}"]
        lines += [f"  {e}" for e in self.fused]
        lines.append(f"left: {len(self.left) or 'nothing'}")
        lines += [f"  {e}" for e in self.left]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# small graph helpers

def _val(n: Any) -> Optional[torch.Tensor]:
    v = n.meta.get("val") if isinstance(n, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _is(n: Any, targets: set) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def _users(n: Node) -> list[Node]:
    """Users that compute something (metadata asserts left out)."""
    return [u for u in n.users if u.target not in _ASSERTS]


def _only_user(n: Node) -> Optional[Node]:
    users = _users(n)
    return users[0] if len(users) == 1 else None


def _is_cast(n: Any) -> bool:
    if not _is(n, _CASTS) or _val(n) is None or _val(n.args[0]) is None:
        return False
    return tuple(_val(n).shape) == tuple(_val(n.args[0]).shape)


def _other(n: Node, one: Any) -> Any:
    """The other operand of a binary node, or None if ``one`` is not an operand."""
    a, b = n.args[0], n.args[1]
    return b if a is one else a if b is one else None


def _number(a: Any) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def _last_dim(dim: int, rank: int) -> bool:
    return dim == -1 or dim == rank - 1


def _clean_fqn(fqn: str) -> str:
    fqn = re.sub(r"^L\['self'\]\.?", "", fqn)
    return re.sub(r"\[(\d+)\]", r".\1", fqn)


def _scope(n: Node) -> Optional[tuple[str, str]]:
    """(module path, class name) of the innermost module that produced ``n``."""
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return None
    fqn, cls = list(stack.values())[-1]
    cls_name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
    return _clean_fqn(fqn), cls_name.rsplit(".", 1)[-1]


def _where(n: Node) -> str:
    scope = _scope(n)
    return f"{scope[0] or '<root>'} ({scope[1]})" if scope else f"node {n.name}"


# ---------------------------------------------------------------------------------------
# matches

@dataclass
class _Match:
    kind: str
    out: Node  # the node the fused op replaces
    op: Any
    args: tuple
    internal: list[Node]  # must be used only inside the pattern
    detail: str


@dataclass
class _Left:
    kind: str
    node: Node
    reason: str


_Result = Union[_Match, _Left, None]


def _weight(w: Node, channels: int) -> Optional[tuple[Node, float]]:
    """(weight, offset) if ``w`` is a [C] weight, optionally upcast and offset by a constant."""
    offset = 0.0
    if _is(w, _ADDS) and not w.kwargs.get("alpha"):
        a, b = w.args[0], w.args[1]
        const, w = (a, b) if _number(a) else (b, a) if _number(b) else (None, w)
        if const is None:
            return None
        offset = float(const)
    if _is_cast(w) and _val(w).dtype == torch.float32 and _val(w.args[0]).is_floating_point():
        w = w.args[0]  # an upcast is exact: the op upcasts the weight itself where it multiplies in fp32
    v = _val(w)
    if v is None or v.dim() != 1 or v.shape[0] != channels or not v.is_floating_point():
        return None
    return w, offset


def _match_rms_norm(r: Node) -> _Result:
    add = r.args[0]
    if not _is(add, _ADDS) or add.kwargs.get("alpha"):
        return None
    a, b = add.args[0], add.args[1]
    mean, eps = (a, b) if _number(b) else (b, a) if _number(a) else (None, None)
    if not _is(mean, {aten.mean.dim}):
        return None
    sq = mean.args[0]
    if _is(sq, {aten.pow.Tensor_Scalar}) and sq.args[1] == 2:
        h = sq.args[0]
    elif _is(sq, _MULS) and sq.args[0] is sq.args[1]:
        h = sq.args[0]
    elif _is(sq, {aten.square.default}):
        h = sq.args[0]
    else:
        return None
    hv = _val(h)
    if hv is None or not hv.is_floating_point():
        return None
    dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if list(dims or []) not in ([-1], [hv.dim() - 1]):
        return _Left("rms_norm", r, f"mean over dims {list(dims or [])}, not only the last one")
    if not keepdim or mean.kwargs.get("dtype") is not None:
        return _Left("rms_norm", r, "mean(x²) without keepdim (or with a dtype): not the RMSNorm broadcast")
    users = _users(r)
    if len(users) != 1:
        return _Left("rms_norm", r, f"rsqrt(mean(x²) + eps) also feeds {', '.join(u.name for u in users[1:])}; "
                     "fusing would compute it twice")
    norm = users[0]
    if not _is(norm, _MULS) or _other(norm, r) is not h:
        return _Left("rms_norm", r, "rsqrt(mean(x²) + eps) is not multiplied by the same x it was computed from")
    x = h.args[0] if _is_cast(h) and hv.dtype == torch.float32 and _val(h.args[0]).is_floating_point() else h
    in_dtype = _val(x).dtype
    policy = "fp32" if hv.dtype == torch.float32 else "native"
    channels = hv.shape[-1]
    internal = [sq, mean, add, r, norm]
    weight, offset, multiply, out = None, 0.0, "input_dtype", norm

    nxt = _only_user(norm)
    if _is_cast(nxt) and _val(nxt).dtype == in_dtype:
        # Llama: cast back, then weight * y
        out = nxt
        mul = _only_user(nxt)
        if _is(mul, _MULS) and (w := _weight(_other(mul, nxt), channels)) is not None:
            internal.append(nxt)
            (weight, offset), out = w, mul
    elif _is(nxt, _MULS) and (w := _weight(_other(nxt, norm), channels)) is not None:
        # OLMo2, Gemma: weight * y in fp32, then cast back
        (weight, offset), out = w, nxt
        multiply = "input_dtype" if in_dtype == hv.dtype == _val(weight).dtype else "fp32"
        back = _only_user(nxt)
        if _is_cast(back) and _val(back).dtype == in_dtype:
            internal.append(nxt)
            out = back
    elif in_dtype != hv.dtype and not (_is_cast(nxt) and _val(nxt).dtype == in_dtype):
        return _Left("rms_norm", r, f"the normalized value stays {hv.dtype} and is never cast back to {in_dtype}")
    detail = f"eps={eps}, offset={offset}, multiply={multiply}, policy={policy}" + ("" if weight is not None else ", no weight")
    return _Match("rms_norm", out, torch.ops.circle.rms_norm.default,
                  (x, weight, float(eps), offset, multiply, policy), internal, detail)


def _match_sqrt_form(s: Node) -> _Result:
    """x / sqrt(mean(x²) + eps): an RMSNorm, but not bit-equal to the rsqrt form."""
    add = s.args[0]
    if not _is(add, _ADDS) or not any(_is(a, {aten.mean.dim}) for a in add.args[:2]):
        return None
    if any(_is(u, {aten.div.Tensor}) and u.args[1] is s for u in _users(s)):
        return _Left("rms_norm", s, "x / sqrt(mean(x²) + eps): circle.rms_norm computes x · rsqrt(...), which can "
                     "differ in the last bit; write the module with torch.rsqrt to have it fused")
    return None


def _slice(n: Any) -> Optional[tuple[Node, int, int, int]]:
    """(x, dim, start, end) of a step-1 slice, end clamped to x's size."""
    if not _is(n, {aten.slice.Tensor}):
        return None
    x, dim = n.args[0], n.args[1] if len(n.args) > 1 else 0
    start = n.args[2] if len(n.args) > 2 else 0
    end = n.args[3] if len(n.args) > 3 else _INT_MAX
    step = n.args[4] if len(n.args) > 4 else 1
    xv = _val(x)
    if xv is None or step != 1 or not all(isinstance(v, int) for v in (dim, start or 0, end if end is not None else 0)):
        return None
    size = xv.shape[dim]
    return x, dim % xv.dim(), start or 0, min(size, _INT_MAX if end is None else end)


def _table(t: Node, x: torch.Tensor) -> Optional[Node]:
    """cos/sin as circle.rope takes it ([S, R], [B, S, R] or [B, 1, S, R]); None if the
    table broadcasts over x another way (x not [B, H, S, D])."""
    v = _val(t)
    if v is None:
        return None
    if _is(t, {aten.unsqueeze.default}) and t.args[1] == 1 and _val(t.args[0]) is not None and _val(t.args[0]).dim() == 3:
        return t.args[0]
    if v.dim() == 2 or (v.dim() == 4 and v.shape[1] == 1 and v.shape[0] in (1, x.shape[0])):
        return t if v.shape[-2] == x.shape[2] else None
    return None


def _match_rope(cat: Node) -> _Result:
    tensors = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or not _is(tensors[0], {aten.neg.default}):
        return None
    hi, lo = _slice(tensors[0].args[0]), _slice(tensors[1])
    if hi is None or lo is None or hi[0] is not lo[0]:
        return None
    x = lo[0]
    xv = _val(x)
    d = xv.shape[-1]
    if not (_last_dim(dim, xv.dim()) and hi[1] == lo[1] == xv.dim() - 1 and d % 2 == 0
            and lo[2:] == (0, d // 2) and hi[2:] == (d // 2, d)):
        return None
    msin = _only_user(cat)
    sin = _other(msin, cat) if _is(msin, _MULS) else None
    total = _only_user(msin) if sin is not None else None
    if not _is(total, {aten.add.Tensor}) or total.kwargs.get("alpha"):
        return _Left("rope", cat, "rotate_half(x) is not used as x·cos + rotate_half(x)·sin")
    mcos = _other(total, msin)
    cos = _other(mcos, x) if _is(mcos, _MULS) else None
    if cos is None or _only_user(mcos) is not total:
        return _Left("rope", cat, "rotate_half(x)·sin is not added to x·cos of the same x")
    if xv.dim() != 4:
        return _Left("rope", cat, f"x has rank {xv.dim()}; circle.rope takes [B, H, S, D]")
    cos_t, sin_t = _table(cos, xv), _table(sin, xv)
    if cos_t is None or sin_t is None or tuple(_val(cos_t).shape) != tuple(_val(sin_t).shape):
        return _Left("rope", cat, f"cos/sin {list(_val(cos).shape)} do not broadcast as [B, 1, S, D] over x "
                     f"{list(xv.shape)} (x is not laid out [B, H, S, D])")
    internal = [tensors[0].args[0], tensors[0], tensors[1], cat, msin, mcos]
    out, src = total, x
    # partial rotary: cat(rope(x0[..., :R]), x0[..., R:])
    part = _slice(x)
    outer = _only_user(total)
    if part is not None and part[2] == 0 and _is(outer, {aten.cat.default}) and len(outer.args[0]) == 2 \
            and outer.args[0][0] is total and _last_dim(outer.args[1] if len(outer.args) > 1 else 0, xv.dim()):
        rest = _slice(outer.args[0][1])
        x0 = part[0]
        if rest is not None and rest[0] is x0 and rest[1] == part[1] == xv.dim() - 1 \
                and rest[2] == part[3] and rest[3] == _val(x0).shape[-1] and set(_users(x)) <= set(internal):
            internal += [total, x, outer.args[0][1]]
            out, src = outer, x0
    detail = "mode=gpt_neox" + (f", partial: {d} of {_val(src).shape[-1]} dims" if src is not x else "")
    return _Match("rope", out, torch.ops.circle.rope.default, (src, cos_t, sin_t, "gpt_neox"), internal, detail)


_ANCHORS = {
    aten.rsqrt.default: _match_rms_norm,
    aten.sqrt.default: _match_sqrt_form,
    aten.cat.default: _match_rope,
}


# ---------------------------------------------------------------------------------------
# rewriting

def _fake_out(op: Any, args: tuple) -> Optional[torch.Tensor]:
    from torch._guards import detect_fake_mode

    vals = [_val(a) if isinstance(a, Node) else a for a in args]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        return None
    with mode:
        return op(*vals)


def _escapes(m: _Match) -> Optional[str]:
    for n in m.internal:
        if n is m.out:
            continue
        outside = [u for u in _users(n) if u not in m.internal and u is not m.out]
        if outside:
            return f"intermediate {n.name} also feeds {outside[0].name}; fusing would compute it twice"
    return None


def _apply(graph: Graph, m: _Match) -> Union[Node, str]:
    """Replace ``m.out`` with the fused op and return it; or return why that would change the result."""
    why = _escapes(m)
    if why:
        return why
    val = _fake_out(m.op, m.args)
    ref = _val(m.out)
    if val is None or ref is None or tuple(val.shape) != tuple(ref.shape) or val.dtype != ref.dtype:
        got = "nothing" if val is None else f"{val.dtype} {list(val.shape)}"
        want = "nothing" if ref is None else f"{ref.dtype} {list(ref.shape)}"
        return f"the fused op would give {got} where the graph has {want}"
    with graph.inserting_before(m.out):
        node = graph.call_function(m.op, m.args)
    node.meta.update({k: v for k, v in m.out.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")})
    node.meta["val"] = val
    try:
        from torch.fx.passes.shape_prop import _extract_tensor_metadata

        node.meta["tensor_meta"] = _extract_tensor_metadata(val)
    except Exception:  # metadata only; the value is what matters
        pass
    m.out.replace_all_uses_with(node)
    return node


def _prune(graph: Graph, doomed: set[Node]) -> None:
    # metadata asserts keep their input alive; drop those on nodes the fusion made dead
    for n in list(graph.nodes):
        if n.target in _ASSERTS and n.args and n.args[0] in doomed:
            graph.erase_node(n)
    graph.eliminate_dead_code()


def _attention_entries(graph: Graph, model: Optional[torch.nn.Module]) -> tuple[list[FusionEntry], list[FusionEntry]]:
    """circle.attention nodes, and attention modules the graph holds decomposed (with why)."""
    from circleops.adapters import DECISIONS, FAMILIES, attention_blockers

    known = {f.attention_class: f for f in FAMILIES}
    scopes: dict[str, str] = {}
    fused_scopes: set[str] = set()
    for n in graph.nodes:
        for fqn, cls in (n.meta.get("nn_module_stack") or {}).values():
            name = (cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))).rsplit(".", 1)[-1]
            if name in known or (name.endswith("Attention") and n.target == aten.softmax.int):
                scopes.setdefault(_clean_fqn(fqn), name)
                if n.target == torch.ops.circle.attention.default:
                    fused_scopes.add(_clean_fqn(fqn))
    fused = [FusionEntry("attention", f"{fqn} ({cls})", "already fused (attention adapter)")
             for fqn, cls in scopes.items() if fqn in fused_scopes]
    left = []
    for fqn, cls in scopes.items():
        if fqn in fused_scopes:
            continue
        reason = None
        if model is not None:
            try:
                reason = "; ".join(attention_blockers(model.get_submodule(fqn))) or None
            except AttributeError:
                pass
        if reason is None:
            layer = re.findall(r"\.(\d+)\.", f".{fqn}.")
            decision = DECISIONS.get((cls, int(layer[-1]))) if layer else None
            if decision is not None and not decision.fused:
                reason = decision.reason
        if reason is None:
            fam = known.get(cls)
            reason = (f"exported without the attention adapter (export inside patched_{fam.name}_attention(); "
                      "pass model= to fuse_patterns to see whether ATTENTION can express it)"
                      if fam else "attention is not pattern-fused, and no adapter knows this class")
        left.append(FusionEntry("attention", f"{fqn} ({cls})", f"left decomposed: {reason}"))
    return fused, left


def fuse_patterns(ep: torch.export.ExportedProgram, *, model: Optional[torch.nn.Module] = None
                  ) -> tuple[torch.export.ExportedProgram, FusionReport]:
    """Replace decomposed RMSNorm and rotate_half RoPE in ``ep`` with circle ops.

    Returns a new ExportedProgram (``ep`` itself is not modified; weights are shared) and
    a :class:`FusionReport`. ``model`` (the exported module) is optional: with it, the
    report explains exactly why each decomposed attention layer could not be fused.
    """
    graph = copy_graph(ep.graph)
    report = FusionReport()
    for n in graph.nodes:
        spec = circleops.ops.by_overload(n.target) if n.op == "call_function" else None
        if spec is not None and spec.builtin and spec.name in ("rms_norm", "rope"):
            report.fused.append(FusionEntry(spec.name, _where(n), "already fused (adapter)"))

    doomed: set[Node] = set()
    renamed: dict[str, str] = {}
    outputs = {a.name for a in torch.utils._pytree.tree_leaves(graph.output_node().args) if isinstance(a, Node)}
    for n in list(graph.nodes):
        if n in doomed or n.op != "call_function" or n.target not in _ANCHORS:
            continue
        result = _ANCHORS[n.target](n)
        if isinstance(result, _Left):
            report.left.append(FusionEntry(result.kind, _where(result.node), result.reason))
        elif isinstance(result, _Match):
            where = _where(result.out)
            fused = _apply(graph, result)
            if isinstance(fused, str):
                report.left.append(FusionEntry(result.kind, where, fused))
                continue
            report.fused.append(FusionEntry(result.kind, where, result.detail))
            doomed.update(result.internal)
            doomed.add(result.out)
            if result.out.name in outputs:
                renamed[result.out.name] = fused.name
    _prune(graph, doomed)

    att_fused, att_left = _attention_entries(graph, model)
    report.fused += att_fused
    report.left += att_left

    gm = GraphModule(ep.graph_module, graph)
    signature = ep.graph_signature
    if renamed:
        signature = copy.deepcopy(signature)
        for spec in signature.output_specs:
            if getattr(spec.arg, "name", None) in renamed:
                spec.arg = type(spec.arg)(name=renamed[spec.arg.name])
    return ep._update(gm, signature), report


__all__ = ["FusionEntry", "FusionReport", "fuse_patterns"]

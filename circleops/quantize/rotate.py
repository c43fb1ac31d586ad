"""Hadamard rotation of an LLM's residual stream, folded into its weights (QuaRot-style,
offline only: no rotation op is left in the graph).

Per-tensor uint8 activations fail on LLMs because of a few outlier channels of the residual
stream (SmolLM2: RMS above 900 in a couple of channels, bench/README.md): one scale per tensor
leaves the other channels no levels. An orthogonal Q spreads every channel over all of them
(x·Q, with Q a randomized Hadamard matrix: ±1/sqrt(d) entries), and the model computes the
same function when

* every RMSNorm's gamma is folded into the linears that read it first (W ← W·diag(gamma),
  gamma ← 1; the final norm's into the lm_head, which is untied from the embedding),
  because RMSNorm(x·Q) = RMSNorm(x)·Q only without a per-channel gamma;
* the embedding table, and the output rows of every linear that writes the residual stream
  (o_proj, down_proj), are rotated: E ← E·Q, W ← Qᵀ·W (and a bias b ← b·Q);
* every linear that reads it (q/k/v, gate/up, lm_head) gets W ← W·Q.

Also, per attention head, v_proj's output rows and o_proj's input columns take a head-sized
Hadamard (v and the attention output per head, which attention only mixes across positions),
which flattens o_proj's input as well.

``rotated(model)`` does all this in place for the duration of a ``with`` block (the weights,
the tie and the gammas are restored on exit) and checks the fold: the rotated model's fp32
logits on the shipped calibration text must equal the original's within ``FOLD_RTOL``, or
nothing is changed.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from circleops.system.snapshot import Snapshot

FOLD_RTOL = 1e-3  # relative to max |logit|: float64 rotations, fp32 weights
SEED = 0


@dataclass
class RotateReport:
    hidden: int = 0
    head_dim: int = 0
    layers: int = 0
    skipped: str | None = None
    fold_error: float = 0.0  # measured max |Δlogit| / max |logit| on the calibration text
    construction: str = ""
    matrix: torch.Tensor | None = None  # Q [hidden, hidden]: the rotated residual stream is h · Q
    # while folded in: each changed tensor and its snapshot, and the untied head's own clone
    saved: list = field(default_factory=list, repr=False)
    untied: torch.Tensor | None = field(default=None, repr=False)

    def summary_line(self) -> str:
        if self.layers:
            return (f"Hadamard rotation folded into the weights: residual stream ({self.hidden}, {self.construction}), "
                    f"v/o per head ({self.head_dim}), {self.layers} decoder layers, norm gammas folded into the "
                    f"next linears (fp32 logits moved {self.fold_error:.1e} relative)")
        return f"no rotation: {self.skipped}"


# --------------------------------------------------------------------------- Hadamard matrices

def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % p for p in range(2, int(n ** 0.5) + 1))


def _paley(q: int) -> torch.Tensor:
    """Paley construction I: a Hadamard matrix of order q + 1 for a prime q ≡ 3 (mod 4)."""
    residues = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0] + [1 if i in residues else -1 for i in range(1, q)], dtype=torch.float64)
    jac = torch.stack([chi[(torch.arange(q) - i) % q] for i in range(q)])  # Jacobsthal: Q[i, j] = chi(j - i)
    h = torch.ones(q + 1, q + 1, dtype=torch.float64)
    h[1:, 0] = -1
    h[1:, 1:] = jac + torch.eye(q, dtype=torch.float64)
    return h


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_construction(n: int) -> tuple[int, int] | None:
    """(2^k, m) with n = 2^k · m and m = 1 or m = q + 1 for a prime q ≡ 3 (mod 4): a Hadamard
    matrix of order n is then Sylvester(2^k) ⊗ Paley(q); None when there is no such split."""
    k = 1
    while n % k == 0:
        m = n // k
        if m == 1 or (m > 2 and _is_prime(m - 1) and (m - 1) % 4 == 3):
            return k, m
        k *= 2
    return None


def orthogonal(n: int, seed: int = SEED) -> tuple[torch.Tensor, str]:
    """An n x n orthogonal matrix (float64) and how it was built: a Hadamard matrix (scaled
    by 1/sqrt(n)) with its columns' signs randomized (seeded), or, for an n with no
    Hadamard construction here, a seeded random orthogonal matrix (QR of a Gaussian)."""
    gen = torch.Generator().manual_seed(seed)
    split = hadamard_construction(n)
    signs = torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1
    if split is None:
        q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r))[None, :], "random orthogonal"
    k, m = split
    h = _sylvester(k) if m == 1 else torch.kron(_sylvester(k), _paley(m - 1))
    how = f"Hadamard {k}" if m == 1 else f"Hadamard {k} ⊗ Paley {m}"
    return h / n ** 0.5 * signs[None, :], "randomized " + how


# --------------------------------------------------------------------------- the fold

def _llama_parts(model: torch.nn.Module) -> dict[str, Any] | None:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    embed, norm = getattr(inner, "embed_tokens", None), getattr(inner, "norm", None)
    head = getattr(model, "lm_head", None)
    if not isinstance(layers, torch.nn.ModuleList) or not isinstance(embed, torch.nn.Embedding) \
            or not isinstance(head, torch.nn.Linear) or head.bias is not None or not _plain_rmsnorm(norm):
        return None
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = [(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
                [(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")]
        if any(not isinstance(getattr(m, p, None), torch.nn.Linear) for m, p in names):
            return None
        if not (_plain_rmsnorm(getattr(layer, "input_layernorm", None))
                and _plain_rmsnorm(getattr(layer, "post_attention_layernorm", None))):
            return None
        # Gemma-style sandwich norms, q/k norms: the residual stream is not read only through the two norms
        if any(hasattr(layer, n) for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")) \
                or any(hasattr(attn, n) for n in ("q_norm", "k_norm")):
            return None
    return {"layers": layers, "embed": embed, "norm": norm, "head": head}


def _plain_rmsnorm(norm: Any) -> bool:
    name = type(norm).__name__
    return name.endswith("RMSNorm") and "Gemma" not in name and isinstance(getattr(norm, "weight", None),
                                                                            torch.nn.Parameter)


@contextlib.contextmanager
def rotated(model: torch.nn.Module, tokenizer: Any = None, seed: int = SEED) -> Iterator[RotateReport]:
    """Fold a Hadamard rotation of the residual stream into ``model`` (a Llama-shaped HF
    CausalLM, fp32) for the duration of the block; everything is restored on exit."""
    report = RotateReport()
    saved: list[tuple[torch.Tensor, Snapshot]] = []
    tie = parts = None
    try:
        parts = _llama_parts(model)
        if parts is None:
            report.skipped = ("not a Llama-shaped decoder (embedding, RMSNorm -> q/k/v/o, RMSNorm -> gate/up/down, "
                              "final RMSNorm, lm_head without bias)")
        elif any(p.dtype != torch.float32 for p in model.parameters()):
            report.skipped = "not an fp32 model"
        else:
            tie = _apply(model, parts, tokenizer, seed, report, saved)
        yield report
    finally:
        _restore(parts if report.layers else None, saved, tie)


def _apply(model, parts, tokenizer, seed, report, saved) -> Any:
    from circleops.quantize.importance import calibration_ids
    from circleops.system.memory import trim_heap

    ids = calibration_ids(model, tokenizer)
    before = _logits(model, ids) if ids is not None else None
    cfg = model.config
    hidden = parts["embed"].weight.shape[1]
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    q, how = orthogonal(hidden, seed)
    qh, _ = orthogonal(head_dim, seed + 1)
    head, embed = parts["head"], parts["embed"]
    tie = None
    if head.weight is embed.weight:  # the lm_head takes the final gamma: untie it (restored on exit)
        tie = head.weight
        head.weight = torch.nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
        report.untied = head.weight
    report.saved = saved

    def keep(t: torch.Tensor) -> None:
        # no clone of a weight its file still holds, nor of the untied head's own copy (dropped
        # when the tie is restored: a snapshot of it was 1.05 GB at the Llama-3.2-1B shape)
        if not any(t is p for p, _ in saved) and not (tie is not None and t is head.weight):
            saved.append((t, Snapshot(t)))

    def reads(lin: torch.nn.Linear, gamma: torch.Tensor) -> None:  # W ← W · diag(gamma) · Q
        keep(lin.weight)
        g = gamma.double()[None, :]
        by_rows(lin.weight, lambda w: (w * g) @ q)

    def writes(lin: torch.nn.Linear) -> None:  # W ← Qᵀ · W, b ← b · Q
        keep(lin.weight)
        by_columns(lin.weight, lambda w: q.T @ w)
        if lin.bias is not None:
            keep(lin.bias)
            lin.bias.copy_((lin.bias.double() @ q).to(lin.bias.dtype))

    with torch.no_grad():
        keep(embed.weight)
        by_rows(embed.weight, lambda w: w @ q)
        for layer in parts["layers"]:
            attn, mlp = layer.self_attn, layer.mlp
            for norm, lins in ((layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj)),
                               (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))):
                gamma = norm.weight.detach().clone()
                for lin in lins:
                    reads(lin, gamma)
                keep(norm.weight)
                norm.weight.fill_(1.0)
            writes(attn.o_proj)
            writes(mlp.down_proj)
            _rotate_heads(attn.v_proj, attn.o_proj, qh, head_dim, keep)
            report.layers += 1
            trim_heap()  # the layer's float64 temporaries, before the next layer's pile up beside them
        gamma = parts["norm"].weight.detach().clone()
        reads(head, gamma)
        keep(parts["norm"].weight)
        parts["norm"].weight.fill_(1.0)
    trim_heap()  # before the fold check's forward
    report.hidden, report.head_dim, report.construction = hidden, head_dim, how
    report.matrix = q
    if before is not None:
        after = _logits(model, ids)
        report.fold_error = fold_error(before, after)
        del before, after
        if not report.fold_error <= FOLD_RTOL:
            err = report.fold_error
            _restore(parts, saved, tie)
            saved.clear()
            report.layers = 0
            report.skipped = f"the fold changed the fp32 logits by {err:.2g} (relative): the model is not of the Llama shape"
            return None
    return tie


# rows of a weight rotated at a time: its float64 copy and product stay ~2 x 64 MB (the
# Llama-3.2-1B shape's embedding and lm_head, 128256 x 2048, whole: 2 x 2.1 GB of float64
# beside the model, its convert's peak at 2.5x the fp32 weights, issue 32)
ROTATE_ELEMENTS = 1 << 23


def by_rows(weight: torch.Tensor, f: Any) -> None:
    """``weight`` ← ``f(weight as float64)``, rounded back to its dtype, a block of rows at a
    time (``f`` maps each row on its own: a product on the right)."""
    rows = max(1, ROTATE_ELEMENTS // max(1, weight.shape[-1]))
    for i in range(0, weight.shape[0], rows):
        block = weight[i:i + rows]
        block.copy_(f(block.double()).to(weight.dtype))


def by_columns(weight: torch.Tensor, f: Any) -> None:
    """``weight`` ← ``f(weight as float64)``, rounded back to its dtype, a block of columns at
    a time (``f`` maps each column on its own: a product on the left). Whole, the 1B shape's
    down_proj was a float64 copy and product (2 x 134 MB) beside its rounding."""
    cols = max(1, ROTATE_ELEMENTS // max(1, weight.shape[0]))
    for i in range(0, weight.shape[1], cols):
        block = weight[:, i:i + cols]
        block.copy_(f(block.double()).to(weight.dtype))


def _rotate_heads(v_proj: torch.nn.Linear, o_proj: torch.nn.Linear, qh: torch.Tensor, head_dim: int, keep) -> None:
    """v's output per head · Qh, o_proj's input columns per head · Qh (the same Qh for every
    head, so a kv head shared by a group of query heads stays consistent)."""
    kv = v_proj.out_features // head_dim
    keep(v_proj.weight)
    wv = v_proj.weight.double().reshape(kv, head_dim, -1)
    v_proj.weight.copy_(torch.einsum("ji,hjk->hik", qh, wv).reshape(v_proj.weight.shape).to(v_proj.weight.dtype))
    if v_proj.bias is not None:
        keep(v_proj.bias)
        v_proj.bias.copy_((v_proj.bias.double().reshape(kv, head_dim) @ qh).reshape(-1).to(v_proj.bias.dtype))
    keep(o_proj.weight)
    wo = o_proj.weight.double().reshape(o_proj.out_features, -1, head_dim)
    o_proj.weight.copy_((wo @ qh).reshape(o_proj.weight.shape).to(o_proj.weight.dtype))


def release_unread(report: RotateReport, read: set[int]) -> int:
    """Give back the rotated copies of the weights nothing reads any more (``read``: the
    storages still read, by data pointer; what PT2E folded into integers is not), before the
    restore: a weight its file holds gets the file's values again now (its snapshot's
    restore, which the exit repeats), the untied head's clone is freed (its storage resized
    to nothing: a later read fails loudly; the exit ties the head again). The model computes
    nothing sensible until the exit, and nothing runs it. At the Llama-3.2-1B shape: the
    rotated embedding and the untied head, 2.1 GB through the lowering and verify (issue 32).
    The bytes given back."""
    released = 0
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    for param, snap in report.saved:
        if snap.from_file and ptr(param) not in read and not snap.done:
            snap.restore(param)
            released += param.numel() * param.element_size()
    if report.untied is not None and ptr(report.untied) not in read:
        storage = report.untied.untyped_storage()
        released += storage.nbytes()
        if storage.resizable():
            storage.resize_(0)
        else:  # a storage numpy has seen (GPTQ spills the head it rounds) cannot shrink: the parameter lets go of it
            report.untied.data = torch.empty(0, dtype=report.untied.dtype)
        report.untied = None
    return released


def _restore(parts, saved, tie) -> None:
    for param, original in saved:
        original.restore(param)
    if tie is not None and parts is not None:
        parts["head"].weight = tie


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits on ``ids`` as it computes them (fp32: the fold check's float64
    copies of them, and of their difference and its absolute value, were 4 x 131 MB at the
    Llama-3.2-1B shape's vocabulary on the 128 calibration tokens, issue 32)."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False)
    return (out.logits if hasattr(out, "logits") else out[0]).detach()


# logits compared at a time by fold_error: its float64 temporaries stay ~2 x 8 MB
FOLD_ELEMENTS = 1 << 20


def fold_error(before: torch.Tensor, after: torch.Tensor) -> float:
    """max |after - before| / max(max |before|, 1), the differences taken in float64 (the
    difference of two fp32 values is exact there) a block of FOLD_ELEMENTS at a time: the
    same figure as on whole float64 copies, without them."""
    b, a = before.reshape(-1), after.reshape(-1)
    worst = 0.0
    for i in range(0, b.numel(), FOLD_ELEMENTS):
        diff = float((a[i:i + FOLD_ELEMENTS].double() - b[i:i + FOLD_ELEMENTS].double()).abs().max())
        if diff != diff:  # NaN: the fold check fails, as on the whole tensors
            return diff
        worst = max(worst, diff)
    return worst / max(float(b.abs().max()), 1.0)

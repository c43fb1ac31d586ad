"""SmoothQuant folding for ``--quantize w8`` (onert's hybrid FULLY_CONNECTED).

onert quantizes each input row of a hybrid FULLY_CONNECTED with one int8 scale,
max|x_row| / 127: a few outlier input channels make that step coarse for all the others.
Per input channel j of a linear, with m_j = max|x_j|^alpha / max|W[:, j]|^(1 - alpha),
x' = x / m and W' = W * m compute the same product in fp32, with flatter rows x' (and
columns of W' that the per-output-channel int8 weight still holds well).

The 1/m is folded where it costs nothing, into what produces the linear's input, on the
torch model's own weights (restored afterwards: ``smoothed`` is a context manager):

* q/k/v (and gate/up): their input is an RMSNorm's output ``x * gamma``: gamma / m, and the
  columns of every sibling reading it * m (one m for the siblings: the max of their |W|);
* down_proj: its input is act(gate) * up: up_proj's weight rows / m (for w8 that is also
  its per-channel scale / m), down_proj's columns * m;
* o_proj and lm_head: not smoothed. o_proj's input (softmax(QK^T) V) could take the 1/m in
  v_proj's output rows, one m per kv head: measured on SmolLM2, worse at alpha 0.3 and equal
  at 0.4 (bench/README.md); lm_head is tied to the embedding table in most small models.

A decoder layer is smoothed when it has that shape (Llama-like: ``input_layernorm`` ->
``self_attn.{q,k,v}_proj``, ``post_attention_layernorm`` -> ``mlp.{gate,up}_proj``,
``mlp.down_proj``) with an RMSNorm computing ``weight * normalized`` (not Gemma's
``1 + weight``); the fold is then checked: the smoothed model's fp32 logits on the
calibration text must equal the original's within 1e-4 (relative), or nothing is smoothed.

The maxima come from one forward over the shipped calibration text
(``circleops.quantize.importance.input_absmax``, cached on disk like the importances).
``CIRCLEOPS_W8_SMOOTH``: an alpha to use instead of ``ALPHA``, or ``0`` / ``off`` to not
smooth (measured on SmolLM2 in bench/README.md, "bench/ggml.py with --quantize w8").
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from circleops.system.snapshot import Snapshot, restored_once_read

# measured on SmolLM2-135M (circleops check smollm2 --quantize w8), bench/README.md: perplexity
# +1.25 % on the whole text (0.3: +1.36 %, no smoothing +3.68 %); 0.2-0.25 are worse than none
ALPHA = 0.4
# a fold whose fp32 logits move more than this (relative to max |logit|) is not applied
FOLD_RTOL = 1e-4
_EPS = 1e-5


@dataclass
class SmoothReport:
    alpha: float | None
    linears: int = 0  # linears whose input columns were scaled
    layers: int = 0
    skipped: str | None = None  # why nothing was smoothed
    names: list[str] = field(default_factory=list)

    def summary_line(self) -> str:
        if self.linears:
            return (f"SmoothQuant (alpha {self.alpha:g}, maxima over the shipped calibration text): {self.linears} "
                    f"linears in {self.layers} decoder layers smoothed (q/k/v, gate/up via the norms, down_proj via "
                    "up_proj); o_proj and lm_head not")
        return f"no SmoothQuant: {self.skipped}"


def alpha_setting() -> float | None:
    """The alpha to smooth with: CIRCLEOPS_W8_SMOOTH (a number; 0 / off / no: None) or ALPHA."""
    value = os.environ.get("CIRCLEOPS_W8_SMOOTH", "").strip().lower()
    if not value:
        return ALPHA
    if value in ("0", "off", "no", "false", "none"):
        return None
    alpha = float(value)
    if not 0 < alpha < 1:
        raise ValueError(f"CIRCLEOPS_W8_SMOOTH must be an alpha in (0, 1) or 'off', got {value!r}")
    return alpha


def _is_rmsnorm(norm: Any, width: int) -> bool:
    name = type(norm).__name__
    weight = getattr(norm, "weight", None)
    return (name.endswith("RMSNorm") and "Gemma" not in name and isinstance(weight, torch.nn.Parameter)
            and tuple(weight.shape) == (width,) and getattr(norm, "bias", None) is None)


def _linear(module: Any, name: str) -> torch.nn.Linear | None:
    lin = getattr(module, name, None)
    return lin if isinstance(lin, torch.nn.Linear) else None


def find_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Per decoder layer of the Llama shape: {"layer": name, "attn": (norm, [q, k, v]),
    "mlp": (post norm, [gate, up]), "down": (up, down)} with module names for the linears."""
    names = {id(m): n for n, m in model.named_modules()}
    groups = []
    for lname, layer in model.named_modules():
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        n1, n2 = getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)
        if attn is None or mlp is None or n1 is None or n2 is None:
            continue
        qkv = [_linear(attn, p) for p in ("q_proj", "k_proj", "v_proj")]
        gate, up, down = (_linear(mlp, p) for p in ("gate_proj", "up_proj", "down_proj"))
        if any(x is None for x in (*qkv, gate, up, down)) or not callable(getattr(mlp, "act_fn", None)):
            continue
        if any(x.bias is not None for x in (gate, up)):  # a bias on up would need dividing too: keep it simple
            continue
        width = qkv[0].in_features
        if not (_is_rmsnorm(n1, width) and _is_rmsnorm(n2, gate.in_features)):
            continue
        if up.out_features != down.in_features or gate.out_features != up.out_features:
            continue
        groups.append({"layer": lname, "attn": (n1, [(names[id(x)], x) for x in qkv]),
                       "mlp": (n2, [(names[id(gate)], gate), (names[id(up)], up)]),
                       "down": ((names[id(up)], up), (names[id(down)], down))})
    return groups


def scales(xmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """m = max|x|^alpha / max|W[:, j]|^(1 - alpha) per input channel j (W: the siblings' weights,
    max over all of them); 1 where a maximum is 0 (a channel never used, or a zero column)."""
    wmax = torch.stack([w.detach().abs().amax(0) for w in weights]).amax(0).to(torch.float64)
    x = xmax.to(torch.float64)
    m = x.clamp_min(_EPS) ** alpha / wmax.clamp_min(_EPS) ** (1 - alpha)
    m = torch.where((x > 0) & (wmax > 0) & torch.isfinite(m), m, torch.ones_like(m))
    return m.to(torch.float32)


@contextlib.contextmanager
def smoothed(model: torch.nn.Module, example_args: Any = (), tokenizer: Any = None,
             alpha: float | None | str = "default") -> Iterator[SmoothReport]:
    """Fold SmoothQuant scales into ``model``'s weights (in place, same storage: the export and
    the graph point at them) for the duration of the block; the weights are restored bit for
    bit on exit. Yields the SmoothReport (``linears == 0``: nothing was changed).

    Inside, each folded linear weight is restored as soon as the quantizer has its blocks
    (circleops.system.snapshot.restore_read): the file holds the blocks, and the reference
    on the file's weights decodes them, so no one reads the folded fp32 values again (the
    norms' folded gammas stay: the graph holds them as they are)."""
    if alpha == "default":
        alpha = alpha_setting()
    report = SmoothReport(alpha)
    saved: list[tuple[torch.Tensor, Snapshot]] = []
    try:
        if alpha is None:
            report.skipped = "turned off (CIRCLEOPS_W8_SMOOTH=off)"
        else:
            _apply(model, example_args, tokenizer, float(alpha), report, saved)
        with restored_once_read((t, snap) for t, snap in saved if t.dim() == 2):
            yield report
    finally:
        for param, original in saved:
            if not original.done:
                original.restore(param)


def _apply(model, example_args, tokenizer, alpha, report, saved) -> None:
    from circleops.quantize.importance import calibration_ids, input_absmax

    groups = find_groups(model)
    if not groups:
        report.skipped = "no decoder layer of the Llama shape (RMSNorm -> q/k/v, gate/up; up -> down_proj)"
        return
    ids = calibration_ids(model, tokenizer)
    if ids is None:
        report.skipped = "not a causal LM (no calibration text to take the maxima over)"
        return
    params = [p for p in model.parameters()]
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in params):
        report.skipped = "not an fp32 CPU model"
        return
    xmax = input_absmax(model, example_args, tokenizer)
    before = _logits(model, ids)

    def keep(t: torch.Tensor) -> None:
        if not any(t is p for p, _ in saved):
            saved.append((t, Snapshot(t)))  # no clone of a weight its file still holds

    with torch.no_grad():
        for g in groups:
            done = 0
            for norm, lins in (g["attn"], g["mlp"]):
                first = lins[0][0]
                if first not in xmax:
                    continue
                m = scales(xmax[first], [lin.weight for _, lin in lins], alpha)
                keep(norm.weight)
                norm.weight.div_(m)
                for name, lin in lins:
                    keep(lin.weight)
                    lin.weight.mul_(m[None, :])
                    report.names.append(name)
                done += len(lins)
            (_, up), (dname, down) = g["down"]
            if dname in xmax:
                m = scales(xmax[dname], [down.weight], alpha)
                keep(up.weight)
                keep(down.weight)
                up.weight.div_(m[:, None])
                down.weight.mul_(m[None, :])
                report.names.append(dname)
                done += 1
            report.linears += done
            report.layers += bool(done)
    after = _logits(model, ids)
    err = float((after - before).abs().max()) / max(float(before.abs().max()), 1.0)
    if not err <= FOLD_RTOL:
        for param, original in saved:
            original.restore(param)
        saved.clear()
        report.linears = report.layers = 0
        report.names.clear()
        report.skipped = f"the fold changed the fp32 logits by {err:.2g} (relative): the layers are not of the Llama shape"


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from circleops.quantize.ggml import one_thread

    # the model's own attention settings: both sides of the comparison run the same way
    with torch.no_grad(), one_thread():
        out = model(input_ids=ids, use_cache=False)
    return (out.logits if hasattr(out, "logits") else out[0]).detach().to(torch.float64)

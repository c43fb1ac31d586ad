"""Mixed precision chosen by measurement: which ops of a uint8 graph get int16 activations.

After calibration every activation observer of the prepared (PT2E) module knows the uint8
scale and zero point its tensor will get. ``tensor_sqnr`` runs the calibration samples once
more and measures, per observed tensor, the SQNR of that uint8 rounding alone, per token
(row) and averaged: -10·log10(mean over rows of Σ(x - q(x))² / Σx²). A tensor with a wide
range and most of its values near zero (an outlier channel, the gate·up product of an MLP,
the tokens beside an attention sink with a huge norm) scores low. ``choose_int16`` then gives
int16 to the ops around the worst tensors — the op that writes the tensor and every op that
reads it, so the tensor is int16 on every edge — until every tensor left in uint8 scores at
least ``min_db`` or ``budget`` of the ops are int16.

    q = make_quantizer("uint8"); prepared = prepare_pt2e(gm, q); calibrate(prepared)
    scores = tensor_sqnr(prepared, samples)
    names = choose_int16(scores, min_db=..., budget=...)
    for n in names: q2.set_node_name(n, "int16")      # a fresh quantizer, prepared again
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch


@dataclass
class TensorScore:
    """One observed activation tensor: the node that writes it, the ops that read it (node
    names of the exported graph) and its uint8 rounding SQNR over the samples."""

    producer: str
    consumers: list[str]
    sqnr_db: float
    module: str = ""  # the innermost module the producer was traced in (for reports)
    op: str = ""


@dataclass
class MixedReport:
    """What ``choose_int16`` picked and why (recorded in the file's metadata)."""

    min_db: float
    budget: float
    ops: int = 0  # annotated ops of the graph
    int16_ops: list[str] = field(default_factory=list)
    worst_db_left: float = math.inf  # the lowest tensor SQNR still in uint8
    tensors: int = 0

    def summary_line(self) -> str:
        share = len(self.int16_ops) / max(self.ops, 1)
        return (f"mixed precision by measured sensitivity: {len(self.int16_ops)} of {self.ops} ops int16 "
                f"({share:.0%}; uint8 rounding SQNR of each activation, target >= {self.min_db:g} dB, budget "
                f"{self.budget:.0%}); the worst uint8 tensor left: {self.worst_db_left:.1f} dB")


def _observers(prepared: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, Any]]:
    from torchao.quantization.pt2e import ObserverBase

    out = []
    for node in prepared.graph.nodes:
        if node.op != "call_module":
            continue
        obs = getattr(prepared, str(node.target), None)
        if not isinstance(obs, ObserverBase) or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        src = node.args[0]
        # activations only: weights are constants (get_attr) and per channel
        if src.op == "get_attr" or getattr(obs, "qscheme", None) not in (torch.per_tensor_affine,
                                                                         torch.per_tensor_symmetric):
            continue
        if getattr(obs, "dtype", None) != torch.uint8:
            continue
        out.append((node, obs))
    return out


def _real_node(node: torch.fx.Node) -> torch.fx.Node:
    """The op behind observers (an observer node's input, recursively)."""
    while node.op == "call_module" and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _readers(node: torch.fx.Node) -> list[str]:
    """The ops that read ``node``'s value, looking through the observers between them."""
    names = []
    for user in node.users:
        if user.op == "call_module":
            names += _readers(user)
        elif user.op == "call_function":
            names.append(user.name)
    return names


# elements of one block of rows tensor_sqnr rounds at a time (float64: 16 MB per temporary)
SQNR_BLOCK = 1 << 21


def tensor_sqnr(prepared: torch.fx.GraphModule, samples: Sequence[Sequence[Any]]) -> list[TensorScore]:
    """Per uint8 activation observer of a calibrated ``prepared`` module, the SQNR of rounding
    its tensor to the observer's uint8 grid over ``samples``, worst first."""
    observers = _observers(prepared)
    sums: dict[str, list[float]] = {}
    hooks = []

    def hook_for(key: str, obs: Any):
        scale, zp = (t.detach() for t in obs.calculate_qparams())
        scale, zp = float(scale.reshape(-1)[0]), int(zp.reshape(-1)[0])

        def hook(module, args, output):
            x = args[0].detach()
            # per token (row): one token with a huge norm (an attention sink) must not hide
            # that the others got no levels left
            rows = x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.reshape(1, -1)
            # by blocks of rows: an observer an op's output shares with its input (the embedding's
            # gather) also sees the whole table, 128256 x 2048 at 1B, whose float64 temporaries were
            # 8 GB at once (uint8 --int16 auto's peak, bench/results/72); each row's ratio is the
            # same float64 either way, and they are summed as one vector as before
            step = max(1, SQNR_BLOCK // max(1, rows.shape[-1]))
            kept, ratios = 0.0, []
            for start in range(0, rows.shape[0], step):
                block = rows[start:start + step].to(torch.float64)
                q = torch.clamp(torch.round(block / scale) + zp, obs.quant_min, obs.quant_max)
                err = (q - zp) * scale - block
                signal = block.pow(2).sum(-1)
                keep = signal > 0
                kept += float(keep.sum())
                ratios.append(err.pow(2).sum(-1)[keep] / signal[keep])
            acc = sums.setdefault(key, [0.0, 0.0])
            acc[0] += kept
            acc[1] += float(torch.cat(ratios).sum())
        return hook

    for node, obs in observers:
        hooks.append(obs.register_forward_hook(hook_for(node.name, obs)))
    try:
        with torch.no_grad():
            for args in samples:
                prepared(*args)
    finally:
        for h in hooks:
            h.remove()
    scores: dict[str, TensorScore] = {}
    for node, _ in observers:
        count, relative = sums.get(node.name, (0.0, 0.0))
        if count == 0:
            continue
        src = _real_node(node)
        db = math.inf if relative == 0 else -10 * math.log10(relative / count)
        prev = scores.get(src.name)
        if prev is not None and prev.sqnr_db <= db:
            continue
        stack = list(src.meta.get("nn_module_stack", {}).values())
        module = stack[-1][0] if stack else ""
        scores[src.name] = TensorScore(src.name, _readers(src), db, module.replace("L['self'].", ""),
                                       str(getattr(src.target, "__name__", src.target)))
    return sorted(scores.values(), key=lambda s: s.sqnr_db)


def annotated_ops(prepared: torch.fx.GraphModule) -> int:
    """How many ops of the prepared graph carry a quantization annotation."""
    return sum(1 for n in prepared.graph.nodes if n.op == "call_function" and "quantization_annotation" in n.meta)


def choose_int16(scores: Iterable[TensorScore], ops: int, *, min_db: float, budget: float,
                 known: set[str] | None = None) -> MixedReport:
    """The ops to give int16 activations: around the worst-scoring tensors first, until the
    worst tensor left in uint8 scores ``min_db`` or the int16 ops reach ``budget`` (a
    fraction of ``ops``). ``known``: node names that exist in the graph to annotate (others,
    e.g. placeholders, are skipped)."""
    report = MixedReport(min_db=min_db, budget=budget, ops=ops)
    chosen: list[str] = []
    limit = int(budget * ops)
    scores = list(scores)
    report.tensors = len(scores)
    for score in scores:
        if score.sqnr_db >= min_db:
            report.worst_db_left = score.sqnr_db
            break
        names = [n for n in [score.producer, *score.consumers] if n not in chosen and (known is None or n in known)]
        if len(chosen) + len(names) > limit:
            report.worst_db_left = score.sqnr_db
            break
        chosen += names
    report.int16_ops = chosen
    return report

"""The numerics report: per-layer error and greedy agreement per norm policy.

    report = circleops.tools.precision.check(model, tokenizer, dtype="fp16")
    print(report.table())
    report.to_json("check.json")
    report.plot("check.png")          # needs matplotlib (the `plot` extra)
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from circleops.errors import CircleOpsError, OutputError


@dataclass
class PolicyResult:
    """One norm policy's file, run by the reference interpreter, against the fp32 model.

    ``layer_max_abs[i]``: max |h_i - h_i(fp32)| over every position and channel of decoder
    layer i's output (inf when the file's value is inf or NaN); ``layer_rel`` the same
    divided by max |h_i(fp32)|. ``agreement``: how many of the N greedy tokens equal fp32's
    before the first divergence (``first_divergence``: its index, None if all N agree).
    ``generated``: the tokens greedy generation with this file produces, up to and including
    the first divergent one. ``predicted``: the file's greedy choice at each of the N
    positions of the fp32 text (teacher-forced).
    """

    name: str
    description: str
    path: str
    ops: dict[str, int]  # opcode -> count in the written file
    layer_max_abs: list[float]
    layer_rel: list[float]
    layer_nonfinite: list[int]  # inf/NaN values in each layer's output
    logits_max_abs: float
    logits_nonfinite: int
    agreement: int
    first_divergence: int | None
    generated: list[int]
    predicted: list[int]
    eos_predicted: int  # how many of ``predicted`` are end-of-text tokens
    generated_text: str | None = None
    predicted_text: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # lower, write, run

    @property
    def nonfinite(self) -> int:
        return sum(self.layer_nonfinite) + self.logits_nonfinite


@dataclass
class CheckReport:
    """Every policy's result for one model, dtype and prompt."""

    source: str
    dtype: str
    prompt: str | None
    prompt_ids: list[int]
    new_tokens: int
    reference_tokens: list[int]  # fp32 greedy, N tokens (end-of-text is not special)
    reference_text: str | None
    layer_rms: list[float]  # fp32: max over positions of each layer output's RMS
    layer_max: list[float]  # fp32: max |h| of each layer output
    eos_ids: list[int]
    policies: list[PolicyResult] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.layer_rms)

    def result(self, name: str) -> PolicyResult:
        for r in self.policies:
            if r.name == name:
                return r
        raise KeyError(name)

    # ------------------------------------------------------------------ text
    def table(self) -> str:
        """The report as text: the error table (layers x policies), then agreement."""
        names = [r.name for r in self.policies]
        width = max(12, *(len(n) + 2 for n in names))
        head = f"{'layer':>5}  {'fp32 RMS':>9}  {'fp32 max':>9}" + "".join(f"{n:>{width}}" for n in names)
        lines = [
            f"circleops check: {self.source}, {self.dtype}, {self.num_layers} layers, "
            f"prompt {self.prompt!r}" if self.prompt is not None else
            f"circleops check: {self.source}, {self.dtype}, {self.num_layers} layers, prompt ids {self.prompt_ids}",
            "",
            f"max |error| of each decoder layer's output against the fp32 model "
            f"({len(self.prompt_ids) + self.new_tokens - 1} positions):",
            head,
            "-" * len(head),
        ]
        for i in range(self.num_layers):
            row = f"{i:>5}  {_num(self.layer_rms[i]):>9}  {_num(self.layer_max[i]):>9}"
            row += "".join(f"{_num(r.layer_max_abs[i]):>{width}}" for r in self.policies)
            lines.append(row)
        lines.append(f"{'logits':>5}  {'':>9}  {'':>9}" + "".join(f"{_num(r.logits_max_abs):>{width}}"
                                                            for r in self.policies))
        lines += ["", f"greedy generation, {self.new_tokens} tokens: tokens equal to fp32's before the first divergence",
                  f"  {'fp32':<12} {_text(self.reference_text, self.reference_tokens)}"]
        for r in self.policies:
            where = "all agree" if r.first_divergence is None else f"diverges at token {r.first_divergence}"
            eos = f", end-of-text predicted at {r.eos_predicted}/{self.new_tokens} positions" if r.eos_predicted else ""
            bad = f", {r.nonfinite} inf/NaN values" if r.nonfinite else ""
            lines.append(f"  {r.name:<12} {r.agreement:>3}/{self.new_tokens} ({where}{eos}{bad}){_norm_ops(r.ops)}")
            if r.first_divergence is not None:
                lines.append(f"  {'':<12} generates {_text(r.generated_text, r.generated)}")
                lines.append(f"  {'':<12} predicts  {_text(r.predicted_text, r.predicted)}  (along the fp32 text)")
        return "\n".join(lines)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: inf/NaN errors become null (the *_nonfinite counts say why)."""
        d = asdict(self)
        for p in d["policies"]:
            p["layer_max_abs"] = [_finite(v) for v in p["layer_max_abs"]]
            p["layer_rel"] = [_finite(v) for v in p["layer_rel"]]
            p["logits_max_abs"] = _finite(p["logits_max_abs"])
            p["seconds"] = {k: round(v, 3) for k, v in p["seconds"].items()}
        d["timings"] = {k: round(v, 3) for k, v in self.timings.items()}
        return d

    def to_json(self, path: str | os.PathLike) -> None:
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(self.to_dict(), f, indent=2, allow_nan=False)
                f.write("\n")
        except OSError as err:
            raise OutputError(f"cannot write the JSON report {path}: {err.strerror}. Choose another --json path.") from None

    # ------------------------------------------------------------------ plot
    def plot(self, path: str | os.PathLike) -> None:
        """A PNG: max |error| per layer (log scale), one line per policy; inf/NaN drawn at the top."""
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        layers = list(range(self.num_layers))
        finite = [v for r in self.policies for v in r.layer_max_abs if math.isfinite(v) and v > 0]
        top = max(finite) * 10 if finite else 1.0
        floor = min(finite) / 10 if finite else 1e-6
        styles = [("-", "o"), ("--", "s"), ("-.", "^"), (":", "D")]  # equal curves (fused = island) stay visible
        for k, r in enumerate(self.policies):
            ys = [v if math.isfinite(v) else top for v in r.layer_max_abs]
            ys = [max(v, floor) for v in ys]
            label = f"{r.name} ({r.agreement}/{self.new_tokens} tokens agree)"
            linestyle, marker = styles[k % len(styles)]
            line, = ax.plot(layers, ys, linestyle=linestyle, marker=marker, markersize=4, markerfacecolor="none",
                            label=label)
            bad = [i for i, v in enumerate(r.layer_max_abs) if not math.isfinite(v)]
            if bad:
                ax.scatter(bad, [top] * len(bad), marker="x", color=line.get_color(), zorder=3)
        ax.set_yscale("log")
        ax.set_xlabel("decoder layer")
        ax.set_ylabel(f"max |{self.dtype} - fp32| of the layer output")
        ax.set_title(f"{self.source}, {self.dtype}: error per layer per norm policy", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        try:
            fig.savefig(os.fspath(path), format="png")
        except OSError as err:
            raise OutputError(f"cannot write the plot {path}: {err.strerror}. Choose another --plot path.") from None
        finally:
            plt.close(fig)


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend; CircleOpsError naming the extra when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise CircleOpsError("--plot needs matplotlib, which is not installed: pip install 'circleops[plot]' "
                             "(or pip install matplotlib), or leave out --plot.") from None
    return plt


def _num(v: float) -> str:
    if not math.isfinite(v):
        return "inf" if v == math.inf else "nan"
    return f"{v:.3g}" if 1e-3 <= abs(v) < 1e4 or v == 0 else f"{v:.2e}"


def _norm_ops(ops: dict[str, int]) -> str:
    """What the file's norms are made of, in a few opcodes."""
    shown = [f"{ops[k]} {k}" for k in ("RMS_NORM", "CAST", "RSQRT", "MEAN", "POW", "SQUARE") if ops.get(k)]
    return f"  [{', '.join(shown)}]" if shown else ""


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _text(text: str | None, ids: list[int]) -> str:
    return repr(text) if text is not None else str(ids)

"""What the package step wrote (:class:`GraphsReport`): one report type for every recipe,
printed by ``circleops convert --graphs`` and written by its ``--report``."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from circleops.targets import PROFILES


def io_entry(name: str, tensor: Any) -> tuple[str, list[int], str]:
    """(name, shape, dtype) of one graph input or output."""
    return name, list(tensor.shape), tensor.dtype


@dataclass
class GraphInfo:
    """One written graph: its file (and signature), ops, bytes, inputs and outputs."""

    name: str
    file: str
    signature: str | None
    ops: dict[str, int]
    file_size: int
    inputs: list[tuple[str, list[int], str]]
    outputs: list[tuple[str, list[int], str]]
    max_abs_error: float | None = None  # the numeric comparison with torch (--verify)
    part_files: list[str] | None = None  # a split graph's files, one per layer range (circleops.package.split)


@dataclass
class GraphsReport:
    """What the package step (circleops.package.step.run) wrote for a recipe."""

    directory: str
    target: str
    dtype: str
    graphs: dict[str, GraphInfo]
    manifest: Any  # circleops.package.manifest.Manifest (or a speech manifest)
    timings: dict[str, float] = field(default_factory=dict)
    verify_runtime: str | None = None  # the runtime the written graphs were compared on (--verify)
    verify_note: str | None = None  # why that is not the target's own runtime
    tolerance: float | None = None
    noise_floor: float | None = None  # the largest of the model's own noise floors verify measured (quantized)
    quality: Any = None  # a quantized file against fp32 (circleops.quantize.quality.Quality), measured with --verify
    source: str = ""
    quantization: Any = None  # circleops.quantize.weights.QuantReport when quantize= was given
    attention: str | None = None  # which layers' attention is decomposed, and why (DecoderWithCache.attention_note)
    kind: str = "text"  # the recipe's kind: its manifest section (text, vision, speech)
    manifest_line: str = ""  # what manifest.json records, in the recipe's words
    next_args: str | None = None  # the arguments of the `circleops generate DIR ...` that runs the graphs
    compared: str = "logit"  # what the comparison measures ("logit" error; "" for any output)
    # integer graphs: graph -> the converted (fake-quantized) torch module the file was verified
    # against (circleops.recipes.llm_integer.torch_generator generates with them); not serialized
    converted: Any = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        """The report as plain data (``circleops convert --graphs --report``)."""
        return {"directory": self.directory, "target": self.target, "dtype": self.dtype, "source": self.source,
                "kind": self.kind,
                "quantization": self.quantization.to_dict() if self.quantization is not None else None,
                "graphs": {g: asdict(info) for g, info in self.graphs.items()},
                "manifest": self.manifest.to_json() if self.manifest else None,
                "attention": self.attention, "verify_runtime": self.verify_runtime, "verify_note": self.verify_note,
                "tolerance": self.tolerance, "noise_floor": self.noise_floor,
                "quality": self.quality.to_dict() if self.quality is not None else None, "timings": {k: round(v, 3) for k, v in self.timings.items()}}

    @property
    def one_file_per_graph(self) -> bool:
        return len({g.file for g in self.graphs.values()}) > 1

    def summary(self) -> str:
        """The lines ``circleops convert --graphs`` prints."""
        lines = [f"circleops: wrote {len(self.graphs)} graph(s) of {self.source or 'the model'} to {self.directory}/ "
                 f"(target {self.target}, {self.dtype})", *self._file_lines()]
        width = max([8, *(len(g) for g in self.graphs)])
        for g in self.graphs.values():
            where = g.file + (f" [signature {g.signature}]" if g.signature else "")
            ops = ", ".join(f"{k} {v}" for k, v in sorted(g.ops.items(), key=lambda kv: -kv[1])
                            if k in ("RMS_NORM", "ROPE", "ATTENTION") or "composite" in k.lower() or "(" in k)
            lines.append(f"  {g.name:{width}s} {where}  {_mb(g.file_size)}  in: {_io(g.inputs)}  out: {_io(g.outputs)}")
            lines.append(f"  {'':{width}s} {sum(g.ops.values())} ops" + (f"; fused: {ops}" if ops else ""))
        if self.attention:
            lines.append(f"  attention: {self.attention}")
        if self.quantization is not None:
            lines += [f"  {'quantize:' if k == 0 else '':9} {line}"
                      for k, line in enumerate(self.quantization.summary_lines())]
        if self.manifest_line:
            lines.append(f"  manifest.json: {self.manifest_line}")
        if self.verify_runtime:
            errs = ", ".join(f"{g.name} {g.max_abs_error:.3g}" for g in self.graphs.values() if g.max_abs_error is not None)
            what = f"max abs {self.compared} error" if self.compared else "max abs error"
            lines.append(f"  verify ({self.verify_runtime}, against the model's own forward): {what} "
                         f"{errs} (tolerance {self.tolerance:.3g}{self._floor_words()}): passed")
            if self.verify_note:
                lines.append(f"  note: {self.verify_note}")
        if self.quality is not None and self.converted is not None:
            lines.append(f"  quality against fp32 (torch's quantized prefill and decode, teacher-forced on a hold-out "
                         f"text; not a verify bound): {self.quality.line()}")
        elif self.quality is not None:
            lines.append(f"  quality against fp32 (torch on the file's weights and {self.verify_runtime}'s input "
                         f"rounding, the verify tokens; not a verify bound): {self.quality.line()}; perplexity on "
                         f"text: circleops check MODEL --quantize {self.quantization.format}")
        lines.append("  time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.timings.items())
                     + f", total {sum(self.timings.values()):.1f} s")
        if self.next_args is not None:
            hint = "; for onert, convert with --target onert" if self.target == "circle" else ""
            lines.append(f"  next: circleops generate {self.directory} {self.next_args} (runtime "
                         f"{PROFILES[self.target].runtime}{hint})")
        return "\n".join(lines)

    def _floor_words(self) -> str:
        """How the noise floor entered the verify bound, or nothing when it was not measured."""
        from circleops.quantize.weights import NOISE_FLOORS

        if self.noise_floor is None:
            return ""
        how = ("every integer op rounds stochastically instead of to nearest (unbiased, at most one step)" if self.converted is not None else
               "every input the runtime rounds moves by 16 fp32 ulps")
        return (f" relative, or {NOISE_FLOORS:g} x the model's own noise floor {self.noise_floor:.3g}: how far its "
                f"outputs move when {how}")

    def _file_lines(self) -> list[str]:
        parts = getattr(self.manifest, "parts", None)
        lines = []
        if parts:
            # "head": the tied table is the last file's lm_head only (circleops.package.split)
            table = ("the last holds the lm_head, whose rows are the first's embeddings (the tied table stored once)"
                     if getattr(self.manifest, "part_embedding", None) == "head" else
                     "the first holds the embedding table, the last the lm_head")
            lines.append(f"  split: {len(parts)} consecutive files per graph (layers "
                         f"{', '.join(f'{a}-{b - 1}' for a, b in parts)}): each within the target's file limit; "
                         f"{table}; the generator passes the hidden state")
        elif getattr(self.manifest, "part_embedding", None) == "head":
            lines.append("  embeddings: each graph takes the token ids' rows (hidden_in), which the generator reads "
                         "from its lm_head's quantized weight (dequantized): the tied table is not stored beside it")
        if self.one_file_per_graph:
            lines.append("  files: one per graph: onert 0.1.0 runs only subgraph 0 of a file and cannot select a "
                         "signature, so the weights are stored in each file")
        else:
            lines.append("  files: one file, a signature per graph, weights shared between them")
        return lines


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _io(items: list[tuple[str, list[int], str]]) -> str:
    def is_row(name: str) -> bool:
        return name.startswith(("k_new_", "v_new_"))

    caches = [x for x in items if "cache" in x[0]]
    rows = [x for x in items if is_row(x[0])]
    cross = [x for x in items if x[0].startswith("cross_")]  # an encoder-decoder's cross-attention K/V
    rest = [f"{n} {s}" for n, s, _ in items if "cache" not in n and not is_row(n) and not n.startswith("cross_")]
    if caches:
        rest.append(f"{len(caches)} caches {caches[0][1]}")
    if rows:
        rest.append(f"{len(rows)} new cache rows {rows[0][1]}")
    if cross:
        rest.append(f"{len(cross)} cross-attention K/V {cross[0][1]}")
    return ", ".join(rest)

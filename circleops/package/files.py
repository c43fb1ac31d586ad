"""The files a set of graphs is written as, per target, and their writing.

* One file with a signature per graph, whose subgraphs share every weight buffer (targets
  circle and tflite: the reference interpreter and LiteRT run any signature): ``model.circle``.
* A file per graph, each with its weights (target onert: onert 0.1.0 runs subgraph 0 of a
  file and its Python API cannot select a signature, measured in tests/generate/test_graphs.py):
  ``prefill.circle``, ``decode.circle``.
* Target onert with onert 0.2.0.dev's C API (``nnfw_set_signature_run``): one file again, the
  manifest's ``signature_api`` "nnfw-c" (circleops.runtime.onert_c).
* A model past one file's limit (onert: 2 GiB): each graph as consecutive files of a layer range
  each (circleops.package.split), ``decode.part1.circle`` or, in one file per part, ``part1.circle``.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from circleops.errors import TargetError
from circleops.package import split
from circleops.package.report import GraphInfo, io_entry


@dataclass(frozen=True)
class FilePlan:
    """Which file holds each graph (and each part of a split graph)."""

    fmt: str  # the target's file format: "circle" or "tflite"
    per_graph: bool  # a file (or a part's file) per graph, else one file with a signature per graph
    signature_api: str | None = None  # "nnfw-c": onert selects the one file's signatures through its C API
    parts: tuple[tuple[int, int], ...] = ()  # a split model: each file's layer range (() when not split)
    max_file_bytes: int | None = None  # the most one file may hold (the parts are planned within it)

    def file(self, graph: str, part: int | None = None) -> str:
        """The file of ``graph`` (of its part ``part`` when split)."""
        if part is not None:
            return split.part_file_name(graph, part, self.fmt, self.per_graph)
        if self.parts:
            return split.part_file_name(graph, 0, self.fmt, self.per_graph)
        return f"{graph}.{self.fmt}" if self.per_graph else f"model.{self.fmt}"

    def signature(self, graph: str) -> str | None:
        """The signature to run ``graph`` by in its file (None: the file's main subgraph)."""
        return None if self.per_graph else graph


def file_limit(profile: Any, max_file_bytes: int | None) -> int | None:
    """The most one file may hold: ``max_file_bytes``, else 2 GiB where the target's runtime
    reads no weights after the flatbuffer (onert), else no limit (None)."""
    from circleops.targets import FLATBUFFER_LIMIT

    if max_file_bytes is None:
        return None if profile.weights_after_flatbuffer else FLATBUFFER_LIMIT
    if isinstance(max_file_bytes, bool) or not isinstance(max_file_bytes, int) or max_file_bytes < 1:
        raise TargetError(f"max_file_bytes must be a positive whole number of bytes; got {max_file_bytes!r}.")
    return max_file_bytes


def signature_files(profile: Any, wanted: bool | None) -> bool:
    """Whether a target that writes a file per graph (onert) writes one file with a signature
    per graph instead: ``wanted``, or (None) when the installed onert selects signatures through
    its C API (circleops.runtime.onert_c: onert 0.2.0.dev; 0.1.0 cannot)."""
    if not profile.one_file_per_graph or profile.runtime != "onert" or wanted is False:
        return False
    if wanted:
        return True
    from circleops.runtime import onert_c

    return onert_c.available()


def plan_files(profile: Any, onert_signatures: bool | None, max_file_bytes: int | None,
               layer_bytes: split.PartBytes | None) -> FilePlan:
    """The file plan of a target: a file per graph or one with signatures, and the layer
    ranges of a split model (``layer_bytes``: its parts' weights, None: it cannot be split)
    past the file limit; from the sizes alone, before any work."""
    per_graph = profile.one_file_per_graph and not signature_files(profile, onert_signatures)
    limit = file_limit(profile, max_file_bytes)
    parts = split.plan_parts(layer_bytes, limit) if layer_bytes is not None else []
    return FilePlan(profile.format, per_graph,
                    "nnfw-c" if profile.one_file_per_graph and not per_graph else None,
                    tuple(parts) if len(parts) > 1 else (), limit)


def integer_parts_message(quantize: str, target: str, max_file_bytes: int | None) -> str:
    """The refusal of integer --graphs (one file of every layer) past the file limit."""
    return (f"--quantize {quantize} --graphs writes one file of every layer: this model's weights pass "
            f"--max-file-bytes {max_file_bytes}; raise it (target {target} has no size limit of its own).")


def refuse_plan_from_sizes(model: str | None, config: str | None, target: str, quantize: str | None,
                           max_file_bytes: int | None) -> None:
    """The split plan's refusals (a layer too large for one file; integer graphs past the
    limit), decided from an HF directory's safetensors headers or a dense ``config``'s sizes
    (circleops.sources.sizes.dense_shapes) before the model is loaded or anything imports
    torch: milliseconds, where the plan on the loaded model came after the load (and, from
    the CLI, torch's import). Nothing is refused that the plan on the model would accept
    (split.named_part_bytes is its lower bound); what this cannot read is left to it."""
    from circleops.errors import ModelLoadError
    from circleops.inputs.user_files import read_safetensors_header
    from circleops.quantize import INTEGER_FORMATS
    from circleops.sources import sizes
    from circleops.sources.config_json import read_config_dict
    from circleops.targets import PROFILES

    limit = file_limit(PROFILES[target], max_file_bytes)
    path = Path(config) if config is not None else Path(model) / "config.json" if model is not None else None
    if limit is None or path is None or not path.is_file():
        return
    cfg = read_config_dict(path)
    if isinstance(cfg.get("text_config"), dict):
        return  # a VLM: its recipe is never split
    if config is not None:
        shapes = sizes.dense_shapes(cfg)
    else:
        shapes = {name: info["shape"] for f in sizes.safetensors_files(Path(model))
                  for name, info in read_safetensors_header(f, error=ModelLoadError).items()
                  if "rotary_emb." not in name}  # RoPE buffers some checkpoints hold: no parameter
    if not shapes:
        return
    tied = "lm_head.weight" not in shapes or bool(cfg.get("tie_word_embeddings", sizes.tied_default(cfg)))
    part_sizes = split.named_part_bytes(shapes, tied, quantize, target)
    if part_sizes is None:
        return
    parts = split.plan_parts(part_sizes, limit)
    if quantize in INTEGER_FORMATS and len(parts) > 1:
        raise TargetError(integer_parts_message(quantize, target, max_file_bytes))


def merge_models(models: Mapping[str, Any]) -> Any:
    """One ir.Model holding every graph's subgraphs, one signature per graph.

    Constants keep their tensors (the model's parameters), so the writer stores each
    weight once and both subgraphs point at the same buffer.
    """
    from circleops import ir

    merged = ir.Model(description=" + ".join(f"{g}" for g in models) + " (circleops)")
    for graph, model in models.items():
        offset = len(merged.subgraphs)
        for sub in model.subgraphs:
            if offset:
                for op in sub.operators:
                    for key, value in list(op.options.items()):
                        # STABLEHLO_COMPOSITE's decomposition, IF/WHILE/CALL_ONCE bodies
                        if key.endswith("SubgraphIndex") and isinstance(value, int):
                            op.options[key] = value + offset
            merged.subgraphs.append(sub)
        for sig in model.signatures:
            merged.signatures.append(ir.Signature(sig.key, sig.subgraph_index + offset, sig.inputs, sig.outputs))
        merged.metadata.update(model.metadata)
    return merged


def write_files(lowered: Mapping[str, Any], graphs: list[Any], plan: FilePlan, opts: Any,
                directory: Path) -> dict[str, GraphInfo]:
    """Write the lowered programs (program name -> ir.Model) of ``graphs`` (each a
    circleops.package.step.Graph, a split one by its parts) into the plan's files, every file
    checked against the target's limits before the first is written; the GraphInfo of each."""
    from circleops.pipeline import stages

    groups: dict[str, dict[str, Any]] = {}
    for graph in graphs:
        for j, name in enumerate(graph.programs()):
            groups.setdefault(plan.file(graph.name, j if graph.parts else None), {})[name] = lowered[name]
    files_ir = {file: next(iter(members.values())) if len(members) == 1 and plan.per_graph
                else merge_models(members) for file, members in groups.items()}
    for file, one in files_ir.items():
        stages.check_size(one, opts.profile)
        split.check_part_size(one, plan.max_file_bytes, file)
    written: dict[str, int] = {}
    for file in groups:
        written[file] = stages.write(files_ir.pop(file), directory / file, opts).file_bytes
    return {graph.name: _info(graph, [lowered[n] for n in graph.programs()], plan, written) for graph in graphs}


def _info(graph: Any, models: list[Any], plan: FilePlan, written: Mapping[str, int]) -> GraphInfo:
    """The GraphInfo of ``graph`` written as ``models`` (one, or a split graph's parts in
    layer order: their files, bytes and ops together; its inputs and outputs those of the one
    graph the parts replace, circleops.runtime.chain)."""
    from circleops.pipeline import stages

    ops: Counter = Counter()
    found: dict[str, tuple] = {}
    for model, part in zip(models, graph.parts or [graph]):
        ops.update(stages.op_histogram(model))
        sub = model.subgraphs[0]
        for name, i in [*zip(part.inputs, sub.inputs), *zip(part.outputs, sub.outputs)]:
            found.setdefault(name, io_entry(name, sub.tensors[i]))
    if graph.parts and graph.inputs[0] not in found:  # the generator embeds the ids (split.HeadEmbedding)
        from circleops import ir

        first = models[0].subgraphs[0]
        hidden = first.tensors[first.inputs[0]]
        found[graph.inputs[0]] = io_entry(graph.inputs[0], ir.Tensor(graph.inputs[0], tuple(hidden.shape[:2]), "INT64"))
    files = [plan.file(graph.name, j if graph.parts else None) for j in range(len(models))]
    return GraphInfo(name=graph.name, file=files[0], signature=plan.signature(graph.name), ops=dict(ops),
                     file_size=sum(written[f] for f in dict.fromkeys(files)),
                     inputs=[found[n] for n in graph.inputs], outputs=[found[n] for n in graph.outputs],
                     part_files=files if graph.parts else None)

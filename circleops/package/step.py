"""The package step: a recipe's graphs written the same way for every recipe.

    report = run(recipe, "out/", progress=print)

A recipe (circleops.recipes.base.Recipe: the decoder LLM, each VLM family, Whisper...) says
which graphs it is (:class:`Graph`: a torch module, its example inputs, its input and output
names), what its manifest section holds, the assets saved beside the graphs and how its
written graphs are compared with torch. This step does the rest, in this order:

1. the options checked (:func:`resolve`) and the files planned (circleops.package.files:
   a file per graph, one with a signature per graph, onert's C-API signatures, a split
   model's layer-range parts), before any work;
2. the torch references (the model's own forward, before its weights are changed or its
   modules fused);
3. the weight format's steps on the torch model (SmoothQuant, importances, GGUF blocks);
4. each graph exported, then ``circleops.pipeline.stages.build`` (fuse, lower, quantize);
5. the files written into a staging directory beside the output, the assets, the manifest;
   then, for integer (PT2E) graphs, torch's references on the converted graphs (after the
   lowered models are dropped: issue 32);
6. the numeric comparison of the written graphs with torch (``--verify``), one rule for all;
7. the manifest written last and the directory published atomically (circleops.package.output).

A recipe is used through its attributes only (this package sits below circleops.recipes).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from circleops.errors import CircleOpsError, TargetError, VerifyError
from circleops.package import split
from circleops.package.files import FilePlan, integer_parts_message, plan_files, write_files
from circleops.package.manifest import graph_runtimes
from circleops.package.output import prepare_dir, publish, staging_dir
from circleops.package.report import GraphsReport

Progress = Callable[[str], None]


@dataclass
class Graph:
    """One graph of a recipe, as the package step exports, lowers and writes it."""

    name: str  # the manifest's key, the signature's key and the subgraph's name
    module: Any = None  # the torch module exported
    example_args: tuple = ()  # its export inputs
    inputs: Sequence[str] = ()  # the graph's input names, in order
    outputs: Sequence[str] = ()  # its output names, in order
    rows: int | None = None  # the rows one run computes (prefill length; decode 1): lowered for the threads
    #                          it runs at (circleops.recipes.base.Recipe.lowering_options); None: the budget
    quantize: bool = True  # --quantize applies to its weights (a VLM's vision graph: False, it stays fp32)
    layers: tuple[int, int] | None = None  # a part of a split graph: its layer range [start, stop)
    parts: list["Graph"] = field(default_factory=list)  # a split graph: one Graph per layer range, in order

    def programs(self) -> dict[str, "Graph"]:
        """The programs to export and lower: name -> graph (itself, or its parts "decode.part1")."""
        if not self.parts:
            return {self.name: self}
        return {split.part_graph_name(self.name, j): part for j, part in enumerate(self.parts)}


@dataclass
class Package:
    """One run of the step: its resolved options, file plan, directories and tracker."""

    opts: Any  # circleops.pipeline.stages.Options
    plan: FilePlan
    staging: Path  # where everything is written (and compared) first
    out_dir: Path  # where it is published
    tracker: Any  # circleops.pipeline.stages.Tracker
    # undoes what prepare_weights changed in place (w8's SmoothQuant): closed once the files
    # are written, before verify's runtime loads them (the folded weights' written pages are
    # dropped, the file's again: 4.5 GB of the 1B shape's anonymous memory, issue 32)
    restore: contextlib.ExitStack | None = None
    # an integer format's recipe (circleops.quantize.recipe.IntegerRecipe), and the fp32 outputs
    # its quality is measured against (the recipe's integer_probe, before the weights change)
    integer: Any = None
    probe: Any = None


def verify_runtime(verify: bool | str, target: str, quantize: str | None) -> tuple[str | None, str | None]:
    """(the runtime the written graphs are compared on, a note when it is not the target's own):
    None without ``verify``; ``verify`` True picks the target's, a name must run its graphs."""
    from circleops.runtime import choose_runtime

    if not verify:
        return None, None
    if verify is not True and str(verify) not in graph_runtimes(target):
        raise TargetError(f"runtime {verify} cannot run target {target}'s files; use one of "
                          f"{', '.join(graph_runtimes(target))}.")
    return choose_runtime(verify, target, quantize)  # GGML on a CPU without AVX-512: the reference interpreter


def resolve(recipe: Any) -> tuple[Any, str | None]:
    """The pipeline's Options of ``recipe.options`` (circleops.options.ConvertOptions),
    every option checked (the recipe's own by ``recipe.check``), and the verify note."""
    from circleops.pipeline import stages
    from circleops.pipeline.validate import validate_quantize, validate_target, validate_target_dtype, validate_threads
    from circleops.quantize import INTEGER_FORMATS, WEIGHT_ONLY_FORMATS
    from circleops.targets import PROFILES

    o = recipe.options
    target = validate_target(o.target)[0]
    dtype = recipe.dtype()
    int16 = None if o.int16 is None else tuple(p.strip() for p in o.int16 if p.strip())
    quantize = validate_quantize(o.quantize, target, int16)
    if quantize in INTEGER_FORMATS:
        check_integer(recipe, target, quantize, WEIGHT_ONLY_FORMATS)
    validate_target_dtype(target, dtype, quantize)
    validate_threads(o.threads)
    threads = o.threads
    if threads is None and quantize:
        threads = PROFILES[target].quantized_threads  # the thread count quantized files are made for
    runtime, note = verify_runtime(o.verify_runtime, target, quantize)
    opts = stages.Options(target, dtype, quantize=quantize, threads=threads, runtime=runtime, tolerance=o.tolerance,
                          functionalize=False, given=o)
    recipe.check(opts)
    recipe.check_token_ids()
    return opts, note


def check_integer(recipe: Any, target: str, quantize: str, weight_only: Sequence[str]) -> None:
    """Refuse integer (PT2E) graphs that ``recipe`` or ``target`` cannot have: the recipe needs
    its integer hooks (``integer_graphs``), and the target must write attention as its
    builtin with integer kernels (``integer_fused_ops``): the op that reads and writes the
    integer KV caches in place."""
    from circleops.targets import BUILTIN, PROFILES

    p = PROFILES[target]
    if not getattr(recipe, "integer_graphs", False):
        name = recipe.__name__ if isinstance(recipe, type) else type(recipe).__name__
        raise TargetError(f"quantize={quantize!r} makes an integer graph, which --graphs does not write for "
                          f"{name} yet (only the decoder LLM's prefill and decode graphs): use one of "
                          f"{', '.join(weight_only)} (weight-only), or circleops convert for an integer file")
    if not (p.integer_fused_ops and p.fused_form("ATTENTION") == BUILTIN):
        float_only = ", ".join(sorted(p.quantized_float_only)) or "none"
        raise TargetError(
            f"--graphs --quantize {quantize} --target {target}: {p.runtime} has no integer ATTENTION (the op that "
            f"reads and writes the integer KV caches in place: {target} writes attention decomposed, and its "
            f"integer kernels lack {float_only}), so these graphs' caches cannot stay integer there. Write integer "
            f"generation graphs with --target circle (circleops generate OUT --runtime reference runs them), or "
            f"use a weight-only format for {target}: --quantize {' / '.join(weight_only)}.")


def integer_recipe(recipe: Any, opts: Any) -> Any:
    """The integer recipe of ``recipe.options`` (circleops.quantize.recipe.resolve_recipe: the
    measured defaults for an LLM), checked; None for a float or weight-only conversion."""
    from circleops.quantize.recipe import RecipeOptions, resolve_recipe

    if opts.integer_format is None:
        return None
    return resolve_recipe(opts.quantize, opts.target, recipe.weights_module(), RecipeOptions.of(recipe.options))


def run(recipe: Any, out_dir: str | os.PathLike, progress: Progress | None = None) -> GraphsReport:
    """Write ``recipe``'s graphs, assets and manifest into ``out_dir`` (see the module's
    docstring); nothing in ``out_dir`` changes unless every graph was written (and compared)."""
    from circleops.pipeline import stages

    opts, note = resolve(recipe)
    o = recipe.options
    integer = integer_recipe(recipe, opts)
    plan = plan_files(opts.profile, o.onert_signatures, o.max_file_bytes, recipe.layer_bytes(opts.quantize))
    if plan.signature_api is not None:  # one onert file's graphs share its weights: no CONV_2D filter copies
        opts = dataclasses.replace(opts, shared_weights=True)
    if integer is not None and plan.parts:
        raise TargetError(integer_parts_message(opts.quantize, opts.target, o.max_file_bytes))
    out = Path(out_dir)
    prepare_dir(out)
    staging = staging_dir(out)
    tracker = stages.Tracker(progress)
    try:
        references = _references(recipe, opts, tracker)
        probe = recipe.integer_probe() if integer is not None and opts.runtime is not None else None
        with contextlib.ExitStack() as restore:  # w8's SmoothQuant weights live until the files are written
            weights = stages.prepare_weights(recipe.weights_module(), opts, restore, tokenizer=recipe.tokenizer,
                                             tracker=tracker)
            if integer is not None:  # rotation and GPTQ change the weights until the files are written
                _prepare_integer(recipe, integer, restore, tracker)
            report = _package(recipe, Package(opts, plan, staging, out, tracker, restore, integer, probe), weights,
                              references)
        report.verify_note = note
        publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report.manifest.directory = out
    return report


def _references(recipe: Any, opts: Any, tracker: Any) -> "References | None":
    """The model's own forward (None without verify), before the weight format's steps change
    its weights in place (w8's SmoothQuant fold) and before its modules are fused: a
    quantized file's fp32 references come from the mapped weights alone, never beside a
    folded copy of them (the 1B shape's w8 convert peaked there at 1.39x its weights, issue 32)."""
    from circleops.pipeline import stages

    if opts.runtime is None:
        return None
    with tracker.stage("torch reference logits", "verify", enter=False):
        references = References(recipe.references())
    if opts.quantize:  # its mapped weights are read next one at a time, as each is smoothed or quantized
        stages.release_weights()
    return references


def _package(recipe: Any, pkg: Package, weights: Any, references: "References | None") -> GraphsReport:
    """The step's work into the staging directory: export, build, write, compare."""
    from circleops.pipeline import stages
    from circleops.quantize.grouped import forget_integers

    opts, tracker = pkg.opts, pkg.tracker
    with tracker.stage("export"), recipe.exporting():  # the recipe's settings hold while its graphs are built
        graphs = recipe.graphs(opts, pkg.plan.parts)
        programs = {name: g for graph in graphs for name, g in graph.programs().items()}
        eps = _export(programs)
    _note_head_table(recipe, opts, weights)
    converted = None
    if pkg.integer is not None:  # PT2E per graph: calibrated, converted, exported again
        eps, converted = _quantize_graphs(recipe, programs, eps, pkg)
    lowered, quantization = _build(recipe, programs, eps, opts, weights, tracker)
    del eps
    if opts.runtime is not None and quantization is not None:
        references = _quantized_references(recipe, quantization, opts.runtime, tracker, references.own)
    with tracker.stage("write"):
        infos = write_files(lowered, graphs, pkg.plan, opts, pkg.staging)
        del lowered
        forget_integers()  # the per-group integers the lowering read back: written, no longer read
        manifest = recipe.manifest(pkg.staging, opts, pkg.plan, infos)  # and the assets beside it
    if converted is not None:
        quantization = pkg.integer
        if opts.runtime is not None:  # torch running the same quantized computation; fp32 is reported
            references = _integer_references(recipe, converted, references, pkg)
    report = GraphsReport(directory=str(pkg.out_dir), target=opts.target, dtype=manifest.dtype, graphs=infos,
                          manifest=manifest, timings=tracker.timings, source=recipe.source,
                          quantization=quantization, kind=recipe.kind, compared=recipe.compared,
                          converted=converted, **recipe.describe(manifest))
    if opts.runtime is not None:
        _compare(recipe, manifest, references, report, pkg)
    manifest.write()
    return report


def _note_head_table(recipe: Any, opts: Any, weights: Any) -> None:
    """A tied table no graph stores (the recipe's ``head_table``: the generator reads its rows
    from the quantized head, circleops.package.split.PartBytes.head_rows) named to the weight
    pass before it runs: the head is stored at the format's head type, and verify's torch
    embedding looks its rows up in the head's stored values, as the generator does."""
    table = getattr(recipe, "head_table", None)
    fmt = opts.weight_format
    if table is None or fmt is None or weights is None:
        return
    from circleops.quantize.weights import QuantReport, source_key

    weights.report = weights.report or QuantReport(fmt.name, form=fmt.form_for(opts.profile.format))
    key = source_key(table.detach())
    if key is not None:
        weights.report.host_tables.add(key)


def _integer_references(recipe: Any, converted: dict[str, Any], references: "References",
                        pkg: Package) -> "References":
    """torch's run of the converted (PT2E) modules: the references the written integer graphs
    are compared with, their noise floor (every integer op rounded stochastically) and the
    quality against fp32. Run after the files are written and the lowered models dropped
    (their tables and the lowering's were the 16a4w 1B convert's peak beside these runs,
    bench/results/64-npu-1b-verify.yaml, issue 32), each weight dequantized in float32 by
    blocks (circleops.quantize.blocked_dequantize: the same values without int64 copies)."""
    from circleops.quantize.blocked_dequantize import float32_dequantize

    tracker = pkg.tracker
    collect_garbage(sum(_weight_bytes(m) for m in converted.values()))  # the lowered models' cycles
    with float32_dequantize(converted.values()):
        with tracker.stage("torch reference logits", "verify", enter=False):
            own = recipe.integer_references(converted, references.own)
            with recipe.integer_rounding(converted):  # every integer op rounded stochastically: the noise floor
                noise = recipe.noise(own, recipe.integer_references(converted, references.own))
        with tracker.stage("quality against fp32", "quality", enter=False):
            return References(own, noise, quality=recipe.integer_quality(converted, pkg.probe))


@dataclass
class References:
    """torch's references the written graphs are compared with: the recipe's own (for a
    quantized file: on the file's weights and the runtime's input rounding) and how far they
    move when the inputs the runtime rounds move (graph -> noise)."""

    own: Any  # recipe.references(): what the recipe's compare takes
    noise: dict[str, float] | float | None = None  # the model's own noise floor (Recipe.noise); None: not measured
    quality: Any = None  # a quantized file's circleops.quantize.quality.Quality against fp32; None: fp32


def _quantized_references(recipe: Any, quantization: Any, runtime: str, tracker: Any, fp32: Any) -> References:
    """The recipe's references on the weights the files hold (the model's forward, fused by
    now: same numerics) with ``runtime``'s rounding of each quantized linear's input, and
    their quality against ``fp32`` (its references on the model's own weights: reported, never
    a bound); where that rounding applies, again with every rounded input nudged 16 fp32 ulps
    (circleops.quantize.weights.perturbed): the two differ by how far this model carries a
    rounding that another summation order flips, its noise floor."""
    from circleops.quantize import quality
    from circleops.quantize.weights import dequantized_sources, input_rounding

    module = recipe.weights_module()
    with tracker.stage("torch reference logits", "verify", enter=False), \
            dequantized_sources(quantization, module, runtime):
        refs = References(recipe.references())
    refs.quality = quality.measure(fp32, refs.own)
    if input_rounding(quantization, runtime) is not None:
        with tracker.stage("torch reference logits", "verify", enter=False), \
                dequantized_sources(quantization, module, runtime, perturb=0):
            refs.noise = recipe.noise(refs.own, recipe.references())
    return refs


def _prepare_integer(recipe: Any, integer: Any, restore: contextlib.ExitStack, tracker: Any) -> None:
    """The integer recipe's weight steps (rotation, GPTQ / per-group rounding) on the model,
    before export (circleops.quantize.llm.prepare_llm), in place until ``restore`` closes."""
    import torch

    from circleops.pipeline.stages import hf_export_settings
    from circleops.quantize.llm import prepare_llm
    from circleops.system.memory import trim_heap

    model = recipe.weights_module()
    example = (torch.zeros(1, 1, dtype=torch.int64),)  # an LLM's GPTQ windows come from the calibration text
    with hf_export_settings(model), torch.no_grad():
        prepare_llm(model, example, integer, restore, (recipe.options.calibration_data, recipe.tokenizer), tracker)
    trim_heap()  # the steps' freed temporaries between what they keep, before export and calibration


def _quantize_graphs(recipe: Any, programs: Mapping[str, Graph], eps: dict[str, Any],
                     pkg: Package) -> tuple[dict[str, Any], dict[str, Any]]:
    """PT2E on every graph (circleops.pipeline.stages.quantize_program) with the recipe's
    calibration inputs, its inputs of fixed range (the KV caches) quantized with fixed
    parameters; (the converted programs, the converted modules the files are verified against)."""
    import torch

    from circleops.pipeline import stages

    opts, integer = pkg.opts, pkg.integer
    model = recipe.weights_module()
    head_module = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    from circleops.quantize.integer.folded_floats import read_storages
    from circleops.quantize.rotate import release_unread
    from circleops.quantize.blocked_fold import shared_folds
    from circleops.system.memory import trim_heap
    from circleops.quantize.integer.shared import SharedIntegers

    qeps, converted = {}, {}
    shared = SharedIntegers()  # one storage for the integer tables the graphs hold alike
    # the later graphs' folds of the same tables return the earlier graph's integers (none made twice)
    with pkg.tracker.stage("calibrate"), torch.no_grad(), shared_folds():
        cal = recipe.integer_calibration(integer.calibrate)
        for name, ep in eps.items():
            g = programs[name]
            holders = dict(zip(g.inputs, ep.graph_signature.user_inputs))  # input name -> placeholder
            fixed = {holders[n]: r for n, r in cal.ranges.items() if n in holders}
            head = tuple(n for n, m in g.module.named_modules() if head_module is not None and m is head_module)
            calibration = stages.Calibration(
                tuple(g.example_args), integer.calibrate, None, recipe.tokenizer, None, tuple(integer.int16),
                getattr(pkg.tracker.progress, "bar", None) is not None, integer, head, samples=cal.samples[name],
                fixed=fixed)
            converted[name], qeps[name] = stages.quantize_program(ep, g.module, opts, calibration)
            shared.share(converted[name], qeps[name])
            trim_heap()  # calibration's and convert_pt2e's freed temporaries, before the next graph's
        if integer.rotated is not None:  # the rotated weights every graph now holds as integers
            # (the embedding, the untied head) given back: nothing reads them until the restore
            release_unread(integer.rotated, read_storages(converted.values(), qeps.values()))
    return qeps, converted


def _export(programs: Mapping[str, Graph]) -> dict[str, Any]:
    """torch.export of every program (errors as ExportError)."""
    import torch

    from circleops.pipeline.stages import export

    with torch.no_grad():
        return {name: export(g.module, tuple(g.example_args), adapters=False, warn_list=[])
                for name, g in programs.items()}


def _build(recipe: Any, programs: Mapping[str, Graph], eps: dict[str, Any], opts: Any, weights: Any,
           tracker: Any) -> tuple[dict[str, Any], Any]:
    """fuse -> lower -> quantize over the programs (circleops.pipeline.stages.build): those
    --quantize does not apply to first, without the weight format; (models in graph order,
    the QuantReport or None)."""
    from circleops.pipeline import stages

    def builder(graph_opts: Any) -> Callable[[str, Any], Any]:
        return lambda name, ep: lower_graph(ep, programs[name], recipe.lowering_options(graph_opts, programs[name]))

    models: dict[str, Any] = {}
    plain = {n: eps.pop(n) for n in list(eps) if not programs[n].quantize}
    if plain:
        plain_opts = dataclasses.replace(opts, quantize=None)
        models.update(stages.build(plain, plain_opts, None, tracker, lower_one=builder(plain_opts)).models)
        del plain
    quantization = None
    if eps:
        built = stages.build(eps, opts, weights, tracker, lower_one=builder(opts))
        models.update(built.models)
        quantization = built.quantization
        del built
    return {name: models[name] for name in programs}, quantization


def lower_graph(ep: Any, graph: Graph, opts: Any) -> Any:
    """Lower one exported graph for ``opts`` (the profile's ``graph_inline_ops`` op by op) and
    name its subgraph, inputs, outputs and signature after ``graph``."""
    from circleops.pipeline import stages

    stages.inline_fused_ops(ep, graph_inline_ops(opts))
    model = name_graph(stages.lower(ep, opts), graph.name, graph.inputs, graph.outputs)
    if opts.format == "tflite" and opts.quantize is None:  # XNNPACK packs no fp32 lm_head whole
        from circleops.lowering.table_blocks import split_large_weights

        split_large_weights(model)
    collect_garbage(_weight_bytes(ep))
    return model


# A full collection costs ~0.3 s with torch and transformers loaded (600k objects; 18 % of a
# generate test run's time when every graph's lowering collected): worth it only where the
# cycles hold weights of a size that moves the peak.
COLLECT_FROM_BYTES = 64 * 2**20


def collect_garbage(weight_bytes: int) -> None:
    """A full collection now, for a graph of ``weight_bytes`` of weights of at least
    :data:`COLLECT_FROM_BYTES`: what a lowering (or a torch run) leaves in reference cycles
    (torch.fx graphs, the lowering's float constants) is freed before the next graph's
    lowering piles up its own beside it, not when the collector next happens to run (the
    16a4w recipe on 2 layers of the Llama-3.2-1B width, vocabulary 32768, with --verify: the
    lowering's peak 3.46 -> 2.98 GB, verify's torch runs after it 3.98 -> 2.93 GB, issue 32)."""
    import gc

    if weight_bytes >= COLLECT_FROM_BYTES:
        gc.collect()


def _weight_bytes(program: Any) -> int:
    """The bytes of an exported program's parameters, buffers and constants (a module's
    state dict: PT2E's converted graphs)."""
    import torch

    if isinstance(program, torch.nn.Module):
        tensors = list(program.state_dict().values())
    else:
        tensors = [*program.state_dict.values(), *getattr(program, "constants", {}).values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def graph_inline_ops(opts: Any) -> frozenset[str]:
    """The circle ops a generation graph writes inline: the target's, and its weight format's."""
    fmt = opts.weight_format
    return frozenset(opts.profile.graph_inline_ops) | (fmt.graph_inline_ops if fmt is not None else frozenset())


def name_graph(model: Any, name: str, inputs: Sequence[str], outputs: Sequence[str]) -> Any:
    """``model``'s subgraph named ``name``, its inputs and outputs named in order, its signature
    key ``name``. An output that is an input (an in-place cache update, Circle ATTENTION) keeps
    the input's name."""
    sub = model.subgraphs[0]
    sub.name = name
    ins, outs = list(inputs), list(outputs)
    if len(sub.inputs) != len(ins) or len(sub.outputs) != len(outs):
        raise CircleOpsError(f"internal: the {name} graph has {len(sub.inputs)} inputs and {len(sub.outputs)} "
                             f"outputs, expected {len(ins)} and {len(outs)}.")
    for idx, n in zip(sub.inputs, ins):
        sub.tensors[idx].name = n
    taken = set(sub.inputs)
    for idx, n in zip(sub.outputs, outs):
        if idx not in taken:
            sub.tensors[idx].name = n
    sig = model.signatures[0]
    sig.key, sig.inputs, sig.outputs = name, dict(zip(ins, sub.inputs)), dict(zip(outs, sub.outputs))
    return model


def _compare(recipe: Any, manifest: Any, references: Any, report: GraphsReport, pkg: Package) -> None:
    """The written graphs run on the verify runtime against the torch references (the
    recipe's ``compare``), one rule for every recipe: VerifyError above tolerance x
    max(1, max|reference|), unless (a quantized file whose inputs the runtime rounds) within
    NOISE_FLOORS x the model's own noise floor at what that graph is compared with."""
    from circleops.pipeline import stages
    from circleops.quantize.weights import NOISE_FLOORS

    opts = pkg.opts
    tol = opts.verify_tolerance()
    tol = stages.format_tolerance(None, opts.dtype) if tol is None else tol
    noise = references.noise
    if pkg.restore is not None:  # written and referenced: the model's own weights again (ExitStack closes once)
        pkg.restore.close()
    stages.release_weights()  # and paged out: the runtime's child needs the memory now
    from circleops.runtime.isolated import sharing_children

    # one child per LiteRT file serves all its graphs: it loads and compiles the file once
    with pkg.tracker.stage("verify"), sharing_children():
        compared = recipe.compare(manifest, opts.runtime, references.own)
    what = f"max abs {recipe.compared} error" if recipe.compared else "max abs error"
    floors = {g: None if noise is None else float(noise[g] if isinstance(noise, Mapping) else noise) for g in compared}
    for g, (err, reference_max) in compared.items():
        scale = max(1.0, float(reference_max))
        floor = floors[g]
        if not (err <= tol * scale or (floor is not None and err <= NOISE_FLOORS * floor)):
            bound = f"tolerance {tol:.3g} x {scale:.3g}" + (
                "" if floor is None else f", or {NOISE_FLOORS:g} x {floor:.3g}, the model's own noise floor: how far "
                "its outputs move when every input the runtime rounds moves by 16 fp32 ulps, or, integer graphs, "
                "when every integer op rounds stochastically (unbiased, at most one step)")
            raise VerifyError(
                f"the written {g} graph does not match the model: {opts.runtime} gives {what} {err:.3g} "
                f"({bound}); nothing was written (an earlier output there is unchanged). "
                f"Convert without --verify to inspect them (circleops inspect), and report the model.")
    for g, (err, _) in compared.items():
        report.graphs[g].max_abs_error = err
    report.verify_runtime, report.tolerance, report.quality = opts.runtime, tol, references.quality
    if noise is not None:
        report.noise_floor = max(f for f in floors.values() if f is not None)

"""Vision-language models: a vision graph, prefill graphs that take image embeddings, and
the decode graph with its KV cache; generation from an image and a prompt.

    from circleops.recipes import vlm
    from circleops.generation import vision
    model, processor = vlm.load("smolvlm-dir/")
    vlm.convert_vlm_graphs(model, "out/", processor=processor, target="onert", verify=True)
    result = vision.generate("out/", "Describe it", image="photo.png")

The families (one row each in circleops.adapters.vlm: where the vision tower, projector and
text model are, what the prefill mask is):

* SmolVLM / Idefics3 (``Idefics3ForConditionalGeneration``, ``SmolVLMForConditionalGeneration``):
  a SigLIP vision tower, a connector (pixel shuffle + linear) and a Llama text model; the
  processor splits an image into tiles.
* PaliGemma (``PaliGemmaForConditionalGeneration``): a SigLIP vision tower, a linear projector
  and a Gemma text model whose prefill attends both ways over the prefix (the image tokens,
  BOS, the prompt and "\n", as PaliGemmaProcessor lays them out) and causally after it.

* ``vision``: one image tile ``pixel_values [1, 3, S, S]`` -> ``image_embeds [1, T, H]``, the
  projected embeddings that replace the tile's T ``<image>`` tokens (T = the model's
  ``image_seq_len``; a processor that splits an image into tiles makes one run per tile).
* ``prefill`` (one per ``--seq-len``): the text model's prefill with one input more,
  ``image_embeds [1, N, H]`` (a prefix-LM, PaliGemma: two, ``prefix_len [1]`` after it, the
  mask built in the graph from it and ``pos``; the whole prefix goes through one run): the chunk's rows that are ``<image>`` tokens take that row
  instead of their token embedding (``where(input_ids == image_token_id, ...)``: what the
  model's ``inputs_merger`` does), every other row its embedding. The merge is in the graph,
  so the host needs no embedding table; the rest of the graph is the causal LM's prefill
  (RMS_NORM, ROPE and the attention as for SmolLM2). Text without an image feeds zeros.
* ``decode``: the causal LM's decode graph, unchanged (a generated token is text).

The host (:class:`VisionGenerator`) runs the vision graph on each tile, places the image
embeddings at the positions of the ``<image>`` tokens of the prompt, and feeds them chunk by
chunk with the prefill graphs; the manifest's ``vision`` entry (:class:`VisionSpec`) names
the vision graph, the image token and the tile size. The processor (tokenizer, image
processor, chat template) is saved in the directory's ``tokenizer/``.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from circleops.errors import CircleOpsError, ModelLoadError, TargetError, VerifyError
from circleops.generation.vision import VisionGenerator, load_processor
from circleops.recipes.llm import (DEFAULT_MAX_CACHE_LEN, DEFAULT_PREFILL_LENS, GraphInfo, GraphsReport, check_lengths,
                              decoder_step, default_cache_update, eos_ids, export_graph, io_names, lower_step,
                              merge_models, pad_id, prefill_lengths, prepare_dir, publish, staging_dir,
                              text_lines)
from circleops.package.manifest import TOKENIZER_DIR, Manifest, graph_runtimes, prefill_graph_name
from circleops.package.vision_manifest import (IMAGE_EMBEDS, PIXEL_VALUES, PREFIX_LEN, VISION_GRAPH, VLM_GRAPH_NAMES,
                                               VisionSpec)
from circleops.targets import PROFILES
from circleops.adapters.vlm import FAMILIES, family_of
from circleops.inputs.remote_code import refuse_remote_code

# model_type of config.json -> what it is; the classes are transformers'
VLM_MODEL_TYPES = {t: cls for fam in FAMILIES if fam.converted for t, cls in fam.classes.items()}
# SmolVLM's chat template (HuggingFaceTB/SmolVLM-*-Instruct): "User:<image>text<end_of_utterance>\nAssistant:"
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
# the special tokens an Idefics3 processor expects in its tokenizer
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)))

Progress = Callable[[str], None]


# --------------------------------------------------------------------------- the model

def vlm_model_type(model: str | os.PathLike | None = None, config: str | os.PathLike | None = None) -> str | None:
    """The model_type of a vision-language model directory (or config.json) circleops
    converts with ``--graphs vision,prefill,decode``; None for anything else."""
    path = Path(config) if config else Path(model) / "config.json" if model else None
    if path is None or not path.is_file():
        return None
    from circleops.inputs.user_files import read_json

    try:
        cfg = read_json(path)
    except CircleOpsError:  # not JSON, or damaged: not a VLM directory (read again, with the error, later)
        return None
    kind = cfg.get("model_type") if isinstance(cfg, dict) else None
    return kind if kind in VLM_MODEL_TYPES else None


def _classes(model_type: str) -> Any:
    import transformers

    return getattr(transformers, VLM_MODEL_TYPES[model_type])


def load(model: str | os.PathLike | None, *, config: str | os.PathLike | None = None, seed: int = 0) -> tuple[Any, Any]:
    """(the model, its processor or None) from a directory (config.json + safetensors, as
    ``save_pretrained`` writes it) or, with ``config``, random weights from a config.json."""
    import torch

    from circleops.sources.models import check_model_size, quiet_transformers, read_config_dict
    from circleops.inputs.user_files import check_json_files

    kind = vlm_model_type(model, config)
    if kind is None:
        raise ModelLoadError(f"{config or model} is not a vision-language model circleops knows (model_type "
                             f"{', '.join(VLM_MODEL_TYPES)}).")
    # sizes bounded before anything is built; the directory's JSON files read by circleops first
    check_model_size(read_config_dict(Path(config) if config else Path(model) / "config.json"), str(config or model))
    if not config:
        check_json_files(model, error=ModelLoadError, fix="The directory is damaged: download or save it again.")
    cls = _classes(kind)
    with quiet_transformers():
        try:
            if config:
                cfg = cls.config_class.from_json_file(str(config))
                torch.manual_seed(seed)
                module = cls(cfg)
            else:
                refuse_remote_code(model)
                module = cls.from_pretrained(str(model), dtype=torch.float32, trust_remote_code=False)
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise ModelLoadError(f"cannot load {config or model} as {cls.__name__}: {str(err).strip()[:300]}") from None
        processor = None
        if model and not config:
            processor = load_processor(Path(model), required=False)
    return module.eval(), processor


def build_processor(tokenizer: Any, model: Any, *, do_image_splitting: bool = True, longest_edge: int | None = None,
                    chat_template: str | None = SMOLVLM_CHAT_TEMPLATE) -> Any:
    """The processor of ``model`` over ``tokenizer`` (a text model's, e.g. SmolLM2's: the
    image tokens are added). An Idefics3 / SmolVLM: tiles of the vision tower's image size,
    images resized to ``longest_edge`` (default two tiles) first, ``chat_template``. A
    PaliGemma: :func:`paligemma_processor` (the other arguments do not apply)."""
    if family_of(model).name == "paligemma":
        return paligemma_processor(tokenizer, image_size=int(model.config.vision_config.image_size),
                                   image_seq_len=family_of(model).tokens_per_image(model))
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tile = int(model.config.vision_config.image_size)
    missing = [t for t in IMAGE_TOKENS if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    images = Idefics3ImageProcessorPil(size={"longest_edge": longest_edge or 2 * tile},
                                       max_image_size={"longest_edge": tile}, do_image_splitting=do_image_splitting)
    return Idefics3Processor(images, tokenizer, image_seq_len=int(model.model.image_seq_len),
                             chat_template=chat_template)


def paligemma_processor(tokenizer: Any, *, image_size: int, image_seq_len: int) -> Any:
    """A PaliGemmaProcessor over ``tokenizer`` (any text tokenizer: it adds ``<image>`` and
    PaliGemma's 1152 ``<locNNNN>`` / ``<segNNN>`` tokens to it, so make the model's vocabulary
    ``len(processor.tokenizer)`` and its ``image_token_index`` ``processor.image_token_id``),
    with SigLIP's image processor at ``image_size`` pixels and ``image_seq_len`` image tokens."""
    from transformers import PaliGemmaProcessor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    images = SiglipImageProcessorPil(size={"height": image_size, "width": image_size}, image_seq_length=image_seq_len)
    return PaliGemmaProcessor(images, tokenizer)


def vision_spec(model: Any) -> VisionSpec:
    cfg = model.config
    fam = family_of(model)
    return VisionSpec(graph=VISION_GRAPH, image_token_id=int(cfg.image_token_id),
                      image_seq_len=fam.tokens_per_image(model), tile_size=int(cfg.vision_config.image_size),
                      hidden_size=int(cfg.text_config.hidden_size), family=str(cfg.model_type), prefix_lm=fam.prefix_lm)


def parse_vlm_graphs(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"vision,prefill,decode"``: a vision-language model needs all three."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    if sorted(names) != sorted(VLM_GRAPH_NAMES):
        raise TargetError(f"a vision-language model converts with --graphs {','.join(VLM_GRAPH_NAMES)} (the vision "
                          f"tower, the prefill that merges image embeddings, the decode step); got "
                          f"--graphs {','.join(names) or 'nothing'}.")
    return VLM_GRAPH_NAMES


# --------------------------------------------------------------------------- convert

@dataclass
class _Example:
    ids: Any  # [P + 1] int64: text, one tile's image tokens, text (a prefix-LM: the image first)
    pixel_values: Any  # [1, 3, S, S]
    features: Any  # [T, H]: the vision tower's output on it
    logits: Any  # [P + 1, V]: the model's logits of every prefix
    prefix_len: int = 0  # a prefix-LM: the positions that attend both ways (token_type_ids 0)


# a prefix-LM's verify prompt: the image, then this many text tokens in the prefix (BOS, a
# word, "\n" in PaliGemma's layout), then a causal suffix of 2 (+ the decode step's token)
PREFIX_TEXT, SUFFIX_TEXT = 3, 2


def _example(model: Any, spec: VisionSpec, lengths: Sequence[int]) -> _Example:
    """A prompt of text, one tile's <image> tokens and text, through the model's own forward
    (with pixel_values: its vision tower and merge), before anything is fused. A prefix-LM's
    prompt is the image and 3 tokens as the prefix (token_type_ids 0), then a causal suffix."""
    import torch

    from circleops.adapters.vlm import VisionTower

    vocab = int(model.config.text_config.vocab_size)
    g = torch.Generator().manual_seed(0)
    image = torch.full((spec.image_seq_len,), spec.image_token_id)
    if spec.prefix_lm:
        text = torch.randint(0, vocab, (PREFIX_TEXT + SUFFIX_TEXT + 1,), generator=g)
        text = torch.where(text == spec.image_token_id, (text + 1) % vocab, text)
        ids, prefix = torch.cat([image, text]), spec.image_seq_len + PREFIX_TEXT
    else:
        text = torch.randint(0, vocab, (max(2, min(lengths) // 2) + 2,), generator=g)
        text = torch.where(text == spec.image_token_id, (text + 1) % vocab, text)
        ids, prefix = torch.cat([text[:2], image, text[2:]]), 0
    pixels = torch.rand((1, 3, spec.tile_size, spec.tile_size), generator=g) * 2 - 1
    # PaliGemma's pixel_values are [B, 3, S, S]; Idefics3's [B, tiles, 3, S, S]
    pv = pixels if spec.prefix_lm else pixels[None]
    kinds = {}
    if spec.prefix_lm:
        kinds = {"token_type_ids": (torch.arange(len(ids)) >= prefix).long()[None]}
    p = len(ids) - 1
    with torch.no_grad():
        logits = model(input_ids=ids[None, :p], pixel_values=pv, use_cache=False,
                       **{k: v[:, :p] for k, v in kinds.items()}).logits[0]
        # the last token after the prompt (the decode check): the same forward, one longer
        last = model(input_ids=ids[None], pixel_values=pv, use_cache=False, **kinds).logits[0, -1:]
        features = VisionTower(model)(pixels)[0]
    return _Example(ids, pixels, features.numpy(), torch.cat([logits, last]).float().numpy(), prefix)


def convert_vlm_graphs(model: Any, out_dir: str | os.PathLike, *, processor: Any = None,
                       graphs: str | Sequence[str] = VLM_GRAPH_NAMES, target: str = "onert",
                       prefill_len: int | Sequence[int] = DEFAULT_PREFILL_LENS,
                       max_cache_len: int = DEFAULT_MAX_CACHE_LEN, verify: bool | str = False,
                       tolerance: float | None = None, source: str = "", progress: Progress | None = None,
                       quantize: str | None = None, threads: int | None = None) -> GraphsReport:
    """Write the vision, prefill and decode graphs of ``model`` (a model of a family of
    circleops.adapters.vlm: SmolVLM / Idefics3, PaliGemma) for ``target`` into ``out_dir``
    with ``manifest.json`` (its ``vision`` entry) and the processor in ``out_dir/tokenizer``.

    ``quantize``: a weight-only format (q4_0, q8_0, w8, as for
    :func:`circleops.recipes.llm.convert_graphs`) for the text graphs (prefill and decode share one
    set of blocks); the vision graph stays fp32. ``threads``: as for convert_graphs.

    ``verify``: run the written graphs (True: the target's runtime, or name one) on a prompt
    of text and one image tile, against the model's own forward with ``pixel_values``: the
    vision graph's embeddings, the prefill's logits of the last prompt token and one decode
    step; VerifyError above ``tolerance`` x max(1, max|value|); with ``quantize``, against
    the model running the weights the files hold (dequantized). The text model's modules
    are fused in place (circleops.fuse).
    """
    import torch

    from circleops.pipeline import stages as pipeline
    from circleops.quantize import INTEGER_FORMATS, WEIGHT_ONLY_FORMATS
    from circleops.runtime import choose_runtime
    from circleops.pipeline.validate import validate_quantize, validate_threads

    parse_vlm_graphs(graphs)
    if target not in PROFILES:
        raise TargetError(f"unknown target {target!r}: choose one of {', '.join(PROFILES)}.")
    if type(model).__name__ not in VLM_MODEL_TYPES.values():
        raise TargetError(f"convert_vlm_graphs takes one of {', '.join(VLM_MODEL_TYPES.values())}; got "
                          f"{type(model).__name__}.")
    quantize = validate_quantize(quantize, target)
    if quantize in INTEGER_FORMATS:
        raise TargetError(f"quantize={quantize!r} makes an integer graph, which --graphs does not write: use one of "
                          f"{', '.join(WEIGHT_ONLY_FORMATS)} (weight-only; the vision graph stays fp32).")
    validate_threads(threads)
    if threads is None and quantize:
        threads = PROFILES[target].quantized_threads  # what quantized files are made for (the profile says)
    runtime, note = None, None
    if verify:
        if verify is not True and str(verify) not in graph_runtimes(target):
            raise TargetError(f"runtime {verify} cannot run target {target}'s files; use one of "
                              f"{', '.join(graph_runtimes(target))}.")
        runtime, note = choose_runtime(verify, target, quantize)
    lengths = prefill_lengths(prefill_len)
    limit = getattr(model.config.text_config, "max_position_embeddings", None)
    check_lengths(lengths[0], max_cache_len, limit, source or "the model")
    check_lengths(lengths[-1], max_cache_len, None, source or "the model")
    spec = vision_spec(model)
    if spec.prefix_lm and lengths[0] < spec.image_seq_len + PREFIX_TEXT:
        raise TargetError(f"--seq-len {','.join(map(str, lengths))}: {source or 'the model'} ({spec.family}) attends "
                          f"both ways over its prompt prefix (the image's {spec.image_seq_len} tokens, BOS, the prompt "
                          f"and \"\\n\"), so the whole prefix goes through one prefill run: the longest --seq-len "
                          f"must hold the image and the longest prompt, at least {spec.image_seq_len + PREFIX_TEXT} "
                          f"(e.g. --seq-len {spec.image_seq_len + 32},8).")
    opts = pipeline.Options(target, torch.float32, quantize=quantize, threads=threads, runtime=runtime,
                            tolerance=tolerance, functionalize=False)
    out_dir = Path(out_dir)
    prepare_dir(out_dir)
    staging = staging_dir(out_dir)
    tracker = pipeline.Tracker(progress)
    try:
        with contextlib.ExitStack() as restore:  # w8's SmoothQuant weights live until the files are written
            from circleops.adapters.vlm import TextLM

            tokenizer = getattr(processor, "tokenizer", None)
            weights = pipeline.prepare_weights(TextLM(model.eval()), opts, restore, tokenizer=tokenizer, tracker=tracker)
            report = _convert_into(model, processor, spec, (lengths, max_cache_len, source), opts,
                                   tracker=tracker, staging=staging, weights=weights)
        report.verify_note = note
        publish(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report.directory = str(out_dir)
    report.manifest.directory = out_dir
    return report


def _convert_into(model: Any, processor: Any, spec: VisionSpec, sizes: tuple, opts: Any, *, tracker: Any,
                  staging: Path, weights: Any = None) -> GraphsReport:
    import dataclasses

    import torch

    from circleops.pipeline import stages as pipeline
    from circleops.adapters.vlm import ImagePrefill, TextLM, VisionTower
    from circleops.quantize.weights import dequantized_sources

    lengths, max_cache_len, source = sizes
    example = None
    if opts.runtime is not None and not opts.quantize:  # the model's own forward, before it is fused
        with tracker.stage("torch reference logits", "verify", enter=False):
            example = _example(model, spec, lengths)
    cache_update = default_cache_update(opts.target)
    family = family_of(model)
    with tracker.stage("export"), torch.no_grad(), family.explicit_mask(model):
        tile = torch.zeros((1, 3, spec.tile_size, spec.tile_size))
        eps = {VISION_GRAPH: pipeline.export(VisionTower(model).eval(), (tile,), adapters=False, warn_list=[])}
        step = decoder_step(TextLM(model), max_cache_len, cache_update)
        prefill = ImagePrefill(step, spec.image_token_id, prefix_lm=spec.prefix_lm, image_blocks=family.image_blocks)
        for n in lengths:
            extra = (torch.tensor([n]),) if spec.prefix_lm else ()
            args = (torch.zeros((1, n), dtype=torch.int64), torch.tensor([0]), torch.tensor([n - 1]),
                    torch.zeros((1, n, spec.hidden_size)), *extra, *step.empty_caches())
            eps[prefill_graph_name(n, lengths)] = pipeline.export(prefill, args, adapters=False, warn_list=[])
        eps["decode"] = export_graph(step, "decode", lengths[0])
    names = _io(step.num_layers, cache_update, spec.prefix_lm)
    vision_opts = dataclasses.replace(opts, quantize=None)  # the vision graph stays fp32

    def lower_one(g: str, ep: Any, graph_opts: Any = opts) -> Any:
        return lower_step(ep, g, graph_opts, step.num_layers,
                          names=names[VISION_GRAPH if g == VISION_GRAPH else "decode" if g == "decode" else "prefill"])

    vision = pipeline.build({VISION_GRAPH: eps.pop(VISION_GRAPH)}, vision_opts, None, tracker,
                            lower_one=lambda g, ep: lower_one(g, ep, vision_opts))
    built = pipeline.build(eps, opts, weights, tracker, lower_one=lower_one)
    lowered = {**vision.models, **built.models}
    quantization = built.quantization
    del eps, built, vision
    if opts.runtime is not None and opts.quantize:
        # the model's forward (fused by now: same numerics) on the weights the files hold
        with tracker.stage("torch reference logits", "verify", enter=False), \
                dequantized_sources(quantization, TextLM(model)):
            example = _example(model, spec, lengths)
    profile = opts.profile
    files = {g: f"{g}.{profile.format}" if profile.one_file_per_graph else f"model.{profile.format}" for g in lowered}
    with tracker.stage("write"):
        infos = _write(lowered, files, names, opts, staging)
        tokenizer_dir = None
        if processor is not None:
            processor.save_pretrained(str(staging / TOKENIZER_DIR))
            tokenizer_dir = TOKENIZER_DIR
        text = TextLM(model)
        eos = eos_ids(text)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.to_json_file(str(staging / "generation_config.json"))
        k_names, outs = io_names(step.num_layers, "decode", cache_update)
        manifest = Manifest(
            directory=staging, target=opts.target, dtype="fp32", files=files, quantize=opts.quantize,
            num_threads=opts.threads,
            signatures={g: infos[g].signature for g in files}, prefill_len=lengths[0], prefill_lens=list(lengths),
            prefill_inputs=names["prefill"][0], max_cache_len=max_cache_len, num_layers=step.num_layers,
            cache_shape=list(step.cache_shape), cache_layout=step.cache_layout,
            vocab_size=int(model.config.text_config.vocab_size), inputs=k_names, outputs=outs, eos_token_ids=eos,
            pad_token_id=pad_id(text, eos), tokenizer=tokenizer_dir, source=source, cache_update=cache_update,
            vision=spec.to_json())
        manifest.write()
    report = GraphsReport(directory=str(staging), target=opts.target, dtype="fp32", graphs=infos, manifest=manifest,
                          timings=tracker.timings, source=source, quantization=quantization,
                          **text_lines(manifest, list(files)))
    if example is not None:
        tol = opts.verify_tolerance()
        tol = pipeline.format_tolerance(None, opts.dtype) if tol is None else tol
        with tracker.stage("verify"):
            for g, err in _verify(manifest, opts.runtime, example, tol).items():
                infos[g].max_abs_error = err
        report.verify_runtime, report.tolerance = opts.runtime, tol
    return report


def _io(num_layers: int, cache_update: str, prefix_lm: bool = False) -> dict[str, tuple[list[str], list[str]]]:
    """Input and output names per graph kind: the prefill's image_embeds (and a prefix-LM's
    prefix_len) after logits_row."""
    ins, outs = io_names(num_layers, "prefill", cache_update)
    prefill_ins = [*ins[:3], IMAGE_EMBEDS, *([PREFIX_LEN] if prefix_lm else []), *ins[3:]]
    return {VISION_GRAPH: ([PIXEL_VALUES], [IMAGE_EMBEDS]), "prefill": (prefill_ins, outs),
            "decode": io_names(num_layers, "decode", cache_update)}


def _write(lowered: dict[str, Any], files: dict[str, str], names: dict, opts: Any, out: Path) -> dict[str, GraphInfo]:
    from circleops.pipeline import stages as pipeline

    groups: dict[str, dict[str, Any]] = {}
    for g, m in lowered.items():
        groups.setdefault(files[g], {})[g] = m
    infos: dict[str, GraphInfo] = {}
    for file, members in groups.items():
        one = next(iter(members.values())) if len(members) == 1 else merge_models(members)
        info = pipeline.write(one, out / file, opts)
        for g, m in members.items():
            sub = m.subgraphs[0]
            kind = VISION_GRAPH if g == VISION_GRAPH else "decode" if g == "decode" else "prefill"
            infos[g] = GraphInfo(
                name=g, file=file, signature=None if len(members) == 1 else g, ops=pipeline.op_histogram(m),
                file_size=info.file_bytes,
                inputs=[(sub.tensors[i].name, list(sub.tensors[i].shape), sub.tensors[i].dtype) for i in sub.inputs],
                outputs=[(n, list(sub.tensors[i].shape), sub.tensors[i].dtype)
                         for n, i in zip(names[kind][1], sub.outputs)])
    return infos


def _verify(manifest: Manifest, runtime: str, example: _Example, tol: float) -> dict[str, float]:
    """The written graphs against the model's forward (see convert_vlm_graphs)."""
    import numpy as np

    gen = VisionGenerator(manifest, runtime=runtime)
    ids = [int(i) for i in example.ids]
    features = gen.image_features(example.pixel_values.numpy()[None])
    errors = {VISION_GRAPH: float(np.abs(features - example.features).max())}
    wants = {VISION_GRAPH: example.features}
    p, longest = example.prefix_len, max(manifest.prefill_graphs)
    for n, g in manifest.prefill_graphs.items():  # the whole prompt through each prefill graph alone
        gen.reset()
        gen.attach_images(ids[:-1], 0, features)
        gen.prefix_len = p
        # a prefix-LM's prefix in one run (of this graph if it holds it), the causal rest in runs of n
        first = [(n if n >= p else longest, 0)] if p else []
        gen.plan = lambda start, end, n=n, first=first: first + [(n, s) for s in range(max(start, p), end, n)]
        logits = gen.feed(ids[:-1])
        errors[g], wants[g] = float(np.abs(logits - example.logits[-2]).max()), example.logits[-2]
    step = gen.decode(ids[-1])
    errors["decode"], wants["decode"] = float(np.abs(step - example.logits[-1]).max()), example.logits[-1]
    for g, err in errors.items():
        scale = max(1.0, float(np.abs(wants[g]).max()))
        if not err <= tol * scale:
            raise VerifyError(f"the written {g} graph does not match the model: {runtime} gives max abs error "
                              f"{err:.3g} (tolerance {tol:.3g} x {scale:.3g}); nothing was written. Convert without "
                              f"--verify to inspect the files (circleops inspect), and report the model.")
    return errors



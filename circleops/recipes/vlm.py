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
* Gemma 3 (``Gemma3ForConditionalGeneration``): each image's tokens attended both ways.
* Qwen2-VL / Qwen2.5-VL: a patch tower (adapters.qwen_vision) over one image resized to the
  directory's fixed size (circleops.generation.patch_images), its integer inputs from the
  host; the prefill takes the 3-D M-RoPE positions (``rope_positions [3, 1, N]``), the decode
  ``rope_delta``.

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

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from circleops.dtypes import short_name
from circleops.errors import CircleOpsError, ModelLoadError, TargetError
from circleops.generation.patch_images import fixed_side, load_patch_processor
from circleops.generation.vision import VisionGenerator, load_processor
from circleops.options import DEFAULT_PREFILL_LENS, ConvertOptions
from circleops.package import step as package_step
from circleops.package.manifest import Manifest, prefill_graph_name
from circleops.package.report import GraphsReport
from circleops.package.step import Graph
from circleops.recipes.base import Recipe, eos_token_ids, pad_token_id, save_generation_config
from circleops.recipes.llm import (check_lengths, decoder_step, default_cache_update, example_args, io_names,
                                  positions_of, prefill_lengths, save_tokenizer, text_lines)
from circleops.package.vision_manifest import (IMAGE_EMBEDS, PATCH_INDEX, PIXEL_VALUES, PREFIX_LEN, ROPE_DELTA,
                                               ROPE_POSITIONS, VISION_GRAPH, VLM_GRAPH_NAMES, VisionSpec,
                                               vlm_model_type)
from circleops.adapters.vlm import BY_MODEL_TYPE, FAMILIES, family_of

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

def _classes(model_type: str) -> Any:
    import transformers

    return getattr(transformers, VLM_MODEL_TYPES[model_type])


def load(model: str | os.PathLike | None, *, config: str | os.PathLike | None = None, seed: int = 0,
         allow_random_init: bool = False, dtype: Any = None) -> tuple[Any, Any]:
    """(the model, its processor or None) from a directory (config.json + safetensors, as
    ``save_pretrained`` writes it) or, with ``config``, random weights from a config.json: the
    one loader (circleops.sources.models.load: sizes, JSON files and remote code checked
    first, every weight of the model in the files unless ``allow_random_init``) with the
    family's transformers class, in ``dtype`` (a torch dtype; default float32)."""
    from circleops.sources import models

    kind = vlm_model_type(model, config)
    if kind is None:
        raise ModelLoadError(f"{config or model} is not a vision-language model circleops knows (model_type "
                             f"{', '.join(VLM_MODEL_TYPES)}).")
    loaded = models.load(None if config else str(model), config=str(config) if config else None, seed=seed,
                         allow_random_init=allow_random_init, model_class=lambda *_: _classes(kind),
                         **({"dtype": dtype} if dtype is not None else {}))
    processor = None
    if model and not config:
        processor = load_processor(Path(model), required=False)
        if BY_MODEL_TYPE[kind].tower == "qwen":  # its own processor (Qwen2VLProcessor needs torchvision)
            processor = load_patch_processor(Path(model))
    return loaded.module.eval(), processor


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


def vision_spec(model: Any, processor: Any = None) -> VisionSpec:
    """The manifest's vision entry of ``model``; a patch tower's (Qwen) from ``processor``'s
    fixed image size too (:func:`patch_geometry`)."""
    cfg = model.config
    fam = family_of(model)
    common = dict(graph=VISION_GRAPH, image_token_id=int(cfg.image_token_id), hidden_size=int(cfg.text_config.hidden_size),
                  family=str(cfg.model_type), prefix_lm=fam.prefix_lm, image_blocks=fam.image_blocks, mrope=fam.mrope)
    if fam.tower == "qwen":
        return VisionSpec(**common, **patch_geometry(model, processor))
    return VisionSpec(**common, image_seq_len=fam.tokens_per_image(model), tile_size=int(cfg.vision_config.image_size))


def patch_geometry(model: Any, processor: Any = None) -> dict[str, Any]:
    """A patch tower's fixed image (circleops.generation.patch_images): every image resized to
    one square, so one grid of patches and one count of image tokens. Its side is the
    processor's (or, without one, what the model's default image processor allows); the
    processor's patches must be the model's."""
    vc = model.config.vision_config
    patch, merge, frames = int(vc.patch_size), int(vc.spatial_merge_size), int(vc.temporal_patch_size)
    if processor is not None:
        ip = processor.image_processor
        theirs = (int(ip.patch_size), int(ip.merge_size), int(ip.temporal_patch_size))
        if theirs != (patch, merge, frames):
            raise TargetError(f"the processor saved with {model.config.model_type} cuts patches of (patch, merge, "
                              f"frames) {theirs} and the model takes {(patch, merge, frames)}: save the model's own "
                              f"processor with it.")
        side = int(processor.side)
    else:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        side = fixed_side(Qwen2VLImageProcessorPil(patch_size=patch, merge_size=merge, temporal_patch_size=frames))
    per = side // patch
    windowed = getattr(vc, "fullatt_block_indexes", None) is not None  # Qwen2.5: window attention
    patches = {"grid": [1, per, per], "patch_dim": int(getattr(vc, "in_channels", 3)) * frames * patch * patch,
               "merge_size": merge, "patch_size": patch, "window_size": int(vc.window_size) if windowed else 0}
    return {"image_seq_len": (per // merge) ** 2, "tile_size": side, "patches": patches}


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


def _patch_example(model: Any, spec: VisionSpec, lengths: Sequence[int]) -> _Example:
    """A patch tower's (Qwen) verify prompt: text, one image's tokens on the fixed grid, text,
    through the model's own forward (its vision tower on random patches, its merge and its
    M-RoPE positions, get_rope_index's)."""
    import torch

    from circleops.adapters.qwen_vision import QwenVisionTower
    from circleops.generation.patch_images import graph_index

    vocab = int(model.config.text_config.vocab_size)
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, vocab, (max(2, min(lengths) // 2) + 2,), generator=g)
    text = torch.where(text == spec.image_token_id, (text + 1) % vocab, text)
    ids = torch.cat([text[:2], torch.full((spec.image_seq_len,), spec.image_token_id), text[2:]])
    index = graph_index(spec.patches)
    pixels = torch.rand((index.patches, spec.patches["patch_dim"]), generator=g) * 2 - 1
    kw = {"pixel_values": pixels, "image_grid_thw": torch.tensor([spec.patches["grid"]])}
    kinds = (ids == spec.image_token_id).to(torch.int32)[None]
    p = len(ids) - 1
    with torch.no_grad():
        logits = model(input_ids=ids[None, :p], mm_token_type_ids=kinds[:, :p], use_cache=False, **kw).logits[0]
        last = model(input_ids=ids[None], mm_token_type_ids=kinds, use_cache=False, **kw).logits[0, -1:]
        features = QwenVisionTower(model)(pixels, *index.inputs())
    return _Example(ids, pixels, features.numpy(), torch.cat([logits, last]).float().numpy())


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
    # PaliGemma's and Gemma 3's pixel_values are [B, 3, S, S]; Idefics3's [B, tiles, 3, S, S]
    fam = family_of(model)
    pv = (pixels if spec.prefix_lm or fam.image_blocks else pixels[None]).to(model.dtype)  # fp16: the tower's
    kinds = {}
    if spec.prefix_lm:
        kinds = {"token_type_ids": (torch.arange(len(ids)) >= prefix).long()[None]}
    elif fam.image_blocks:  # Gemma 3: its image block attended both ways (transformers reads it from these)
        kinds = {"token_type_ids": (ids == spec.image_token_id).long()[None]}
    p = len(ids) - 1
    with torch.no_grad():
        logits = model(input_ids=ids[None, :p], pixel_values=pv, use_cache=False,
                       **{k: v[:, :p] for k, v in kinds.items()}).logits[0]
        # the last token after the prompt (the decode check): the same forward, one longer
        last = model(input_ids=ids[None], pixel_values=pv, use_cache=False, **kinds).logits[0, -1:]
        features = VisionTower(model)(pixels.to(model.dtype))[0]
    return _Example(ids, pixels, features.float().numpy(), torch.cat([logits, last]).float().numpy(), prefix)


class VLMRecipe(Recipe):
    """A vision-language model's vision graph (one image tile -> its embeddings; fp32 whatever
    ``quantize`` says), prefill graphs that merge image embeddings (one per length; a
    prefix-LM's take ``prefix_len``) and the text model's decode graph (see the module
    docstring). ``processor`` is saved with the graphs; its tokenizer tokenizes calibration text."""

    kind = "vision"
    graph_names = VLM_GRAPH_NAMES

    def __init__(self, model: Any, options: ConvertOptions | None = None, *, processor: Any = None,
                 source: str = ""):
        super().__init__(model, options, tokenizer=getattr(processor, "tokenizer", None), source=source)
        self.processor = processor

    def dtype(self) -> Any:
        """fp16 for a model in float16 (--dtype fp16 loads it so: every graph fp16, as the LLM
        recipe's; targets circle and tflite), else fp32."""
        import torch

        return torch.float16 if getattr(self.model, "dtype", None) == torch.float16 else torch.float32

    @classmethod
    def check_options(cls, options: ConvertOptions, source: str | None = None) -> None:
        parse_vlm_graphs(options.graphs if options.graphs is not None else VLM_GRAPH_NAMES)
        if vlm_model_type(source, options.config) is None and (source is not None or options.config is not None):
            raise TargetError(f"--graphs {options.graphs}: the vision graph is for vision-language models (model_type "
                              f"{', '.join(VLM_MODEL_TYPES)}); {options.config or source} is not one. Use --graphs "
                              f"prefill,decode for a causal LM.")

    @classmethod
    def from_source(cls, model: str | None, options: ConvertOptions) -> "VLMRecipe":
        from circleops.pipeline.validate import resolve_dtype

        module, processor = load(model, config=options.config, seed=options.seed,
                                 allow_random_init=options.allow_random_init, dtype=resolve_dtype(options.dtype, None))
        return cls(module, options, processor=processor, source=str(options.config or model))

    def check(self, opts: Any) -> None:
        import torch

        o, model = self.options, self.model
        parse_vlm_graphs(o.graphs if o.graphs is not None else VLM_GRAPH_NAMES)
        if type(model).__name__ not in VLM_MODEL_TYPES.values():
            raise TargetError(f"convert_vlm_graphs takes one of {', '.join(VLM_MODEL_TYPES.values())}; got "
                              f"{type(model).__name__}.")
        self.lengths = lengths = prefill_lengths(DEFAULT_PREFILL_LENS if o.seq_len is None else o.seq_len)
        source = self.source or "the model"
        limit = getattr(model.config.text_config, "max_position_embeddings", None)
        check_lengths(lengths[0], o.max_cache_len, limit, source)
        check_lengths(lengths[-1], o.max_cache_len, None, source)
        self.spec = spec = vision_spec(model, self.processor)
        if spec.patches and self.dtype() != torch.float32:
            # the patch tower's host side (generation.patch_images) feeds fp32 patches: not built for fp16 yet
            raise TargetError(f"--dtype fp16: {source} ({spec.family}) converts in fp32 only so far (its patch "
                              f"tower's fp16 graphs are not built); drop --dtype fp16, or use --quantize for the "
                              f"text graphs.")
        if spec.prefix_lm and lengths[0] < spec.image_seq_len + PREFIX_TEXT:
            raise TargetError(f"--seq-len {','.join(map(str, lengths))}: {source} ({spec.family}) attends both ways "
                              f"over its prompt prefix (the image's {spec.image_seq_len} tokens, BOS, the prompt and "
                              f"\"\\n\"), so the whole prefix goes through one prefill run: the longest --seq-len must "
                              f"hold the image and the longest prompt, at least {spec.image_seq_len + PREFIX_TEXT} "
                              f"(e.g. --seq-len {spec.image_seq_len + 32},8).")
        self.cache_update = default_cache_update(opts.target)

    def weights_module(self) -> Any:
        from circleops.adapters.vlm import TextLM

        return TextLM(self.model.eval())

    def references(self) -> _Example:
        if self.spec.patches:
            return _patch_example(self.model, self.spec, self.lengths)
        return _example(self.model, self.spec, self.lengths)

    def exporting(self) -> Any:
        return family_of(self.model).explicit_mask(self.model)

    def graphs(self, opts: Any, parts: Sequence[tuple[int, int]]) -> list[Graph]:
        import torch

        from circleops.adapters.vlm import ImagePrefill, MRopeDecode, TextLM

        spec, model, o = self.spec, self.model, self.options
        graphs = [_vision_graph(model, spec, self.dtype())]
        self.step = step = decoder_step(TextLM(model), o.max_cache_len, self.cache_update)
        self.names = names = _io(step.num_layers, self.cache_update, spec.prefix_lm, spec.mrope)
        prefill = ImagePrefill(step, spec.image_token_id, prefix_lm=spec.prefix_lm,
                               image_blocks=family_of(self.model).image_blocks, mrope=spec.mrope)
        for n in self.lengths:
            # M-RoPE: the rows' t/h/w positions [3, 1, n]; a prefix-LM: prefix_len
            extra = ((torch.arange(n).expand(3, 1, n).clone(),) if spec.mrope else ()) + \
                ((torch.tensor([n]),) if spec.prefix_lm else ())
            args = (torch.zeros((1, n), dtype=torch.int64), torch.tensor([0]), torch.tensor([n - 1]),
                    torch.zeros((1, n, spec.hidden_size), dtype=self.dtype()), *extra, *step.empty_caches())
            graphs.append(Graph(prefill_graph_name(n, self.lengths), prefill, args, *names["prefill"], rows=n))
        args = example_args(step, "decode", self.lengths[0])
        decode, args = (MRopeDecode(step), (*args[:2], torch.tensor([0]), *args[2:])) if spec.mrope else (step, args)
        graphs.append(Graph("decode", decode, args, *names["decode"], rows=1))
        self.graph_list = [g.name for g in graphs]
        return graphs

    def manifest(self, directory: Path, opts: Any, plan: Any, infos: dict[str, Any]) -> Manifest:
        from circleops.adapters.vlm import TextLM

        step, files = self.step, {g: plan.file(g) for g in self.graph_list}
        tokenizer_dir = save_tokenizer(self.processor, directory)
        save_generation_config(self.model, directory)
        text = TextLM(self.model)
        eos = eos_token_ids(getattr(text, "generation_config", None), getattr(text, "config", None))
        k_names, outs = self.names["decode"]
        return Manifest(
            directory=directory, target=opts.target, dtype=short_name(opts.dtype), files=files, quantize=opts.quantize,
            num_threads=opts.threads, signatures={g: infos[g].signature for g in files},
            prefill_len=self.lengths[0], prefill_lens=list(self.lengths), prefill_inputs=self.names["prefill"][0],
            max_cache_len=self.options.max_cache_len, num_layers=step.num_layers, cache_shape=list(step.cache_shape),
            cache_layout=step.cache_layout, vocab_size=int(self.model.config.text_config.vocab_size), inputs=k_names,
            outputs=outs, eos_token_ids=eos, pad_token_id=pad_token_id(getattr(text, "config", None), eos),
            tokenizer=tokenizer_dir, source=self.source, cache_update=self.cache_update, vision=self.spec.to_json(),
            signature_api=plan.signature_api,
            max_positions=positions_of(self.model.config.text_config, self.options.max_cache_len))

    def compare(self, manifest: Manifest, runtime: str, example: _Example) -> dict[str, tuple[float, float]]:
        return compare(manifest, runtime, example)

    def noise(self, example: _Example, moved: _Example) -> dict[str, float]:
        """At what :func:`compare` reads: the vision features (fp32: no floor), the prefills'
        logits of the last prompt token, the decode step's of the next."""
        import numpy as np

        rows = np.abs(moved.logits - example.logits).max(axis=-1)
        floors = {g: float(rows[-2]) for g in self.graph_list}
        return {**floors, VISION_GRAPH: float(np.abs(moved.features - example.features).max()),
                "decode": float(rows[-1])}

    def describe(self, manifest: Manifest) -> dict[str, Any]:
        lines = text_lines(manifest, self.graph_list)
        return {**lines, "next_args": '--image photo.png --prompt "..."' if lines["next_args"] else None}


def convert_vlm_graphs(model: Any, out_dir: str | os.PathLike, options: ConvertOptions | None = None, *,
                       processor: Any = None, source: str = "", progress: Progress | None = None,
                       **fields: Any) -> GraphsReport:
    """Write the vision, prefill and decode graphs of ``model`` (a model of a family of
    circleops.adapters.vlm: SmolVLM / Idefics3, PaliGemma) into ``out_dir`` with
    ``manifest.json`` (its ``vision`` section) and the processor in ``out_dir/tokenizer``: the
    :class:`VLMRecipe` through the package step (circleops.package.step.run).

    The options are ``options`` (circleops.options.ConvertOptions) or the same names as
    keyword arguments (``target`` defaults to "onert" here): ``graphs`` (all three),
    ``seq_len`` (or ``prefill_len``) and ``max_cache_len`` as for
    :func:`circleops.recipes.llm.convert_graphs`; ``quantize``: a weight-only format (q4_0, q8_0,
    w8) for the text graphs (prefill and decode share one set of blocks), the vision graph
    stays fp32; ``threads`` as for convert_graphs. A model in float16 (``model.half()``;
    ``circleops convert --dtype fp16`` loads it so) writes fp16 graphs, targets circle and tflite.

    ``verify``: run the written graphs (True: the target's runtime, or name one) on a prompt
    of text and one image tile, against the model's own forward with ``pixel_values``: the
    vision graph's embeddings, the prefill's logits of the last prompt token and one decode
    step; VerifyError above ``tolerance`` x max(1, max|value|); with ``quantize``, against
    the model running the weights the files hold (dequantized). The text model's modules
    are fused in place (circleops.fuse).
    """
    opts = ConvertOptions.of(options, fields, "convert_vlm_graphs", target="onert")
    return package_step.run(VLMRecipe(model, opts, processor=processor, source=source), out_dir, progress)


def _vision_graph(model: Any, spec: VisionSpec, dtype: Any) -> Graph:
    """The vision graph in the model's float type (never --quantize'd): one tile ``pixel_values [1, 3, S, S]``
    (VisionTower), or a patch tower's one image on the fixed grid ``pixel_values [N, C*T*P*P]``
    and its integer inputs (QwenVisionTower, circleops.generation.patch_images.graph_index)."""
    import torch

    from circleops.adapters.vlm import VisionTower

    if spec.patches:
        from circleops.adapters.qwen_vision import QwenVisionTower
        from circleops.generation.patch_images import graph_index

        index = graph_index(spec.patches)
        args = (torch.zeros((index.patches, spec.patches["patch_dim"])), *index.inputs())
        return Graph(VISION_GRAPH, QwenVisionTower(model).eval(), args, [PIXEL_VALUES, *PATCH_INDEX], [IMAGE_EMBEDS],
                     quantize=False)
    tile = torch.zeros((1, 3, spec.tile_size, spec.tile_size), dtype=dtype)
    return Graph(VISION_GRAPH, VisionTower(model).eval(), (tile,), [PIXEL_VALUES], [IMAGE_EMBEDS], quantize=False)


def _io(num_layers: int, cache_update: str, prefix_lm: bool = False,
        mrope: bool = False) -> dict[str, tuple[list[str], list[str]]]:
    """Input and output names per graph kind: the prefill's image_embeds (then M-RoPE's
    rope_positions, a prefix-LM's prefix_len) after logits_row; M-RoPE's decode takes
    rope_delta after pos."""
    ins, outs = io_names(num_layers, "prefill", cache_update)
    prefill_ins = [*ins[:3], IMAGE_EMBEDS, *([ROPE_POSITIONS] if mrope else []), *([PREFIX_LEN] if prefix_lm else []),
                   *ins[3:]]
    d_ins, d_outs = io_names(num_layers, "decode", cache_update)
    decode_ins = [*d_ins[:2], ROPE_DELTA, *d_ins[2:]] if mrope else d_ins
    return {VISION_GRAPH: ([PIXEL_VALUES], [IMAGE_EMBEDS]), "prefill": (prefill_ins, outs),
            "decode": (decode_ins, d_outs)}


def compare(manifest: Manifest, runtime: str, example: _Example) -> dict[str, tuple[float, float]]:
    """Graph -> (max abs error, max |reference|): the written graphs against the model's
    forward (see convert_vlm_graphs); the package step applies the tolerance."""
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
        if gen.vision.image_blocks:  # runs of n that keep each image block whole (Gemma 3)
            gen.plan = lambda start, end, n=n: gen._block_plan(start, end, (n,))
        logits = gen.feed(ids[:-1])
        errors[g], wants[g] = float(np.abs(logits - example.logits[-2]).max()), example.logits[-2]
    step = gen.decode(ids[-1])
    errors["decode"], wants["decode"] = float(np.abs(step - example.logits[-1]).max()), example.logits[-1]
    return {g: (err, float(np.abs(wants[g]).max())) for g, err in errors.items()}

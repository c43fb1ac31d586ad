"""Hugging Face models that are not text decoders: the task table ``circleops convert`` uses.

A *task* says which transformers class to build from a config (``AutoModelFor...``), which
inputs the graph takes and how they are shaped (from the config and the saved processor),
and how ``circleops run`` reads its outputs. One row per task in :data:`TASKS`; the task of
a model directory is inferred from config.json (``architectures``, else ``model_type``).

    from circleops.recipes import tasks
    report = tasks.convert_task("my-vit/", "vit.circle", target="onert", verify=True)

The written file records the task, the source model directory, its input/output names and
``id2label`` in its metadata (:data:`METADATA_KEY`), so ``circleops run vit.circle --image
cat.png`` finds the processor and prints labels. text-generation (causal LMs) keeps its own
path (``circleops.sources.models`` / ``--graphs``); it is listed here so that inference and the
error messages cover every task.
"""
from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from circleops.errors import CircleOpsError, ModelLoadError, TargetError
from circleops.options import TASK_METADATA_KEY, ConvertOptions
from circleops.inputs.remote_code import refuse_remote_code
from circleops.inputs.user_files import check_bytes, check_count, machine_memory, parse_json, read_json

METADATA_KEY = TASK_METADATA_KEY  # circleops.options: inspect reads it without importing this module
DEFAULT_SEQ_LEN = 64
DEFAULT_IMAGE_SIZE = 224
MAX_IMAGE_SIDE = 16384  # a processor's height/width; the input's bytes are checked as well
DEFAULT_SAMPLING_RATE = 16000


@dataclass(frozen=True)
class Task:
    """One task: the transformers ``*_MAPPING_NAMES`` table its classes come from, the
    modalities its main input may have, and what ``circleops run`` prints."""

    name: str
    mapping: str  # a dict in transformers.models.auto.modeling_auto: model_type -> class name
    modalities: tuple[str, ...]  # "text" (input_ids), "image" (pixel_values), "audio" (input_values/features)
    description: str
    encoder: bool = False  # the graph is model.get_encoder() (encoder-decoder speech models)
    base: bool = False  # the graph is the base model (of a head model's checkpoint: its body, as saved)
    reads: str = "summary"  # how run prints the outputs: labels / token-labels / fill-mask / ctc / summary


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("text-generation", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", ("text",),
         "causal LM: input_ids -> logits (also --graphs prefill,decode)"),
    Task("feature-extraction", "MODEL_MAPPING_NAMES", ("text", "audio"),
         "the base model: -> last_hidden_state (+ pooler_output)", base=True),
    Task("fill-mask", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", ("text",), "masked LM: -> logits over the vocabulary",
         reads="fill-mask"),
    Task("text-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", ("text",),
         "-> logits per label (config.id2label)", reads="labels"),
    Task("token-classification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", ("text",),
         "-> logits per token and label", reads="token-labels"),
    Task("question-answering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", ("text",),
         "extractive QA: -> start_logits, end_logits"),
    Task("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", ("image",),
         "pixel_values -> logits per label", reads="labels"),
    Task("image-feature-extraction", "MODEL_MAPPING_NAMES", ("image",),
         "pixel_values -> last_hidden_state (+ pooler_output)", base=True),
    Task("semantic-segmentation", "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES", ("image",),
         "-> logits per label and pixel (at the model's output resolution)", reads="segmentation"),
    Task("depth-estimation", "MODEL_FOR_DEPTH_ESTIMATION_MAPPING_NAMES", ("image",), "-> predicted_depth"),
    Task("object-detection", "MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES", ("image",),
         "-> logits per query and label, pred_boxes (models with a static set of queries)", reads="detections"),
    Task("audio-classification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", ("audio",),
         "waveform or features -> logits per label", reads="labels"),
    Task("automatic-speech-recognition", "MODEL_FOR_CTC_MAPPING_NAMES", ("audio",),
         "CTC: waveform -> logits per frame over the characters", reads="ctc"),
    Task("speech-encoder", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", ("audio",),
         "the encoder of a speech-to-text model (Whisper): input_features -> last_hidden_state", encoder=True),
)}

_MODALITY = {"input_ids": "text", "pixel_values": "image", "input_values": "audio", "input_features": "audio"}


def task_names() -> str:
    return ", ".join(TASKS)


def _mapping(task: Task) -> dict[str, Any]:
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, task.mapping)


def _class_names(value: Any) -> tuple[str, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _modality(cls: type) -> str:
    return _MODALITY.get(getattr(cls, "main_input_name", "input_ids"), "text")


def _transformers_class(name: str) -> type | None:
    import transformers

    try:
        return getattr(transformers, name)
    except (AttributeError, ImportError, RuntimeError):  # a class whose optional dependency is missing
        return None


def tasks_for(model_type: str) -> list[str]:
    """The tasks transformers has a class for with this model_type (and input modality)."""
    found = []
    for task in TASKS.values():
        names = _mapping(task).get(model_type)
        cls = _transformers_class(_class_names(names)[0]) if names else None
        if cls is not None and _modality(cls) in task.modalities:
            found.append(task.name)
    return found


def infer_task(cfg: dict[str, Any], source: str = "the model") -> str:
    """The task of a config.json (a dict): its ``architectures`` if given, else the model_type's
    causal LM (as circleops always did), else its base model (feature extraction)."""
    model_type = cfg.get("model_type")
    archs = [a for a in cfg.get("architectures") or [] if isinstance(a, str)]
    for arch in archs:
        for task in TASKS.values():
            if any(arch in _class_names(v) for v in _mapping(task).values()):
                cls = _transformers_class(arch)
                if cls is not None and _modality(cls) in task.modalities:
                    return task.name
        if arch.endswith(("ForCausalLM", "LMHeadModel")):
            return "text-generation"
    if archs:
        raise TargetError(f"{source}: circleops does not know the task of {', '.join(archs)} (config.json "
                          f"architectures). Pass --task, one of: {task_names()}"
                          + (f" ({model_type} has: {', '.join(tasks_for(model_type))})." if model_type else "."))
    available = tasks_for(model_type) if model_type else []
    base = _mapping(TASKS["feature-extraction"]).get(model_type)
    base_cls = _transformers_class(_class_names(base)[0]) if base else None
    # a text model's causal LM, as circleops always built (not Whisper's decoder-only LM: its model hears)
    if "text-generation" in available and (base_cls is None or _modality(base_cls) == "text"):
        return "text-generation"
    for name in ("image-feature-extraction", "speech-encoder", "feature-extraction"):
        if name in available:
            return name
    raise TargetError(f"{source}: transformers has no model class circleops can convert for model_type "
                      f"{model_type!r}. circleops knows the tasks: {task_names()}.")


def check_task(name: str) -> Task:
    if name not in TASKS:
        raise TargetError(f"unknown task {name!r}: circleops converts {task_names()}.")
    return TASKS[name]


def model_class_for(task_name: str):
    """A ``model_class`` callback for circleops.sources.models.load: the task's class for the config."""
    task = check_task(task_name)

    def pick(config: Any, cfg: dict[str, Any], source: str) -> type:
        model_type = cfg.get("model_type")
        names = _mapping(task).get(model_type)
        archs = [a for a in cfg.get("architectures") or [] if names and a in _class_names(names)]
        if task.base and names and not archs:  # a head model's checkpoint: built as saved, its body taken
            saved = [c for c in map(_transformers_class, cfg.get("architectures") or []) if c is not None]
            if saved and _modality(saved[0]) in task.modalities:
                return saved[0]
        cls = _transformers_class((archs or list(_class_names(names or ())))[0]) if names else None
        if cls is None or _modality(cls) not in task.modalities:
            has = tasks_for(model_type) if model_type else []
            raise TargetError(f"{source}: transformers has no {task.name} model for model_type {model_type!r}. "
                              f"Its tasks: {', '.join(has) or 'none circleops knows'}; pass one of them as --task.")
        return cls

    return pick


# --------------------------------------------------------------------------- example inputs

def _processor_config(model_dir: str | None) -> dict[str, Any]:
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = Path(model_dir) / name if model_dir else None
        if path is not None and path.is_file():
            try:
                cfg = read_json(path)
            except CircleOpsError:  # damaged: transformers' processor reports it when it loads
                continue
            return cfg.get("image_processor", cfg.get("feature_extractor", cfg)) if isinstance(cfg, dict) else {}
    return {}


def _image_hw(config: Any, proc: dict[str, Any]) -> tuple[int, int]:
    """(height, width) the processor makes (its crop, else its size), else the config's image_size."""
    def side(value: Any) -> int:  # a processor's size is a user's file: a count, checked
        return check_count(value, f"the processor's image {key} {size!r}", high=MAX_IMAGE_SIDE, error=TargetError,
                           fix="Fix preprocessor_config.json, or give the shape with --input-shape.")

    for key in (("crop_size",) if proc.get("do_center_crop") else ()) + ("size",):
        size = proc.get(key)
        if isinstance(size, int):
            return side(size), side(size)
        if isinstance(size, dict):
            if "height" in size and "width" in size:
                return side(size["height"]), side(size["width"])
            if "shortest_edge" in size:
                return side(size["shortest_edge"]), side(size["shortest_edge"])
    size = getattr(config, "image_size", None)
    if isinstance(size, int):
        return size, size
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return int(size[0]), int(size[1])
    return DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE


def input_shapes(model: Any, config: Any, model_dir: str | None, seq_len: int | None) -> dict[str, tuple]:
    """The graph's inputs, name -> (shape, torch dtype name), from the config and the processor."""
    main = getattr(model, "main_input_name", "input_ids")
    proc = _processor_config(model_dir)
    if main == "input_ids":
        if seq_len is None:
            seq_len = min(DEFAULT_SEQ_LEN, getattr(config, "max_position_embeddings", None) or DEFAULT_SEQ_LEN)
        from circleops.sources.models import check_seq_len

        check_seq_len(seq_len, getattr(config, "max_position_embeddings", None), "the model")
        shapes = {"input_ids": ((1, seq_len), "int64")}
        if "attention_mask" in inspect.signature(model.forward).parameters:
            shapes["attention_mask"] = ((1, seq_len), "int64")
        return shapes
    if main == "pixel_values":
        h, w = _image_hw(config, proc)
        return {"pixel_values": ((1, getattr(config, "num_channels", 3) or 3, h, w), "float32")}
    if main == "input_features":  # log-mel frames (Whisper: 2 x max_source_positions)
        frames = 2 * getattr(config, "max_source_positions", 1500)
        return {"input_features": ((1, getattr(config, "num_mel_bins", 80), frames), "float32")}
    if main == "input_values" and getattr(config, "num_mel_bins", None) and getattr(config, "max_length", None):
        return {"input_values": ((1, config.max_length, config.num_mel_bins), "float32")}  # AST spectrogram
    if main == "input_values":  # one second of waveform
        return {"input_values": ((1, int(proc.get("sampling_rate", DEFAULT_SAMPLING_RATE))), "float32")}
    raise TargetError(f"cannot make example inputs for a model whose main input is {main!r}; circleops knows "
                      f"{', '.join(_MODALITY)}.")


def check_input_sizes(shapes: dict[str, tuple]) -> None:
    """TargetError when an example input (from --input-shape, the processor or the config)
    would take more than a quarter of the machine's memory: the export's activations are
    several times larger, so such a shape cannot convert here (and 1e18 would not allocate)."""
    for name, (shape, dtype) in shapes.items():
        count = 1
        for n in shape:
            count *= int(n)
        check_bytes(count * (8 if dtype == "int64" else 4), f"the example input {name} of shape "
                    f"{'x'.join(map(str, shape))}", limit=machine_memory() // 4, limit_name="a quarter of this machine's memory", error=TargetError,
                    fix="Give a smaller shape with --input-shape NAME=DxDx..., or fix the processor's size in "
                        "preprocessor_config.json.")


def parse_input_shapes(items: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """``["pixel_values=1x3x224x224", ...]`` -> {name: shape}."""
    shapes: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, _, dims = item.partition("=")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            shape = ()
        if not name or not shape or min(shape) < 1:
            raise TargetError(f"--input-shape {item!r}: write NAME=DxDx... with positive sizes, e.g. "
                              "pixel_values=1x3x224x224.")
        shapes[name] = shape
    return shapes


def example_inputs(shapes: dict[str, tuple], vocab_size: int | None, seed: int = 0) -> dict[str, Any]:
    """Deterministic tensors for the shapes: token ids below vocab_size, a mask of ones, noise."""
    import torch

    g = torch.Generator().manual_seed(seed)
    inputs = {}
    for name, (shape, dtype) in shapes.items():
        if name == "attention_mask":
            inputs[name] = torch.ones(shape, dtype=torch.int64)
        elif dtype == "int64":
            inputs[name] = torch.randint(0, vocab_size or 2, shape, generator=g)
        else:
            inputs[name] = torch.randn(shape, generator=g)
    return inputs


# --------------------------------------------------------------------------- the graph

def task_module(model: Any, input_names: Sequence[str]) -> Any:
    """``model`` as a module whose forward takes the inputs by these names, positionally (so
    the file's inputs carry them) and returns the ModelOutput's tensors as a tuple."""
    import torch

    names = list(input_names)

    def forward(self, *args):
        out = self.model(**dict(zip(names, args)), return_dict=True)
        values = out.values() if hasattr(out, "values") else out
        return tuple(v for v in values if isinstance(v, torch.Tensor))

    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ["self"] + names]
    forward.__signature__ = inspect.Signature(params)  # torch.export names the placeholders from it
    cls = type(f"{type(model).__name__}Task", (torch.nn.Module,), {"forward": forward})
    module = cls()
    module.model = model
    return module.eval()


def output_names(model: Any, inputs: dict[str, Any]) -> list[str]:
    """The names of the tensors the model returns on ``inputs`` (logits, last_hidden_state, ...)."""
    import torch

    with torch.no_grad():
        out = model(**inputs, return_dict=True)
    return [k for k, v in out.items() if isinstance(v, torch.Tensor)]


def convert_task(model: str | None, path: str | os.PathLike, options: ConvertOptions | None = None, *,
                 progress: Any = None, **fields: Any) -> Any:
    """Convert the HF model directory ``model`` (or the ``config`` option: random weights) for
    its ``task`` (inferred from config.json when None) with ``circleops.convert``; returns its
    Report.

    The options are ``options`` (circleops.options.ConvertOptions) or the same names as
    keyword arguments: ``task``, ``config``, ``seq_len`` (a text model's sequence length),
    ``input_shape`` ({input name: shape}), ``dtype``, ``seed``, ``allow_random_init``, and every
    option circleops.convert takes (target, verify, fuse, quantize, ...).
    """
    import tempfile

    from circleops.pipeline import convert as conversion
    from circleops.sources import models

    o = ConvertOptions.of(options, fields, "convert_task")
    name = check_task(o.task).name if o.task else task_of(model, o.config)
    if name == "text-generation":
        raise TargetError("text-generation (causal LMs) converts with circleops.convert / `circleops convert` "
                          "directly; convert_task is for the other tasks.")
    from circleops.pipeline.validate import resolve_dtype

    source = models.load(model, config=o.config, dtype=resolve_dtype(o.dtype, None), seed=o.seed,
                         allow_random_init=o.allow_random_init, model_class=model_class_for(name))
    hf = source.module
    graph_model = hf.get_encoder() if TASKS[name].encoder else hf.base_model if TASKS[name].base else hf
    model_dir = None if o.config is not None else str(Path(source.source).resolve())
    inputs = _example_inputs(graph_model, hf.config, model_dir, o)
    names = _output_names(graph_model, inputs)
    record = _record(name, hf, model_dir, inputs, names)
    with tempfile.TemporaryDirectory(prefix="circleops-calib-") as tmp:
        if "input_ids" in inputs and o.quantize and not o.calibration_data:
            o = o.replace(calibration_data=_text_calibration(inputs, model_dir, hf.config, o, tmp))
        report = conversion.convert(task_module(graph_model, list(inputs)), tuple(inputs.values()), path,
                                    o.replace(output_names=tuple(names),
                                              metadata={METADATA_KEY: json.dumps(record).encode()}),
                                    progress=progress)
    # The decoder-family adapters did not apply to this model: not a thing the user must act on.
    report.warnings[:] = [w for w in report.warnings if not w.startswith("patched_modules(): these patched")]
    report.source = f"{source.source} ({name}, {type(hf).__name__}" + (", encoder)" if TASKS[name].encoder else ")")
    return report


def _example_inputs(graph_model: Any, config: Any, model_dir: str | None, o: ConvertOptions) -> dict[str, Any]:
    """The graph's example inputs: shapes from the config and processor, ``o.input_shape``'s
    over them (each a known input), checked against the machine's memory."""
    shapes = input_shapes(graph_model, config, model_dir, o.seq_len)
    for key, shape in (o.input_shape or {}).items():
        if key not in shapes:
            raise TargetError(f"--input-shape {key}: the model has no input {key!r}; its inputs: {', '.join(shapes)}.")
        shapes[key] = (shape, shapes[key][1])
    check_input_sizes(shapes)
    return example_inputs(shapes, getattr(config, "vocab_size", None), o.seed)


def _output_names(graph_model: Any, inputs: dict[str, Any]) -> list[str]:
    """The model's output names on ``inputs``; TargetError when it does not run on them."""
    try:
        return output_names(graph_model, inputs)
    except Exception as err:  # the model's own check of its input sizes, in torch
        given = ", ".join(f"{k}={'x'.join(map(str, v.shape))}" for k, v in inputs.items())
        raise TargetError(f"{type(graph_model).__name__} does not run on the inputs {given} in torch: "
                          f"{str(err).strip()[:300].rstrip('.')}. Give shapes the model takes with --input-shape.") from None


def _record(name: str, hf: Any, model_dir: str | None, inputs: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """What the file's metadata records (METADATA_KEY): the task, the source model, its
    input shapes, output names and labels."""
    record = {"task": name, "model_type": hf.config.model_type, "class": type(hf).__name__, "model_dir": model_dir,
              "inputs": {k: list(v.shape) for k, v in inputs.items()}, "outputs": names}
    if TASKS[name].reads in ("labels", "token-labels", "segmentation", "detections") and getattr(hf.config, "id2label", None):
        record["id2label"] = {str(k): v for k, v in hf.config.id2label.items()}
    return record


def _text_calibration(inputs: dict[str, Any], model_dir: str | None, config: Any, o: ConvertOptions,
                      tmp: str) -> str | None:
    """Integer quantization of a text model: calibration samples of token windows (the shipped
    calibration text through the model's tokenizer) with an all-ones attention mask, as a .pt
    file for convert(calibration_data=...). The generic sampler would take the mask for token ids."""
    import torch

    from circleops.quantize import INTEGER_FORMATS
    from circleops.quantize.pt2e import calibration_samples

    if o.quantize not in INTEGER_FORMATS:
        return None
    tokenizer = None
    if model_dir is not None:
        from transformers import AutoTokenizer

        refuse_remote_code(model_dir)
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        except Exception:  # no tokenizer saved: seeded ids below vocab_size
            tokenizer = None
    ids = calibration_samples((inputs["input_ids"],), int(o.calibrate), tokenizer=tokenizer,
                              vocab_size=getattr(config, "vocab_size", None))
    rows = [tuple(sample[0] if name == "input_ids" else torch.ones_like(t) if name == "attention_mask" else t
                  for name, t in inputs.items()) for sample in ids]
    path = os.path.join(tmp, "calibration.pt")
    torch.save(rows, path)
    return path


def task_of(model: str | None, config: str | None) -> str:
    """The task of MODEL (an HF directory or hub id) or --config, from its config.json."""
    from circleops.sources.hub import resolve_model
    from circleops.sources.models import read_config_dict

    path = Path(config if config is not None else resolve_model(model or ""))
    cfg = read_config_dict(path / "config.json" if path.is_dir() else path)
    return infer_task(cfg, str(model or config))


def read_task_record(path: str | os.PathLike) -> dict[str, Any] | None:
    """The record convert_task wrote into a file's metadata, or None (a file without one)."""
    from circleops.serialize import read_model

    blob = read_model(path).metadata.get(METADATA_KEY)
    if not blob:
        return None
    try:
        return parse_json(bytes(blob), f"the metadata of {path}")
    except CircleOpsError:
        return None

"""Inputs from an image, a text or a WAV file, and outputs read as labels, for the files
circleops.recipes.tasks writes (``circleops run vit.circle --image cat.png --top 5``).

The file's metadata (circleops.recipes.tasks.METADATA_KEY) names its task, input shapes, ``id2label``
and the model directory it was converted from; that directory's saved processor (image
processor, tokenizer, feature extractor) makes the inputs exactly as transformers would for
the torch model. Image processors run on their PIL backend: no torchvision needed.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from circleops.errors import RuntimeRunError
from circleops.inputs.remote_code import refuse_remote_code
from circleops.inputs.user_files import check_count, users_processor


@dataclass
class Prepared:
    """The inputs made for a file, in its input order, and what reading its outputs needs."""

    inputs: list[np.ndarray]
    record: dict[str, Any]
    tokenizer: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No "falling back to the PIL backend" chatter: the PIL processor is the one meant."""
    from circleops.sources.models import quiet_transformers

    with quiet_transformers(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _model_dir(record: dict[str, Any], model_dir: str | None, what: str) -> Path:
    chosen = model_dir or record.get("model_dir")
    if not chosen:
        raise RuntimeRunError(f"making inputs from {what} needs the model's processor, and this file was converted "
                              "from --config (random weights, no processor saved). Pass --model DIR, a directory "
                              "with the processor / tokenizer files of the model.")
    path = Path(chosen)
    if not path.is_dir():
        raise RuntimeRunError(f"the model directory {path} (recorded when the file was converted) is not there; "
                              "pass --model DIR, the directory with the model's processor / tokenizer files.")
    return path


def _fit(name: str, array: np.ndarray, shape: list[int]) -> np.ndarray:
    """The processor's array, padded with zeros / cut to the file's static shape (audio)."""
    if list(array.shape) == shape:
        return array
    if array.ndim != len(shape) or array.shape[:-1] != tuple(shape[:-1]):
        raise RuntimeRunError(f"the processor made {name} of shape {list(array.shape)}, and the file takes "
                              f"{shape}. Convert the model again with --input-shape {name}="
                              f"{'x'.join(map(str, array.shape))}, or give an input of the size it was made for.")
    out = np.zeros(shape, dtype=array.dtype)
    n = min(shape[-1], array.shape[-1])
    out[..., :n] = array[..., :n]
    return out


def prepare(record: dict[str, Any], *, image: str | None = None, text: str | None = None,
            audio: str | None = None, model_dir: str | None = None) -> Prepared:
    """The file's inputs from one image / text / WAV file through the model's saved processor."""
    shapes: dict[str, list[int]] = record["inputs"]
    given = [k for k, v in (("--image", image), ("--text", text), ("--audio", audio)) if v is not None]
    if len(given) != 1:
        raise RuntimeRunError("give one of --image, --text, --audio (or .npy inputs with --input).")
    main = next(iter(shapes))
    wants = {"input_ids": "--text", "pixel_values": "--image"}.get(main, "--audio")
    if given[0] != wants:
        raise RuntimeRunError(f"this file ({record['task']}) takes {main}: give {wants}, not {given[0]}.")
    path = _model_dir(record, model_dir, given[0])
    with _quiet():
        if text is not None:
            return _text(record, shapes, path, text)
        if image is not None:
            return _image(record, shapes, path, image)
        return _audio(record, shapes, path, audio or "")


def _text(record: dict[str, Any], shapes: dict[str, list[int]], path: Path, text: str) -> Prepared:
    from transformers import AutoTokenizer

    refuse_remote_code(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as err:
        raise RuntimeRunError(f"cannot load the tokenizer of {path}: {str(err).strip()[:200]}. Pass --model DIR "
                              "with the tokenizer files.") from None
    length = shapes["input_ids"][1]
    with users_processor("tokenizer", path, error=RuntimeRunError):
        enc = tokenizer(text, padding="max_length", truncation=True, max_length=length, return_tensors="np")
    inputs = [np.asarray(enc[name], dtype=np.int64) for name in shapes]
    return Prepared(inputs, record, tokenizer, {"attention_mask": np.asarray(enc["attention_mask"])})


def _image(record: dict[str, Any], shapes: dict[str, list[int]], path: Path, image: str) -> Prepared:
    from PIL import ImageOps
    from transformers import AutoImageProcessor

    from circleops.inputs.user_files import opened_image

    with opened_image(image, error=RuntimeRunError) as opened:
        picture = ImageOps.exif_transpose(opened).convert("RGB")  # upright, as transformers' load_image
    refuse_remote_code(path)
    try:
        processor = AutoImageProcessor.from_pretrained(str(path), trust_remote_code=False)
    except Exception as err:
        raise RuntimeRunError(f"cannot load the image processor of {path} (preprocessor_config.json): "
                              f"{str(err).strip()[:200]}. Pass --model DIR with the processor files.") from None
    for key in ("size", "crop_size"):  # a hostile size (10^5) would make a 120 GB image before any resize
        value = getattr(processor, key, None)
        sides = [value] if isinstance(value, int) else [
            value.get(n) if isinstance(value, dict) else getattr(value, n, None)  # a dict or transformers' SizeDict
            for n in ("height", "width", "shortest_edge", "longest_edge")]
        for side in sides:
            if side is not None:
                check_count(side, f"the image processor's {key} in {path}", high=16384, error=RuntimeRunError,
                            fix="Fix preprocessor_config.json.")
    _, _, h, w = shapes["pixel_values"]
    with users_processor("image processor", path, error=RuntimeRunError):
        pixels = processor(images=picture, return_tensors="np")["pixel_values"]
        if list(pixels.shape[2:]) != [h, w]:  # converted with --input-shape: the file's size wins
            pixels = processor(images=picture, size={"height": h, "width": w}, do_center_crop=False,
                               return_tensors="np")["pixel_values"]
    return Prepared([_fit("pixel_values", np.asarray(pixels, dtype=np.float32), shapes["pixel_values"])], record)


def read_wav(path: str) -> tuple[np.ndarray, int]:
    """A WAV file as mono float32 in [-1, 1], and its sample rate (circleops.inputs.user_files.read_wav)."""
    from circleops.inputs.user_files import read_wav as read

    return read(path, error=RuntimeRunError)


def _audio(record: dict[str, Any], shapes: dict[str, list[int]], path: Path, audio: str) -> Prepared:
    from transformers import AutoFeatureExtractor

    samples, rate = read_wav(audio)
    refuse_remote_code(path)
    try:
        extractor = AutoFeatureExtractor.from_pretrained(str(path), trust_remote_code=False)
    except Exception as err:
        raise RuntimeRunError(f"cannot load the feature extractor of {path}: {str(err).strip()[:200]}.") from None
    wanted = getattr(extractor, "sampling_rate", rate)
    if rate != wanted:
        raise RuntimeRunError(f"{audio} is sampled at {rate} Hz and the model hears {wanted} Hz: resample it "
                              f"first (e.g. sox {audio} -r {wanted} out.wav).")
    name = next(iter(shapes))
    with users_processor("feature extractor", path, error=RuntimeRunError):
        features = extractor(samples, sampling_rate=rate, return_tensors="np")[name]
    tokenizer = None
    if record.get("task") == "automatic-speech-recognition":  # CTC: its characters, when it has a tokenizer
        from transformers import AutoTokenizer

        with contextlib.suppress(Exception):
            tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    return Prepared([_fit(name, np.asarray(features, dtype=np.float32), shapes[name])], record, tokenizer)


# --------------------------------------------------------------------------- outputs

def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _label(record: dict[str, Any], i: int) -> str:
    return (record.get("id2label") or {}).get(str(i), f"LABEL_{i}")


def describe(prepared: Prepared, outputs: list[np.ndarray], top: int = 5) -> list[str]:
    """Lines reading the outputs for the task (labels, tokens, text); [] when there is nothing to add."""
    from circleops.recipes.tasks import TASKS

    record = prepared.record
    task = TASKS.get(record.get("task", ""))
    if task is None or not outputs:
        return []
    logits = np.asarray(outputs[0], dtype=np.float64)
    if task.reads == "labels":
        probs = _softmax(logits.reshape(-1))
        order = np.argsort(-probs, kind="stable")[:top]
        return [f"top {len(order)} ({task.name}):"] + [f"  {probs[i]:.4f}  {_label(record, int(i))}" for i in order]
    if task.reads == "segmentation":  # logits [1, L, h, w]: the share of pixels each label wins
        share = np.bincount(logits[0].argmax(0).reshape(-1), minlength=logits.shape[1]) / logits[0, 0].size
        order = [int(i) for i in np.argsort(-share, kind="stable")[:top] if share[i] > 0]
        return [f"pixels per label ({task.name}, {logits.shape[2]}x{logits.shape[3]}):"] + [
            f"  {share[i]:7.2%}  {_label(record, i)}" for i in order]
    if task.reads == "detections" and len(outputs) > 1:  # DETR-style: the last class is "no object"
        probs = _softmax(logits[0])[:, :-1]
        boxes = np.asarray(outputs[1], dtype=np.float64)[0]
        best = np.argsort(-probs.max(-1), kind="stable")[:top]
        return [f"top {len(best)} queries ({task.name}; box = center x, center y, width, height, relative):"] + [
            f"  {probs[q].max():.4f}  {_label(record, int(probs[q].argmax()))}  "
            f"({', '.join(f'{v:.3f}' for v in boxes[q])})" for q in best]
    tok = prepared.tokenizer
    if task.reads == "token-labels" and tok is not None:
        ids, mask = prepared.inputs[0][0], prepared.extra["attention_mask"][0]
        labels = logits[0].argmax(-1)
        return [f"tokens ({task.name}):"] + [f"  {tok.convert_ids_to_tokens(int(t))}\t{_label(record, int(k))}"
                                            for t, k, m in zip(ids, labels, mask) if m]
    if task.reads == "fill-mask" and tok is not None and tok.mask_token_id is not None:
        lines = []
        for pos in np.flatnonzero(prepared.inputs[0][0] == tok.mask_token_id):
            probs = _softmax(logits[0, pos])
            best = np.argsort(-probs, kind="stable")[:top]
            lines.append(f"{tok.mask_token} at {pos}: " + ", ".join(
                f"{tok.decode([int(i)]).strip()} ({probs[i]:.3f})" for i in best))
        return lines or [f"no {tok.mask_token} in the text: nothing to fill"]
    if task.reads == "ctc":  # greedy CTC: the best token per frame, repeats merged, blanks dropped
        best = [int(t) for t in logits[0].argmax(-1)]
        if tok is not None:  # a CTC tokenizer merges and drops them itself (and maps | to spaces)
            return [f"transcript ({task.name}, greedy CTC): {tok.decode(best)!r}"]
        ids = [t for i, t in enumerate(best) if t != 0 and (i == 0 or t != best[i - 1])]
        return [f"transcript ({task.name}, greedy CTC, token ids: no tokenizer saved): {ids}"]
    return []

"""Directories written by the previous version still read and run.

tests/package/legacy/*.json are the manifest.json files that circleops at commit 3222152 (the
last to write the flat formats: circleops-generate v2/v3, circleops-speech v1) wrote for tiny
models (make_legacy.py says how). Its graph files and the current package step's are the same
bytes (checked when the fixtures were made; but a VLM's 8-row prefill, which the package step
now lowers for the one thread generation runs it at, as the LLM's), so each test converts the
same model again and puts the old manifest beside the files: the directory the previous
version left. It
must read as the same manifest as the one written now (version 4, a section per kind), and
generate the same tokens.
"""
from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "legacy"), str(HERE.parent / "generate"), str(HERE.parent / "speech")]

import make_legacy as legacy  # noqa: E402

# the manifest fields written since the previous version (optional: an old file reads them as None)
ADDED_SINCE = ("max_positions",)
PROMPT = [5, 17, 42, 99, 3, 7, 8, 200, 11, 12]  # longer than the prefill: two chunks


def _old_and_new(tmp: Path, name: str, write) -> tuple[Path, Path]:
    """(the directory as the previous version left it, the one written now)."""
    new = tmp / f"{name}-new"
    write(new)
    old = tmp / f"{name}-old"
    shutil.copytree(new, old)
    (old / "manifest.json").write_text((HERE / "legacy" / f"{name}.json").read_text())
    return old, new


@pytest.fixture(scope="module")
def text_dirs(tmp_path_factory):
    from circleops.recipes.llm import convert_graphs

    tmp = tmp_path_factory.mktemp("legacy")
    dirs = {"text-onert": dict(target="onert"), "text-circle": dict(target="circle"),
            "text-split": dict(target="onert", max_file_bytes=legacy.SPLIT_BYTES)}
    return {name: _old_and_new(tmp, name, lambda out, kw=kw: convert_graphs(legacy.text_model(), out, **kw,
                                                                             **legacy.TEXT))
            for name, kw in dirs.items()}


def _same_fields(old: Path, new: Path) -> None:
    """The old manifest's every field holds what the new one's does (the new one: version 4)."""
    from circleops.package.manifest import manifest_fields

    old_data, new_data = (json.loads((d / "manifest.json").read_text()) for d in (old, new))
    assert new_data["version"] == 4 and old_data["version"] in (1, 2, 3)
    fields = manifest_fields(new_data)
    shared = set(old_data) - {"format", "version", "kind"}
    assert shared <= set(fields), shared - set(fields)
    assert {k: old_data[k] for k in shared} == {k: fields[k] for k in shared}


@pytest.mark.parametrize("name", ["text-onert", "text-circle", "text-split"])
def test_a_text_directory_of_the_previous_version_reads_and_generates_alike(text_dirs, name):
    from circleops.generation.generator import Generator
    from circleops.package.manifest import read_manifest

    old, new = text_dirs[name]
    _same_fields(old, new)
    was, now = read_manifest(old), read_manifest(new)
    # optional fields added since (absent from the old files: read as unknown)
    assert all(getattr(was, k) is None for k in ADDED_SINCE)
    assert now.max_positions == legacy.text_model().config.max_position_embeddings
    assert {**vars(was), "directory": None} == {**vars(now), "directory": None, **dict.fromkeys(ADDED_SINCE)}
    tokens = [Generator(d).generate(PROMPT, max_new_tokens=6).tokens for d in (old, new)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6


def test_a_vision_directory_of_the_previous_version_reads_and_generates_alike(tmp_path):
    from circleops.generation.vision import VisionGenerator, generate
    from circleops.package.manifest import read_manifest
    from circleops.recipes.vlm import convert_vlm_graphs
    from vlm_fixtures import save_image

    model, processor = legacy.vision_model()
    old, new = _old_and_new(tmp_path, "vision-onert", lambda out: convert_vlm_graphs(
        copy.deepcopy(model), out, processor=processor, target="onert", **legacy.VISION))
    _same_fields(old, new)
    assert read_manifest(old).vision == read_manifest(new).vision and VisionGenerator(old).vision.graph == "vision"
    image = save_image(tmp_path / "photo.png", 40, 56, 0)
    texts = [generate(d, "Describe it", image=image, max_new_tokens=4) for d in (old, new)]
    assert texts[0].tokens == texts[1].tokens and len(texts[0].tokens) == 4


def test_a_speech_directory_of_the_previous_version_reads_and_transcribes_alike(tmp_path):
    from circleops.generation.speech import SpeechGenerator
    from circleops.package.manifest import manifest_fields
    from circleops.package.speech_manifest import read_speech_manifest
    from circleops.recipes.speech import convert_speech
    from tiny_whisper import save_tiny_whisper

    whisper = save_tiny_whisper(tmp_path / "whisper-tiny")
    old, new = _old_and_new(tmp_path, "speech-onert", lambda out: convert_speech(
        whisper, out, target="onert", max_cache_len=legacy.SPEECH_CACHE, source="whisper-tiny"))
    old_data, new_data = (json.loads((d / "manifest.json").read_text()) for d in (old, new))
    assert old_data["format"] == "circleops-speech" and (new_data["format"], new_data["kind"]) == (
        "circleops-generate", "speech")
    fields = manifest_fields(new_data)
    assert {k: old_data[k] for k in set(old_data) - {"format", "version"}} == {
        k: fields[k] for k in set(old_data) - {"format", "version"}}
    assert {**vars(read_speech_manifest(old)), "directory": None} == {**vars(read_speech_manifest(new)),
                                                                      "directory": None}
    features = np.random.default_rng(0).standard_normal(read_speech_manifest(new).input_features).astype(np.float32)
    with torch.no_grad():
        tokens = [SpeechGenerator(d).generate(features, max_new_tokens=5).tokens for d in (old, new)]
    assert tokens[0] == tokens[1] and len(tokens[0]) >= 1

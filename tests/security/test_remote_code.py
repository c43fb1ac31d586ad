"""No code from a model directory (issue 31): a config naming Python code of its directory
(``auto_map``) is refused before transformers reads the directory, through every command
that loads one, with stdin answering "y" to transformers' "run the custom code? [y/N]".

Each evil directory's code creates a marker file when imported. The first test shows that
transformers really imports it when allowed to, so "the marker never appears" can fail.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from circleops.errors import ModelLoadError
from evil_dirs import cli_with_yes, make_evil, refused

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "generate"))
sys.path.insert(0, str(REPO / "tests" / "speech"))


def _tokenizer_dir(path: Path) -> Path:
    from chat_fixtures import tiny_chat_tokenizer

    tiny_chat_tokenizer().save_pretrained(str(path))
    return path


def _text_manifest(d: Path, vision: dict | None = None) -> Path:
    from circleops.package.manifest import Manifest

    d.mkdir(parents=True)
    files = {"prefill": "prefill.circle", "decode": "decode.circle", **({"vision": "vision.circle"} if vision else {})}
    Manifest(directory=d, target="onert", dtype="float32", files=files, signatures={g: None for g in files},
             prefill_len=8, max_cache_len=16, num_layers=1, cache_shape=[1, 16, 1, 8], vocab_size=259,
             inputs=["input_ids", "pos", "k0", "v0"], outputs=["logits", "k0", "v0"], tokenizer="tokenizer",
             vision=vision).write()
    return d


def _speech_manifest(d: Path) -> Path:
    from circleops.package.speech_manifest import SpeechManifest

    d.mkdir(parents=True)
    SpeechManifest(directory=d, target="onert", dtype="float32",
                   files={g: f"{g}.circle" for g in ("encoder", "prefill", "decode")},
                   signatures={g: None for g in ("encoder", "prefill", "decode")}, num_layers=1,
                   cache_shape=[1, 2, 16, 8], cross_shape=[1, 2, 10, 8], input_features=[1, 80, 20], prefill_len=4,
                   vocab_size=64, decoder_start_token_id=1, eos_token_ids=[2], pad_token_id=2,
                   max_target_positions=16).write()
    return d


def test_the_evil_tokenizer_really_runs_code_when_transformers_is_allowed_to(tmp_path):
    marker = tmp_path / "pwned"
    d = make_evil(_tokenizer_dir(tmp_path / "tok"), "tokenizer_config.json", marker)
    # in a child: transformers caches the imported module and registers its class for good
    code = f"from transformers import AutoTokenizer; AutoTokenizer.from_pretrained({str(d)!r}, trust_remote_code=True)"
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True, timeout=120)
    assert marker.exists()


@pytest.fixture(scope="module")
def evil(tmp_path_factory):
    """kind -> (the directory to pass, the file naming code, the marker)."""
    root = tmp_path_factory.mktemp("evil")
    marker = root / "pwned"
    text = _text_manifest(root / "llm")
    make_evil(_tokenizer_dir(text / "tokenizer"), "tokenizer_config.json", marker)
    vlm = _text_manifest(root / "vlm", vision={"graph": "vision"})
    make_evil(_tokenizer_dir(vlm / "tokenizer"), "processor_config.json", marker)
    speech = _speech_manifest(root / "asr")
    make_evil(speech / "processor", "preprocessor_config.json", marker)
    vlm_hf = root / "vlm_hf"
    vlm_hf.mkdir()
    (vlm_hf / "config.json").write_text(json.dumps({"model_type": "smolvlm"}))
    make_evil(vlm_hf, "config.json", marker)
    from families import BY_NAME

    llm_hf = root / "llm_hf"
    BY_NAME["llama"].build().save_pretrained(str(llm_hf))
    make_evil(llm_hf, "config.json", marker)
    return {"llm": (text, text / "tokenizer" / "tokenizer_config.json", marker),
            "vlm": (vlm, vlm / "tokenizer" / "processor_config.json", marker),
            "asr": (speech, speech / "processor" / "preprocessor_config.json", marker),
            "vlm_hf": (vlm_hf, vlm_hf / "config.json", marker),
            "llm_hf": (llm_hf, llm_hf / "config.json", marker)}


def _image(path: Path) -> Path:
    from PIL import Image

    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(path)
    return path


# (the evil directory, the command line after it: {d} is the directory, {out} a fresh path)
CLI_PATHS = {
    "chat": ("llm", ["chat", "{d}"]),
    "generate --chat": ("llm", ["generate", "{d}", "--prompt", "hi", "--chat"]),
    "generate --prompt": ("llm", ["generate", "{d}", "--prompt", "hi"]),
    "generate --image": ("vlm", ["generate", "{d}", "--prompt", "hi", "--image", "{image}"]),
    "chat --image": ("vlm", ["chat", "{d}", "--image", "{image}"]),
    "generate --audio": ("asr", ["generate", "{d}", "--audio", "{wav}"]),
    "convert --graphs vision": ("vlm_hf", ["convert", "{d}", "--graphs", "vision,prefill,decode", "-o", "{out}"]),
    "convert HF dir": ("llm_hf", ["convert", "{d}", "-o", "{out}.circle"]),
}


@pytest.mark.parametrize("path", CLI_PATHS)
def test_cli_refuses_a_directory_naming_code(path, evil, tmp_path):
    from tiny_whisper import write_wav

    kind, argv = CLI_PATHS[path]
    d, file, marker = evil[kind]
    values = {"d": str(d), "out": str(tmp_path / "out"), "image": str(_image(tmp_path / "i.png")),
              "wav": str(write_wav(tmp_path / "c.wav"))}
    proc = cli_with_yes(*[a.format(**values) for a in argv], cwd=tmp_path)
    refused(proc, file, marker)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.circle").exists()


@pytest.mark.parametrize("file", ["tokenizer_config.json", "preprocessor_config.json", "processor_config.json"])
def test_every_loader_refuses_before_transformers(file, tmp_path):
    """The library calls too (not only the CLI): each loader of a saved tokenizer/processor."""
    from circleops.generation import generator as generate
    from circleops.tools import precision
    from circleops.generation import speech, vision

    marker = tmp_path / "pwned"
    d = make_evil(_tokenizer_dir(tmp_path / "tok"), file, marker)
    for load in (generate.hf_tokenizer, vision.load_processor, speech.load_processor, precision.directory_tokenizer):
        with pytest.raises(ModelLoadError, match=f"{file}.*auto_map"):
            load(d if load is not precision.directory_tokenizer else str(d))
    assert not marker.exists()


def test_nested_auto_map_and_a_config_file_are_refused(tmp_path):
    from circleops.sources import models
    from circleops.inputs.remote_code import refuse_remote_code

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": {
        "model_type": "llama", "auto_map": {"AutoConfig": "x.Y"}}}))
    with pytest.raises(ModelLoadError, match=r"'text_config\.auto_map'"):
        refuse_remote_code(tmp_path)
    with pytest.raises(ModelLoadError, match="auto_map"):
        models.load(None, config=str(tmp_path / "config.json"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": {}}))
    refuse_remote_code(tmp_path)  # an empty auto_map names nothing


def test_every_from_pretrained_passes_trust_remote_code_false():
    """Every ``X.from_pretrained(...)`` call in circleops/ says ``trust_remote_code=False``."""
    bad = []
    for path in sorted((REPO / "circleops").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "from_pretrained":
                ok = any(k.arg == "trust_remote_code" and isinstance(k.value, ast.Constant) and k.value.value is False
                         for k in node.keywords)
                if not ok:
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not bad, "from_pretrained without trust_remote_code=False:\n" + "\n".join(bad)

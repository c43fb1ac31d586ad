"""Model directories whose configs name Python code (``auto_map``): importing that code
creates a marker file. Used by tests/security/test_remote_code.py and the ``run --model DIR``
tests (tests/tasks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CODE = """open({marker!r}, "w").close()
import transformers


class EvilTokenizer(transformers.PreTrainedTokenizerFast):
    pass


class EvilFeatureExtractor(transformers.WhisperFeatureExtractor):
    pass


class EvilImageProcessor(transformers.ViTImageProcessor):
    pass


class EvilConfig(transformers.LlamaConfig):
    pass


class EvilModel(transformers.LlamaForCausalLM):
    pass
"""
AUTO_MAP = {  # file -> the auto_map transformers honours in it
    "tokenizer_config.json": {"AutoTokenizer": ["evil_code.EvilTokenizer", None]},
    "preprocessor_config.json": {"AutoFeatureExtractor": "evil_code.EvilFeatureExtractor",
                                 "AutoImageProcessor": "evil_code.EvilImageProcessor"},
    "processor_config.json": {"AutoProcessor": "evil_code.EvilProcessor"},  # not defined: refused first
    "config.json": {"AutoConfig": "evil_code.EvilConfig", "AutoModelForCausalLM": "evil_code.EvilModel"},
}


def make_evil(directory: Path, file: str, marker: Path) -> Path:
    """Add an ``auto_map`` to ``directory/file`` (created if missing) pointing at evil_code.py."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "evil_code.py").write_text(CODE.format(marker=str(marker)))
    path = directory / file
    data = json.loads(path.read_text()) if path.is_file() else {}
    data["auto_map"] = AUTO_MAP[file]
    path.write_text(json.dumps(data))
    return directory


def cli_with_yes(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``circleops ARGS`` in a child whose stdin answers "y" to any question."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "circleops.cli", *args], input="y\n", capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120)


def refused(proc: subprocess.CompletedProcess, file: Path, marker: Path) -> None:
    """The command refused ``file`` (exit 2, one paragraph naming it) and ran no code."""
    assert not marker.exists(), "the model directory's code ran"
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "[y/N]" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert str(file) in proc.stderr and "auto_map" in proc.stderr and "refusing" in proc.stderr, proc.stderr

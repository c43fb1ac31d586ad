"""docs/vlm.md runs: its Python blocks in order (one namespace), its shell commands through
the CLI in the same directory (a `printf ... |` feeds the command's stdin), its console
transcripts (errors: exit code 2 and that message)."""
from __future__ import annotations

import io
import json
import shlex
import sys
from pathlib import Path

from doc_blocks import blocks, run_cli
import manifest_json
from generate_fixtures import one_torch_thread

DOC = Path(__file__).resolve().parents[2] / "docs" / "vlm.md"
NOT_RUN: dict[str, str] = {}


def _blocks() -> list[tuple[str, str]]:
    return blocks(DOC)


def _cli(command: str, monkeypatch) -> tuple[int, str, str]:
    stdin = ""
    if command.startswith("printf "):
        printf, command = (part.strip() for part in command.split("|", 1))
        stdin = shlex.split(printf)[1].replace("\\n", "\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    return run_cli(command)


def test_every_block_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    ran = {"python": 0, "shell": 0, "console": 0}
    with one_torch_thread():
        for lang, code in _blocks():
            assert lang in ("python", "shell", "console", "text"), lang
            if lang == "python":
                exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - the doc's own example
            elif lang == "shell":
                for command in filter(None, (x.strip() for x in code.splitlines())):
                    if command in NOT_RUN:
                        continue
                    status, out, err = _cli(command, monkeypatch)
                    assert status == 0, (command, err)
                    assert out.strip(), command  # generated text
            elif lang == "console":
                lines = code.strip().splitlines()
                command, transcript = lines[0].removeprefix("$ "), lines[1:]
                status, out, err = _cli(command, monkeypatch)
                assert status == 2, (command, out, err)
                for line in transcript:
                    assert line in err.splitlines(), (command, line, err)
            if lang in ran:
                ran[lang] += 1
    assert ran == {"python": 4, "shell": 8, "console": 3}
    assert (tmp_path / "smolvlm-out" / "vision.circle").is_file()
    assert (tmp_path / "paligemma-out" / "prefill.circle").is_file()
    assert manifest_json.read(tmp_path / "qwen-out")["vision"]["patches"]["grid"] == [1, 8, 8]  # 64 px, 8 px patches
    assert manifest_json.read(tmp_path / "smolvlm-fp16")["dtype"] == "fp16"
    assert manifest_json.read(tmp_path / "paligemma-q4")["quantize"] == "q4_0"
    assert not (tmp_path / "paligemma-short").exists()

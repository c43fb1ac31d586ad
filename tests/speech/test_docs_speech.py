"""docs/speech.md runs: its Python blocks in order (one namespace, in one directory), its shell
commands through the CLI there, its console transcripts (exit code 2 and that message); the
transcript of the convert summary lists what the command prints."""
from __future__ import annotations

from pathlib import Path

from doc_blocks import blocks, run_cli

DOC = Path(__file__).resolve().parents[2] / "docs" / "speech.md"


def _blocks() -> list[tuple[str, str]]:
    return blocks(DOC)


def _cli(command: str) -> tuple[int, str, str]:
    return run_cli(command)


def test_every_block_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    ran, outputs = 0, []
    for lang, code in _blocks():
        assert lang in ("python", "shell", "console", "text"), lang
        if lang == "python":
            exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - the doc's own example
        elif lang == "shell":
            for command in filter(None, (x.strip() for x in code.splitlines())):
                status, out, err = _cli(command)
                assert status == 0, (command, err)
                outputs.append(out)
        elif lang == "console":
            lines = code.strip().splitlines()
            command, transcript = lines[0].removeprefix("$ "), lines[1:]
            status, out, err = _cli(command)
            assert status == 2, (command, out, err)
            for line in transcript:
                assert line in err.splitlines(), (command, line, err)
        elif lang == "text" and "circleops: wrote" in code:
            summary = outputs[-1].splitlines()
            for want in code.strip().splitlines():  # every line but the measured errors, word for word
                if "verify" not in want:
                    assert want in summary, (want, summary)
        ran += 1
    assert ran >= 7
    assert Path("asr/manifest.json").is_file()

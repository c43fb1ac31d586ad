"""docs/text2text.md runs: its Python blocks in order (one namespace, in one directory), its
shell commands through the CLI there, its console transcripts (exit code 2 and that message);
the summary transcript lists what convert prints (but the measured errors)."""
from __future__ import annotations

from pathlib import Path

from doc_blocks import blocks, run_cli

DOC = Path(__file__).resolve().parents[2] / "docs" / "text2text.md"


def test_every_block_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    ran, outputs = 0, []
    for lang, code in blocks(DOC):
        assert lang in ("python", "shell", "console", "text"), lang
        if lang == "python":
            exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - the doc's own example
        elif lang == "shell":
            for command in filter(None, (x.strip() for x in code.splitlines())):
                status, out, err = run_cli(command)
                assert status == 0, (command, err)
                outputs.append(out)
        elif lang == "console":
            lines = code.strip().splitlines()
            command, transcript = lines[0].removeprefix("$ "), lines[1:]
            status, out, err = run_cli(command)
            assert status == 2, (command, out, err)
            for line in transcript:
                assert line in err.splitlines(), (command, line, err)
        elif lang == "text" and "wrote 3 graph(s)" in code:
            summary = outputs[-1].splitlines()
            for want in code.strip().splitlines():
                if "verify" not in want:
                    assert want in summary, (want, summary)
        ran += 1
    assert ran >= 8
    assert Path("t5-w8/manifest.json").is_file()
    from circleops.serialize import read_model  # --quantize w8 for tflite: LiteRT's int8 weights

    assert any(t.dtype == "INT8" for sub in read_model("t5-w8/model.tflite").subgraphs for t in sub.tensors)

"""A convert option is its field and its use (CONTRIBUTING.md, "Adding a convert option"): this
test copies circleops, adds a throwaway option ``stamp`` (the text written as the file's
description) as one field of circleops.options.ConvertOptions and one use in
circleops/pipeline/stages.py, and nothing else. ``circleops convert`` then takes ``--stamp``
(in its --help, in one file and in --graphs' files) and the Python API ``stamp=``: the CLI
builds its options once from the fields, every path passes them on as they are."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FIELD = ('''    # the one file of circleops.convert
''', '''    # the one file of circleops.convert
    stamp: str | None = field(default=None, metadata=flag(
        "--stamp", "target", "a test's option: the text written as the files' description"))
''')
USE = ('''    p = opts.profile if isinstance(opts, Options) else profile(opts)
    check_size(ir_model, p)
''', '''    p = opts.profile if isinstance(opts, Options) else profile(opts)
    check_size(ir_model, p)
    if isinstance(opts, Options) and opts.given is not None and opts.given.stamp:
        ir_model.description = opts.given.stamp
''')
EDITS = {"circleops/options.py": FIELD, "circleops/pipeline/stages.py": USE}

SCRIPT = r'''
import sys, torch, circleops
assert circleops.__file__.startswith(sys.argv[3]), circleops.__file__  # the copy, with the option
from circleops.cli import main
from circleops.serialize import read_model

config, out = sys.argv[1], sys.argv[2]
assert main(["convert", "--config", config, "-q", "--seq-len", "8", "--stamp", "one file", "-o", out + "/m.circle"]) == 0
print(read_model(out + "/m.circle").description)
assert main(["convert", "--config", config, "-q", "--graphs", "prefill,decode", "--target", "circle", "--seq-len", "4",
             "--max-cache-len", "8", "--stamp", "graphs", "-o", out + "/g"]) == 0
print(read_model(out + "/g/model.circle").description)
model = torch.nn.Linear(8, 4)
circleops.convert(model, (torch.randn(2, 8),), out + "/api.circle", stamp="the API")
print(read_model(out + "/api.circle").description)
'''


def test_a_convert_option_is_its_field_and_its_use(tmp_path, llama_config):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "circleops", tree / "circleops", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "schema", tree / "schema")  # the op contracts, read beside the package
    for rel, (anchor, replacement) in EDITS.items():
        text = (tree / rel).read_text()
        assert text.count(anchor) == 1, rel
        (tree / rel).write_text(text.replace(anchor, replacement))
    assert len(EDITS) <= 2  # the option's field and its use: no other file knows of it
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # run from tmp_path: `python -c` puts the working directory first on sys.path
    help_text = subprocess.run([sys.executable, "-c", "from circleops.cli import main; main(['convert', '--help'])"],
                               env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path).stdout
    assert "--stamp" in help_text and "a test's option" in help_text
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(llama_config), str(out), str(tree)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["one file", "graphs", "the API"]

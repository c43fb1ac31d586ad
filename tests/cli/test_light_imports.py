"""What a command imports, checked in a fresh process through sys.modules (never a clock).

Importing is most of a small conversion's time (torch, transformers, torch.export): ``import
circleops`` and ``--help`` load none of it, and ``circleops convert`` of a Llama loads only what
a conversion uses: no runtime (onert, LiteRT, the reference interpreter), no GGUF reader, none
of the packages transformers pulls in for features a conversion never uses (scipy.optimize,
torchao; circleops.cli.common.scipy_hidden), and no other family's modeling module
(circleops.adapters.patched_modules(model=...)).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

# loaded by a runtime, a reader or a feature that `import circleops`, `--help` and a plain
# convert do not use
RUNTIMES_AND_READERS = ("onert", "ai_edge_litert", "gguf", "circleops.runtime.reference", "circleops.runtime.onert",
                        "circleops.runtime.litert")
HEAVY = ("torch", "transformers", "numpy", "tqdm", "PIL", "scipy", "torchao")


def _modules_after(code: str) -> set[str]:
    """The names in sys.modules after ``code`` ran in a fresh interpreter."""
    script = code + "\nimport json, sys\nprint('MODULES=' + json.dumps(sorted(sys.modules)))\n"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("MODULES="))
    return set(json.loads(line[len("MODULES="):]))


def test_import_circleops_is_light():
    loaded = _modules_after("import circleops")
    assert not loaded & set(RUNTIMES_AND_READERS + HEAVY), sorted(loaded & set(RUNTIMES_AND_READERS + HEAVY))


@pytest.mark.parametrize("argv", [["--help"], ["convert", "--help"], ["generate", "--help"], ["inspect", "--help"],
                                  ["run", "--help"]])
def test_help_is_light(argv):
    code = ("import contextlib, io\nfrom circleops.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n"
            f"        main({argv!r})\n"
            "    except SystemExit:\n"
            "        pass\n")
    loaded = _modules_after(code)
    # `run --help` names numpy's dtypes; nothing heavier
    heavy = set(RUNTIMES_AND_READERS + HEAVY) - ({"numpy"} if argv[0] == "run" else set())
    assert not loaded & heavy, sorted(loaded & heavy)


def test_convert_of_a_llama_imports_only_what_it_uses(llama_dir, tmp_path):
    out = tmp_path / "m.circle"
    code = ("from circleops.cli import main\n"
            f"assert main(['convert', {str(llama_dir)!r}, '-o', {str(out)!r}, '--seq-len', '8', '--quiet']) == 0\n")
    loaded = _modules_after(code)
    assert out.is_file()
    assert "transformers.models.llama.modeling_llama" in loaded  # the check sees what convert imports
    unused = set(RUNTIMES_AND_READERS) | {"scipy", "scipy.optimize", "torchao", "transformers.video_processing_utils"}
    # other families' modeling modules: the adapters patch the model's own family only
    unused |= {f"transformers.models.{f}.modeling_{f}" for f in ("mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma",
                                                                  "gemma2", "gemma3", "mixtral", "qwen2_moe",
                                                                  "qwen3_moe", "granitemoe", "deepseek_v3", "gpt_oss")}
    assert not loaded & unused, sorted(loaded & unused)


def test_a_torchao_checkpoint_still_sees_torchao(tmp_path):
    """scipy_hidden keeps torchao visible when the model's config names it (transformers needs
    torchao to load a torchao-quantized checkpoint)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "torchao"}}))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"model_type": "llama"}))
    code = ("import importlib.util, sys\nfrom circleops.cli.common import scipy_hidden\n"
            "with scipy_hidden(sys.argv[1]):\n"
            "    print(importlib.util.find_spec('torchao') is not None, importlib.util.find_spec('scipy') is not None)\n"
            "print(importlib.util.find_spec('torchao') is not None)\n")
    for path, inside in ((cfg, "True False"), (plain, "False False"), (tmp_path, "True False")):
        proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split("\n")[:2] == [inside, "True"], (path, proc.stdout)


@pytest.mark.parametrize("graphs", [[], ["--graphs", "prefill,decode"]])
def test_an_output_that_cannot_be_written_is_refused_before_the_model_loads(llama_dir, tmp_path, graphs):
    """-o in a directory that does not exist: exit 2 from light modules only (was ~7 s of
    imports and model loading before the same refusal)."""
    out = tmp_path / "missing" / ("out" if graphs else "m.circle")
    code = ("import contextlib, io\nfrom circleops.cli import main\nerr = io.StringIO()\n"
            "with contextlib.redirect_stderr(err):\n"
            f"    rc = main(['convert', {str(llama_dir)!r}, '-o', {str(out)!r}, *{graphs!r}])\n"
            "assert rc == 2 and 'does not exist. Create it first' in err.getvalue(), (rc, err.getvalue())\n")
    loaded = _modules_after(code)
    assert not loaded & set(RUNTIMES_AND_READERS + HEAVY), sorted(loaded & set(RUNTIMES_AND_READERS + HEAVY))
    assert not out.parent.exists()


def test_vlm_model_types_named_without_torch_are_the_recipes():
    """convert tells a VLM directory from an LLM's by the names vision_manifest keeps without
    torch; they must be the converted rows' model_types (a new VLM row adds its name there)."""
    from circleops.package.vision_manifest import VLM_MODEL_TYPE_NAMES
    from circleops.recipes.vlm import VLM_MODEL_TYPES

    assert sorted(VLM_MODEL_TYPE_NAMES) == sorted(VLM_MODEL_TYPES)

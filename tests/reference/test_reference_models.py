"""Whole converted models: the interpreter agrees with the real runtimes and with torch.

* target onert, every family and the conv net: onert and the interpreter agree within 1e-5
  (the interpreter is checked against a real runtime on every op the lowering writes);
* target tflite: LiteRT and the interpreter agree within 1e-5;
* target circle (ATTENTION, INSTANCE_NORM, RMS_NORM, ROPE as builtins, which no runtime on
  PyPI executes): the interpreter matches torch within 1e-4 in fp32.

Each model is exported once (inside the adapters' patches) and written for every target.
tflite and circle run on a representative set of families (fused attention; q/k norms;
soft-capping and Gemma's weight offset) to keep the suite fast.
"""
from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch

import convnet
from circleops.adapters import patched_modules
from circleops.pipeline.convert import convert, save
from circleops.runtime import litert, onert, reference
from circleops.serialize import read_model
from families import BY_NAME, FAMILIES, example_ids

REPRESENTATIVE = ["llama", "qwen3", "gemma2"]
EXT = {"onert": "circle", "circle": "circle", "tflite": "tflite"}


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


@functools.lru_cache(maxsize=None)
def exported(name: str):
    """(ExportedProgram, inputs, torch output) for a family name or "convnet"."""
    if name == "convnet":
        module, args = convnet.build(), (convnet.example_image(),)
    else:
        module, args = Logits(BY_NAME[name].build()), (example_ids(),)
    with torch.no_grad():
        want = module(*args).numpy()
    with warnings.catch_warnings(), patched_modules(), torch.no_grad():
        warnings.simplefilter("ignore")
        ep = torch.export.export(module, args)
    return ep, [a.numpy() for a in args], want


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")

    @functools.lru_cache(maxsize=None)
    def get(name: str, target: str):
        ep, inputs, want = exported(name)
        path = root / f"{name}_{target}.{EXT[target]}"
        save(ep, path, target=target, fuse="none")
        return path, inputs, want

    return get


def _max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


@pytest.mark.parametrize("name", [f.name for f in FAMILIES] + ["convnet"])
def test_onert_file_runs_the_same_in_the_interpreter(written, name):
    path, inputs, want = written(name, "onert")
    (ours,) = reference.run(path, inputs)
    (real,) = onert.run(path, inputs)
    assert _max_diff(ours, real) <= 1e-5
    assert _max_diff(ours, want) <= 1e-4


@pytest.mark.parametrize("name", REPRESENTATIVE + ["convnet"])
def test_tflite_file_runs_the_same_in_the_interpreter(written, name):
    path, inputs, want = written(name, "tflite")
    (ours,) = reference.run(path, inputs)
    (real,) = litert.run(path, inputs)
    assert _max_diff(ours, real) <= 1e-5
    assert _max_diff(ours, want) <= 1e-4


@pytest.mark.parametrize("name,fused", [("llama", "ATTENTION"), ("qwen3", "RMS_NORM"), ("gemma2", "RMS_NORM"),
                                        ("convnet", "INSTANCE_NORM")])
def test_circle_file_with_fused_builtins_matches_torch(written, name, fused):
    path, inputs, want = written(name, "circle")
    opcodes = {op.opcode for sg in read_model(path).subgraphs for op in sg.operators}
    assert fused in opcodes  # the builtin under test is really in the file
    (ours,) = reference.run(path, inputs)
    assert _max_diff(ours, want) <= 1e-4


def test_fp16_circle_file_computes_in_fp16(tmp_path):
    model = BY_NAME["llama"].build(dtype=torch.float16)
    ids = example_ids()
    with torch.no_grad():
        want16 = model(ids).logits
    path = tmp_path / "llama16.circle"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(model, (ids,), path, target="circle", dtype="fp16")
    tensors = [t for sg in read_model(path).subgraphs for t in sg.tensors]
    assert sum(t.dtype == "FLOAT16" for t in tensors) > sum(t.dtype == "FLOAT32" for t in tensors)
    (ours,) = reference.run(path, [ids.numpy()])
    assert ours.dtype == np.float16
    # fp16 rounding of every intermediate, as torch fp16 does: close, not equal to fp32.
    assert _max_diff(ours, want16.float().numpy()) <= 1e-2 * max(1.0, float(want16.abs().max()))


@pytest.fixture(scope="module")
def decoder_files(tmp_path_factory):
    """Prefill and decode graphs of the tiny Llama with static KV caches, for circle and onert."""
    from circleops.adapters.decode import DecoderWithCache

    model = BY_NAME["llama"].build()
    ids = example_ids(6)
    with torch.no_grad():
        hf = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True)[0, 6:].tolist()
    step = DecoderWithCache(model, max_len=16)
    caches = step.empty_caches()
    root = tmp_path_factory.mktemp("decoder")
    files = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind, args in (("prefill", (ids, torch.tensor([0]))), ("decode", (ids[:, :1], torch.tensor([6])))):
            ep = torch.export.export(step, (*args, *caches))
            for target in ("circle", "onert"):
                files[kind, target] = root / f"{kind}_{target}.circle"
                save(ep, files[kind, target], target=target, fuse="none")
    return files, ids.numpy(), [c.numpy() for c in caches], hf


def test_greedy_generation_with_in_place_attention_matches_hf(decoder_files):
    """target circle writes ATTENTION with one output whose caches are updated in place:
    prefill + decode steps in the interpreter generate HF's greedy tokens."""
    files, ids, caches, hf = decoder_files
    decode = reference.Interpreter(read_model(files["decode", "circle"]))
    assert "ATTENTION" in {op.opcode for op in decode.model.subgraphs[0].operators}
    logits, *caches = reference.run(files["prefill", "circle"], [ids, np.array([0]), *caches])
    tokens, pos = [int(logits[0, -1].argmax())], ids.shape[1]
    while len(tokens) < len(hf):
        logits, *caches = decode.run([np.array([[tokens[-1]]]), np.array([pos]), *caches])
        tokens.append(int(logits[0, -1].argmax()))
        pos += 1
    assert tokens == hf


def test_onert_decode_step_matches_the_interpreter(decoder_files):
    """The onert decode graph (one position: ROPE builtin, decomposed attention)."""
    files, ids, caches, _ = decoder_files
    inputs = [ids[:, :1], np.array([3]), *caches]
    ours = reference.run(files["decode", "onert"], inputs)
    real = onert.run(files["decode", "onert"], inputs)
    assert "ROPE" in {op.opcode for op in read_model(files["decode", "onert"]).subgraphs[0].operators}
    assert len(ours) == len(real)
    for a, b in zip(ours, real):
        assert _max_diff(a, b) <= 1e-5

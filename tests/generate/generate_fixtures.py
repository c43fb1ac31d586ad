"""Session-scoped conversions for the generate tests (imported by this directory's
conftest.py; test modules import the constants from here, never from ``conftest``, a module
name every test directory has): the 2-layer random Llama of
tests/families.py for each target, and (slow) the real SmolLM2-135M, each converted once,
with transformers' own greedy generation (fp32, with its KV cache) as the expected tokens."""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from families import BY_NAME

TINY_PREFILL, TINY_CACHE, TINY_NEW = 8, 32, 16
TINY_PROMPTS = [[5, 17, 42, 99, 3], [1, 200, 7], [9, 8, 7, 6, 5, 4, 3, 250]]  # the last fills the prefill
# the README's out/: convert's default prefill lengths (64 and 8) and cache length
SMOL_PREFILL, SMOL_PREFILL_SHORT, SMOL_CACHE, SMOL_NEW = 64, 8, 512, 32
SMOL_LONG, SMOL_LONG_NEW = 300, 16  # a prompt of 300 tokens: five prefill chunks
SMOL_PROMPTS = ["Once upon a time,", "The capital of France is", "def fibonacci(n):"]


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread: with pytest -n 2 (or other jobs) on 2 cores, two OpenMP threads
    per process oversubscribe the cores and a 32-token generate takes 10x longer."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy generate with its cache: the new tokens (EOS included)."""
    with torch.no_grad(), one_torch_thread():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, use_cache=True,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@dataclass
class Converted:
    directory: Path
    expected: dict[tuple, list[int]]  # prompt ids -> HF greedy tokens


@pytest.fixture(scope="session")
def tiny_model() -> torch.nn.Module:
    return BY_NAME["llama"].build()


@pytest.fixture(scope="session")
def tiny_expected(tiny_model) -> dict[tuple, list[int]]:
    return {tuple(p): hf_greedy(tiny_model, p, TINY_NEW) for p in TINY_PROMPTS}


def _tiny(tmp_path_factory, tiny_model, tiny_expected, target: str) -> Converted:
    from circleops.recipes.llm import convert_graphs

    out = tmp_path_factory.mktemp(f"tiny_{target}")
    convert_graphs(copy.deepcopy(tiny_model), out, target=target, prefill_len=TINY_PREFILL,
                   max_cache_len=TINY_CACHE, source="tiny llama")
    return Converted(out, tiny_expected)


@pytest.fixture(scope="session")
def tiny_onert(tmp_path_factory, tiny_model, tiny_expected) -> Converted:
    return _tiny(tmp_path_factory, tiny_model, tiny_expected, "onert")


@pytest.fixture(scope="session")
def tiny_tflite(tmp_path_factory, tiny_model, tiny_expected) -> Converted:
    return _tiny(tmp_path_factory, tiny_model, tiny_expected, "tflite")


@pytest.fixture(scope="session")
def tiny_circle(tmp_path_factory, tiny_model, tiny_expected) -> Converted:
    return _tiny(tmp_path_factory, tiny_model, tiny_expected, "circle")


@dataclass
class SmolLM2:
    directory: Path
    prompts: dict[str, list[int]]  # text -> ids
    expected: dict[str, list[int]]  # text -> HF greedy tokens
    tokenizer: object
    long_prompt: list[int]  # SMOL_LONG tokens
    long_expected: list[int]  # HF greedy, SMOL_LONG_NEW tokens


def _long_text() -> str:
    return " ".join(f"Chapter {i}. The lighthouse keeper counted the ships that passed the harbour, "
                    f"wrote their names in a ledger and watched the weather turn." for i in range(1, 40))


@pytest.fixture(scope="session")
def smollm2(readme_llm_out) -> SmolLM2:
    """SmolLM2-135M converted once as a newcomer does: the README's own command (the CLI,
    --verify on onert, default lengths; tests/readme_llm.py), and transformers' tokens."""
    from circleops.sources.models import load_smollm2

    assert readme_llm_out.proc.returncode == 0, readme_llm_out.proc.stderr[-3000:]
    model, tokenizer = load_smollm2()
    prompts = {p: [int(i) for i in tokenizer(p)["input_ids"]] for p in SMOL_PROMPTS}
    expected = {p: hf_greedy(model, ids, SMOL_NEW) for p, ids in prompts.items()}
    long_prompt = [int(i) for i in tokenizer(_long_text())["input_ids"]][:SMOL_LONG]
    long_expected = hf_greedy(model, long_prompt, SMOL_LONG_NEW)
    del model
    return SmolLM2(readme_llm_out.directory, prompts, expected, tokenizer, long_prompt, long_expected)

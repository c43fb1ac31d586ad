"""The real SmolLM2-135M-Instruct: the README's out/ (its own convert command, onert,
--verify; tests/readme_llm.py), then greedy generation on onert equals transformers' fp32
greedy generate token for token."""
from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from generate_fixtures import (SMOL_CACHE, SMOL_LONG, SMOL_LONG_NEW, SMOL_NEW, SMOL_PREFILL, SMOL_PREFILL_SHORT,
                               SMOL_PROMPTS)
import readme_llm

from circleops.generation.generator import Generator
from circleops.package.manifest import read_manifest
from circleops.serialize import read_model

# one worker converts the README's out/ for this module and tests/docs/test_readme.py
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group(readme_llm.GROUP)]

# onert against the reference interpreter on the real 30-layer model (tests/conftest.py):
# measured 1.04e-5 and 1.1e-5 of the output's scale on cache values (prefill over a 336-slot
# cache, and a 300-token prompt in chunks), just past the default 1e-5.
CROSS_CHECK_ATOL = 5e-5
LAYERS = 30


def test_greedy_tokens_equal_transformers_on_onert(smollm2):
    gen = Generator(smollm2.directory)
    assert gen.runtime == "onert"
    for prompt in SMOL_PROMPTS:
        result = gen.generate(smollm2.prompts[prompt], SMOL_NEW)
        assert result.tokens == smollm2.expected[prompt], prompt
    # the three prompts' outputs are real, different continuations
    assert len({tuple(v) for v in smollm2.expected.values()}) == 3


def test_decode_graph_structure(smollm2):
    """RoPE in the decode graph is the fused ROPE op (q and k of 30 layers) and every norm
    is RMS_NORM (2 per layer + the final one)."""
    ops = Counter(op.opcode for op in read_model(str(smollm2.directory / "decode.circle")).subgraphs[0].operators)
    assert ops["ROPE"] == 2 * LAYERS
    assert ops["RMS_NORM"] == 2 * LAYERS + 1
    assert ops["ATTENTION"] == 0


def test_manifest_and_tokenizer(smollm2):
    m = read_manifest(smollm2.directory)
    assert (m.prefill_len, m.max_cache_len, m.num_layers) == (SMOL_PREFILL, SMOL_CACHE, LAYERS)
    assert m.prefill_lens == [SMOL_PREFILL, SMOL_PREFILL_SHORT]
    assert m.cache_shape == [1, SMOL_CACHE, 3, 64] and m.vocab_size == 49152
    assert m.eos_token_ids == [2] and m.tokenizer == "tokenizer"
    assert (smollm2.directory / "tokenizer" / "tokenizer.json").is_file()


def test_cli_streams_text_and_reports_speed(smollm2):
    """`circleops generate` in a fresh process: the prompt and its continuation on stdout
    (equal to transformers' text), prefill time and decode tokens/s on stderr."""
    prompt = SMOL_PROMPTS[0]
    proc = subprocess.run([sys.executable, "-m", "circleops.cli", "generate", str(smollm2.directory), "--prompt",
                           prompt, "--max-new-tokens", str(SMOL_NEW)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    expected = smollm2.tokenizer.decode(smollm2.expected[prompt], skip_special_tokens=True)
    assert proc.stdout == prompt + expected + "\n"
    assert f"prefill 5-token prompt (graph length {SMOL_PREFILL_SHORT})" in proc.stderr
    assert f"decode {SMOL_NEW - 1} tokens" in proc.stderr and "tokens/s" in proc.stderr


def test_prompt_of_300_tokens_in_chunks_equals_transformers(smollm2):
    """Runs of the 64-token prefill graph (the last one end-aligned), then decode."""
    from circleops.generation.generator import Generator

    assert len(smollm2.long_prompt) == SMOL_LONG
    result = Generator(smollm2.directory).generate(smollm2.long_prompt, SMOL_LONG_NEW)
    assert result.tokens == smollm2.long_expected

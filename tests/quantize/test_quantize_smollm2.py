"""The real SmolLM2-135M (a Q4_1 GGUF) as q4_0 generation graphs for onert: the summary
says its weights were requantized, the files are a fifth of fp32's, onert generates
English, and the perplexity text is long enough in its tokenizer."""
from __future__ import annotations

import pytest

from onert_host import GGML_RUNTIME

pytestmark = pytest.mark.slow


def test_smollm2_q4_0_graphs_generate(tmp_path):
    from circleops.generation.generator import Generator
    from circleops.recipes.llm import convert_graphs
    from circleops.package.manifest import read_manifest
    from circleops.sources.models import load_smollm2
    from circleops.tools.quant_report import text_ids

    model, tokenizer = load_smollm2()
    assert len(text_ids(tokenizer, model.config.vocab_size)) >= 2000
    params = sum(p.numel() for p in model.parameters())  # tied: the embedding counted once
    out = tmp_path / "q4"
    report = convert_graphs(model, out, target="onert", prefill_len=16, max_cache_len=64, tokenizer=tokenizer,
                            verify=True, quantize="q4_0", source="smollm2")
    q = report.quantization
    # no table stored: the generator reads the tied embeddings from the Q8_0 head (onert GATHERs no Q8_0)
    assert q.embedding is None and not q.kept_fp32 and read_manifest(out).part_embedding == "head"
    assert q.requantized_from.get("Q4_1", 0) >= 200  # 30 layers x 7 linears
    assert "GGUF Q4_1 tensors requantized to GGML_Q4_0" in report.summary()
    manifest = read_manifest(out)
    size = (out / manifest.files["decode"]).stat().st_size
    assert size < 0.2 * params * 4, (size, params)
    gen = Generator(manifest).generate(tokenizer("Once upon a time,")["input_ids"], 12)
    assert gen.runtime == GGML_RUNTIME  # onert, or the interpreter where onert cannot run GGML here
    text = tokenizer.decode(gen.tokens)
    assert sum(c.isalpha() for c in text) > 20 and " " in text, text

"""Text-to-text generation end to end, over the family table (tiny_seq2seq.FAMILIES: T5 v1
and v1.1, BART, mBART, Marian, each a tiny random model saved with save_pretrained, its
tokenizer and a generation config with decoding rules): ``circleops convert DIR --graphs
encoder,prefill,decode --verify``, then ``circleops generate`` gives transformers' greedy
``generate`` tokens, on the runtimes of the target each family is converted for: T5 for onert
(onert and the reference interpreter), mBART for tflite (LiteRT; its forced target language),
Marian for circle (its sinusoidal positions, bad words and --token-ids). T5 v1.1 and BART add
no op to these graphs (gated-gelu, learned positions, post-norm): their step modules equal
transformers in test_seq2seq_steps.py, and the quantized test converts BART. Conversions are
module-scoped: one per family and target (the suite's time budget)."""
from __future__ import annotations

import dataclasses

import pytest

from circleops.cli import main
from circleops.generation.core import GenerationLimitError
from circleops.generation.text2text import Text2TextGenerator
from tiny_seq2seq import FAMILIES, PROMPT, save_tiny

NEW = 16
SEQ_LEN = "4"  # decoder prefill runs of 4: an 11-token decoder prefix takes three
SOURCE_LEN = 128  # BART's byte-level tokens of PROMPT: 103
# family -> the targets it is converted for, each with the runtimes generate runs it on
CASES = {"t5": {"onert": ("onert", "reference")}, "mbart": {"tflite": ("litert",)},
         "marian": {"circle": ("reference",)}}
PARAMS = [(f, t) for f in FAMILIES if f in CASES for t in CASES[f]]


@dataclasses.dataclass
class Converted:
    family: str
    target: str
    runtimes: tuple[str, ...]
    tiny: object  # tiny_seq2seq.TinySeq2Seq
    out: object  # the directory convert wrote

    def args(self) -> list[str]:
        """How the source reaches generate: the prompt (the saved tokenizer), or its ids (Marian:
        no sentencepiece here), and mBART's target language."""
        lang = ["--language", "de_DE"] if self.family == "mbart" else []
        if self.tiny.tokenizer is None:
            return ["--token-ids", ",".join(map(str, self.tiny.source_ids()))]
        return ["--prompt", PROMPT, *lang]


@pytest.fixture(scope="module", params=PARAMS, ids=[f"{f}-{t}" for f, t in PARAMS])
def converted(request, tmp_path_factory):
    family, target = request.param
    root = tmp_path_factory.mktemp(f"{family}-{target}")
    tiny = save_tiny(family, root / "model", seed=2)
    out = root / "out"
    assert main(["convert", str(tiny.directory), "--graphs", "encoder,prefill,decode", "--target", target,
                 "--seq-len", SEQ_LEN, "--max-cache-len", "48", "--input-shape", f"input_ids=1x{SOURCE_LEN}",
                 "--verify", "-o", str(out), "-q"]) == 0
    return Converted(family, target, CASES[family][target], tiny, out)


def _hf(tiny, ids, new=NEW, prefix=None):
    """transformers' greedy generate: the decoder sequence (start token first)."""
    return tiny.hf_greedy(ids, new, prefix)


def test_generate_equals_transformers(converted, capsys):
    """`circleops generate` prints the text of transformers' greedy tokens, on each runtime."""
    t = converted.tiny
    want = _hf(t, t.source_ids())[1:]
    assert len(set(want)) > 3  # the decoding rules keep the random model from repeating one token
    for runtime in converted.runtimes:
        assert main(["generate", str(converted.out), *converted.args(), "--max-new-tokens", str(NEW),
                     "--runtime", runtime]) == 0
        out, err = capsys.readouterr()
        if t.tokenizer is None:
            assert out.split() == [str(i) for i in want], runtime
        else:
            assert out == t.tokenizer.decode(want, skip_special_tokens=True) + "\n", runtime
        assert f"circleops generate [{runtime}]" in err


def test_another_source_through_the_api(converted):
    """The generation kind on a second, shorter source after the first (the encoder reruns:
    the cross-attention K/V and the source length are the new source's): transformers'
    tokens, EOS kept."""
    t = converted.tiny
    gen = Text2TextGenerator(converted.out, runtime=converted.runtimes[-1])
    gen.generate(t.source_ids(), 4, forced_bos_token_id=t.forced_bos)
    ids = t.source_ids("summarize: the cat sees the dog.")
    result = gen.generate(ids, NEW, forced_bos_token_id=t.forced_bos)
    assert result.tokens == _hf(t, ids)[1:]
    assert result.prefill_runs == 1 and result.decode_steps == len(result.tokens) - 1


def test_decoder_prefix_in_several_prefill_runs(converted):
    """An 11-token decoder prefix goes through the prefill graph of 4 in three runs; the
    tokens after it are transformers' with that decoder_input_ids."""
    t = converted.tiny
    ids = t.source_ids("summarize: the cat sees the dog and the green river walks quickly.")
    prefix = (_hf(t, ids, 10) + list(range(5, 16)))[:11]
    result = Text2TextGenerator(converted.out, runtime=converted.runtimes[0]).generate(ids, 6, decoder_prefix=prefix)
    assert result.prefill_runs == 3 and result.prefill_chunks == [4, 4, 4]
    assert result.tokens == _hf(t, ids, 6, prefix)[len(prefix):]


def test_a_source_longer_than_the_encoder_is_refused(converted):
    gen = Text2TextGenerator(converted.out)
    with pytest.raises(GenerationLimitError, match=r"the source is 129 tokens .* --input-shape input_ids=1x129"):
        gen.generate([5] * (SOURCE_LEN + 1), 4)
    assert main(["generate", str(converted.out), "--prompt", "x", "--image", "a.png"]) == 2


def test_quantized_decoder(tmp_path_factory):
    """--quantize q8_0 for target onert (GGML weights: onert and the reference interpreter),
    of BART (its graphs are converted only here): --verify against the model on the files'
    own weights passes, every graph's linears are quantized, and generate runs on onert. w8
    for tflite (LiteRT's dynamic-range FULLY_CONNECTED) is docs/text2text.md's (its test
    checks the file's int8 weights)."""
    from circleops.serialize import read_model

    root = tmp_path_factory.mktemp("quantized")
    tiny = save_tiny("bart", root / "model", seed=2)
    out = root / "q8_0"
    assert main(["convert", str(tiny.directory), "--graphs", "encoder,prefill,decode", "--target", "onert",
                 "--quantize", "q8_0", "--seq-len", SEQ_LEN, "--max-cache-len", "48", "--verify", "-o", str(out),
                 "-q"]) == 0
    for graph in ("encoder", "prefill", "decode"):
        model = read_model(out / f"{graph}.circle")
        assert any(t.dtype == "GGML_Q8_0" for sub in model.subgraphs for t in sub.tensors), graph
    result = Text2TextGenerator(out).generate(tiny.source_ids(), NEW)
    assert len(result.tokens) == NEW or result.stopped_at_eos


def test_a_damaged_text2text_section_is_refused(converted, tmp_path):
    """The manifest's text2text section is checked on reading, before any graph opens: an id
    outside the vocabulary, a cross-attention shape that is not the source length's."""
    import json
    import shutil

    from circleops.errors import ModelLoadError
    from circleops.package.manifest import read_manifest

    for key, value, message in (("decoder_start_token_id", 10 ** 6, "outside the model's vocabulary"),
                                ("cross_shape", [1, 4, 7, 8], "must be \\[1, H, source_len, D\\]"),
                                ("forced_bos_token_id", "de_DE", "incomplete")):
        copy = tmp_path / key
        shutil.copytree(converted.out, copy)
        data = json.loads((copy / "manifest.json").read_text())
        data["text2text"][key] = value
        (copy / "manifest.json").write_text(json.dumps(data))
        with pytest.raises(ModelLoadError, match=message):
            read_manifest(copy)


def test_dtype_other_than_fp32_is_refused_before_loading():
    """The graphs compute in fp32: --dtype fp16 is one clear refusal before any model loads."""
    from circleops.errors import TargetError
    from circleops.options import ConvertOptions
    from circleops.recipes.text2text import Text2TextRecipe

    with pytest.raises(TargetError, match="--dtype fp16: a text-to-text model's graphs compute in fp32"):
        Text2TextRecipe.check_options(ConvertOptions(dtype="fp16", graphs="encoder,prefill,decode"))
    Text2TextRecipe.check_options(ConvertOptions(dtype="fp32", graphs="encoder,prefill,decode"))

"""Token ids are checked against the vocabulary before a runtime sees them (issue 31): an id
past the embedding table (or negative) made onert read outside it (SIGSEGV, or tokens out of
garbage). Every path is checked by circleops.inputs.token_ids.check_token_ids: --token-ids, the
tokenizer's output, the manifest's pad / eos ids, the tokens fed and decoded, on onert and
the reference interpreter (the tiny 2-layer Llama's graphs)."""
from __future__ import annotations

import json
import shutil

import pytest

import manifest_json
from circleops.cli import main as cli
from circleops.errors import ModelLoadError
from circleops.generation.generator import GenerationLimitError, Generator
from circleops.package.manifest import read_manifest


@pytest.fixture(params=["onert", "reference"])
def tiny(request, tiny_onert, tiny_circle):
    """(the directory, its runtime): onert's file on onert, circle's on the reference interpreter."""
    return (tiny_onert if request.param == "onert" else tiny_circle).directory, request.param


def _vocab(directory) -> int:
    return read_manifest(directory).vocab_size


def _error(capsys, *argv) -> str:
    rc = cli(list(argv))
    out, err = capsys.readouterr()
    assert rc == 2, (rc, err)
    assert err.count("\n") == 1 and "Traceback" not in err and "internal error" not in err
    return err


@pytest.mark.parametrize("bad", ["past", "-5", str(2 ** 63), str(-2 ** 63 - 1)])
def test_cli_token_ids_outside_the_vocabulary(capsys, tiny, bad):
    directory, runtime = tiny
    v = _vocab(directory)
    bad = str(v + 8) if bad == "past" else bad
    err = _error(capsys, "generate", str(directory), "--token-ids", f"1,2,{bad}", "--runtime", runtime)
    assert f"--token-ids: token id {bad} outside the model's vocabulary of {v} tokens" in err
    if bad == str(v + 8):  # the last id of the vocabulary is fine
        assert cli(["generate", str(directory), "--token-ids", f"1,{v - 1}", "--max-new-tokens", "2", "-q",
                    "--runtime", runtime]) == 0


def _counting(gen: Generator) -> list[int]:
    """Count the runs of every session of ``gen`` (a runtime seeing an id at all)."""
    runs = [0]
    for session in [*gen.prefill_sessions.values(), gen.decode_session]:
        run = session.run

        def counted(inputs, *a, _run=run, **k):
            runs[0] += 1
            return _run(inputs, *a, **k)
        session.run = counted
    return runs


def test_generator_checks_fed_and_decoded_ids_before_running(tiny):
    directory, runtime = tiny
    gen = Generator(directory, runtime=runtime)
    v, runs = gen.manifest.vocab_size, _counting(gen)
    for ids in ([1, v], [-5], [1, 2 ** 63], [1.5]):
        with pytest.raises(GenerationLimitError, match="outside the model's vocabulary"):
            gen.generate(ids, 2)
    assert runs[0] == 0
    gen.feed([1, 2])
    with pytest.raises(GenerationLimitError, match=f"token id {v} outside"):
        gen.decode(v)  # what a sampler returning a bad index would feed
    assert runs[0] == 1 and gen.history == [1, 2]


def _copy(directory, tmp_path, change):
    out = shutil.copytree(directory, tmp_path / "copy")
    data = manifest_json.fields(out)
    before = dict(data)
    change(data)
    manifest_json.edit(out, {k: v for k, v in data.items() if k not in before or before[k] != v})
    return out


@pytest.mark.parametrize("field, value", [("pad_token_id", 1e9), ("pad_token_id", -1), ("eos_token_ids", [2, 10 ** 6]),
                                          ("eos_token_ids", [-3])])
def test_manifest_ids_outside_the_vocabulary(capsys, tiny_onert, tmp_path, field, value):
    out = _copy(tiny_onert.directory, tmp_path, lambda d: d.update({field: value}))
    with pytest.raises(ModelLoadError, match=f"manifest.json: {field}: token id .* outside"):
        read_manifest(out)
    assert f"{field}: token id" in _error(capsys, "generate", str(out), "--token-ids", "1,2")


def test_manifest_vocab_size_must_be_the_graphs(tiny_onert, tmp_path):
    """A manifest claiming a bigger vocabulary would let bigger ids through the check."""
    out = _copy(tiny_onert.directory, tmp_path, lambda d: d.update({"vocab_size": d["vocab_size"] * 1000}))
    with pytest.raises(ModelLoadError, match="logits have shape"):
        Generator(out)


def test_a_tokenizer_mapping_a_piece_past_the_vocabulary(capsys, tiny_onert, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    v = _vocab(tiny_onert.directory)
    out = _copy(tiny_onert.directory, tmp_path, lambda d: d.update({"tokenizer": "tokenizer"}))
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 5, "evil": 1_000_000}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (out / "tokenizer").mkdir()
    tok.save(str(out / "tokenizer" / "tokenizer.json"))
    assert cli(["generate", str(out), "--prompt", "hello", "--max-new-tokens", "1", "-q"]) == 0
    capsys.readouterr()
    err = _error(capsys, "generate", str(out), "--prompt", "hello evil")
    assert f"the prompt, as the tokenizer in {out / 'tokenizer'} encodes it: token id 1000000 outside" in err
    assert f"vocabulary of {v} tokens" in err



@pytest.mark.parametrize("field, value", [("eos_token_id", 10 ** 6), ("eos_token_id", -1), ("pad_token_id", 256)])
def test_convert_refuses_special_ids_outside_the_vocabulary(tmp_path, field, value):
    """A model whose config names an EOS or pad id its vocabulary does not have is refused
    before any work, nothing written, not written into a manifest that generate then refuses."""
    from families import BY_NAME

    from circleops.recipes.llm import convert_graphs

    model = BY_NAME["llama"].build()
    setattr(model.config, field, value)
    if field == "eos_token_id":
        model.generation_config.eos_token_id = value
    with pytest.raises(ModelLoadError, match=f"its {field} {value} is outside its vocabulary of "
                                             f"{model.config.vocab_size} tokens"):
        convert_graphs(model, tmp_path / "out", target="circle", prefill_len=8, max_cache_len=32)
    assert not (tmp_path / "out").exists()


def test_cli_convert_refuses_an_eos_id_outside_the_vocabulary(tmp_path):
    """The same through the CLI, in a process of its own: one line, exit 2."""
    import subprocess
    import sys

    from families import BY_NAME

    model = BY_NAME["llama"].build()
    model.config.eos_token_id = model.generation_config.eos_token_id = 10 ** 6
    model.save_pretrained(tmp_path / "hf")
    proc = subprocess.run([sys.executable, "-m", "circleops.cli", "convert", str(tmp_path / "hf"), "--graphs",
                           "prefill,decode", "--target", "circle", "--seq-len", "8", "--max-cache-len", "32", "-q", "-o",
                           str(tmp_path / "out")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "its eos_token_id 1000000 is outside its vocabulary of 256 tokens" in proc.stderr
    assert not (tmp_path / "out").exists()

"""Hand-made hostile inputs, one per defect issue 31 found through the documented readers: each
is refused with a CircleOpsError that says what is wrong (CLI: exit 2), never a traceback, an
internal error, a MemoryError or a hang. tests/fuzz/test_fuzz_inputs.py mutates the same kinds."""
from __future__ import annotations

import io
import json
import os
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))

import manifest_json
import fuzz_inputs  # noqa: E402
from bounds import address_space_limit  # noqa: E402
from circleops.errors import CircleOpsError, ModelLoadError  # noqa: E402
from circleops.inputs.user_files import InputFileError, load_npy, opened_image, read_json, read_wav  # noqa: E402


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return fuzz_inputs.build_seeds(tmp_path_factory.mktemp("seeds"))


def _file(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _wav_header(channels=1, width=2, data_len=0, rate=16000):
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * channels * width, channels * width, 8 * width)
    return (b"RIFF" + struct.pack("<I", min(36 + data_len, 0xFFFFFFFF)) + b"WAVEfmt " + struct.pack("<I", 16) + fmt
            + b"data" + struct.pack("<I", data_len))


CLIP = fuzz_inputs._wav(1, 2, frames=800)


@pytest.mark.parametrize("data, message", ids=["mid-sample", "mid-frame", "empty", "8-bytes", "cut-in-fmt",
                                               "no-data-chunk", "more-frames", "2^31-frames", "0-channels", "40-bit"],
                         argvalues=[
    (CLIP[:1001], r"header declares 800 frames \(0.05 s\) and the file holds 478"),  # stops mid-sample
    (_wav_header(2, 2, 4002) + b"\1" * 4002, "not a whole number of 4-byte frames"),  # mid-frame
    (b"", "the file is empty"),
    (CLIP[:8], "shorter than a WAV header"),
    (CLIP[:30], "'fmt ' chunk is 16 bytes and the file holds 10"),  # cut inside its header
    (CLIP[:40], "without a 'data' chunk"),
    (_wav_header(1, 2, 32000) + b"\0" * 3200, r"declares 16000 frames \(1.00 s\) and the file holds 1600.*cut"),
    (_wav_header(1, 2, 0xFFFFFFF0) + b"\0" * 3200, "declares 2147483640 frames"),  # 2^31 frames: no buffer
    (_wav_header(0, 2, 10) + b"\0" * 10, "0 channels"),
    (_wav_header(1, 5, 10) + b"\0" * 10, "40-bit"),
])
def test_damaged_wav_is_refused_with_the_reason(tmp_path, data, message):
    with address_space_limit(64 << 20), pytest.raises(InputFileError, match=message) as err:
        read_wav(_file(tmp_path, "a.wav", data))
    assert not str(err.value).endswith(": .")


def test_wav_kinds_read_as_samples(tmp_path):
    for args in ((1, 2), (2, 2), (1, 1), (1, 3), (1, 4, 3)):
        samples, rate = read_wav(_file(tmp_path, "a.wav", fuzz_inputs._wav(*args)))
        assert rate == 16000 and samples.shape == (400,) and 0.4 < np.abs(samples).max() <= 0.5 + 1e-6
    # a writer to a pipe leaves data size 0xFFFFFFFF: read to the end of the file
    samples, _ = read_wav(_file(tmp_path, "s.wav", _wav_header(1, 2, 0xFFFFFFFF) + b"\0\1" * 100))
    assert samples.shape == (100,)


def _png_header(w: int, h: int) -> bytes:
    """A PNG whose IHDR declares w x h pixels and whose data is empty (~60 bytes)."""
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def test_image_bomb_is_refused_from_its_header_and_the_limit_is_configurable(tmp_path, monkeypatch):
    bomb = _file(tmp_path, "bomb.png", _png_header(20000, 20000))
    assert bomb.stat().st_size < 200
    with address_space_limit(64 << 20), \
            pytest.raises(InputFileError, match=r"20000 x 20000 = 400000000 pixels, over circleops' limit of "
                                                r"134217728.*CIRCLEOPS_MAX_IMAGE_PIXELS"):
        with opened_image(bomb) as picture:
            picture.load()
    small = _file(tmp_path, "small.png", fuzz_inputs._png(8, 6))
    with opened_image(small) as picture:
        assert picture.convert("RGB").size == (8, 6)
    monkeypatch.setenv("CIRCLEOPS_MAX_IMAGE_PIXELS", "40")
    with pytest.raises(InputFileError, match="48 pixels, over circleops' limit of 40"):
        with opened_image(small):
            pass


def test_npy_inputs(tmp_path):
    good = io.BytesIO()
    np.save(good, np.arange(6, dtype=np.float32).reshape(2, 3))
    assert load_npy(_file(tmp_path, "g.npy", good.getvalue())).tolist() == [[0, 1, 2], [3, 4, 5]]
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776,), }"
    header += " " * (117 - len(header)) + "\n"
    huge = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + b"\0" * 64
    obj = io.BytesIO()
    np.save(obj, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    for data, message in ((b"", "is empty"), (huge, r"shape \[1099511627776\] \(4398046511104 bytes\) and the "
                                                    r"file holds 64"),
                          (obj.getvalue(), "Python objects.*pickle"), (good.getvalue()[:-4], "it is cut")):
        with address_space_limit(64 << 20), pytest.raises(InputFileError, match=message):
            load_npy(_file(tmp_path, "x.npy", data))


def _deep(n=100000):
    return "[" * n + "]" * n


def test_json_depth_and_damage_are_named(tmp_path):
    for text, message in ((_deep(), "nests 100000 levels"), ('{"a": ' + _deep(65) + "}", "nests 66 levels"),
                          ("", "is empty"), ("\xff", "not UTF-8"), ("{", "not valid JSON"), ("9" * 5000, "4300")):
        with pytest.raises(InputFileError, match=message):
            read_json(_file(tmp_path, "x.json", text.encode("latin-1")))
    ok = '{"s": "' + "[" * 1000 + '", "v": ' + "[" * 60 + "]" * 60 + "}"  # brackets in strings do not count
    assert read_json(_file(tmp_path, "ok.json", ok.encode()))["s"] == "[" * 1000


@pytest.mark.parametrize("name", ["manifest.json", "generation_config.json", "tokenizer/tokenizer_config.json",
                                  "tokenizer/tokenizer.json"])
def test_nested_json_in_a_converted_directory(seeds, tmp_path, name):
    from circleops.generation.generator import encode_prompt, load_tokenizer
    from circleops.package.manifest import read_manifest
    from circleops.generation.sampling import SamplingConfig

    d = shutil.copytree(seeds.chat_dir, tmp_path / "chat")
    (d / name).write_text(_deep())
    with pytest.raises(CircleOpsError, match=f"{Path(name).name} nests 100000 levels"):
        SamplingConfig.from_generation_config(read_manifest(d).directory, do_sample=True)
        encode_prompt(load_tokenizer(read_manifest(d)), "hi", chat=True)


def test_nested_speech_manifest_and_wrong_types(seeds, tmp_path):
    from circleops.package.speech_manifest import read_speech_manifest

    d = shutil.copytree(seeds.speech_dir, tmp_path / "speech")
    (d / "manifest.json").write_text(_deep())
    with pytest.raises(ModelLoadError, match="nests 100000 levels"):
        read_speech_manifest(d)
    for key, value in (("num_layers", 10 ** 12 * 1.0), ("suppress_tokens", {"a": 1}), ("cross_shape", [1, 2]),
                       ("lang_to_id", ["en"]), ("pad_token_id", "x")):
        m = fuzz_inputs.speech_manifest_dict()
        m[key] = value
        (d / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(ModelLoadError, match=f"{key}.*wrong type"):
            read_speech_manifest(d)


@pytest.mark.parametrize("index, message", [
    (_deep(), "nests 100000 levels"), ("nope{", "not valid JSON"), ("{}", r"no weight_map object.*it has none"),
    ('{"weight_map": ["a"]}', "it has a list"), ('[1]', "holds a JSON list"),
    ('{"weight_map": {"model.embed_tokens.weight": "../../../outside.safetensors"}}', "leaves the directory"),
    ('{"weight_map": {"model.embed_tokens.weight": "/etc/passwd"}}', "absolute path"),
])
def test_safetensors_index(seeds, tmp_path, index, message):
    from circleops.sources import models

    d = shutil.copytree(seeds.hf_dir, tmp_path / "hf")
    (d / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ModelLoadError, match=message):
        models.load(str(d))


def test_index_pointing_outside_through_a_symlink(seeds, tmp_path):
    from circleops.sources import models

    d = shutil.copytree(seeds.hf_dir, tmp_path / "hf")
    (d / "model.safetensors").rename(tmp_path / "outside.safetensors")
    (d / "model.safetensors").symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(ModelLoadError, match="symbolic link"):
        models.load(str(d))


@pytest.mark.parametrize("data, message", [
    (lambda t: t[: len(t) // 2], "not valid JSON"), (lambda t: bytes(range(256)) * 4, "not UTF-8"),
    (lambda t: b"", "is empty"), (lambda t: t.replace(b'"<|endoftext|>":0', b'"<|endoftext|>":-5', 1), "-5"),
])
def test_damaged_tokenizer_json(seeds, tmp_path, data, message):
    from circleops.generation.generator import encode_prompt, load_tokenizer
    from circleops.package.manifest import read_manifest

    d = shutil.copytree(seeds.chat_dir, tmp_path / "chat")
    path = d / "tokenizer" / "tokenizer.json"
    text = json.dumps(json.loads(path.read_bytes()), separators=(",", ":")).encode()
    path.write_bytes(data(text))
    with pytest.raises(ModelLoadError, match=message):
        encode_prompt(load_tokenizer(read_manifest(d)), "hi")


@pytest.mark.parametrize("template, message", [
    ("{{ ''.__class__.__mro__ }}", "unsafe"), ("{% for %}", "fails at line 1"), ("{{ foo.bar }}", "'foo' is undefined"),
    ("{{ raise_exception('no tools here') }}", "no tools here"),
    ("{{ 'x' * 10000000000 }}", "repeated string or list of 10000000000 items, over the budget"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "MiB more memory"),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "an output of"),
])
def test_chat_template_errors_and_budget(seeds, tmp_path, template, message):
    from circleops.inputs.chat_template import ChatTemplateError
    from circleops.generation.generator import encode_prompt, hf_tokenizer

    d = shutil.copytree(seeds.chat_dir / "tokenizer", tmp_path / "tokenizer")
    (d / "chat_template.jinja").write_text(template)
    with pytest.raises(ChatTemplateError, match=message):
        encode_prompt(hf_tokenizer(d), "hi", chat=True)


def test_chat_template_time_budget(seeds, tmp_path, monkeypatch):
    import circleops.inputs.chat_template as ct
    from circleops.generation.generator import encode_prompt, hf_tokenizer

    monkeypatch.setattr(ct, "TEMPLATE_SECONDS", 0.5)  # the same 10^10-step loop, stopped sooner than 10 s
    d = shutil.copytree(seeds.chat_dir / "tokenizer", tmp_path / "tokenizer")
    (d / "chat_template.jinja").write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                           "{% endfor %}")
    with pytest.raises(ct.ChatTemplateError, match=r"ran for more than 0.5 s"):
        encode_prompt(hf_tokenizer(d), "hi", chat=True)
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # the budget left for real templates
    assert encode_prompt(hf_tokenizer(d), "hi", chat=True) == encode_prompt(hf_tokenizer(d), "hi")


def test_sampling_values(seeds, tmp_path):
    from circleops.errors import CircleOpsError
    from circleops.generation.sampling import Sampler, SamplingConfig, SamplingError

    d = shutil.copytree(seeds.chat_dir, tmp_path / "chat")
    (d / "generation_config.json").write_text(json.dumps({"temperature": "hot", "top_k": [1]}))
    with pytest.raises(SamplingError, match=r"generation_config.json: temperature='hot', top_k=\[1\].*Fix "):
        SamplingConfig.from_generation_config(d, do_sample=True)
    with pytest.raises(SamplingError, match="seed must be 0 or more"):
        SamplingConfig(do_sample=True, seed=-1)
    logits = np.linspace(-3, 3, 50, dtype=np.float32)
    assert Sampler(SamplingConfig(do_sample=True, temperature=1e-45, seed=0))(logits) == 49  # the argmax
    assert isinstance(SamplingError("x"), CircleOpsError)


def test_cli_values(seeds, tmp_path, capsys, monkeypatch):
    from circleops.cli import main

    existing = _file(tmp_path, "existing", b"x")
    np.save(tmp_path / "x.npy", np.ones((2, 8), np.float32))
    cases = [(["run", str(seeds.circle), "-i", str(tmp_path / "x.npy"), "-o", str(existing)], "it is a file"),
             (["generate", str(seeds.chat_dir), "--token-ids", "5,6", "--sample", "--seed", "-1"], "seed must be")]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe hi\nhello\n"), encoding="utf-8",
                                                       errors="surrogateescape"))
    assert main(["chat", str(seeds.chat_dir), "-q", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "not UTF-8 text" in err and "internal error" not in err


def test_thread_counts_are_bounded(seeds, tmp_path, capsys):
    """A thread count past validate.MAX_THREADS is refused before any pool is made (the CLI
    hold-out fuzz: check --threads 100000 ended in an internal MemoryError from torch)."""
    from circleops.cli import main
    from circleops.pipeline.validate import MAX_THREADS

    config = tmp_path / "config.json"
    shutil.copy(seeds.hf_dir / "config.json", config)
    for argv in (["check", "--config", str(config), "-q", "--prompt-ids", "5,6", "-n", "1", "--policies", "fused"],
                 ["generate", str(seeds.chat_dir), "--token-ids", "5,6", "-q", "--max-new-tokens", "1"],
                 ["convert", "--config", str(config), "-o", str(tmp_path / "m.circle"), "--seq-len", "4"]):
        assert main([*argv, "--threads", "100000"]) == 2, argv
        err = capsys.readouterr().err
        assert f"from 1 to {MAX_THREADS}" in err and "internal error" not in err, err


def test_manifest_cache_slots_must_match_the_caches(seeds, tmp_path):
    from circleops.package.manifest import read_manifest

    d = shutil.copytree(seeds.chat_dir, tmp_path / "chat")
    manifest_json.edit(d, {"max_cache_len": 100000})
    with pytest.raises(ModelLoadError, match="max_cache_len is 100000 but the caches.*hold 32 slots"):
        read_manifest(d)
    manifest_json.edit(d, {"max_cache_len": 32, "vocab_size": float("inf")})  # written as Infinity; int() overflows
    with pytest.raises(ModelLoadError, match="is incomplete"):
        read_manifest(d)


@pytest.mark.parametrize("normalizer", [
    {"type": "Replace", "pattern": {"String": "h"}, "content": "h" * 100000},
    {"type": "Sequence", "normalizers": [{"type": "Replace", "pattern": {"Regex": "a?"}, "content": "bb"}] * 6},
])
def test_a_normalizer_that_multiplies_the_text_is_refused_before_it_runs(seeds, tmp_path, normalizer):
    """CLI fuzz run 2, case 15: a Replace of "h" by 100000 h's made a 100-character prompt a
    1.7 GB allocation that aborted the process inside the Rust library."""
    from circleops.generation.generator import load_tokenizer
    from circleops.package.manifest import read_manifest

    d = shutil.copytree(seeds.chat_dir, tmp_path / "chat")
    path = d / "tokenizer" / "tokenizer.json"
    saved = json.loads(path.read_bytes())
    load_tokenizer(read_manifest(d))  # the seed's own normalizer passes
    path.write_text(json.dumps({**saved, "normalizer": normalizer}))
    with pytest.raises(ModelLoadError, match="its normalizer can make each character of a prompt up to"):
        load_tokenizer(read_manifest(d))


@pytest.mark.parametrize("chat", [False, True])
def test_a_catastrophic_pre_tokenizer_regex_is_refused_in_one_paragraph(seeds, tmp_path, capfd, chat):
    """CLI fuzz run 3: the pre-tokenizer (a+)+$ on 30 a's and a "!" exhausts the regex
    engine's retry limit; the Rust library panics (pyo3's PanicException, a BaseException,
    and the panic hook's report on fd 2). One ModelLoadError, nothing else on stderr."""
    from circleops.generation.generator import encode_prompt, load_tokenizer
    from circleops.package.manifest import read_manifest

    d = shutil.copytree(seeds.chat_dir, tmp_path / "chat")
    path = d / "tokenizer" / "tokenizer.json"
    saved = json.loads(path.read_bytes())
    path.write_text(json.dumps({**saved, "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(a+)+$"},
                                                            "behavior": "Isolated", "invert": False}}))
    tokenizer = load_tokenizer(read_manifest(d))
    assert encode_prompt(tokenizer, "hello", chat=chat)  # a text the regex handles
    capfd.readouterr()
    with pytest.raises(ModelLoadError, match="failed on this input: PanicException: Onig"):
        encode_prompt(tokenizer, "a" * 30 + "!", chat=chat)
    assert "panicked" not in capfd.readouterr().err


@pytest.mark.parametrize("change, message", [
    ({"model_type": 3}, "model_type is 3, not a name"),
    ({"architectures": 0.5}, "architectures is '0.5', not a list of class names"),
    ({"architectures": ["LlamaForCausalLM", 7]}, "not a list of class names"),
])
def test_config_names_of_the_wrong_type(seeds, tmp_path, change, message):
    """CLI fuzz run 2, case 81: a float architectures ended in TypeError inside task inference."""
    from circleops.recipes.tasks import task_of

    cfg = {**json.loads((seeds.hf_dir / "config.json").read_text()), **change}
    path = _file(tmp_path, "config.json", json.dumps(cfg).encode())
    with pytest.raises(ModelLoadError, match=message):
        task_of(None, str(path))


def test_the_tokenizers_librarys_own_errors_are_the_files_fault(tmp_path):
    """CLI fuzz run 2, case 260: an empty WordPiece vocab.txt raises the Rust library's bare
    Exception on the first text; it is refused naming the tokenizer, not an internal error."""
    from tokenizers import Tokenizer, models

    from circleops.inputs.user_files import users_processor

    tok = Tokenizer(models.WordPiece({}, unk_token="[UNK]"))
    with pytest.raises(InputFileError, match=r"the tokenizer saved in sst failed on this input: Exception: WordPiece"):
        with users_processor("tokenizer", "sst"):
            tok.encode("the cat")
    with pytest.raises(KeyboardInterrupt), users_processor("tokenizer", "sst"):
        raise KeyboardInterrupt  # only the library's errors are turned into a refusal


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 10 ** 6}, "asks for 1000000 layers"),
    ({"hidden_size": 10 ** 7, "intermediate_size": 10 ** 7}, "parameters, which in fp32 would need"),
])
def test_config_sizes_are_bounded_before_building(seeds, tmp_path, change, message):
    from circleops.sources import models

    cfg = {**json.loads((seeds.hf_dir / "config.json").read_text()), **change}
    path = _file(tmp_path, "config.json", json.dumps(cfg).encode())
    with address_space_limit(256 << 20), pytest.raises(ModelLoadError, match=message):
        models.load(None, config=str(path))


def test_task_input_sizes_are_bounded():
    from circleops.errors import TargetError
    from circleops.recipes.tasks import _image_hw, check_input_sizes, parse_input_shapes

    shapes = {"pixel_values": (parse_input_shapes(["pixel_values=1x3x1000000000000000000x1"])["pixel_values"],
                               "float32")}
    with pytest.raises(TargetError, match="would need .* PiB, more than .*a quarter of this machine's memory"):
        check_input_sizes(shapes)
    with pytest.raises(TargetError, match="image size .* 100000; it must be an integer from 1 to 16384"):
        _image_hw(None, {"size": {"height": 100000, "width": 100000}})


def test_calibration_ids_past_the_vocabulary(tmp_path):
    import torch

    from circleops.quantize.pt2e import CalibrationError, calibration_samples

    path = tmp_path / "calib.pt"
    torch.save([torch.tensor([[1, 2, 100000, 4]])], path)
    with pytest.raises(CalibrationError, match="token id 100000 outside the model.s vocabulary of 259 tokens"):
        calibration_samples((torch.zeros(1, 4, dtype=torch.long),), 1, data=path, vocab_size=259)
    torch.save([torch.rand(1, 4)], path)
    with pytest.raises(CalibrationError, match="torch.float32, the model takes torch.int64 token ids"):
        calibration_samples((torch.zeros(1, 4, dtype=torch.long),), 1, data=path, vocab_size=259)


def test_cli_subprocess_exit_2_on_a_damaged_npy(seeds, tmp_path):
    # one through a real process: the exit status and the one paragraph, no traceback
    import subprocess

    npy = _file(tmp_path, "cut.npy", seeds.files["npy"][0][:30])
    proc = subprocess.run([sys.executable, "-m", "circleops.cli", "run", str(seeds.circle), "-i", str(npy)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "is not a readable .npy file" in proc.stderr


def test_feature_extractor_window_must_be_the_encoders(seeds, tmp_path):
    # a processor whose chunk_length is 10^9 would pad the audio to 1.6e13 samples
    from types import SimpleNamespace

    from circleops.package.speech_manifest import check_extractor, read_speech_manifest

    m = read_speech_manifest(seeds.speech_dir)
    good = SimpleNamespace(feature_size=20, n_samples=16000, hop_length=160, sampling_rate=16000)
    check_extractor(good, m)
    for change in ({"n_samples": 16000 * 10 ** 9}, {"feature_size": 80}, {"hop_length": 0}, {"n_samples": "x"}):
        with pytest.raises(ModelLoadError, match="does not make the encoder's input of 20 mel bins x 100 frames"):
            check_extractor(SimpleNamespace(**{**vars(good), **change}), m)


def test_text_longer_than_the_cache_could_hold_is_refused_before_tokenizing(seeds, tmp_path, capsys, monkeypatch):
    """A prompt or chat message longer than the cache's slots times the longest token is
    refused before the tokenizer sees it (the CLI hold-out fuzz: a 3 MB line on chat's stdin
    made the tokenizers library abort on a failed allocation, SIGABRT, under a 6 GiB limit;
    tokenizing costs hundreds of bytes per character)."""
    from circleops.cli import main
    from circleops.generation.core import GenerationLimitError
    from circleops.generation.tokenizers import check_text_fits, load_tokenizer
    from circleops.package.manifest import read_manifest

    manifest = read_manifest(seeds.chat_dir)
    tokenizer = load_tokenizer(manifest)
    capacity = manifest.max_cache_len
    check_text_fits(tokenizer, "x" * capacity, capacity)  # one character per token: fits
    with pytest.raises(GenerationLimitError, match="cache slots can hold"):
        check_text_fits(tokenizer, "x" * (capacity * 20), capacity)
    big = "x" * 3_000_000
    assert main(["generate", str(seeds.chat_dir), "--prompt", big, "-q", "--max-new-tokens", "2"]) == 2
    assert "3000000 characters" in capsys.readouterr().err
    with address_space_limit(256 << 20):  # refused without the gigabytes tokenizing would take
        monkeypatch.setattr(sys, "stdin", io.StringIO(big + "\nhi\n"))
        assert main(["chat", str(seeds.chat_dir), "-q", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "this message is 3000000 characters" in err and "internal error" not in err, err


@pytest.mark.parametrize("change,message", [
    (lambda h, n: h[n].update(shape=[[1, "a"]]), "is not a tensor"),
    (lambda h, n: h[n].update(data_offsets=["0", "8"]), "is not a tensor"),
    (lambda h, n: h[n].update(data_offsets=[0, 2 ** 40]), "data offsets inside"),
    (lambda h, n: h[n].update(shape=[True, 2]), "is not a tensor"),
    (lambda h, n: h.update({n: [1, 2]}), "is not a tensor"),
])
def test_safetensors_header_entries_are_checked(seeds, tmp_path, capsys, change, message):
    """The sizes read from a safetensors header before anything is built are checked by one
    reader (user_files.read_safetensors_header; the CLI hold-out fuzz: a shape holding a list
    ended in an internal TypeError in the size estimate)."""
    from circleops.cli import main
    from circleops.inputs.user_files import read_safetensors_header

    d = tmp_path / "hf"
    shutil.copytree(seeds.hf_dir, d)
    (d / "model.safetensors.index.json").unlink()
    data = (d / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    change(header, sorted(k for k in header if k != "__metadata__")[0])
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])
    with pytest.raises(InputFileError, match=message):
        read_safetensors_header(d / "model.safetensors")
    assert main(["convert", str(d), "-o", str(tmp_path / "m.circle"), "--seq-len", "4", "-q"]) == 2
    err = capsys.readouterr().err
    assert message in err and "internal error" not in err, err

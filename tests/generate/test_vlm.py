"""A vision-language model end to end: `circleops convert DIR --graphs vision,prefill,decode`
on a tiny random model of each family (SmolVLM / Idefics3, PaliGemma) saved with its
processor, then `generate --image` and `chat --image` on onert (and the reference
interpreter, and the one-file targets circle and tflite) give transformers' greedy tokens.
``tiny_vlm_onert`` is parametrized over the families (vlm_fixtures.py)."""
from __future__ import annotations

import copy
import io
import sys

import numpy as np
import pytest
import torch

import manifest_json
from bounds import address_space_limit
from onert_host import GGML_RUNTIME
from circleops.cli import main
from circleops.package.manifest import read_manifest
from circleops.serialize import read_model
from circleops.generation import vision as vision_gen
from circleops.recipes import vlm
from vlm_fixtures import VLM_NEW


def _inputs(t, prompt, image, chat=False):
    return vision_gen.prepare(t.processor, prompt, vision_gen.read_image(image) if image else None, chat=chat)


@pytest.mark.parametrize("runtime, prompt, chat", [
    ("onert", "Describe it", True), ("onert", "What is in this picture? Answer briefly.", False),
    ("reference", "Describe it", True)])
def test_generate_with_image_equals_transformers(tiny_vlm_onert, runtime, prompt, chat):
    t = tiny_vlm_onert
    chat = chat and t.chat  # PaliGemma has no chat template: its processor's own layout
    ids, pixels = _inputs(t, prompt, t.photo, chat)
    assert ids.count(t.model.config.image_token_id) == t.tiles * t.image_tokens and len(ids) > 16
    result = vision_gen.generate(t.out, prompt, t.photo, VLM_NEW, runtime=runtime, chat=chat)
    assert result.prompt_ids == ids
    assert result.tokens == t.hf_greedy(ids, pixels)
    # SmolVLM's prompt spans several chunks; PaliGemma's prefix attends both ways: one run
    assert result.prefill_runs == 1 if t.family == "paligemma" else result.prefill_runs > 1


def test_several_images_equal_transformers(tiny_vlm_onert, capsys):
    """`generate --image a --image b`: both images go before the prompt in the order given
    (one image marker each, as the processor expands them), and the tokens are transformers'
    greedy ones on the same inputs; the other order is another prompt."""
    t = tiny_vlm_onert
    prompt = "Describe them"
    ids, pixels = vision_gen.prepare(t.processor, prompt, [vision_gen.read_image(p) for p in (t.photo, t.other)])
    one, _ = _inputs(t, prompt, t.photo)
    image = t.model.config.image_token_id
    assert ids.count(image) > one.count(image) > 0  # the second image's tokens are in the prompt
    swapped = vision_gen.prepare(t.processor, prompt, [vision_gen.read_image(p) for p in (t.other, t.photo)])[1]
    assert swapped.shape != pixels.shape or not np.array_equal(swapped, pixels)  # the order is kept
    want = t.processor.tokenizer.decode(t.hf_greedy(ids, pixels), skip_special_tokens=True)
    capsys.readouterr()
    assert main(["generate", str(t.out), "--image", str(t.photo), "--image", str(t.other), "--prompt", prompt,
                 "--max-new-tokens", str(VLM_NEW)]) == 0
    out, err = capsys.readouterr()
    assert out == prompt + want + "\n" and "2 image(s)" in err, (out, want, err)
    # a prompt that places one image marker for two images is refused, naming both counts
    mark = getattr(t.processor, "boi_token", None) or "<image>"
    assert main(["generate", str(t.out), "--image", str(t.photo), "--image", str(t.other), "--prompt",
                 f"{mark} {prompt}"]) == 2
    assert "places 1 image(s)" in capsys.readouterr().err


def test_the_image_decides_the_tokens(tiny_vlm_onert):
    """Another image gives transformers' tokens for that image, which differ: the graphs see it."""
    t = tiny_vlm_onert
    ids, pixels = _inputs(t, "Describe it", t.other, t.chat)
    got = vision_gen.generate(t.out, "Describe it", t.other, VLM_NEW, chat=t.chat).tokens
    assert got == t.hf_greedy(ids, pixels)
    assert got != vision_gen.generate(t.out, "Describe it", t.photo, VLM_NEW, chat=t.chat).tokens


def test_text_only_prompt_equals_transformers(tiny_vlm_onert):
    """SmolVLM answers text alone as transformers does; PaliGemma's processor takes no text
    without an image, which is one clear error."""
    t = tiny_vlm_onert
    if t.family == "paligemma":
        with pytest.raises(vision_gen.ImageInputError, match="PaliGemma generates from an image and a prompt"):
            vision_gen.generate(t.out, "Hello there, how are you?", None, VLM_NEW)
        return
    ids, pixels = _inputs(t, "Hello there, how are you?", None)
    assert pixels is None
    assert vision_gen.generate(t.out, "Hello there, how are you?", None, VLM_NEW).tokens == t.hf_greedy(ids, None)


def test_cli_generate_prints_transformers_text(tiny_vlm_onert, capsys):
    t = tiny_vlm_onert
    ids, pixels = _inputs(t, "Describe it", t.photo, t.chat)
    want = t.processor.tokenizer.decode(t.hf_greedy(ids, pixels), skip_special_tokens=True)
    assert main(["generate", str(t.out), "--image", str(t.photo), "--prompt", "Describe it",
                 *(["--chat"] if t.chat else []), "--max-new-tokens", str(VLM_NEW)]) == 0
    out, err = capsys.readouterr()
    assert out == ("" if t.chat else "Describe it") + want + "\n"
    assert f"{t.tiles} tile(s) through the vision graph" in err


def _rendered(t, texts_and_replies, images):
    """The ids and pixel_values of a conversation (user, assistant, ..., user) rendered by the
    processor's template, ``images[i]`` (a list) in message i, as transformers takes it."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant",
                 "content": [{"type": "image"}] * len(images.get(i, [])) + [{"type": "text", "text": text}]}
                for i, text in enumerate(texts_and_replies)]
    rendered = t.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return vision_gen.prepare(t.processor, rendered, [x for i in sorted(images) if i < len(messages) for x in images[i]] or None)


def test_chat_with_image_equals_transformers(tiny_vlm_onert, monkeypatch, capsys):
    """Each reply is transformers' greedy continuation of the whole conversation rendered by
    the processor's template, each image in the turn that brought it (the first message's
    --image, a later turn's /image); a later turn feeds only its own tokens. A turn whose
    images do not fit the cache is refused, the conversation kept. PaliGemma (no chat
    template) refuses to chat in one paragraph."""
    t = tiny_vlm_onert
    image, other = vision_gen.read_image(t.photo), vision_gen.read_image(t.other)
    if not t.chat:
        assert main(["chat", str(t.out), "--image", str(t.photo)]) == 2
        err = capsys.readouterr().err
        assert "has no chat template: its prompt is one prefix" in err and "Traceback" not in err
        assert main(["generate", str(t.out), "--image", str(t.photo), "--prompt", "Hi", "--chat"]) == 2
        assert "so it does not chat" in capsys.readouterr().err
        return
    chat = vision_gen.VisionChat(vision_gen.VisionGenerator(t.out), t.processor, image)
    said: list[str] = []
    images = {0: [image]}
    for text, added in [("Describe it", None), ("And this one?", other)]:
        if added is not None:
            chat.add_image(added)
            images[len(said)] = [added]
        ids, pixels = _rendered(t, [*said, text], images)
        first = first if said else len(ids)
        reply = chat.turn(text, 8)
        assert reply.tokens == t.hf_greedy(ids, pixels, 8, eos=chat.stop_ids)
        said += [text, reply.text]
    assert ids.count(t.model.config.image_token_id) == 2 * t.tiles * t.image_tokens  # both images' tokens
    assert len(ids) - reply.fed >= first  # the first turn's prompt and image stay in the cache

    # the CLI: a second turn that adds an image (/image), then images past the 128-slot cache
    said, images = [], {0: [image], 2: [other]}
    for text in ["Describe it", "And this one?"]:
        ids, pixels = _rendered(t, [*said, text], images)
        want = [x for x in t.hf_greedy(ids, pixels, 8, eos=chat.stop_ids) if x not in chat.stop_ids]
        said += [text, t.processor.tokenizer.decode(want, skip_special_tokens=True)]
    more = f"/image {t.photo}\n" * 4
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"Describe it\n/image {t.other}\nAnd this one?\n{more}Too many\n"))
    capsys.readouterr()
    assert main(["chat", str(t.out), "--image", str(t.photo), "--max-new-tokens", "8", "-q"]) == 0
    out, err = capsys.readouterr()
    assert out == said[1] + "\n" + said[3] + "\n", (out, said)
    assert "the KV cache is full" in err and "Traceback" not in err, err


def test_manifest_lists_the_vision_graph_and_the_text_part_stays_fused(tiny_vlm_onert):
    t = tiny_vlm_onert
    m = read_manifest(t.out)
    assert m.files["vision"] == "vision.circle" and m.vision["graph"] == "vision"
    assert m.vision["image_token_id"] == t.model.config.image_token_id
    assert m.vision["image_seq_len"] == t.image_tokens
    assert "image_embeds" in m.prefill_inputs
    assert ("prefix_len" in m.prefill_inputs) == m.vision["prefix_lm"] == (t.family == "paligemma")
    ops = {g: [op.opcode for op in read_model(t.out / f).subgraphs[0].operators] for g, f in m.files.items()}
    sub = read_model(t.out / m.files["vision"]).subgraphs[0]
    assert [list(sub.tensors[i].shape) for i in sub.inputs] == [[1, 3, 32, 32]]
    assert [list(sub.tensors[i].shape) for i in sub.outputs] == [[1, t.image_tokens, 32]]
    for g in ("prefill", "prefill_8", "decode"):
        assert ops[g].count("RMS_NORM") == 5, g  # 2 layers x 2 + the final norm
    assert ops["decode"].count("ROPE") == 4


def test_errors_are_one_clear_paragraph(tiny_vlm_onert, tmp_path, capsys):
    t = tiny_vlm_onert
    cases = [
        (["convert", str(t.model_dir), "-o", str(tmp_path / "x.circle")], "--graphs vision,prefill,decode"),
        (["convert", str(t.model_dir), "--graphs", "prefill,decode", "-o", str(tmp_path / "o")],
         "converts with --graphs vision,prefill,decode"),
        (["generate", str(t.out), "--image", str(tmp_path / "missing.png"), "--prompt", "Hi"],
         "missing.png does not exist"),
        (["generate", str(t.out), "--prompt", "<image>What is it?"],
         "PaliGemma generates from an image and a prompt" if t.family == "paligemma"
         else "image tokens (<image>) with no image: pass the image"),
        (["generate", str(t.out), "--image", str(tmp_path / "x.txt"), "--prompt", "Hi"], "does not exist"),
    ]
    (tmp_path / "bad.png").write_text("not an image")
    cases.append((["generate", str(t.out), "--image", str(tmp_path / "bad.png"), "--prompt", "Hi"],
                  "cannot read the image"))
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "o").exists() and not (tmp_path / "x.circle").exists()


def test_the_text_generator_refuses_a_vlm_directory(tiny_vlm_onert):
    from circleops.errors import ModelLoadError
    from circleops.generation.generator import Generator

    with pytest.raises(ModelLoadError, match="VisionGenerator"):
        Generator(tiny_vlm_onert.out)


def test_a_text_model_is_refused_the_vision_graph(tmp_path, capsys):
    from families import BY_NAME

    BY_NAME["llama"].build().save_pretrained(str(tmp_path / "llama"))
    assert main(["convert", str(tmp_path / "llama"), "--graphs", "vision,prefill,decode",
                 "-o", str(tmp_path / "o")]) == 2
    assert "the vision graph is for vision-language models" in capsys.readouterr().err


@pytest.mark.parametrize("target, dtype", [("circle", "fp32"), ("tflite", "fp32"), ("circle", "fp16")])
def test_one_file_targets_generate_transformers_tokens(tiny_vlm_onert, tmp_path, target, dtype):
    """Target circle (ATTENTION updating whole caches, the reference interpreter) and tflite
    (LiteRT): one file, a signature per graph, the vision graph among them. fp16 (`convert
    --dtype fp16`, the CLI: the model loaded in fp16): every graph takes and returns fp16, as
    the LLM recipe's, and generates torch fp16's greedy tokens (_check_fp16_tokens); target
    tflite's fp16 files run in docs/vlm.md's blocks (tests/generate/test_docs_vlm.py)."""
    t = tiny_vlm_onert
    lengths = tuple(int(n) for n in t.prefill.split(","))
    out = tmp_path / "out"
    if dtype == "fp16":
        assert main(["convert", str(t.model_dir), "--graphs", "vision,prefill,decode", "--target", target, "--dtype",
                     dtype, "-q", "--seq-len", t.prefill, "--max-cache-len", "64", "-o", str(out)]) == 0
    else:
        model, processor = vlm.load(t.model_dir)
        vlm.convert_vlm_graphs(model, out, processor=processor, target=target, prefill_len=lengths, max_cache_len=64)
    m = read_manifest(out)
    assert set(m.files.values()) == {f"model.{'tflite' if target == 'tflite' else 'circle'}"} and m.dtype == dtype
    ids, pixels = _inputs(t, "Describe it", t.photo, t.chat)
    # 8 tokens: PaliGemma's causal-prefill tokens part from the prefix-LM's at the 5th
    got = vision_gen.generate(out, "Describe it", t.photo, 8, chat=t.chat).tokens
    if dtype == "fp32":
        assert got == t.hf_greedy(ids, pixels, 8)
    else:
        _check_fp16_tokens(t, read_model(out / m.files["vision"]), ids, pixels, got)


def _check_fp16_tokens(t, model_file, ids, pixels, tokens):
    """An fp16 file's signatures take and return fp16 (pixels, image embeddings, caches,
    logits), and each token it generated is torch fp16's greedy choice (the model cast to
    fp16, teacher-forced on the prompt and the tokens) up to the fp16 roundings of the path
    to the logits: the vision graph's, then the prefill's that reads its embeddings, then the
    decode step's that reads the prefill's caches (tests/rounding.py; two computations, each
    within that bound, may swap two logits twice as close)."""
    from rounding import fp16_error_bound, fp16_roundings, native_fp16

    for sig in model_file.signatures:
        sub = model_file.subgraphs[sig.subgraph_index]
        floats = {name: sub.tensors[sub.inputs[i]].dtype for i, name in enumerate(sig.inputs)
                  if name not in ("input_ids", "pos", "logits_row", "prefix_len")}
        floats.update({name: sub.tensors[i].dtype for name, i in sig.outputs.items()})
        assert set(floats.values()) == {"FLOAT16"}, (sig.key, floats)
    model = copy.deepcopy(t.model).half()
    kw = {} if t.family != "paligemma" else {  # the generated tokens: PaliGemma's causal suffix
        "token_type_ids": torch.tensor([[0] * len(ids) + [1] * len(tokens)])}
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + tokens]), pixel_values=torch.as_tensor(pixels).half(),
                       **kw).logits[0, len(ids) - 1:len(ids) - 1 + len(tokens)].float()
    index = {sig.key: sig.subgraph_index for sig in model_file.signatures}
    roundings = sum(fp16_roundings(model_file, index[g], native_fp16())[0] for g in ("vision", "prefill", "decode"))
    bound = fp16_error_bound(roundings) * max(1.0, float(logits.abs().max()))
    gaps = [float(row.max() - row[x]) for row, x in zip(logits, tokens)]
    assert max(gaps) <= 2 * bound, f"fp16 tokens {tokens} off torch fp16's greedy by logit gaps {gaps} ({bound=:.3g})"


@pytest.mark.parametrize("vision, message", [("oops", "vision has the wrong type"),
                                             ({"graph": "vision"}, "the vision entry is incomplete"),
                                             ({"graph": "../x", "image_token_id": 1, "image_seq_len": 4,
                                               "tile_size": 32, "hidden_size": 32}, "has no ../x graph")])
def test_a_damaged_vision_entry_is_refused(tiny_vlm_onert, tmp_path, vision, message):
    import json
    import shutil

    from circleops.errors import ModelLoadError

    out = tmp_path / "out"
    shutil.copytree(tiny_vlm_onert.out, out)
    manifest_json.edit(out, {"vision": vision})
    with pytest.raises(ModelLoadError, match=message):
        vision_gen.VisionGenerator(out, runtime="reference")


def test_a_damaged_saved_tokenizer_is_named(tiny_vlm_onert, tmp_path, capsys):
    """A VLM directory whose tokenizer.json holds a value of the wrong type (a vocabulary id
    0.5) is one paragraph naming the file, exit 2 (the CLI hold-out fuzz: an internal error
    raised by the tokenizers library inside transformers' AutoProcessor)."""
    import json
    import shutil

    out = tmp_path / "out"
    shutil.copytree(tiny_vlm_onert.out, out)
    path = out / "tokenizer" / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab[next(iter(vocab))] = 0.5
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["generate", str(out), "--image", str(tiny_vlm_onert.photo), "--prompt", "hi", "-q"]) == 2
    err = capsys.readouterr().err
    assert f"{path} is not a tokenizer the tokenizers library can load" in err and "internal error" not in err, err


@pytest.mark.parametrize("value", [2 ** 31, 3])
def test_a_processor_whose_image_tokens_are_not_the_graphs_is_refused(tiny_vlm_onert, tmp_path, capsys, value):
    """The CLI hold-out fuzz, run 3: a processor_config.json image_seq_len of 2^31 made a
    2^31-token prompt (MemoryError); any value but the vision graph's rows is refused."""
    import json
    import shutil

    out = tmp_path / "out"
    shutil.copytree(tiny_vlm_onert.out, out)
    paths = [p for p in (out / "tokenizer").glob("*.json") if "image_seq_len" in json.loads(p.read_text())]
    if not paths:  # a processor keeping its count in the image processor (PaliGemma's image_seq_length)
        paths = [p for p in (out / "tokenizer").glob("*.json") if "image_seq_length" in p.read_text()]
    assert paths, "the saved processor names its image tokens"
    for path in paths:
        data = json.loads(path.read_text())
        for key in ("image_seq_len", "image_seq_length"):
            if key in data:
                data[key] = value
            if isinstance(data.get("image_processor"), dict) and key in data["image_processor"]:
                data["image_processor"][key] = value
        path.write_text(json.dumps(data))
    capsys.readouterr()
    with address_space_limit(2 << 30):  # without the check: a MemoryError here, not the machine's memory
        assert main(["generate", str(out), "--image", str(tiny_vlm_onert.photo), "--prompt", "hi", "-q"]) == 2
    err = capsys.readouterr().err
    assert f"makes {value} image tokens per image" in err and "Convert the model again" in err, err


@pytest.mark.parametrize("fmt", ["q4_0", "w8"])
def test_quantized_text_graphs_keep_torch_greedy_on_their_weights(tiny_vlm_onert, tmp_path, fmt):
    """--quantize makes the prefill and decode graphs' weights q4_0 (GGML) or w8 (int8) and
    leaves the vision graph fp32; --verify compares them with the model running the weights
    the files hold. q4_0: each token generated is torch's greedy choice on those weights
    (dequantized), up to the files' verify error (a near-tie may go either way, as for a text
    model: tests/quantize/test_quantize_convert.py). w8's SmoothQuant (SmolVLM's Llama) is
    undone after the conversion, so its files are checked by --verify alone."""
    from circleops.adapters.vlm import TextLM
    from circleops.quantize.weights import dequantized_sources

    t = tiny_vlm_onert
    model, processor = vlm.load(t.model_dir)
    lengths = tuple(int(n) for n in t.prefill.split(","))
    out = tmp_path / "q"
    report = vlm.convert_vlm_graphs(model, out, processor=processor, target="onert", prefill_len=lengths,
                                    max_cache_len=64, verify=True, quantize=fmt)
    m = read_manifest(out)
    # GGML files verify on onert where this CPU runs its GGML kernels (AVX-512), else on the
    # reference interpreter (which computes onert's rounding of their inputs)
    runtime = GGML_RUNTIME if fmt == "q4_0" else "onert"
    assert m.quantize == fmt and report.quantization.format == fmt and report.verify_runtime == runtime
    # the one verify rule of the package step: onert rounds the text graphs' inputs, so the
    # model's noise floor was measured (the vision graph's, fp32, is none); the quality
    # against fp32 is over the text logits only: one row per prefix of the verify prompt (its
    # image tokens and text), none from the pixels or the vision features it also holds
    from circleops.recipes.vlm import PREFIX_TEXT, SUFFIX_TEXT

    text = PREFIX_TEXT + SUFFIX_TEXT + 1 if m.vision["prefix_lm"] else max(2, min(lengths) // 2) + 2
    q = report.quality
    assert report.noise_floor is not None and q.positions == m.vision["image_seq_len"] + text, (q, m.vision)
    assert 0 <= q.agreement <= q.positions and 0 < q.sqnr_db < float("inf") and q.max_abs > 0, q
    types = {g: {tensor.dtype for tensor in read_model(out / f).subgraphs[0].tensors} for g, f in m.files.items()}
    weight_type = "GGML_Q4_0" if fmt == "q4_0" else "INT8"
    assert weight_type not in types["vision"] and weight_type in types["prefill"] and weight_type in types["decode"]
    ids, pixels = _inputs(t, "Describe it", t.photo, t.chat)
    tokens = vision_gen.generate(out, "Describe it", t.photo, 8, chat=t.chat).tokens
    assert len(tokens) == 8 or tokens[-1] in m.eos_token_ids
    if fmt == "w8":
        return
    # torch on the file's weights with onert's activation rounding (GGML's q8_0 of each linear's
    # input), as verify compares; a near-tie may still go either way within the files' verify
    # error or the model's own noise floor (an input rounding flipped by a summation order)
    err = max(max(info.max_abs_error for info in report.graphs.values()), report.noise_floor)
    kw = {} if t.family != "paligemma" else {
        "token_type_ids": torch.tensor([[0] * len(ids) + [1] * len(tokens)])}  # generated tokens: the suffix
    with dequantized_sources(report.quantization, TextLM(model), runtime="onert"), torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + tokens]), pixel_values=torch.as_tensor(pixels),
                       **kw).logits[0, len(ids) - 1:len(ids) - 1 + len(tokens)]
    gaps = [float(row.max() - row[x]) for row, x in zip(logits, tokens)]
    assert max(gaps) <= 2 * err, f"{fmt}: tokens {tokens} off torch's greedy by logit gaps {gaps} (error {err:.3g})"
    # the CLI writes the same files
    assert main(["convert", str(t.model_dir), "--graphs", "vision,prefill,decode", "--target", "onert", "--quantize",
                 fmt, "-q", "--seq-len", t.prefill, "--max-cache-len", "64", "-o", str(tmp_path / "cli")]) == 0
    assert vision_gen.generate(tmp_path / "cli", "Describe it", t.photo, 8, chat=t.chat).tokens == tokens


def test_fp16_is_refused_where_it_cannot_run(tiny_vlm_onert, tmp_path, capsys):
    """fp16 graphs are for circle and tflite, as the LLM recipe's: onert refuses fp16 tensors,
    and a weight format stores weights for fp32 graphs; one paragraph each, nothing written."""
    t = tiny_vlm_onert
    for extra, message in [(["--target", "onert"], "target onert is fp32 only"),
                           (["--target", "circle", "--quantize", "q8_0"], "use dtype fp32 with quantize")]:
        assert main(["convert", str(t.model_dir), "--graphs", "vision,prefill,decode", *extra, "--dtype", "fp16",
                     "-o", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
        assert not (tmp_path / "o").exists()

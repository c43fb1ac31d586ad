"""Gemma 3 with images converted and run: ``circleops convert DIR --graphs vision,prefill,decode
--verify`` of a tiny random Gemma 3 (saved with its processor), then the written graphs give
transformers' greedy tokens and every step's logits, with one image and with two, on onert and
on the reference interpreter (the same files); prefill graphs of 8 and 4 whose runs never split
an image block (each is attended both ways); ``circleops generate --image`` prints the text."""
from __future__ import annotations

import numpy as np
import pytest

from circleops.cli import main
from tiny_vlms import save_tiny

NEW = 8
PROMPTS = ("Look at <start_of_image> please, what is it?",
           "Look <start_of_image> and then at <start_of_image> now, what is it?")
# fp32 through 2 vision + 2 text layers in another order (chunked prefill, masks built from
# pos): a few ulps of |logits|, as in test_vlm_families.py
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    tiny = save_tiny("gemma3", root)
    out = root / "out"
    assert main(["convert", str(tiny.directory), "--graphs", "vision,prefill,decode", "--target", "onert",
                 "--seq-len", "8,4", "--max-cache-len", "96", "--verify", "-o", str(out), "-q"]) == 0
    return tiny, out


def _graph_greedy(out, runtime, processor, inputs, images, new):
    """Greedy decoding through the written graphs (circleops.generation.vision's generator):
    each image through the vision graph, the prompt's image tokens take its rows."""
    from PIL import Image

    from circleops.generation.vision import VisionGenerator

    gen = VisionGenerator(out, runtime=runtime)
    pixels = [processor(text=["<start_of_image>"], images=[[Image.open(p).convert("RGB")]],
                        return_tensors="np")["pixel_values"] for p in images]
    ids = inputs["input_ids"][0].tolist()
    gen.reset()
    gen.attach_images(ids, 0, np.concatenate([gen.image_features(px[None]) for px in pixels]))
    logits, tokens, seen = gen.feed(ids), [], []
    for _ in range(new):
        seen.append(logits)
        tokens.append(int(np.argmax(logits)))
        logits = gen.decode(tokens[-1])
    return tokens, seen


@pytest.mark.parametrize("images", [1, 2])
def test_graphs_equal_transformers(converted, images):
    tiny, out = converted
    inputs = tiny.inputs(PROMPTS[images - 1], tiny.images[:images])
    want, want_logits = tiny.hf_greedy(inputs, NEW)
    for runtime in ("onert", "reference") if images == 1 else ("onert",):  # the reference: the same files
        got, logits = _graph_greedy(out, runtime, tiny.processor, inputs, tiny.images[:images], NEW)
        assert got == want, runtime
        for i, (g, w) in enumerate(zip(logits, want_logits)):
            assert np.abs(g - w.numpy()).max() <= LOGIT_TOL * max(1.0, float(w.abs().max())), (runtime, i)


@pytest.mark.parametrize("images", [1, 2])
def test_generate_image_prints_transformers_text(converted, capsys, images):
    """The CLI (--image once per image): the processor saved with the graphs expands each
    image where the prompt's <start_of_image> is; the new text is transformers' greedy
    tokens decoded."""
    tiny, out = converted
    inputs = tiny.inputs(PROMPTS[images - 1], tiny.images[:images])
    want = tiny.processor.tokenizer.decode(tiny.hf_greedy(inputs, NEW)[0], skip_special_tokens=True)
    given = [arg for path in tiny.images[:images] for arg in ("--image", str(path))]
    assert main(["generate", str(out), *given, "--prompt", PROMPTS[images - 1],
                 "--max-new-tokens", str(NEW), "--runtime", "onert"]) == 0
    assert capsys.readouterr().out == PROMPTS[images - 1] + want + "\n"  # without --chat the prompt is echoed first


def test_the_image_changes_the_logits(converted):
    """The vision graph's rows are live in the prefill: another image, other logits."""
    tiny, out = converted
    a = _graph_greedy(out, "onert", tiny.processor, tiny.inputs(PROMPTS[0], tiny.images[:1]), tiny.images[:1], 1)
    b = _graph_greedy(out, "onert", tiny.processor, tiny.inputs(PROMPTS[0], tiny.images[1:2]), tiny.images[1:2], 1)
    assert float(np.abs(a[1][0] - b[1][0]).max()) > 1e-2

"""The newer VLM families converted and run: ``circleops convert DIR --graphs vision,prefill,decode
--verify`` of a tiny random model (saved with its processor) of each converted family that
tests/generate/test_vlm.py does not cover (Gemma 3, Qwen2-VL, Qwen2.5-VL), then the written
graphs give transformers' greedy tokens and every step's logits, with one image and with two,
on onert and on the reference interpreter (the same files), the prompt in several runs of the
prefill graphs of 8 and 4 (Gemma 3's never split an image block, which is attended both ways;
Qwen's take the prompt's 3-D M-RoPE positions, the decode steps its delta); ``circleops generate
--image`` prints the text. Qwen's images are resized to the directory's one size (the
manifest's ``vision.tile_size``): transformers runs on the same resized image."""
from __future__ import annotations

import numpy as np
import pytest

from circleops.adapters.vlm import BY_MODEL_TYPE
from circleops.cli import main
from tiny_vlms import BUILDERS, save_tiny

NEW = 8
IMAGE = {"gemma3": "<start_of_image>", "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>"}
IMAGE["qwen2_5_vl"] = IMAGE["qwen2_vl"]
PROMPTS = ("Look at {0} please, what is it?", "Look {0} and then at {0} now, what is it?")
# the families tests/generate/test_vlm.py converts and runs
COVERED_ELSEWHERE = ("smolvlm", "paligemma")
FAMILIES = sorted(t for t in BUILDERS if BY_MODEL_TYPE[t].converted and t not in COVERED_ELSEWHERE)
# fp32 through 2 vision + 2 text layers in another order (chunked prefill, masks built from
# pos): a few ulps of |logits|, as in test_vlm_families.py
LOGIT_TOL = 1e-4


class _Converted:
    """A tiny model, its converted directory, and what the tests share (opened once each):
    the generators per runtime, the processor saved with the graphs, transformers' greedy
    tokens and logits per image count."""

    def __init__(self, tiny, out):
        self.tiny, self.out = tiny, out
        self._gens, self._want = {}, {}

    def __iter__(self):  # tiny, out = converted
        return iter((self.tiny, self.out))

    def generator(self, runtime):
        from circleops.generation.vision import VisionGenerator, saved_processor

        if runtime not in self._gens:
            gen = VisionGenerator(self.out, runtime=runtime)
            self._gens[runtime] = gen, saved_processor(gen.manifest)
        return self._gens[runtime]

    def want(self, images):
        if images not in self._want:
            self._want[images] = self.tiny.hf_greedy(_hf_inputs(self.tiny, self.out, images), NEW)
        return self._want[images]


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    tiny = save_tiny(family, root)
    out = root / "out"
    assert main(["convert", str(tiny.directory), "--graphs", "vision,prefill,decode", "--target", "onert",
                 "--seq-len", "8,4", "--max-cache-len", "96", "--verify", "-o", str(out), "-q"]) == 0
    return _Converted(tiny, out)


def _prompt(tiny, images):
    return PROMPTS[images - 1].format(IMAGE[tiny.family])


def _hf_inputs(tiny, out, images):
    """transformers' inputs: the family's processor on the images; a patch tower's images
    resized first to the directory's one size, as circleops' processor resizes them."""
    from circleops.package.manifest import read_manifest

    vision = read_manifest(out).vision
    side = vision["tile_size"] if vision.get("patches") else None
    return tiny.inputs(_prompt(tiny, images), tiny.images[:images], side=side)


def _graph_greedy(converted, runtime, images, new, paths=None):
    """Greedy decoding through the written graphs (circleops.generation.vision's generator):
    the prompt and images (``paths``, default the first ``images``) through the processor
    saved with the graphs, each image through the vision graph, the prompt's image tokens
    take its rows."""
    from circleops.generation.vision import prepare, read_image

    tiny = converted.tiny
    gen, processor = converted.generator(runtime)
    ids, pixels = prepare(processor, _prompt(tiny, images), [read_image(p) for p in paths or tiny.images[:images]])
    gen.reset()
    gen.attach_images(ids, 0, gen.image_features(pixels))
    logits, tokens, seen = gen.feed(ids), [], []
    assert gen.prefill_runs > 2  # the prompt in several runs
    for _ in range(new):
        seen.append(logits)
        tokens.append(int(np.argmax(logits)))
        logits = gen.decode(tokens[-1])
    return ids, tokens, seen


@pytest.mark.parametrize("images", [1, 2])
def test_graphs_equal_transformers(converted, images):
    tiny, out = converted
    inputs = _hf_inputs(tiny, out, images)
    want, want_logits = converted.want(images)
    for runtime in ("onert", "reference") if images == 1 else ("onert",):  # the reference: the same files
        ids, got, logits = _graph_greedy(converted, runtime, images, NEW)
        assert ids == inputs["input_ids"][0].tolist()
        assert got == want, runtime
        for i, (g, w) in enumerate(zip(logits, want_logits)):
            assert np.abs(g - w.numpy()).max() <= LOGIT_TOL * max(1.0, float(w.abs().max())), (runtime, i)


def test_generate_image_prints_transformers_text(converted, capsys):
    """The CLI (--image once per image, two images): the processor saved with the graphs
    expands each image where the prompt's image marker is; the new text is transformers'
    greedy tokens decoded."""
    tiny, out = converted
    images = 2
    want = tiny.processor.tokenizer.decode(converted.want(images)[0], skip_special_tokens=True)
    given = [arg for path in tiny.images[:images] for arg in ("--image", str(path))]
    assert main(["generate", str(out), *given, "--prompt", _prompt(tiny, images),
                 "--max-new-tokens", str(NEW), "--runtime", "onert"]) == 0
    captured = capsys.readouterr()
    assert captured.out == _prompt(tiny, images) + want + "\n"  # without --chat the prompt is echoed first
    assert f"{images} image(s): {images} tile(s) through the vision graph" in captured.err


def test_the_image_changes_the_logits(converted):
    """The vision graph's rows are live in the prefill: another image, other logits."""
    a, b = (_graph_greedy(converted, "onert", 1, 1, [path])[2][0] for path in converted.tiny.images)
    assert float(np.abs(a - b).max()) > 1e-2


# each Qwen family as one file for one of the one-file targets (both families run on onert and
# the reference interpreter above; one target each keeps the suite's time down)
ONE_FILE = {"qwen2_vl": "tflite", "qwen2_5_vl": "circle"}


def test_one_file_targets_generate_transformers_tokens(mrope_vlm, tmp_path):
    """Qwen2-VL / Qwen2.5-VL as one file (a signature per graph): target circle (ATTENTION
    updating whole caches, the reference interpreter) and tflite (LiteRT) give transformers'
    greedy tokens with two images."""
    from circleops.generation import vision as vision_gen

    tiny, out = mrope_vlm, tmp_path / "out"
    target = ONE_FILE[tiny.family]
    assert main(["convert", str(tiny.directory), "--graphs", "vision,prefill,decode", "--target", target, "-q",
                 "--seq-len", "8", "--max-cache-len", "80", "-o", str(out)]) == 0
    want = tiny.hf_greedy(_hf_inputs(tiny, out, 2), NEW)[0]
    result = vision_gen.generate(out, _prompt(tiny, 2), [str(p) for p in tiny.images], NEW)
    assert result.runtime == {"circle": "reference", "tflite": "litert"}[target]
    assert result.tokens == want and result.prefill_runs > 2


def test_a_damaged_patch_grid_is_refused(converted, tmp_path):
    """A manifest whose patch grid is not the vision graph's, or not whole merge units, or
    that has M-RoPE positions and no grid, is one ModelLoadError naming the entry (never an
    array of the damaged size)."""
    import shutil

    import manifest_json
    from circleops.errors import ModelLoadError
    from circleops.generation.vision import VisionGenerator

    vision = manifest_json.read(converted.out)["vision"]
    # a pooled tower's (Gemma 3: tiles) gets one: its vision graph takes no patches either
    patches = vision.get("patches") or {"grid": [1, 4, 4], "patch_dim": 384, "merge_size": 2, "patch_size": 8}
    for grid, message in (([1, 10 ** 6, 10 ** 6], "the vision graph takes"), ([1, 3, 3], "not a grid of whole")):
        out = tmp_path / f"out{grid[1]}"
        shutil.copytree(converted.out, out)
        manifest_json.edit(out, {"vision": {**vision, "patches": {**patches, "grid": grid}}})
        with pytest.raises(ModelLoadError, match=message):
            VisionGenerator(out, runtime="reference")
    out = tmp_path / "no_grid"
    shutil.copytree(converted.out, out)
    manifest_json.edit(out, {"vision": {**{k: v for k, v in vision.items() if k != "patches"}, "mrope": True}})
    with pytest.raises(ModelLoadError, match=r"3-D positions \(mrope\) and no patch grid"):
        VisionGenerator(out, runtime="reference")


@pytest.mark.parametrize("bounds, side", [
    ({}, 448),  # the released processors' 3136 .. 12845056 pixels
    ({"min_pixels": 3136, "max_pixels": 200 * 200}, 196),  # the largest multiple of 28 px whose square fits
    ({"min_pixels": 600 * 600, "max_pixels": 10 ** 7}, 616),  # the smallest whose square reaches min_pixels
])
def test_the_fixed_image_side(bounds, side):
    """docs/vlm.md's rule: 448 px where the processor's pixel bounds allow, else the nearest
    multiple of patch x merge (28 px) within them; the processor's own resize keeps it."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    from circleops.generation.patch_images import fixed_side

    processor = Qwen2VLImageProcessorPil(**bounds)
    assert fixed_side(processor) == side
    grid = processor(images=[Image.new("RGB", (side, side))], return_tensors="np")["image_grid_thw"]
    assert grid.tolist() == [[1, side // 14, side // 14]]



@pytest.mark.parametrize("family", [f for f in FAMILIES if BY_MODEL_TYPE[f].tower == "qwen"])
def test_fp16_of_a_patch_tower_is_refused(family, tmp_path, capsys):
    """--dtype fp16 of a family whose vision graph takes patches (Qwen) is one clear refusal,
    exit 2, nothing written (its host side feeds fp32 patches; the pooled towers' fp16 is
    tests/generate/test_vlm.py's)."""
    tiny = save_tiny(family, tmp_path)
    out = tmp_path / "fp16"
    assert main(["convert", str(tiny.directory), "--graphs", "vision,prefill,decode", "--target", "circle",
                 "--dtype", "fp16", "--seq-len", "8", "--max-cache-len", "80", "-o", str(out)]) == 2
    assert "converts in fp32 only so far" in capsys.readouterr().err and not out.exists()

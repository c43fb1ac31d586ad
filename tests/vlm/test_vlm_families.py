"""circleops' vision-language modules (adapters.vlm rows) against transformers, for every
family (SmolVLM, PaliGemma, Gemma 3, Qwen2-VL, Qwen2.5-VL): greedy decoding through the vision module, the image-merging prefill (runs that
never split an image block) and the decode step gives generate's tokens and logits, with
one image (the "full" cache form) and with two images placed where the processor places them
("rows": each form with one count, the two counts share every other line);
the vision and prefill modules export and run on the reference interpreter."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tiny_vlms import MAX_PATCHES, greedy

NEW = 8
QWEN = ("Look at <|vision_start|><|image_pad|><|vision_end|> please, what is it?",
        "Look <|vision_start|><|image_pad|><|vision_end|> and then at <|vision_start|><|image_pad|><|vision_end|> now!")
PROMPTS = {"gemma3": ("Look at <start_of_image> please, what is it?",
                      "Look <start_of_image> and then at <start_of_image> now, what is it?"),
           "qwen2_vl": QWEN, "qwen2_5_vl": QWEN,
           "smolvlm": ("Look at <image> please, what is it?", "Look <image> and then at <image> now, what is it?"),
           "paligemma": ("what is it?", "compare them")}
# fp32 through 2 vision + 2 text layers in another order (chunked prefill, masks built
# from pos): a few ulps of |logits|
LOGIT_TOL = 1e-4


def _tiles(inputs):
    px = inputs["pixel_values"]
    return [px[i:i + 1] for i in range(px.shape[0])]


def _close(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert float((g - w).abs().max()) <= LOGIT_TOL * max(1.0, float(w.abs().max())), f"step {i}"


@pytest.mark.parametrize("images, cache_update", [(1, "full"), (2, "rows")])
def test_greedy_equals_transformers(tiny_vlm, images, cache_update):
    inputs = tiny_vlm.inputs(PROMPTS[tiny_vlm.family][images - 1], tiny_vlm.images[:images])
    want, want_logits = tiny_vlm.hf_greedy(inputs, NEW)
    got, logits = greedy(copy.deepcopy(tiny_vlm.model), inputs, NEW, cache_update=cache_update)
    assert got == want
    _close(logits, want_logits)


def test_images_change_the_logits(tiny_vlm):
    """The image rows are live: the other image in the same place gives other logits."""
    text = PROMPTS[tiny_vlm.family][0]
    a, b = (tiny_vlm.inputs(text, [p]) for p in tiny_vlm.images)
    if a["input_ids"].shape != b["input_ids"].shape:  # Qwen: another size, other tokens
        b = tiny_vlm.inputs(text, [tiny_vlm.images[0]])
        b["pixel_values"] = b["pixel_values"].flip(0)
    la = greedy(copy.deepcopy(tiny_vlm.model), a, 1)[1][0]
    lb = greedy(copy.deepcopy(tiny_vlm.model), b, 1)[1][0]
    assert float((la - lb).abs().max()) > 1e-2


def _vision_graph(model, inputs):
    """The vision module and its inputs for the first image."""
    from circleops.adapters.qwen_vision import QwenVisionTower, vision_index
    from circleops.adapters.vlm import VisionTower, family_of

    if family_of(model).tower != "qwen":
        return VisionTower(model), (_tiles(inputs)[0],)
    tower = QwenVisionTower(model)
    index = vision_index(tower.visual, inputs["image_grid_thw"][0].tolist(), MAX_PATCHES)
    px = inputs["pixel_values"][:index.patches]
    return tower, (torch.cat([px, px.new_zeros(MAX_PATCHES - index.patches, px.shape[1])]), *index.inputs())


def test_vision_and_prefill_run_on_the_reference_interpreter(torch_side_vlm, tmp_path):
    """The vision module and the image prefill (with its image blocks or 3-D positions)
    export with static shapes and give torch's outputs on the reference interpreter."""
    from circleops.adapters.decode import DecoderWithCache
    from circleops.adapters.vlm import ImagePrefill, TextLM, family_of
    from circleops.pipeline import stages as pipeline
    from circleops.runtime import open_session

    tiny_vlm = torch_side_vlm
    model = copy.deepcopy(tiny_vlm.model)
    fam = family_of(model)
    inputs = tiny_vlm.inputs(PROMPTS[tiny_vlm.family][0], tiny_vlm.images[:1])
    ids = inputs["input_ids"][0].tolist()[:16]
    step = DecoderWithCache(TextLM(model), 32, "rows")
    prefill = ImagePrefill(step, model.config.image_token_id, image_blocks=fam.image_blocks, mrope=fam.mrope)
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn((1, len(ids), model.config.text_config.hidden_size), generator=g)
    caches = [torch.randn(c.shape, generator=g) for c in step.empty_caches()]
    rope = (torch.randint(0, 20, (3, 1, len(ids)), generator=g),) if fam.mrope else ()
    graphs = {"vision": _vision_graph(model, inputs),
              "prefill": (prefill, (torch.tensor([ids]), torch.tensor([3]), torch.tensor([len(ids) - 1]), embeds,
                                    *rope, *caches))}
    opts = pipeline.Options("circle")
    for name, (module, args) in graphs.items():
        ep = pipeline.export(module, args, adapters=False)
        built = pipeline.build({name: ep}, opts).models[name]
        if fam.tower == "qwen":  # q/k rotate by the fused op, in the vision tower and the text model
            assert "ROPE" in pipeline.op_histogram(built), name
        path = tmp_path / f"{name}.circle"
        pipeline.write(built, path, opts)
        outs = open_session("reference", path).run([a.numpy() for a in args])
        with torch.no_grad():
            want = module(*args)
        want = want if isinstance(want, tuple) else (want,)
        for got, w in zip(outs, want):
            assert np.abs(got - w.numpy()).max() <= 1e-5 * max(1.0, float(w.abs().max())), name


def test_mrope_positions_are_get_rope_index(mrope_vlm):
    """The prompt's 3-D positions and decode delta, computed without the model, equal
    transformers' get_rope_index for one and two images of different sizes."""
    from circleops.adapters.qwen_vision import mrope_positions
    tiny_vlm = mrope_vlm
    for images, text in ((1, PROMPTS[tiny_vlm.family][0]), (2, PROMPTS[tiny_vlm.family][1])):
        inputs = tiny_vlm.inputs(text, tiny_vlm.images[:images])
        want, delta = tiny_vlm.model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                          inputs["image_grid_thw"])
        got, got_delta = mrope_positions(inputs["input_ids"][0].tolist(), tiny_vlm.model.config.image_token_id,
                                         inputs["image_grid_thw"].tolist(), 2)
        assert got == want[:, 0].tolist() and got_delta == int(delta)


def test_decode_runs_on_onert(torch_side_vlm, tmp_path):
    """The decode graph (M-RoPE: with its pos + delta positions, made without an int64
    BROADCAST_TO, which onert cannot run) written for target onert gives torch's outputs."""
    from circleops.adapters.decode import DecoderWithCache
    from circleops.adapters.vlm import MRopeDecode, TextLM, family_of
    from circleops.pipeline import stages as pipeline
    from circleops.runtime import open_session

    model = copy.deepcopy(torch_side_vlm.model)
    step = DecoderWithCache(TextLM(model), 32, "rows")
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(c.shape, generator=g) for c in step.empty_caches()]
    module, extra = (MRopeDecode(step), (torch.tensor([-3]),)) if family_of(model).mrope else (step, ())
    args = (torch.tensor([[5]]), torch.tensor([20]), *extra, *caches)
    opts = pipeline.Options("onert")
    path = tmp_path / "decode.circle"
    pipeline.write(pipeline.build({"decode": pipeline.export(module, args, adapters=False)}, opts).models["decode"],
                   path, opts)
    outs = open_session("onert", path, isolated=True).run([a.numpy() for a in args])
    with torch.no_grad():
        want = module(*args)
    for got, w in zip(outs, want):
        assert np.abs(got - w.numpy()).max() <= 1e-5 * max(1.0, float(w.abs().max()))

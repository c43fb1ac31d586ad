"""A SmolVLM whose text tower is the bundled SmolLM2-135M-Instruct (real weights) and whose
vision tower is random, end to end as a user runs it: the model directory saved with its
processor, `circleops convert DIR --graphs vision,prefill,decode --target onert --verify`,
`circleops generate DIR --image photo.png --prompt ... --chat`, and transformers' greedy
generate on the same model for comparison (tokens, time).

    python bench/vlm_smollm2.py --work /tmp/vlm-smollm2 [--new 32]

The image embeddings are random projections (the vision tower and connector are untrained):
the reply to the image prompt is SmolLM2 derailed by 80 meaningless embeddings (token for
token what transformers generates); the same graphs without an image give SmolLM2's own
fluent answer, token for token with transformers.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

PROMPT = "Describe this image in one sentence."
TEXT_PROMPT = "What is the capital of France?"
CHATML_IMAGE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for part in message['content'] %}"
                "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build(model_dir: Path, photo: Path) -> None:
    from PIL import Image
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration

    from circleops.recipes import vlm
    from circleops.sources.models import load_smollm2

    text, tokenizer = load_smollm2()
    tokenizer.add_special_tokens({"additional_special_tokens": list(vlm.IMAGE_TOKENS)})
    text_config = text.config.to_dict()
    text_config.update(vocab_size=len(tokenizer), tie_word_embeddings=False)
    config = Idefics3Config(
        vision_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           image_size=64, patch_size=8),
        text_config=text_config, scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).eval()
    body = model.model.text_model
    state = {k.removeprefix("model."): v for k, v in text.state_dict().items() if k.startswith("model.")}
    old = state["embed_tokens.weight"]
    # the 40 image tokens are new rows: the mean embedding (they are replaced by image
    # embeddings at <image>; the others frame the tiles)
    state["embed_tokens.weight"] = torch.cat([old, old.mean(0, keepdim=True).expand(len(tokenizer) - len(old), -1)])
    body.load_state_dict(state)
    head = text.lm_head.weight.detach()
    model.lm_head.weight.data = torch.cat([head, torch.full((len(tokenizer) - len(head), head.shape[1]), -1e2)])
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids("<end_of_utterance>"),
                                            tokenizer.eos_token_id]
    # the untrained projection scaled so that image embeddings are as large as SmolLM2's token
    # embeddings (a trained connector's are): larger ones drown the text around them
    with torch.no_grad():
        probe = model.model.get_image_features(torch.rand(1, 1, 3, 64, 64) * 2 - 1).pooler_output[0]
        model.model.connector.modality_projection.proj.weight *= float(old.std() / probe.std())
    model.save_pretrained(str(model_dir))
    # SmolLM2's own ChatML around the image (SmolVLM's "User:" template is not what SmolLM2 was tuned on)
    vlm.build_processor(tokenizer, model, chat_template=CHATML_IMAGE).save_pretrained(str(model_dir))
    pixels = np.zeros((96, 128, 3), dtype=np.uint8)
    pixels[:, :, 0] = np.linspace(0, 255, 128, dtype=np.uint8)  # a red gradient
    pixels[30:70, 40:90] = (20, 160, 40)  # a green box
    Image.fromarray(pixels).save(photo)


def run(argv: list[str]) -> tuple[str, float, float]:
    """stdout+stderr, wall and CPU seconds of one circleops command in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "circleops.cli", *argv], capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        sys.exit(f"{argv} failed:\n{proc.stderr}")
    return proc.stdout + proc.stderr, wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/vlm-smollm2")
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, photo, out = work / "smolvlm-smollm2", work / "photo.png", work / "out"
    print(f"load average {os.getloadavg()[0]:.1f}; {torch.get_num_threads()} torch threads")
    build(model_dir, photo)
    text, wall, cpu = run(["convert", str(model_dir), "--graphs", "vision,prefill,decode", "--target", "onert",
                           "--verify", "--seq-len", "64,8", "--max-cache-len", "256", "-o", str(out)])
    print(text + f"convert: {wall:.1f} s wall, {cpu:.1f} s CPU")
    text, wall, cpu = run(["generate", str(out), "--image", str(photo), "--prompt", PROMPT, "--chat",
                           "--max-new-tokens", str(args.new)])
    print(text + f"generate: {wall:.1f} s wall, {cpu:.1f} s CPU")
    text, wall, cpu = run(["generate", str(out), "--prompt", TEXT_PROMPT, "--chat", "--max-new-tokens",
                           str(args.new)])
    print(text + f"generate (no image): {wall:.1f} s wall, {cpu:.1f} s CPU")

    from circleops.generation import vision
    from circleops.recipes import vlm

    model, processor = vlm.load(model_dir)
    ids, pixel_values = vision.prepare(processor, PROMPT, vision.read_image(photo), chat=True)
    t = time.perf_counter()
    with torch.no_grad():
        hf = model.generate(input_ids=torch.tensor([ids]), pixel_values=torch.as_tensor(pixel_values),
                            max_new_tokens=args.new, do_sample=False)[0, len(ids):].tolist()
    hf_seconds = time.perf_counter() - t
    ours = vision.generate(out, PROMPT, photo, args.new, chat=True)
    print(f"transformers generate: {hf_seconds:.2f} s; {len(ids)}-token prompt")
    print(f"transformers: {processor.tokenizer.decode(hf, skip_special_tokens=True)!r}")
    print(f"tokens equal to transformers' greedy: {ours.tokens == hf} ({len(hf)} tokens)")
    ids, _ = vision.prepare(processor, TEXT_PROMPT, None, chat=True)
    with torch.no_grad():
        hf = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=args.new, do_sample=False)[0, len(ids):]
    ours = vision.generate(out, TEXT_PROMPT, None, args.new, chat=True)
    print(f"no image: tokens equal to transformers' greedy: {ours.tokens == hf.tolist()} ({len(hf)} tokens)")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

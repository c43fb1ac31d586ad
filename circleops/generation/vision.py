"""Generation from an image and a prompt over a vision-language model's directory
(``circleops generate DIR --image photo.png --prompt TEXT``, ``circleops chat DIR --image``):
the vision graph runs on each tile, its embeddings take the places of the prompt's
``<image>`` tokens, and the prefill graphs merge them in chunk by chunk.

    from circleops.generation.vision import generate
    result = generate("out/", "Describe it", image="photo.png")
"""
from __future__ import annotations

from collections.abc import Mapping

import os
from pathlib import Path
from typing import Any, Sequence

from circleops.generation.caches import float_dtype
from circleops.generation.chat import Chat
from circleops.inputs.chat_template import template_budget
from circleops.errors import CircleOpsError, ModelLoadError
from circleops.generation.core import Generation, GenerationLimitError
from circleops.generation.generator import Generator
from circleops.generation.sessions import open_graph
from circleops.generation.tokenizers import TextStream, check_text_fits, check_tokenizer_dir
from circleops.package.manifest import MANIFEST, Manifest
from circleops.package.vision_manifest import VLM_GRAPH_NAMES, VisionSpec
from circleops.inputs.remote_code import refuse_remote_code
from circleops.inputs.user_files import users_processor


class ImageInputError(CircleOpsError):
    """An image that cannot be read, or a prompt whose image tokens have no image."""



def load_processor(path: Path, *, required: bool = True) -> Any:
    """The processor (tokenizer, image processor, chat template) saved in ``path``."""
    from transformers import AutoProcessor

    from circleops.sources.models import quiet_transformers

    refuse_remote_code(path)  # also when not required: a refusal is not "no processor"
    try:
        if required:  # a damaged tokenizer.json or JSON file is named (tokenizers.check_tokenizer_dir)
            check_tokenizer_dir(Path(path))
        with quiet_transformers():
            return AutoProcessor.from_pretrained(str(path), trust_remote_code=False)
    except CircleOpsError:
        raise
    except Exception as err:  # noqa: BLE001 - transformers / tokenizers on a damaged or mistyped file
        if not required:
            return None
        raise ModelLoadError(f"cannot load the processor saved in {path}: {type(err).__name__}: "
                             f"{' '.join(str(err).split())[:300]}. Convert again from a model directory that holds "
                             f"its processor.") from None


# --------------------------------------------------------------------------- generate

class VisionGenerator(Generator):
    """A :class:`~circleops.generation.generator.Generator` over a vision-language model's directory:
    :meth:`image_features` runs the vision graph, :meth:`attach_images` places image
    embeddings at the cache positions of ``<image>`` tokens, and the prefill graphs get each
    chunk's rows (:meth:`prefill_extras`)."""

    def __init__(self, source: Any, runtime: str | None = None, *,
                 threads: int | Mapping[str, int] | None = None):
        import numpy as np

        super().__init__(source, runtime, threads=threads)
        m = self.manifest
        if m.vision is None:
            raise ModelLoadError(f"{m.directory} holds a text model (its manifest has no vision graph): generate "
                                 f"without --image, or convert a vision-language model with --graphs "
                                 f"{','.join(VLM_GRAPH_NAMES)}.")
        self.vision = VisionSpec.from_json(m.vision, m.directory / MANIFEST)
        self.vision_session = open_graph(m, self.vision.graph, self.runtime)
        # the graphs' float type (float16 for --dtype fp16): the pixels and image embeddings they take
        self.float_dtype = np.dtype(float_dtype(m))
        self._rows = np.zeros((m.max_cache_len, self.vision.hidden_size), dtype=self.float_dtype)
        self._has_image = np.zeros(m.max_cache_len, dtype=bool)
        # a prefix-LM (PaliGemma): the first prefix_len positions attend both ways; the prefill
        # graphs take it, and the prefix must go through one run (see plan)
        self.prefix_len = 0
        self._patch_index = self._check_patches() if self.vision.patches else None
        if self.vision.mrope:  # each slot's t/h/w rotary position (padding rows past the cache too)
            self._rope = np.zeros((3, m.max_cache_len + max(self.prefill_sessions)), dtype=np.int64)
            self.step_extras = [np.zeros(1, dtype=np.int64)]  # the decode's rope_delta

    def _check_patches(self) -> Any:
        """The patch tower's integer inputs on the manifest's grid (patch_images.graph_index);
        ModelLoadError unless the vision graph takes that many patches."""
        from circleops.generation.patch_images import graph_index

        p = self.vision.patches
        n = p["grid"][0] * p["grid"][1] * p["grid"][2]
        shape = list(self.vision_session.inputs[0].shape) if self.vision_session.inputs else []
        if shape != [n, p["patch_dim"]]:
            raise ModelLoadError(f"{self.manifest.directory}/{MANIFEST}: the vision entry's grid {p['grid']} is {n} "
                                 f"patches of {p['patch_dim']} values, and the vision graph takes {shape}. Convert "
                                 f"again.")
        return [x.numpy() for x in graph_index(p).inputs()]

    def reset(self) -> None:
        super().reset()
        self._has_image[:] = False
        self.prefix_len = 0

    def check_chat(self, chat: bool) -> None:
        """A prefix-LM (PaliGemma) has no chat: its prompt is one prefix with its image, which a
        conversation's later turns could not extend (they would be causal, unlike transformers'
        re-encoded prompt). ModelLoadError for ``chat``."""
        if chat and self.vision.prefix_lm:
            raise ModelLoadError(f"{self.vision.family or 'this model'} has no chat template: its prompt is one prefix "
                                 f"(the image and the text attend to each other both ways), so it does not chat. Use "
                                 f"`circleops generate {self.manifest.directory} --image PATH --prompt TEXT` without "
                                 f"--chat.")

    def check_prefix(self, prefix_len: int) -> int:
        """The length of the prefill graph that takes a prefix of ``prefix_len`` tokens in one
        run (the shortest that holds it); GenerationLimitError naming --seq-len if none does."""
        fits = [n for n in self.prefill_sessions if n >= prefix_len]
        if not fits:
            raise GenerationLimitError(
                f"the prompt is {prefix_len} tokens (the image's {self.vision.image_seq_len} and the text), and "
                f"{self.vision.family or 'this model'} attends both ways over all of them, so they go through one "
                f"prefill run; the longest prefill graph in {self.manifest.directory} takes "
                f"{max(self.prefill_sessions)}. Shorten the prompt, or convert again with --seq-len {prefix_len} or "
                f"more as the longest length (e.g. --seq-len {prefix_len},8).")
        return min(fits)

    def plan(self, start: int, end: int) -> list[tuple[int, int]]:
        """A prefix-LM's prefix in one run (chunking it would hide later prefix tokens from
        earlier ones), the rest as :meth:`Generator.plan` chunks it."""
        if self.vision.image_blocks:
            return self._block_plan(start, end)
        if not self.vision.prefix_lm or self.prefix_len <= start:
            return super().plan(start, end)
        if start > 0:
            raise GenerationLimitError(f"the prefix ends at position {self.prefix_len}, and {start} tokens are in "
                                       f"the cache already: a prefix is fed from position 0 (start a new prompt).")
        first = self.check_prefix(self.prefix_len)
        return [(first, 0)] + (super().plan(first, end) if end > first else [])

    def _block_plan(self, start: int, end: int, lengths: Sequence[int] = ()) -> list[tuple[int, int]]:
        """Runs from ``start`` on, each as long as the graphs allow but ending before an image
        block it would split (Gemma 3: a block's tokens attend to each other both ways, so
        they are computed in one run; no run re-runs cached tokens either, as that would
        recompute part of a block alone). GenerationLimitError for a block no graph holds."""
        lengths, rows = sorted(lengths or self.prefill_sessions), self._has_image
        runs, s = [], start
        while s < end:
            n = next((n for n in lengths if s + n >= end), lengths[-1])
            e = min(s + n, end)
            while s < e < end and rows[e] and rows[e - 1]:  # e splits a block: end the run before it
                e -= 1
            if e == s:
                raise GenerationLimitError(f"an image block at position {s} is longer than the longest prefill "
                                           f"graph ({lengths[-1]}): convert again with a longer --seq-len.")
            runs.append((n, s))
            s = e
        return runs

    def vision_runs(self, pixel_values: Any) -> int:
        """How many runs of the vision graph ``pixel_values`` (the processor's) takes: its
        non-padding tiles, or a patch tower's images."""
        import numpy as np

        if pixel_values is None:
            return 0
        px = np.asarray(pixel_values)
        if self.vision.patches:
            return int(px.size // (self._patch_index[0].shape[0] * self.vision.patches["patch_dim"]))
        return int((px.reshape(-1, *px.shape[-3:]) != 0).any(axis=(1, 2, 3)).sum())

    def _patch_features(self, pixel_values: Any) -> Any:
        """A patch tower's image embeddings [images x T, H]: ``pixel_values`` [images x N,
        C*T*P*P] (the processor's, each image on the fixed grid), one image per run."""
        import numpy as np

        n, d = self._patch_index[0].shape[0], self.vision.patches["patch_dim"]
        px = np.asarray(pixel_values, dtype=np.float32)
        if px.size % (n * d) or px.shape[-1] != d:
            raise ImageInputError(f"the processor made {list(px.shape)} patch values and the vision graph takes "
                                  f"images of {n} patches of {d} values ({self.vision.tile_size} x "
                                  f"{self.vision.tile_size} pixels): the processor saved with the model does not "
                                  f"match it. Convert again with the model's own processor.")
        px = px.reshape(-1, n, d)
        return np.concatenate([self.vision_session.run([image, *self._patch_index])[0] for image in px])

    def image_features(self, pixel_values: Any) -> Any:
        """The image embeddings [tiles x T, H] of ``pixel_values`` [1, tiles, 3, S, S] (the
        processor's), tile by tile; all-zero tiles are padding and skipped, as the model does.
        A patch tower's: :meth:`_patch_features`."""
        import numpy as np

        if self.vision.patches:
            return self._patch_features(pixel_values)
        s = self.vision.tile_size
        tiles = np.asarray(pixel_values, dtype=self.float_dtype).reshape(-1, 3, *np.shape(pixel_values)[-2:])
        if tiles.shape[-2:] != (s, s):
            raise ImageInputError(f"the processor made tiles of {list(tiles.shape[-2:])} pixels and the vision graph "
                                  f"takes {s} x {s}: the processor saved with the model does not match it. Convert "
                                  f"again with the model's own processor.")
        out = [self.vision_session.run([tile[None]])[0][0] for tile in tiles if np.any(tile != 0)]
        return np.concatenate(out) if out else np.zeros((0, self.vision.hidden_size), self.float_dtype)

    def attach_images(self, ids: Sequence[int], start: int, features: Any) -> None:
        """The ``<image>`` tokens of ``ids`` (to be fed from position ``start``) take the rows
        of ``features`` in order; ImageInputError unless there are as many."""
        import numpy as np

        where = [start + i for i, t in enumerate(ids) if int(t) == self.vision.image_token_id]
        if len(where) != len(features):
            raise ImageInputError(f"the prompt has {len(where)} image tokens and the image gives {len(features)} "
                                  f"embeddings ({self.vision.image_seq_len} per tile): the prompt was not made by "
                                  f"the model's processor from this image.")
        if where and where[-1] >= self.manifest.max_cache_len:
            raise GenerationLimitError(f"the image tokens reach position {where[-1]}, past the "
                                       f"{self.manifest.max_cache_len} slots of the KV cache: convert again with a "
                                       f"larger --max-cache-len.")
        if where:
            self._rows[where] = np.asarray(features, dtype=self.float_dtype)
            self._has_image[where] = True

    def feed(self, token_ids: Sequence[int]) -> Any:
        start = self.position
        img = self.vision.image_token_id
        orphans = [start + i for i, t in enumerate(token_ids)
                   if int(t) == img and start + i < len(self._has_image) and not self._has_image[start + i]]
        if orphans and (len(token_ids) > 1 or start == 0):
            raise ImageInputError(f"the prompt has {len(orphans)} image token(s) (<image>) with no image: pass the "
                                  f"image (--image PATH).")
        if self.vision.mrope and (len(token_ids) > 1 or start == 0):
            self._mrope_positions([*self.history, *(int(t) for t in token_ids)])
        return super().feed(token_ids)

    def _mrope_positions(self, ids: Sequence[int]) -> None:
        """The 3-D rotary positions of ``ids`` (the whole conversation: transformers'
        get_rope_index, every image on the manifest's grid) into the slots, the padding after
        them counting on, and the decode's delta."""
        import numpy as np

        from circleops.adapters.qwen_vision import mrope_positions

        p = self.vision.patches
        images = sum(int(t) == self.vision.image_token_id for t in ids) // max(1, self.vision.image_seq_len) + 1
        rope, delta = mrope_positions(ids, self.vision.image_token_id, [p["grid"]] * images, p["merge_size"])
        if len(rope[0]) != len(ids):
            raise ImageInputError(f"the prompt's image tokens do not come in runs of {self.vision.image_seq_len} "
                                  f"(one image on the fixed grid): the prompt was not made by the model's processor.")
        n = len(ids)
        self._rope[:, :n] = rope
        self._rope[:, n:] = self._rope[:, n - 1:n] + np.arange(1, self._rope.shape[1] - n + 1)
        self.step_extras = [np.array([delta], dtype=np.int64)]

    def prefill_extras(self, ids: Any, pos: int) -> list[Any]:
        import numpy as np

        n = ids.shape[1]
        rows = np.zeros((1, n, self.vision.hidden_size), dtype=self.float_dtype)
        take = max(0, min(n, self.manifest.max_cache_len - pos))
        rows[0, :take] = self._rows[pos:pos + take]
        extras = [rows]
        if self.vision.mrope:
            extras.append(self._rope[:, None, pos:pos + n])
        if self.vision.prefix_lm:
            extras.append(np.array([self.prefix_len], dtype=np.int64))
        return extras

    def generate_with_image(self, prompt_ids: Sequence[int], pixel_values: Any,
                            max_new_tokens: int, **kwargs: Any) -> Generation:
        """:meth:`generate` (a new conversation) with the image ``pixel_values`` (the
        processor's) behind the prompt's image tokens."""
        if self.vision.prefix_lm:  # the whole prompt is the prefix (what PaliGemmaProcessor makes)
            self.check_prefix(len(prompt_ids))
        features = self.image_features(pixel_values) if pixel_values is not None else []
        self.reset()
        self.attach_images(prompt_ids, 0, features)
        self.prefix_len = len(prompt_ids) if self.vision.prefix_lm else 0
        return self.generate(prompt_ids, max_new_tokens, keep_cache=True, **kwargs)


def read_image(path: str | os.PathLike) -> Any:
    """The image at ``path`` as RGB (PIL); ImageInputError when it cannot be read."""
    from PIL import ImageOps

    from circleops.inputs.user_files import opened_image

    # opened_image checks the pixel count (CIRCLEOPS_MAX_IMAGE_PIXELS) before decoding and
    # turns any decoder error into an ImageInputError naming the file
    with opened_image(path, error=ImageInputError) as picture:
        # upright as the camera's EXIF Orientation says, as transformers' load_image does
        return ImageOps.exif_transpose(picture).convert("RGB")


def _user_content(text: str, images: int) -> list[dict[str, str]]:
    return [{"type": "image"}] * int(images) + [{"type": "text", "text": text}]


def _image_list(image: Any) -> list[Any]:
    """``image``: None, one image, or a list of them (in the prompt's order)."""
    if image is None:
        return []
    return list(image) if isinstance(image, (list, tuple)) else [image]


def prepare(processor: Any, prompt: str, image: Any = None, *, chat: bool = False,
            max_tokens: int | None = None) -> tuple[list[int], Any]:
    """(the prompt's token ids, pixel_values [1, tiles, 3, S, S] or None) as the processor
    makes them. ``image``: one image or a list of them. Without ``chat`` the images go before
    the prompt (one image marker each, ``<image>`` or the processor's ``boi_token``) unless
    the prompt places them with its own markers; with ``chat`` the prompt is one user turn
    of the processor's template, the images first. ``max_tokens``: the cache's length (a
    longer text is refused before it is tokenized)."""
    images = _image_list(image)
    # where the processor expands an image
    mark = getattr(processor, "image_marker", None) or getattr(processor, "boi_token", None) or "<image>"
    if max_tokens is not None:
        check_text_fits(processor.tokenizer, prompt, max_tokens)
    if chat:
        if not getattr(processor, "chat_template", None):
            raise ModelLoadError("--chat: the processor saved with this model has no chat template; drop --chat.")
        with template_budget(processor):  # a model's template is someone else's program
            text = processor.apply_chat_template([{"role": "user", "content": _user_content(prompt, len(images))}],
                                                 add_generation_prompt=True, tokenize=False)
    else:
        text = prompt if not images or mark in prompt else mark * len(images) + prompt
    if images and not chat and 0 < text.count(mark) != len(images):
        raise ImageInputError(f"the prompt places {text.count(mark)} image(s) ({mark}) and {len(images)} were given "
                              f"(--image): give one {mark} per image, or none to put every image before the prompt.")
    if not images and type(processor).__name__ == "PaliGemmaProcessor":
        raise ImageInputError("PaliGemma generates from an image and a prompt (its processor takes no text alone): "
                              "pass the image (--image PATH).")
    if not images and "<image>" in text:
        raise ImageInputError("the prompt has image tokens (<image>) with no image: pass the image (--image PATH), "
                              "or drop <image> from the prompt.")
    with users_processor("processor", getattr(processor, "name_or_path", None) or "the model's directory",
                         error=ImageInputError):
        enc = processor(text=[text], images=[images] if images else None, return_tensors="np")
    return [int(i) for i in enc["input_ids"][0]], enc["pixel_values"] if images else None


def generate(directory: str | os.PathLike, prompt: str, image: Any = None,
             max_new_tokens: int = 64, *, runtime: str | None = None, chat: bool = False, stream: Any = None,
             sampler: Any = None) -> Generation:
    """Generation from ``prompt`` and the image at ``image`` (a path, or a list of paths:
    several images, in the prompt's order) with the graphs in ``directory`` (``convert
    --graphs vision,prefill,decode``); ``result.text`` holds the new text, which ``stream``
    (a file) also receives as it is produced."""
    gen = VisionGenerator(directory, runtime=runtime)
    gen.check_chat(chat)
    processor = saved_processor(gen.manifest)
    ids, pixels = prepare(processor, prompt, [read_image(p) for p in _image_list(image)], chat=chat,
                          max_tokens=gen.manifest.max_cache_len)
    gen.check_fits(len(ids), max_new_tokens)
    streamer = TextStream(processor.tokenizer, stream) if stream is not None else None
    result = gen.generate_with_image(ids, pixels, max_new_tokens, on_token=streamer, sampler=sampler)
    result.text = streamer.close() if streamer is not None else processor.tokenizer.decode(
        result.tokens, skip_special_tokens=True)
    return result


def saved_processor(manifest: Manifest) -> Any:
    """The processor saved next to the graphs (``tokenizer/``)."""
    from circleops.package.manifest import confined_tokenizer

    if not manifest.tokenizer:
        raise ModelLoadError(f"{manifest.directory} was converted without a processor (e.g. from --config): "
                             f"convert the model directory, with its processor, to generate from an image.")
    path = confined_tokenizer(manifest.directory, manifest.tokenizer, manifest.directory / MANIFEST)
    spec = VisionSpec.from_json(manifest.vision, manifest.directory / MANIFEST) if manifest.vision else None
    if spec is not None and spec.patches:  # a patch tower: its images resized to the directory's one size
        from circleops.generation.patch_images import load_patch_processor

        refuse_remote_code(path)
        check_tokenizer_dir(Path(path))
        return load_patch_processor(path, side=spec.tile_size)
    processor = load_processor(path)
    if spec is not None:
        _check_image_tokens(processor, spec.image_seq_len, path)
    return processor


def _check_image_tokens(processor: Any, expected: int, path: Any) -> None:
    """The processor's image tokens per image (tile) must be the vision graph's rows: a saved
    value of 2^31 made a 2^31-token prompt (MemoryError); any other value a prompt the graphs
    cannot place."""
    for owner in (processor, getattr(processor, "image_processor", None)):
        for name in ("image_seq_len", "image_seq_length"):
            value = getattr(owner, name, None)
            if value is not None and value != expected:
                raise ModelLoadError(f"the processor saved in {path} makes {str(value)[:40]} image tokens per image "
                                     f"({name}), and the vision graph gives {expected}: the processor's files were "
                                     f"changed after the conversion. Convert the model again.")


class VisionChat(Chat):
    """:class:`~circleops.generation.chat.Chat` over a vision-language model: ``image`` (one
    image or a list) goes in the first user message, and :meth:`add_image` adds images to
    the next one (``/image PATH`` in ``circleops chat``), so any turn may bring images. Each
    turn renders the whole conversation with the processor's chat template, every image in
    its own turn (as transformers' processor takes the conversation); each image's
    embeddings are computed once and placed at its ``<image>`` tokens."""

    def __init__(self, generator: VisionGenerator, processor: Any, image: Any = None, system: str | None = None):
        generator.check_chat(True)
        if not getattr(processor, "chat_template", None):
            raise ModelLoadError("the processor saved with this model has no chat template, so it cannot chat; use "
                                 "`circleops generate DIR --image ... --prompt ...`.")
        self.processor = processor
        self.image = image
        self.pending: list[Any] = []  # images for the next user message (add_image)
        self.turn_images: dict[int, list[Any]] = {}  # message index -> the images add_image gave it
        self._features: dict[int, Any] = {}  # id(image) -> its embeddings (the images are held above)
        super().__init__(generator, processor.tokenizer, system=system)

    def reset(self) -> None:
        """A new conversation: the images added by :meth:`add_image` go; ``image`` stays in
        the first message."""
        super().reset()
        self.pending, self.turn_images = [], {}
        first = {id(i) for i in _image_list(self.image)}
        self._features = {k: v for k, v in self._features.items() if k in first}

    def add_image(self, image: Any) -> None:
        """Put ``image`` (PIL, e.g. :func:`read_image`'s) in the next user message, after any
        added before it; the message's turn raises, and drops them, if they do not fit."""
        self.pending.append(image)

    def turn(self, text: str, max_new_tokens: int = 256, **kwargs: Any) -> Any:
        index = len(self.messages)
        if self.pending:
            self.turn_images[index] = self.pending
        self.pending = []
        try:
            return super().turn(text, max_new_tokens, **kwargs)
        except BaseException:
            del self.messages[index:]  # the conversation as it was, without this message's images
            self.turn_images.pop(index, None)
            raise

    def _images_of(self, index: int, first_user: int | None) -> list[Any]:
        first = _image_list(self.image) if index == first_user else []
        return first + self.turn_images.get(index, [])

    def _image_features(self, image: Any) -> Any:
        """One image's embeddings, computed once: the processor makes each image's tiles
        alone (the tiles of several images are the images' own, in order)."""
        if id(image) not in self._features:
            mark = getattr(self.processor, "boi_token", None) or "<image>"
            pixels = prepare(self.processor, mark, [image])[1]
            self._features[id(image)] = self.generator.image_features(pixels)
        return self._features[id(image)]

    def _render(self) -> list[int]:
        import numpy as np

        first_user = next((i for i, m in enumerate(self.messages) if m["role"] == "user"), None)
        per_message = [self._images_of(i, first_user) for i in range(len(self.messages))]
        messages = [{"role": m["role"], "content": _user_content(m["content"], len(per_message[i]))}
                    for i, m in enumerate(self.messages)]
        with template_budget(self.processor):
            text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        images = [image for group in per_message for image in group]
        ids, _ = prepare(self.processor, text, images or None)
        # Chat.turn refuses a conversation longer than the cache before any image is computed
        if images and len(ids) < self.generator.manifest.max_cache_len:
            features = np.concatenate([self._image_features(image) for image in images])
            self.generator.attach_images(ids, 0, features)
        return ids

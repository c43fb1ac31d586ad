"""``circleops chat DIR``: a multi-turn conversation with the graphs `circleops convert MODEL
--graphs prefill,decode -o DIR` wrote (circleops.generation.chat).

One user message per line of stdin; each reply streams to stdout and ends with a newline.
The KV cache is kept between turns, so a turn costs only its own tokens. `/reset` starts a
new conversation; `/image PATH` (a vision-language model) puts an image in the next message;
end of input (Ctrl-D) ends the chat.
"""
from __future__ import annotations

import argparse
import sys

from circleops.cli.generate import add_sampling_arguments, add_threads_argument, sampler_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from circleops.runtime import RUNTIMES

    parser.description = ("a multi-turn chat with the prefill and decode graphs that `circleops convert MODEL "
                          "--graphs prefill,decode -o DIR` wrote: one message per line of stdin, the replies on "
                          "stdout; the KV cache is kept between turns; /reset starts over")
    parser.add_argument("directory", metavar="DIR", help="directory written by `circleops convert MODEL --graphs "
                                                         "prefill,decode -o DIR` (with a tokenizer that has a chat "
                                                         "template)")
    parser.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                        help="tokens per reply at most (default 256); a reply ends at the end-of-turn token")
    parser.add_argument("--image", metavar="PATH", action="append",
                        help="an image in the first message (a vision-language model converted with --graphs "
                             "vision,prefill,decode); repeat it for several; `/image PATH` at the prompt adds one to "
                             "the next message")
    parser.add_argument("--system", metavar="TEXT", help="a system message opening the conversation")
    parser.add_argument("--runtime", choices=RUNTIMES, default=None,
                        help="onert, reference or litert (default: the one the files were converted for)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no timing line per reply on stderr")
    add_threads_argument(parser)
    add_sampling_arguments(parser)


def _read_line() -> str | UnicodeError | None:
    """The next line of stdin (None at its end), decoded as UTF-8 strictly: a line that is
    not is returned as its UnicodeError (the tokenizer cannot encode what it decodes to)."""
    stream = getattr(sys.stdin, "buffer", None)
    try:
        if stream is None:  # a text stream (tests, an embedding application)
            line = sys.stdin.readline()
            line.encode("utf-8")  # surrogate escapes of undecodable bytes fail here
            return line or None
        raw = stream.readline()
        return raw.decode("utf-8") if raw else None
    except UnicodeError as err:
        return err


def _add_image(chat: object, path: str) -> None:
    """``/image PATH``: the image goes in the next message (a vision-language model's chat);
    anything else is one line on stderr, and the conversation goes on."""
    from circleops.errors import CircleOpsError
    from circleops.generation.vision import VisionChat, read_image

    if not isinstance(chat, VisionChat):
        print("circleops chat: /image: this directory holds a text model (no vision graph), so it takes no image; "
              "convert a vision-language model with --graphs vision,prefill,decode to chat about images.",
              file=sys.stderr)
        return
    if not path:
        print("circleops chat: /image needs a path: /image photo.png (the image goes in your next message).",
              file=sys.stderr)
        return
    try:
        chat.add_image(read_image(path))
    except CircleOpsError as err:
        print(f"circleops chat: {err}", file=sys.stderr)
        return
    print(f"circleops chat: {path} goes in your next message ({len(chat.pending)} image(s) so far)", file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    from circleops.generation.chat import Chat
    from circleops.generation.core import GenerationLimitError
    from circleops.generation.vision import ImageInputError
    from circleops.generation.generator import Generator, TextStream, hf_tokenizer, choose_runtime
    from circleops.package.manifest import MANIFEST, confined_tokenizer, read_manifest

    manifest = read_manifest(args.directory)
    runtime, note = choose_runtime(manifest, args.runtime)
    if note:
        print(f"circleops: {note}", file=sys.stderr)
    if not manifest.tokenizer:
        from circleops.errors import ModelLoadError

        raise ModelLoadError(f"{manifest.directory} has no tokenizer (converted without one, e.g. from --config), "
                             f"so there is no chat template to talk through. Convert a model with a tokenizer.")
    sampler = sampler_from_args(args, manifest.directory)
    if args.image or manifest.vision is not None:
        from circleops.cli.vision import vision_chat

        chat = vision_chat(args, manifest, runtime)
    else:
        tokenizer = hf_tokenizer(confined_tokenizer(manifest.directory, manifest.tokenizer,
                                                    manifest.directory / MANIFEST))
        chat = Chat(Generator(manifest, runtime=runtime, threads=args.threads), tokenizer, system=args.system)
    tokenizer = chat.tokenizer
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"circleops chat: {manifest.directory} on {runtime}, {manifest.max_cache_len} cache slots; "
              f"/reset starts over, /image PATH adds an image to your next message, Ctrl-D ends.", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = _read_line()
        if line is None:
            break
        if isinstance(line, UnicodeError):
            print(f"circleops chat: this line is not UTF-8 text ({line}); it was skipped, the conversation is "
                  f"kept.", file=sys.stderr)
            continue
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() == "/reset":
            chat.reset()
            print("circleops chat: new conversation (cache emptied)", file=sys.stderr)
            continue
        if text.strip().split(maxsplit=1)[0] == "/image":
            _add_image(chat, text.strip()[len("/image"):].strip())
            continue
        stream = TextStream(tokenizer, sys.stdout)
        try:
            reply = chat.turn(text, args.max_new_tokens, on_token=lambda t: None if t in chat.stop_ids else stream(t),
                              sampler=sampler)
        except (GenerationLimitError, ImageInputError) as err:  # the cache is full: the conversation is kept
            print(f"circleops chat: {err}", file=sys.stderr)
            continue
        stream.close()
        if reply.cache_full:
            print(f"circleops chat: the KV cache ({manifest.max_cache_len} slots) is full: this reply was cut "
                  f"there. Type /reset to start a new conversation.", file=sys.stderr)
        if not args.quiet:
            steps = max(1, len(reply.tokens) - 1)
            print(f"circleops chat [{runtime}]: {reply.fed} new tokens fed in {reply.seconds_to_first_token:.3f} s, "
                  f"{len(reply.tokens)} generated ({1000 * reply.decode_seconds / steps:.1f} ms/token), "
                  f"{chat.generator.position} of {manifest.max_cache_len} cache slots used", file=sys.stderr)
    return 0

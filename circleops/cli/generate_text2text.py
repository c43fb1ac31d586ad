"""``circleops generate DIR --prompt TEXT`` on a text-to-text directory (``circleops convert
T5_DIR --graphs encoder,prefill,decode -o DIR``; circleops.generation.text2text): the prompt is
the source, the new text streams to stdout; ``--language de_DE``: mBART's target language."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable


def main(args: argparse.Namespace, manifest: Any, runtime: str, sampler: Any, token_ids: Any = None) -> int:
    """``generate --prompt`` / ``--token-ids`` (parsed: ``token_ids``) on ``manifest``'s
    text-to-text graphs; ``sampler``: what --sample asked for (None: greedy)."""
    from circleops.errors import TargetError
    from circleops.generation.generator import GenerationLimitError, TextStream
    from circleops.generation.text2text import Text2TextGenerator, language_token
    from circleops.generation.tokenizers import encode_prompt, load_tokenizer
    from circleops.inputs.token_ids import check_token_ids

    wrong = [f for f, given in (("--image", args.image), ("--chat", args.chat), ("--task", args.task)) if given]
    if wrong:
        raise TargetError(f"{', '.join(wrong)} do(es) not apply to a text-to-text model ({manifest.directory}): it "
                          f"generates from a source text (--prompt) or its ids (--token-ids); --language names a "
                          f"target-language token (mBART's de_DE).")
    tokenizer = load_tokenizer(manifest) if args.prompt is not None or manifest.tokenizer else None
    ids = encode_prompt(tokenizer, args.prompt) if args.prompt is not None else token_ids
    ids = check_token_ids(ids, manifest.vocab_size, "the source", error=GenerationLimitError)  # before any graph opens
    forced = language_token(tokenizer, args.language, manifest) if args.language is not None else None
    gen = Text2TextGenerator(manifest, runtime=runtime, threads=args.threads)
    if tokenizer is not None:
        on_token: Callable[[int], None] = TextStream(tokenizer, sys.stdout)
    else:
        def on_token(token: int) -> None:
            sys.stdout.write(f"{token} ")
            sys.stdout.flush()
    result = gen.generate(ids, args.max_new_tokens, forced_bos_token_id=forced, on_token=on_token, sampler=sampler)
    if isinstance(on_token, TextStream):
        on_token.close()  # ends the line
    else:
        sys.stdout.write("\n")
    if not args.quiet:
        line = f"{result.timing_line()} (source {len(ids)} tokens through the encoder)"
        print(line if sampler is None else f"{line}; {sampler.config.describe()}", file=sys.stderr)
    return 0

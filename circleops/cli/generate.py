"""``circleops generate DIR --prompt TEXT``: greedy generation with the prefill and decode
graphs that ``circleops convert MODEL --graphs prefill,decode -o DIR`` wrote (circleops.generation.generator)."""
from __future__ import annotations

import argparse
import sys
from typing import Callable



def add_arguments(parser: argparse.ArgumentParser) -> None:
    from circleops.generation.generator import DEFAULT_MAX_NEW_TOKENS  # light: no torch
    from circleops.runtime import RUNTIMES

    parser.description = ("generation (greedy by default, or --sample) with the prefill and decode graphs that `circleops convert MODEL "
                          "--graphs prefill,decode -o DIR` wrote: the text streams to stdout, the prefill time and "
                          "decode tokens/s go to stderr. --audio clip.wav: speech-to-text with the graphs of "
                          "`--graphs encoder,prefill,decode` (Whisper)")
    parser.add_argument("directory", metavar="DIR", help="directory written by `circleops convert MODEL --graphs "
                                                         "prefill,decode -o DIR`")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="prompt text (tokenized with the tokenizer saved in DIR)")
    what.add_argument("--token-ids", metavar="IDS", help="prompt as comma-separated token ids (models without a "
                                                         "tokenizer)")
    from circleops.cli import generate_speech
    generate_speech.add_arguments(parser, what)  # --audio, --language, --task
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                        help=f"tokens to generate at most (default {DEFAULT_MAX_NEW_TOKENS}); stops early at EOS")
    parser.add_argument("--runtime", choices=RUNTIMES, default=None,
                        help="onert, reference or litert (default: onert for --target onert files, litert for "
                             "tflite, reference for circle)")
    parser.add_argument("--image", metavar="PATH", action="append",
                        help="an image for a vision-language model (converted with --graphs vision,prefill,decode), "
                             "placed before the prompt; repeat it for several images, in order (a prompt that has "
                             "the model's image marker, e.g. <image>, once per image places them itself)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template "
                                                            "(for a conversation: circleops chat DIR)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no timing line on stderr")
    add_threads_argument(parser)
    add_sampling_arguments(parser)


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """--threads N: the thread budget of the runtime sessions (circleops.generation.generator.graph_threads)."""
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="threads the runtime may use (default: NUM_THREADS if set, else what the files were "
                             "converted for); each graph runs at N unless fewer measured faster for it "
                             "(onert's decode step: 1)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """--sample, --temperature, --top-k, --top-p, --repetition-penalty, --seed (transformers'
    GenerationConfig names and meaning; circleops.generation.sampling)."""
    g = parser.add_argument_group("sampling (default: greedy, the same text every run)")
    g.add_argument("--sample", action="store_true",
                   help="draw tokens instead of taking the most likely; the values not given below come from the "
                        "model's generation_config.json (saved by convert --graphs), else transformers' defaults")
    g.add_argument("--temperature", type=float, metavar="T", help="divide the logits by T (needs --sample)")
    g.add_argument("--top-k", type=int, metavar="K", help="keep the K most likely tokens; 0: all (needs --sample)")
    g.add_argument("--top-p", type=float, metavar="P", help="keep the most likely tokens up to probability P "
                                                            "(needs --sample)")
    g.add_argument("--repetition-penalty", type=float, metavar="R",
                   help="divide the logits of tokens already seen by R (1.0: none); applies to greedy too")
    g.add_argument("--seed", type=int, help="seed of the draws: the same seed gives the same tokens")


def sampler_from_args(args: argparse.Namespace, directory):
    """The Sampler the flags ask for, or None for plain greedy."""
    from circleops.generation.sampling import Sampler, SamplingConfig, SamplingError

    needs_sample = [f for f, v in (("--temperature", args.temperature), ("--top-k", args.top_k),
                                   ("--top-p", args.top_p), ("--seed", args.seed)) if v is not None]
    if needs_sample and not args.sample:
        raise SamplingError(f"{', '.join(needs_sample)} only apply when sampling: add --sample (greedy decoding "
                            "ignores them, as transformers does).")
    if not args.sample and args.repetition_penalty is None:
        return None
    config = SamplingConfig.from_generation_config(
        directory, do_sample=True if args.sample else None, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed)
    return Sampler(config)


def main(args: argparse.Namespace) -> int:
    from circleops.generation.core import check_fits
    from circleops.generation.generator import (GenerationLimitError, Generator, TextStream, choose_runtime, encode_prompt,
                                    load_tokenizer)
    from circleops.inputs.token_ids import check_token_ids
    from circleops.package.manifest import read_manifest

    from circleops.cli import generate_speech

    if args.audio is not None:  # the sampling flags checked before any graph opens
        return generate_speech.main(args, sampler_from_args(args, args.directory))
    manifest = read_manifest(args.directory)
    if manifest.text2text is None:
        generate_speech.check_text_arguments(args)
    runtime, note = choose_runtime(manifest, args.runtime)
    if note:
        print(f"circleops: {note}", file=sys.stderr)
    if manifest.text2text is not None:  # T5, BART, mBART, Marian: the prompt is the source
        from circleops.cli import generate_text2text

        ids = _parse_ids(args.token_ids) if args.token_ids is not None else None
        return generate_text2text.main(args, manifest, runtime, sampler_from_args(args, manifest.directory), ids)
    if args.image or manifest.vision is not None:
        from circleops.cli.vision import generate_main

        return generate_main(args, manifest, runtime, sampler_from_args(args, manifest.directory))
    if args.prompt is not None:
        tokenizer = load_tokenizer(manifest)
        ids = encode_prompt(tokenizer, args.prompt, args.chat, max_tokens=manifest.max_cache_len)
        source = f"the prompt, as the tokenizer in {manifest.directory / str(manifest.tokenizer)} encodes it"
    else:
        ids = _parse_ids(args.token_ids)
        tokenizer = load_tokenizer(manifest) if manifest.tokenizer else None
        source = "--token-ids"
    ids = check_token_ids(ids, manifest.vocab_size, source, error=GenerationLimitError)  # before any graph opens
    sampler = sampler_from_args(args, manifest.directory)
    check_fits(manifest.max_cache_len, 0, len(ids), args.max_new_tokens, manifest.directory,  # so is this
               manifest.max_positions)
    gen = Generator(manifest, runtime=runtime, threads=args.threads)
    if tokenizer is not None:
        if args.prompt is not None and not args.chat:
            sys.stdout.write(args.prompt)
            sys.stdout.flush()
        on_token: Callable[[int], None] = TextStream(tokenizer, sys.stdout)
    else:
        def on_token(token: int) -> None:
            sys.stdout.write(f"{token} ")
            sys.stdout.flush()
    result = gen.generate(ids, args.max_new_tokens, on_token=on_token, sampler=sampler)
    if isinstance(on_token, TextStream):
        on_token.close()
    else:
        sys.stdout.write("\n")
    if not args.quiet:
        line = result.timing_line(manifest.prefill_len)
        print(line if sampler is None else f"{line}; {sampler.config.describe()}", file=sys.stderr)
    return 0


def _parse_ids(text: str) -> list[int]:
    from circleops.generation.generator import GenerationLimitError

    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise GenerationLimitError(f"--token-ids takes comma-separated integers, got {text!r}.") from None

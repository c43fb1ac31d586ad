"""A generation kind is hooks over the one loop of circleops.generation.core (CONTRIBUTING.md,
"Adding a generation kind"): a kind added here, in the test, with no library file, changes
what the loop picks, what it outputs and what the graphs take, and keeps sampling, streaming,
stop rules and the chunk plan; and no kind of circleops runs a loop of its own."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

from generate_fixtures import TINY_NEW, TINY_PROMPTS

from circleops.generation.core import GenerationCore
from circleops.generation.generator import Generator
from circleops.generation.sampling import Sampler, SamplingConfig

GENERATION = Path(__file__).resolve().parents[2] / "circleops" / "generation"


class Forced(Generator):
    """A throwaway kind: its first new tokens are forced (as Whisper's forced ids would be, by
    a logits processor), it leaves its stop token out of the output, and it counts the decode
    steps' inputs (a per-request extra would go there)."""

    keep_stop_token = False

    def __init__(self, directory, forced):
        super().__init__(directory)
        self.forced = list(forced)
        self.seen_steps: list[int] = []

    def process_logits(self, logits, step):
        self.seen_steps.append(step)
        if step >= len(self.forced):
            return logits
        scores = np.full(logits.shape, -np.inf, dtype=np.float32)
        scores[self.forced[step]] = 0.0
        return scores


def test_a_kind_in_a_test_runs_on_the_core(tiny_onert):
    prompt = TINY_PROMPTS[0]
    forced = [11, 22, 33]
    gen = Forced(tiny_onert.directory, forced)
    streamed: list[int] = []
    result = gen.generate(prompt, TINY_NEW, on_token=streamed.append)
    plain = Generator(tiny_onert.directory)
    # the forced tokens, then what the text model says after them: the loop fed each forced
    # token through the decode graph before picking the next
    assert result.tokens[:3] == forced
    assert result.tokens[3:] == plain.generate(prompt + forced, TINY_NEW - 3).tokens
    assert streamed == result.tokens and gen.seen_steps == list(range(TINY_NEW))
    # a stop token the text model would say: the loop stops there and this kind leaves it out
    stop = result.tokens[5]
    gen.manifest.eos_token_ids = [stop]
    cut = gen.generate(prompt, TINY_NEW)
    assert cut.stopped_at_eos and cut.tokens == result.tokens[:5]
    # sampling comes with the core: top-k 1 draws are the same tokens, a sampler at temperature
    # 2 still starts with the forced ones (it draws from the processed scores)
    gen.manifest.eos_token_ids = []
    assert gen.generate(prompt, TINY_NEW, sampler=Sampler(SamplingConfig(do_sample=True, top_k=1))).tokens \
        == result.tokens
    drawn = gen.generate(prompt, TINY_NEW, sampler=Sampler(SamplingConfig(do_sample=True, temperature=2.0,
                                                                           top_k=0, seed=1))).tokens
    assert drawn[:3] == forced and drawn != result.tokens


def _loops(path: Path) -> list[str]:
    """Functions of a module that run a decode graph inside a loop of their own."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for loop in (n for n in ast.walk(node) if isinstance(n, (ast.While, ast.For))):
                calls = [n for n in ast.walk(loop) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
                if any(c.func.attr == "decode" or (c.func.attr == "run" and "decode" in ast.unparse(c.func.value))
                       for c in calls):
                    found.append(f"{path.name}:{node.lineno} {node.name}")
    return found


def test_one_generation_loop():
    """Only the core decodes in a loop: the text, vision and speech kinds supply hooks."""
    loops = [f for p in sorted(GENERATION.glob("*.py")) for f in _loops(p)]
    assert loops == ["core.py:" + str(GenerationCore._decode_loop.__code__.co_firstlineno) + " _decode_loop"], loops

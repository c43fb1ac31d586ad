"""The real SmolLM2's fp16 numerics report, computed once per test process and shared.

tests/check/test_check_smollm2.py asserts on it, and docs/tools.md's "Python API" block
(tests/docs/test_readme.py) runs the very same call: ``check(model, tok, CheckOptions(prompt=
"Once upon a time,", dtype="fp16", new_tokens=32, policies=<all four>))`` on SmolLM2.
Running it twice cost ~18 s of CPU each; so the block's ``check`` is :meth:`SharedCheck.check`,
which answers that one call (the same weights, the same options but where the files go and
the report's name) with this process's report, and runs the real ``check`` for any other.
tests/conftest.py's session fixture ``smollm2_fp16_check`` holds it; both modules use that
fixture, so they are one xdist group and one worker computes the report once.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import torch

SOURCE = "smollm2"


class SharedCheck:
    """check() of the real SmolLM2 in fp16, every policy, computed on first use."""

    def __init__(self, work_dir: Callable[[], Path]) -> None:
        from circleops.tools.precision import DEFAULT_NEW_TOKENS, DEFAULT_PROMPT, CheckOptions, check

        self._check = check  # the real one, taken before a test puts self.check in its place
        self._work_dir = work_dir  # made only when the report is computed
        self._options = CheckOptions(prompt=DEFAULT_PROMPT, dtype="fp16", new_tokens=DEFAULT_NEW_TOKENS,
                                     source=SOURCE)
        self._report: Any = None
        self._embedding: torch.Tensor | None = None

    def report(self) -> Any:
        """The report (files kept in the work dir: tests read the policies' .circle files)."""
        if self._report is None:
            from circleops.sources.models import load_smollm2

            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # measured: 2 threads on 2 shared cores is ~20x slower per forward
            try:
                model, tokenizer = load_smollm2(torch.float32)
                self._options = dataclasses.replace(self._options, work_dir=self._work_dir())
                self._report = self._check(model, tokenizer, self._options)
                self._embedding = model.get_input_embeddings().weight.detach().clone()
            finally:
                torch.set_num_threads(threads)
        return self._report

    def _answers(self, model: Any, options: Any) -> bool:
        """Whether ``check(model, ..., options)`` is the call this report answers: the same
        options (where the files go and the report's name aside) on the same weights."""
        mine = self._options
        asked = dataclasses.replace(options, work_dir=mine.work_dir, source=mine.source,
                                    policies=tuple(options.policies))
        if asked != dataclasses.replace(mine, policies=tuple(mine.policies)):
            return False
        get = getattr(model, "get_input_embeddings", None)  # an HF model's (check() refuses anything else)
        embedding = getattr(get(), "weight", None) if callable(get) else None
        if embedding is None or tuple(embedding.shape) != (49152, 576):  # SmolLM2-135M's vocabulary x width
            return False
        self.report()
        return bool(torch.equal(embedding.detach(), self._embedding))

    def check(self, model: Any, tokenizer: Any = None, options: Any = None, *, progress: Any = None,
              **fields: Any) -> Any:
        """circleops.tools.precision.check, answering the shared call from the report."""
        from circleops.tools.precision import CheckOptions, options_with

        o = options_with(options or CheckOptions(), fields)
        if not self._answers(model, o):
            return self._check(model, tokenizer, options, progress=progress, **fields)
        # the report check names for these options (its files are in the shared work dir)
        return dataclasses.replace(self.report(), source=o.source or type(model).__name__)

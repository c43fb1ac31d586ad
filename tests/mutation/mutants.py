"""Mutants of circleops: one realistic bug each, applied in memory, and the end-to-end test
that must go red under it (issue 25: a test that cannot fail is found by the machine).

``CIRCLEOPS_MUTANT=<name> pytest <test>`` runs ``<test>`` with the mutant applied: the root
tests/conftest.py calls :func:`apply` before any test module is imported.
tests/mutation/test_mutants.py runs each mutant's named test that way, in a subprocess, and
asserts it fails. Each mutant replaces one function (or one value) of circleops, in its
module and wherever another circleops module imported it by name.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Callable

ACCURACY = "tests/convert/test_format_accuracy.py::test_file_logits_against_fp32"
# a lost bit of a codec costs ~3 dB of SQNR, inside the accuracy floor's margin: the exact check
WEIGHTS = "tests/convert/test_format_accuracy.py::test_weights_hold_the_format_definition"


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the bug, in a line
    apply: Callable[[], None]
    kills: str  # the end-to-end test node id that must fail


def _replace(module_name: str, attr: str, new: Any) -> Any:
    """Put ``new`` in place of ``module.attr`` and of every circleops module's by-name
    import of it; returns the original."""
    import importlib

    module = importlib.import_module(module_name)
    old = getattr(module, attr)
    for name, mod in list(sys.modules.items()):
        if (name == "circleops" or name.startswith("circleops.")) and mod is not None \
                and getattr(mod, attr, None) is old:
            setattr(mod, attr, new)
    setattr(module, attr, new)
    return old


# ----------------------------------------------------------------------- the mutants

def _int8_weights_7_bits() -> None:
    from circleops.quantize import quantizer

    orig = quantizer.Scheme.weight_spec

    def weight_spec(self, axis=0):
        spec = orig(self, axis)
        return dataclasses.replace(spec, quant_min=-63, quant_max=63) if self.weight == "int8" else spec

    quantizer.Scheme.weight_spec = weight_spec


def _uint8_activations_7_bits() -> None:
    from circleops.quantize import quantizer

    orig = quantizer.Scheme.act

    def act(self):
        spec = orig(self)
        return dataclasses.replace(spec, quant_max=127) if self.activation == "uint8" else spec

    quantizer.Scheme.act = act


def _attention_without_rope() -> None:
    import circleops.runtime.reference  # noqa: F401 - every kernel registered before one is replaced
    from circleops.ops import REGISTRY
    from circleops.runtime.kernels import KERNELS, option

    def attention(op, inputs, ctx):
        return list(REGISTRY["attention"].reference(*inputs[:11], float(option(op, "scale", default=0.0)), "full",
                                                     rope=lambda x, cos, sin, mode: x))

    KERNELS["ATTENTION"] = attention


def _rms_norm_kernel_without_epsilon() -> None:
    import circleops.runtime.reference  # noqa: F401 - every kernel registered before one is replaced
    from circleops.ops import REGISTRY
    from circleops.runtime.kernels import KERNELS

    def rms_norm(op, inputs, ctx):
        return [REGISTRY["rms_norm"].reference(inputs[0], inputs[1] if len(inputs) > 1 else None, 0.0)]

    KERNELS["RMS_NORM"] = rms_norm


def _integer_dequantize_without_zero_point() -> None:
    from circleops.runtime.kernels import quantized

    def dequantize(q, t):
        scale, _ = quantized.params(t, q.dim())
        return q.to(quantized.torch.float32) * scale.to(quantized.torch.float32)

    _replace("circleops.runtime.kernels.quantized", "dequantize", dequantize)


def _rms_norm_lowering_epsilon_x10() -> None:
    from circleops.lowering import circle_ops

    orig = circle_ops._options

    def options(spec, bound):
        out = orig(spec, bound)
        return {k: (v * 10 if k == "epsilon" else v) for k, v in out.items()}

    _replace("circleops.lowering.circle_ops", "_options", options)


def _writer_drops_zero_points() -> None:
    import numpy as np

    from circleops.serialize import writer

    orig = writer._quantization

    def quantization(schema, t, where, index=None):  # the writer's signature, whatever the target
        qp = orig(schema, t, where, index)
        if qp.scale is not None and len(qp.scale):  # blockwise tables carry no zero points
            qp.zeroPoint = np.zeros(len(qp.scale), dtype="<i8")
        return qp

    _replace("circleops.serialize.writer", "_quantization", quantization)


def _q8_0_blocks_7_bits() -> None:
    import torch

    from circleops.quantize import ggml

    def pack_q8_0(x, out):
        d = ggml._absmax(x).div_(63.0)
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        v = x * inv
        out[:, :2] = d.to(torch.float16).view(torch.uint8)
        out[:, 2:] = (torch.sign(v) * torch.floor(v.abs() + 0.5)).to(torch.int8).view(torch.uint8)

    _replace("circleops.quantize.ggml", "_pack_q8_0", pack_q8_0)


def _w8_weights_7_bits() -> None:
    import numpy as np

    from circleops.quantize import int8

    orig = int8.quantize_per_channel

    def quantize_per_channel(weight):
        packed = orig(weight)
        q = np.floor(np.abs(packed.q.astype(np.float32)) / 2 + 0.5) * np.sign(packed.q)
        return int8.Int8Weight(q.astype(np.int8), (packed.scale * 2).astype(np.float32))

    _replace("circleops.quantize.int8", "quantize_per_channel", quantize_per_channel)


def _sampling_is_greedy() -> None:
    import numpy as np

    from circleops.generation import sampling

    def call(self, logits, context=()):
        return int(np.argmax(self.process(logits, context)))

    sampling.Sampler.__call__ = call


def _sampling_ignores_top_k() -> None:
    _replace("circleops.generation.sampling", "top_k", lambda scores, k: scores)


def _cache_rows_one_slot_late() -> None:
    from circleops.generation import generator as generate

    orig = generate.store_caches

    def store_caches(caches, outputs, pos, cache_update, cache_layout=generate.SLOT_MAJOR):
        return orig(caches, outputs, pos + 1, cache_update, cache_layout)

    _replace("circleops.generation.generator", "store_caches", store_caches)


MUTANTS: dict[str, Mutant] = {m.name: m for m in [
    Mutant("int8_weights_7_bits", "CircleQuantizer's int8 weights quantized to [-63, 63] (one bit lost)",
           _int8_weights_7_bits, f"{ACCURACY}[int16]"),
    Mutant("uint8_activations_7_bits", "CircleQuantizer's uint8 activation observer over [0, 127]",
           _uint8_activations_7_bits, f"{ACCURACY}[uint8]"),
    Mutant("attention_without_rope", "the interpreter's ATTENTION ignores RoPE",
           _attention_without_rope, f"{ACCURACY}[fp16]"),
    Mutant("rms_norm_kernel_without_epsilon", "the interpreter's RMS_NORM drops the epsilon",
           _rms_norm_kernel_without_epsilon, f"{ACCURACY}[q8_0]"),
    Mutant("integer_dequantize_without_zero_point", "the integer kernels dequantize without the zero point",
           _integer_dequantize_without_zero_point, f"{ACCURACY}[uint8]"),
    Mutant("rms_norm_lowering_epsilon_x10", "the RMS_NORM lowering writes 10x the epsilon",
           _rms_norm_lowering_epsilon_x10, f"{ACCURACY}[w8]"),
    Mutant("writer_drops_zero_points", "the writer stores every zero point as 0",
           _writer_drops_zero_points, f"{ACCURACY}[uint8]"),
    Mutant("q8_0_blocks_7_bits", "the GGML codec packs Q8_0 blocks with d = amax / 63",
           _q8_0_blocks_7_bits, f"{WEIGHTS}[q8_0]"),
    Mutant("w8_weights_7_bits", "w8's int8 weights keep 7 bits",
           _w8_weights_7_bits, f"{WEIGHTS}[w8]"),
    Mutant("sampling_is_greedy", "--sample picks the argmax",
           _sampling_is_greedy, "tests/generate/test_generate.py::test_cli_sample_draws_what_the_sampler_draws"),
    Mutant("sampling_ignores_top_k", "the sampler ignores top-k",
           _sampling_ignores_top_k, "tests/generate/test_generate.py::test_cli_sample_draws_what_the_sampler_draws"),
    Mutant("cache_rows_one_slot_late", "the generator writes a step's cache rows one slot late",
           _cache_rows_one_slot_late, "tests/generate/test_generate.py::test_generate_api_with_token_ids"),
]}


def apply(name: str) -> Mutant:
    """Apply the mutant ``name`` to this process (an unknown name is an error: a typo must
    not run the clean code and pass)."""
    if name not in MUTANTS:
        raise KeyError(f"CIRCLEOPS_MUTANT={name!r}: no such mutant; choose one of {', '.join(MUTANTS)}")
    mutant = MUTANTS[name]
    mutant.apply()
    return mutant

"""Prefill/decode graphs of the families whose attention circle.attention cannot express
(q/k/v biases, q/k norms, soft-capping, sliding windows, another score scale): their layers
attend decomposed over the same caches, and `generate` gives transformers' own greedy
tokens and logits on every target's runtime.

Parametrized over tests/families.py: every family with ``attention_fusable=False`` and
``decode_graphs`` (Qwen2, Qwen3, OLMo2, Gemma 2/3 today). The prompt crosses a chunk
boundary (11 tokens = a run of the 8-row prefill, then 3 in the 4-row one) and Gemma's
sliding window of 4 tokens, and more new tokens than the window are generated;
test_a_wrong_window_changes_the_tokens shows a window mask off by one would fail here.
Each family is converted once per target (module-scoped), ~2-4 s each.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from circleops.adapters import attention_blockers
from circleops.generation.generator import Generator
from circleops.recipes.llm import GraphsReport, convert_graphs
from families import BY_NAME, FAMILIES, MOE_FAMILIES, Family
from generate_fixtures import hf_greedy, one_torch_thread

DECOMPOSED = [f for f in FAMILIES if not f.attention_fusable and f.decode_graphs]
CASES = [("onert", "onert"), ("circle", "reference"), ("tflite", "litert")]
PROMPT = [5, 17, 42, 99, 3, 7, 8, 9, 10, 11, 12]
LENS, CACHE, NEW = (8, 4), 32, 12


def logits_bound(directory: Path) -> float:
    """How far the generator's logits may be from transformers', relative to max(1, max|logit|):
    fp32 rounding steps (tests/rounding.py) on the deepest path of a graph, twice (the K/V
    cache a step reads was computed by another run of a graph), one fp32 step each. Measured
    on the AMD EPYC: <= 1e-5; this comes to 1.5e-4 to 3e-4 for these 2-layer models."""
    from circleops.package.manifest import read_manifest
    from circleops.serialize import read_model
    from rounding import FP32_STEP, rounding_steps

    manifest = read_manifest(directory)
    steps = []
    for name in dict.fromkeys(manifest.files.values()):
        model = read_model(str(directory / name))
        steps += [rounding_steps(model, i) for i in range(len(model.subgraphs)) if not _is_decomposition(model, i)]
    return 2 * max(steps) * FP32_STEP


def _is_decomposition(model, index: int) -> bool:
    """A composite's decomposition subgraph (counted through its composite op)."""
    return any(op.opcode == "STABLEHLO_COMPOSITE" and int(op.options["decompositionSubgraphIndex"]) == index
               for sg in model.subgraphs for op in sg.operators)


@dataclass
class Expected:
    model: torch.nn.Module
    tokens: list[int]  # transformers' greedy generate (stops at EOS, as Generator does)
    logits: np.ndarray  # [len(tokens), V]: the logits each token was picked from


def _expected(family: Family) -> Expected:
    model = family.build()
    with torch.no_grad(), one_torch_thread():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, use_cache=True,
                             output_logits=True, return_dict_in_generate=True,
                             attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
    return Expected(model, out.sequences[0, len(PROMPT):].tolist(), torch.cat(out.logits).numpy())


@pytest.fixture(scope="module")
def expected() -> Callable[[Family], Expected]:
    memo: dict[str, Expected] = {}

    def get(family: Family) -> Expected:
        if family.name not in memo:
            memo[family.name] = _expected(family)
        return memo[family.name]

    return get


@pytest.fixture(scope="module")
def converted(tmp_path_factory, expected) -> Callable[[Family, str], tuple[Path, GraphsReport]]:
    """(family, target) -> (directory, report), each converted once for this module."""
    memo: dict[tuple[str, str], tuple[Path, GraphsReport]] = {}

    def get(family: Family, target: str) -> tuple[Path, GraphsReport]:
        key = (family.name, target)
        if key not in memo:
            out = tmp_path_factory.mktemp(f"{family.name}_{target}")
            with one_torch_thread():
                report = convert_graphs(copy.deepcopy(expected(family).model), out, target=target, prefill_len=LENS,
                                        max_cache_len=CACHE, source=f"tiny {family.name}")
            memo[key] = out, report
        return memo[key]

    return get


@pytest.mark.parametrize("target,runtime", CASES, ids=[f"{t}-{r}" for t, r in CASES])
@pytest.mark.parametrize("family", DECOMPOSED, ids=lambda f: f.name)
def test_generate_equals_transformers(converted, expected, family, target, runtime):
    want = expected(family)
    scale = max(1.0, float(np.abs(want.logits).max()))
    top2 = np.sort(want.logits, axis=-1)[:, -2:]
    directory, _ = converted(family, target)
    bound = logits_bound(directory)
    # the test model's greedy choices are no near-ties: two logits each moved by the bound cannot swap
    assert (top2[:, 1] - top2[:, 0]).min() > 2 * bound * scale, "choose another prompt or seed"
    gen = Generator(directory, runtime=runtime)
    result = gen.generate(PROMPT, NEW)
    assert result.tokens == want.tokens
    assert result.prefill_chunks == [8, 4]  # 11 tokens: a chunk boundary at slot 8
    # the logits of every step, fed transformers' tokens
    got = np.stack([gen.prefill(PROMPT)] + [gen.decode(t) for t in want.tokens[:-1]])
    err = float(np.abs(got - want.logits).max())
    assert err <= bound * scale, f"max abs logit error {err:.3g} (logits up to {scale:.3g}, bound {bound:.3g} x)"


def test_a_one_percent_error_fails_the_bound(tmp_path, expected):
    """The derived bound stays sharp: the same graphs with one weight 1 % off (the final
    norm's gamma, as a wrong scale in a kernel would be) are far outside it."""
    family = BY_NAME["qwen2"]
    want = expected(family)
    model = copy.deepcopy(want.model)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.01)
    with one_torch_thread():
        convert_graphs(model, tmp_path, target="onert", prefill_len=LENS, max_cache_len=CACHE)
    scale = max(1.0, float(np.abs(want.logits).max()))
    gen = Generator(tmp_path)
    got = np.stack([gen.prefill(PROMPT)] + [gen.decode(t) for t in want.tokens[:-1]])
    err = float(np.abs(got - want.logits).max())
    assert err > 10 * logits_bound(tmp_path) * scale, (err, logits_bound(tmp_path) * scale)


def _norms(model: torch.nn.Module) -> int:
    return sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())


@pytest.mark.parametrize("family", DECOMPOSED, ids=lambda f: f.name)
def test_norms_and_rope_stay_fused_and_the_report_says_why_attention_is_not(converted, expected, family):
    """Every RMSNorm (the per-head q/k norms included) is one RMS_NORM and each layer's q
    and k rotations are ROPE (onert: in the decode graph, where its ROPE is right); no
    ATTENTION; the summary and --report JSON say which layers' attention is decomposed, why."""
    model = expected(family).model
    layers = model.config.num_hidden_layers
    _, onert = converted(family, "onert")
    _, circle = converted(family, "circle")
    assert onert.graphs["decode"].ops["RMS_NORM"] == _norms(model)
    assert onert.graphs["decode"].ops["ROPE"] == 2 * layers
    for g in circle.graphs.values():
        assert g.ops["RMS_NORM"] == _norms(model) and g.ops["ROPE"] == 2 * layers and "ATTENTION" not in g.ops
    note = onert.attention
    assert note.startswith(f"{type(model.model.layers[0].self_attn).__name__} decomposed in all {layers} layers")
    for layer in model.model.layers:
        for reason in attention_blockers(layer.self_attn):
            assert reason.split(" (")[0] in note
    assert f"\n  attention: {note}\n" in onert.summary() and onert.to_json()["attention"] == note


def _window_families() -> list[Family]:
    return [f for f in DECOMPOSED if "sliding_attention" in f.overrides.get("layer_types", ())]


@pytest.mark.parametrize("family", _window_families(), ids=lambda f: f.name)
@pytest.mark.parametrize("change", ["window - 1", "window + 1", "no window"])
def test_a_wrong_window_changes_the_tokens(expected, family, change):
    """A sliding-window mask off by one (or none) gives other greedy tokens on these models,
    so test_generate_equals_transformers fails on it."""
    window, types = family.overrides["sliding_window"], family.overrides["layer_types"]
    kw = {"no window": {"layer_types": ["full_attention"] * len(types)},
          "window - 1": {"sliding_window": window - 1}, "window + 1": {"sliding_window": window + 1}}[change]
    assert hf_greedy(family.build(**kw), PROMPT, NEW) != expected(family).tokens


@pytest.mark.parametrize("family", [f for f in MOE_FAMILIES if not f.attention_fusable and f.decode_graphs],
                         ids=lambda f: f.name)
def test_moe_families_generate_on_onert(tmp_path, family):
    """The mixture-of-experts forms (experts as dense dispatch) generate the same way."""
    model = family.build()
    with torch.no_grad():  # a sharper router: picks far from ties (as tests/onert/test_onert_moe.py)
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")):
                p.mul_(10)
    want = hf_greedy(model, PROMPT, NEW)
    with one_torch_thread():
        report = convert_graphs(model, tmp_path, target="onert", prefill_len=LENS, max_cache_len=CACHE)
    assert report.attention and Generator(tmp_path).generate(PROMPT, NEW).tokens == want


def test_cli_convert_and_generate_gemma2(tmp_path, capsys):
    """The commands a user types, on Gemma 2 (soft-capping, a sliding layer, another scale)."""
    from circleops.cli import main as cli
    from circleops.sources.models import load_config

    cfg = tmp_path / "config.json"
    BY_NAME["gemma2"].config().to_json_file(cfg)
    out = tmp_path / "out"
    with one_torch_thread():
        rc = cli(["convert", "--config", str(cfg), "--graphs", "prefill,decode", "--target", "onert",
                  "--seq-len", "8,4", "--max-cache-len", str(CACHE), "--verify", "-o", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0 and "passed" in stdout
    assert ("attention: Gemma2Attention decomposed in all 2 layers (RMS_NORM, ROPE stay fused): attention logit "
            "soft-capping at 2.0; sliding-window attention over 4 tokens [layer 0]; score scale 0.353553 is not "
            "1/sqrt(head_dim) = 0.25") in stdout
    rc = cli(["generate", str(out), "--token-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW), "-q"])
    assert rc == 0
    assert [int(t) for t in capsys.readouterr().out.split()] == hf_greedy(load_config(cfg).module, PROMPT, NEW)


def test_quantized_q4_0(tmp_path, expected):
    """One quantized form: Qwen2 (biases, each its own ADD after a GGML linear) with q4_0
    weights converts, verifies against the model on the weights the files hold, and each
    generated token is torch's greedy choice on those weights up to the files' error."""
    from circleops.quantize.weights import dequantized_sources

    model = copy.deepcopy(expected(BY_NAME["qwen2"]).model)
    with one_torch_thread():
        report = convert_graphs(model, tmp_path, target="onert", prefill_len=LENS, max_cache_len=CACHE, verify=True,
                                quantize="q4_0")
    assert report.quantization.format == "q4_0" and "biases" in report.attention
    gen = Generator(tmp_path).generate(PROMPT, NEW, stop_at_eos=False)
    assert len(gen.tokens) == NEW
    err = max(info.max_abs_error for info in report.graphs.values())
    # torch on the files' weights with onert's input rounding: what verify's error was measured against
    with dequantized_sources(report.quantization, model, "onert"), torch.no_grad():
        logits = model(torch.tensor([PROMPT + gen.tokens])).logits[0, len(PROMPT) - 1:-1]
    gaps = [float(row.max() - row[t]) for row, t in zip(logits, gen.tokens)]
    assert max(gaps) <= 2 * err, f"tokens {gen.tokens} off torch's greedy by logit gaps {gaps} (error {err:.3g})"

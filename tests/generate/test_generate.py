"""Greedy generation on the written graphs equals transformers' greedy generate; limits
are clear errors; the decode graph runs once per token on sessions created once."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import manifest_json
from generate_fixtures import TINY_CACHE, TINY_NEW, TINY_PREFILL, TINY_PROMPTS, hf_greedy
from families import FAMILIES

from circleops.cli import main as cli
from circleops.generation.generator import GenerationLimitError, Generator, generate
from circleops.errors import TargetError

CASES = [("onert", "onert"), ("onert", "reference"), ("tflite", "litert"), ("circle", "reference")]


@pytest.mark.parametrize("target,runtime", CASES, ids=[f"{t}-{r}" for t, r in CASES])
def test_greedy_tokens_equal_transformers(request, target, runtime):
    conv = request.getfixturevalue(f"tiny_{target}")
    gen = Generator(conv.directory, runtime=runtime)
    # the reference interpreter runs the decomposed onert graphs slowly: one prompt there
    prompts = TINY_PROMPTS[:1] if (target, runtime) == ("onert", "reference") else TINY_PROMPTS
    for prompt in prompts:
        result = gen.generate(prompt, TINY_NEW)
        expected = conv.expected[tuple(prompt)]
        assert result.tokens == expected, (prompt, runtime)
        assert result.decode_steps == len(expected) - 1  # the first token comes from the prefill


def test_default_runtime_comes_from_the_manifest(tiny_onert, tiny_tflite, tiny_circle):
    assert Generator(tiny_onert.directory).runtime == "onert"
    assert Generator(tiny_tflite.directory).runtime == "litert"
    assert Generator(tiny_circle.directory).runtime == "reference"


def test_decode_runs_once_per_token_on_one_session(tiny_onert, monkeypatch):
    """Linear cost: one prefill, then the decode graph once per new token with a single
    token, its position and the caches (numpy arrays) in; the session is never rebuilt."""
    gen = Generator(tiny_onert.directory)
    session = gen.decode_session
    calls = {"prefill": [], "decode": []}
    for name in calls:
        s = getattr(gen, f"{name}_session")
        monkeypatch.setattr(s, "run", lambda inputs, r=s.run, n=name: calls[n].append(
            [np.array(a) for a in inputs[:2]] + [type(a) for a in inputs[2:]]) or r(inputs))
    result = gen.generate(TINY_PROMPTS[0], TINY_NEW, stop_at_eos=False)
    assert len(result.tokens) == TINY_NEW
    assert len(calls["prefill"]) == 1 and len(calls["decode"]) == TINY_NEW - 1
    p = len(TINY_PROMPTS[0])
    for i, (ids, pos, *cache_types) in enumerate(calls["decode"]):
        assert ids.shape == (1, 1) and ids[0, 0] == result.tokens[i]
        assert pos.tolist() == [p + i]
        assert set(cache_types) == {np.ndarray} and len(cache_types) == 4
    assert gen.decode_session is session  # one session for every step


def test_prompt_longer_than_prefill(tiny_onert, tiny_model):
    """Chunks of the prefill graph: TINY_PREFILL + 2 tokens = one chunk and an end-aligned one."""
    from generate_fixtures import hf_greedy

    prompt = list(range(1, TINY_PREFILL + 3))
    gen = Generator(tiny_onert.directory)
    assert gen.generate(prompt, 4, stop_at_eos=False).tokens == hf_greedy(tiny_model, prompt, 4)


def test_generation_past_the_cache(tiny_onert):
    gen = Generator(tiny_onert.directory)
    with pytest.raises(GenerationLimitError, match=f"more than the {TINY_CACHE} slots.*at most {TINY_CACHE - 5} new"):
        gen.generate(TINY_PROMPTS[0], TINY_CACHE)
    # exactly filling the cache is allowed
    result = gen.generate(TINY_PROMPTS[0], TINY_CACHE - 5, stop_at_eos=False)
    assert len(result.tokens) == TINY_CACHE - 5


def test_runtime_that_cannot_run_the_files(tiny_onert, tiny_circle):
    with pytest.raises(TargetError, match="--target tflite"):
        Generator(tiny_onert.directory, runtime="litert")
    with pytest.raises(TargetError, match="--target onert"):
        Generator(tiny_circle.directory, runtime="onert")


def test_generate_api_with_token_ids(tiny_onert):
    result = generate(tiny_onert.directory, TINY_PROMPTS[1], TINY_NEW)
    assert result.tokens == tiny_onert.expected[tuple(TINY_PROMPTS[1])] and result.text is None


# --------------------------------------------------------------------------- CLI

def _ids(prompt):
    return ",".join(map(str, prompt))


def test_cli_generate_token_ids(capsys, tiny_onert):
    prompt = TINY_PROMPTS[0]
    rc = cli(["generate", str(tiny_onert.directory), "--token-ids", _ids(prompt), "--max-new-tokens", str(TINY_NEW)])
    out, err = capsys.readouterr()
    assert rc == 0
    assert [int(t) for t in out.split()] == tiny_onert.expected[tuple(prompt)]
    assert "prefill 5-token prompt" in err and "tokens/s" in err and "[onert]" in err


def _topk_recording_sampler(config):
    """A Sampler that also records, per pick, whether the token was among the top_k logits."""
    from circleops.generation.sampling import Sampler

    class Recording(Sampler):
        picks: list = []

        def __call__(self, logits, context=()):
            token = super().__call__(logits, context)
            rank = int((np.asarray(logits) > np.asarray(logits)[token]).sum())
            self.picks.append(rank)
            return token

    return Recording(config)


def test_cli_sample_draws_what_the_sampler_draws(capsys, tiny_onert):
    """--sample --top-k 5 --seed S: the CLI's tokens are the API's draws with that config,
    each token among the 5 most likely ones, not greedy's; the seed decides the draws."""
    from circleops.generation.sampling import SamplingConfig

    prompt, greedy = TINY_PROMPTS[0], tiny_onert.expected[tuple(TINY_PROMPTS[0])]
    gen = Generator(tiny_onert.directory)
    draws = {}
    for seed in (3, 4):
        rc = cli(["generate", str(tiny_onert.directory), "--token-ids", _ids(prompt), "--max-new-tokens",
                  str(TINY_NEW), "--sample", "--top-k", "5", "--temperature", "1.5", "--seed", str(seed), "-q"])
        out, _ = capsys.readouterr()
        assert rc == 0
        draws[seed] = [int(t) for t in out.split()]
        sampler = _topk_recording_sampler(SamplingConfig(do_sample=True, top_k=5, temperature=1.5, seed=seed))
        sampler.picks = []
        api = gen.generate(prompt, TINY_NEW, sampler=sampler).tokens
        assert draws[seed] == api, f"seed {seed}: CLI drew {draws[seed]}, the API {api}"
        assert all(rank < 5 for rank in sampler.picks), sampler.picks
        # sampling, not greedy: at temperature 1.5 over 5 tokens most picks are not the argmax
        assert sum(r > 0 for r in sampler.picks) >= len(sampler.picks) // 3, sampler.picks
        assert draws[seed] != greedy
    assert draws[3] != draws[4]


@pytest.mark.parametrize("argv,message", [
    (["--token-ids", _ids(range(1, 34))], "the prompt (33 tokens) plus --max-new-tokens 64 is 97 tokens"),
    (["--token-ids", "1,2", "--top-p", "0.5"], "add --sample"),
    (["--token-ids", "1,2", "--max-new-tokens", "31"], "is 33 tokens, more than the 32 slots"),
    (["--token-ids", "1,2", "--runtime", "litert"], "LiteRT runs .tflite files"),
    (["--prompt", "hello"], "has no tokenizer"),
])
def test_cli_errors_are_one_paragraph(capsys, tiny_onert, argv, message):
    rc = cli(["generate", str(tiny_onert.directory), *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith("circleops generate: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_refuses_what_sizes_decide_before_opening_a_graph(capsys, tiny_onert, monkeypatch):
    """A prompt plus --max-new-tokens past the cache is refused from the manifest alone: a 1B
    model's sessions take seconds to open (issue 32: every refusal sizes decide comes first)."""
    from circleops.generation import core

    def no_session(*args, **kwargs):
        raise AssertionError("a graph was opened before the refusal")

    monkeypatch.setattr(core, "open_graph", no_session)
    rc = cli(["generate", str(tiny_onert.directory), "--token-ids", "1,2", "--max-new-tokens", "31"])
    err = capsys.readouterr().err
    assert rc == 2 and "is 33 tokens, more than the 32 slots" in err and "Generate at most 30 new tokens" in err


def test_a_length_past_the_models_positions_names_them_not_a_conversion(capsys, tiny_onert, tmp_path):
    """--max-new-tokens past the model's own positions (max_position_embeddings, in the manifest)
    says so: no --max-cache-len could hold it, and convert would refuse the one it once suggested."""
    from circleops.package.manifest import read_manifest

    positions = read_manifest(tiny_onert.directory).max_positions
    assert positions == FAMILIES[0].build().config.max_position_embeddings > TINY_CACHE
    rc = cli(["generate", str(tiny_onert.directory), "--token-ids", "1,2", "--max-new-tokens", str(10 ** 20)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"Generate at most {TINY_CACHE - 2} new tokens" in err
    assert f"the model has {positions} positions" in err and str(10 ** 20 + 2) in err
    assert f"--max-cache-len {positions} for at most {positions - 2} new tokens" in err
    assert f"--max-cache-len {10 ** 20 + 2}" not in err
    # within the model's positions the longer cache is the advice
    rc = cli(["generate", str(tiny_onert.directory), "--token-ids", "1,2", "--max-new-tokens", "40"])
    assert rc == 2 and "convert again with --max-cache-len 42 or more" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["128", True, 1.5, TINY_CACHE - 1, -1])
def test_manifest_max_positions_is_checked(tiny_onert, tmp_path, value):
    from circleops.errors import ModelLoadError
    from circleops.package.manifest import read_manifest

    out = tmp_path / "copy"
    shutil.copytree(tiny_onert.directory, out)
    manifest_json.edit(out, {"max_positions": value})
    with pytest.raises(ModelLoadError, match="max_positions must be an integer of at least max_cache_len"):
        read_manifest(out)


def test_cli_not_a_graphs_directory(capsys, tmp_path):
    rc = cli(["generate", str(tmp_path), "--token-ids", "1"])
    assert rc == 2 and "has no manifest.json" in capsys.readouterr().err


def test_cli_convert_graphs_with_verify(tmp_path, tiny_model):
    """`circleops convert --config ... --graphs prefill,decode --verify` then generate, as
    separate processes (the commands a user types); the model is the config's seeded one."""
    from circleops.sources.models import load_config

    cfg = tmp_path / "config.json"
    tiny_model.config.to_json_file(cfg)
    out = tmp_path / "out"
    conv = subprocess.run([sys.executable, "-m", "circleops.cli", "convert", "--config", str(cfg), "--graphs",
                           "prefill,decode", "--target", "onert", "--seq-len", "4,8", "--max-cache-len", "32",
                           "--verify", "-o", str(out), "--report", str(tmp_path / "r.json")],
                          capture_output=True, text=True)
    assert conv.returncode == 0, conv.stderr
    assert "verify (onert" in conv.stdout and "passed" in conv.stdout
    assert "one per graph" in conv.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["graphs"]["decode"]["ops"]["ROPE"] == 4
    assert report["graphs"]["decode"]["max_abs_error"] < 1e-4
    # two prefill graphs, each verified: prefill (8, the longest) and prefill_4
    assert report["manifest"]["text"]["prefill_lens"] == [8, 4] and (out / "prefill_4.circle").is_file()
    assert max(report["graphs"][g]["max_abs_error"] for g in ("prefill", "prefill_4")) < 1e-4
    expected = hf_greedy(load_config(cfg).module, TINY_PROMPTS[0], TINY_NEW)
    proc = subprocess.run([sys.executable, "-m", "circleops.cli", "generate", str(out), "--token-ids",
                           _ids(TINY_PROMPTS[0]), "--max-new-tokens", str(TINY_NEW)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert [int(t) for t in proc.stdout.split()] == expected


def test_fp16_graphs_verify_and_generate(tmp_path, tiny_model, tiny_expected):
    """--dtype fp16 (the model in fp16) writes fp16 graphs whose caches are fp16: verify and
    generate feed them fp16 caches (they fed fp32 ones, which the runtime refused), and the
    tokens are fp32 transformers' on this sharp tiny Llama (its logits move by 5-9, fp16's
    error is ~1e-2: tests/convert/test_format_accuracy.py asks the same of its fp16 file)."""
    import copy

    import torch

    from circleops.recipes.llm import convert_graphs

    out = tmp_path / "fp16"
    report = convert_graphs(copy.deepcopy(tiny_model).to(torch.float16), out, target="circle",
                            prefill_len=TINY_PREFILL, max_cache_len=TINY_CACHE, verify=True)
    assert report.verify_runtime == "reference" and report.dtype == "fp16"  # verify raises unless it passed
    assert all(g.max_abs_error <= report.tolerance for g in report.graphs.values())
    prompt = TINY_PROMPTS[0]
    assert Generator(out).generate(prompt, TINY_NEW).tokens == tiny_expected[tuple(prompt)]


def test_cli_convert_graphs_refuses_a_file_output(capsys, tmp_path, tiny_model):
    cfg = tmp_path / "config.json"
    tiny_model.config.to_json_file(cfg)
    # a cache length the config supports, so the -o rule is what refuses
    rc = cli(["convert", "--config", str(cfg), "--graphs", "prefill,decode", "--max-cache-len",
              str(tiny_model.config.max_position_embeddings), "-o", str(tmp_path / "m.circle")])
    assert rc == 2 and "-o names a directory" in capsys.readouterr().err


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.attention_fusable and f.name != "llama"],
                         ids=lambda f: f.name)
def test_other_families_on_onert(tmp_path, family):
    """Every family whose attention circle.attention expresses generates like transformers
    on onert (Llama is covered above with more prompts and runtimes)."""
    from generate_fixtures import one_torch_thread

    from circleops.recipes.llm import convert_graphs

    model = family.build()
    prompt = TINY_PROMPTS[0]
    expected = hf_greedy(model, prompt, 8)
    with one_torch_thread():
        convert_graphs(model, tmp_path, target="onert", prefill_len=TINY_PREFILL, max_cache_len=TINY_CACHE)
    assert Generator(tmp_path).generate(prompt, 8).tokens == expected


def test_directories_of_all_row_prefills_still_run(tmp_path, tiny_model, tiny_expected):
    """A directory converted before the one-row prefill (its prefill returns every row's
    logits; manifest.json of version 1 has no prefill_inputs / prefill_lens / cache_update,
    and its graphs return whole caches) generates the same tokens."""
    import copy

    import torch

    from circleops.pipeline.convert import export
    from circleops.recipes.llm import convert_graphs, decoder_step, lower_step
    from circleops.serialize import write_model

    out = tmp_path / "old"
    convert_graphs(copy.deepcopy(tiny_model), out, target="onert", prefill_len=TINY_PREFILL, max_cache_len=TINY_CACHE,
                   cache_update="full")
    step = decoder_step(copy.deepcopy(tiny_model), TINY_CACHE)
    ids, pos = torch.zeros((1, TINY_PREFILL), dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    ep = export(step, (ids, pos, *step.empty_caches()), adapters=False, warn_list=[])
    model = lower_step(ep, "prefill", "onert", step.num_layers, kind="decode")  # the io of the old prefill
    write_model(model, out / "prefill.circle", "circle")
    manifest_json.write_legacy(out, 1, drop=["prefill_inputs", "prefill_lens", "cache_update"])
    gen = Generator(out)
    assert not gen.manifest.prefill_one_row and gen.manifest.cache_update == "full"
    for prompt in TINY_PROMPTS[:2] + [list(range(1, TINY_PREFILL + 4))]:  # the last takes two chunks
        expected = tiny_expected.get(tuple(prompt)) or hf_greedy(tiny_model, prompt, TINY_NEW)
        assert gen.generate(prompt, TINY_NEW).tokens == expected

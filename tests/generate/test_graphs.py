"""The written prefill/decode graphs: which ops they hold, how they are stored, the manifest."""
from __future__ import annotations

import copy
import json
from collections import Counter

import numpy as np
import pytest

import manifest_json
from generate_fixtures import TINY_CACHE, TINY_PREFILL
from families import BY_NAME, FAMILIES, MOE_FAMILIES

from circleops.errors import CircleOpsError, TargetError
from circleops.package.files import merge_models
from circleops.recipes.llm import (convert_graphs, decoder_step, export_graph, io_names, lower_step,
                                  parse_graph_names)
from circleops.package.manifest import read_manifest
from circleops.serialize import read_model, write_model

LAYERS = 2


def opcodes(path, subgraph: int = 0) -> Counter:
    return Counter(op.opcode for op in read_model(str(path)).subgraphs[subgraph].operators)


def test_onert_decode_graph_has_fused_rope_and_rms_norm(tiny_onert):
    """onert's ROPE reads one position, so only the one-token decode graph has it: q and k
    of every layer. RMS_NORM: two per layer and the final norm. ATTENTION is decomposed."""
    decode = opcodes(tiny_onert.directory / "decode.circle")
    assert decode["ROPE"] == 2 * LAYERS
    assert decode["RMS_NORM"] == 2 * LAYERS + 1
    assert decode["ATTENTION"] == 0
    # rows out, head-major caches in: no cache is selected into a copy or transposed per
    # step (the one SELECT_V2 builds the mask, once for all layers)
    assert decode["TRANSPOSE"] == 0 and decode["SELECT_V2"] == 1
    prefill = opcodes(tiny_onert.directory / "prefill.circle")
    assert prefill["ROPE"] == 0  # 8 positions: decomposed, never the one-row ROPE
    assert prefill["RMS_NORM"] == 2 * LAYERS + 1


def test_tflite_graphs_write_attention_inline(tiny_tflite):
    """LiteRT's XNNPACK delegate never takes a composite's decomposition subgraph, so the
    tflite generation graphs write attention inline (TargetProfile.graph_inline_ops): each
    signature's own subgraph holds every layer's q/k/v/o products and the two attention
    products per cache part; RMSNorm stays the odml.rms_norm composite."""
    from circleops.targets import PROFILES

    assert PROFILES["tflite"].graph_inline_ops == {"attention"}
    model = read_model(str(tiny_tflite.directory / "model.tflite"))
    for sig in model.signatures:
        ops = Counter(op.opcode for op in model.subgraphs[sig.subgraph_index].operators)
        names = Counter(op.options["name"] for op in model.subgraphs[sig.subgraph_index].operators
                        if op.opcode == "STABLEHLO_COMPOSITE")
        assert names == {"odml.rms_norm": 2 * LAYERS + 1}, (sig.key, names)
        assert ops["FULLY_CONNECTED"] == 7 * LAYERS + 1, sig.key  # q, k, v, o, gate, up, down; lm_head
        # q and k rotated as one tensor, rotate_half a product with a constant (one BATCH_MATMUL
        # a layer, no NEG: TargetProfile.attention_joint_rope, tests/lowering/test_attention_rope.py)
        assert ops["NEG"] == 0, sig.key
        if sig.key.startswith("decode"):
            # q·kᵀ and p·v over the cache; the one new token's own key and value as MUL (+ SUM):
            # XNNPACK would pack them as right operands on every run (TargetProfile.matmul_packs_rhs)
            assert ops["BATCH_MATMUL"] == 3 * LAYERS and ops["SUM"] == LAYERS, sig.key
        else:
            assert ops["BATCH_MATMUL"] == 5 * LAYERS, sig.key  # q·kᵀ and p·v, over the cache and the new rows
    # a plain `convert` of the same family keeps circle.attention (test_lowering_attention_form)


def test_onert_graph_io(tiny_onert):
    for graph, s in (("prefill", TINY_PREFILL), ("decode", 1)):
        m = read_model(str(tiny_onert.directory / f"{graph}.circle"))
        sub = m.subgraphs[0]
        ins = [(sub.tensors[i].name, sub.tensors[i].shape, sub.tensors[i].dtype) for i in sub.inputs]
        outs = [(sub.tensors[i].name, sub.tensors[i].shape, sub.tensors[i].dtype) for i in sub.outputs]
        # head-major caches (manifest cache_layout): k [1, Hkv, C, D], v [1, Hkv, D, C]
        k_cache, v_cache, rows = (1, 2, TINY_CACHE, 16), (1, 2, 16, TINY_CACHE), (1, s, 2, 16)
        assert ins[:2] == [("input_ids", (1, s), "INT64"), ("pos", (1,), "INT64")]
        row = [("logits_row", (1,), "INT64")] if graph == "prefill" else []  # the one row whose logits it returns
        assert ins[2:2 + len(row)] == row
        assert [i[1] for i in ins[2 + len(row):]] == [k_cache] * LAYERS + [v_cache] * LAYERS
        # cache_update "rows": the caches are inputs only; the outputs are the new tokens' k/v rows
        assert outs == [("logits", (1, 1, 256), "FLOAT32")] + [
            (f"{kv}_new_{i}", rows, "FLOAT32") for kv in "kv" for i in range(LAYERS)]
        assert [sig.key for sig in m.signatures] == [graph]


def test_manifest(tiny_onert):
    data = manifest_json.fields(tiny_onert.directory)  # version 4: the text section's fields and the common ones
    assert manifest_json.read(tiny_onert.directory)["kind"] == "text" and "text" in manifest_json.read(tiny_onert.directory)
    assert data["files"] == {"prefill": "prefill.circle", "decode": "decode.circle"}
    assert data["signatures"] == {"prefill": None, "decode": None}
    assert data["one_file_per_graph"] is True and data["default_runtime"] == "onert"
    assert (data["prefill_len"], data["max_cache_len"], data["num_layers"]) == (TINY_PREFILL, TINY_CACHE, LAYERS)
    assert data["cache_shape"] == [1, TINY_CACHE, 2, 16]
    assert data["eos_token_ids"] == [2] and data["tokenizer"] is None
    assert data["inputs"] == io_names(LAYERS)[0] and data["outputs"] == io_names(LAYERS, "decode", "rows")[1]
    assert data["cache_update"] == "rows" and data["version"] == 4
    assert data["cache_layout"] == "k [1, Hkv, C, D], v [1, Hkv, D, C]"
    assert data["prefill_inputs"] == io_names(LAYERS, "prefill")[0] and data["prefill_lens"] == [TINY_PREFILL]
    m = read_manifest(tiny_onert.directory)
    assert m.path("decode").is_file() and m.default_runtime == "onert"


@pytest.mark.parametrize("target,ext", [("tflite", "tflite"), ("circle", "circle")])
def test_one_file_two_signatures_shared_weights(request, target, ext):
    """Circle/TFLite keep both graphs in one file, one signature each, every weight once."""
    conv = request.getfixturevalue(f"tiny_{target}")
    m = read_manifest(conv.directory)
    # target tflite also writes the prefill reading only the first C/2 cache slots (graphs.default_cache_windows)
    windowed = {f"prefill_c{TINY_CACHE // 2}": [TINY_PREFILL, TINY_CACHE // 2]} if target == "tflite" else {}
    assert m.prefill_windows == (windowed or None)
    graphs = {"prefill", "decode", *windowed}
    assert m.files == {g: f"model.{ext}" for g in graphs}
    assert m.signatures == {g: g for g in graphs}
    model = read_model(str(conv.directory / f"model.{ext}"))
    sigs = {s.key: s.subgraph_index for s in model.signatures}
    assert set(sigs) == graphs and len(set(sigs.values())) == len(graphs)
    # the weights (embedding, projections, lm_head) of the subgraphs are the same buffers
    def weights(i):
        return {id(t.data) for t in model.subgraphs[i].tensors if t.data is not None and t.data.size >= 32 * 64}
    assert all(weights(sigs[g]) == weights(sigs["decode"]) for g in graphs)
    assert len(weights(sigs["prefill"])) == 2 + 7 * LAYERS  # embedding, lm_head, q,k,v,o,gate,up,down per layer


def test_merge_keeps_weights_once(tmp_path, tiny_model):
    step = decoder_step(copy.deepcopy(tiny_model), TINY_CACHE)
    lowered = {g: lower_step(export_graph(step, g, TINY_PREFILL), g, "tflite", LAYERS) for g in ("prefill", "decode")}
    alone = write_model(lowered["prefill"], tmp_path / "p.tflite", "tflite")
    both = write_model(merge_models(lowered), tmp_path / "both.tflite", "tflite")
    assert both.weight_bytes < 1.05 * alone.weight_bytes
    # composite decomposition indices of the second graph were moved with its subgraphs
    merged = read_model(str(tmp_path / "both.tflite"))
    for sub in merged.subgraphs:
        for op in sub.operators:
            if op.opcode == "STABLEHLO_COMPOSITE":
                assert 0 < op.options["decompositionSubgraphIndex"] < len(merged.subgraphs)


def test_onert_runs_only_subgraph_0(tmp_path, tiny_onert):
    """The measurement behind two files for onert: a file holding prefill and decode as
    two signatures loads in onert 0.1.0, but its session exposes only subgraph 0 (the
    prefill) and its Python API has no way to pick another signature or subgraph."""
    import onert

    prefill = read_model(str(tiny_onert.directory / "prefill.circle"))
    decode = read_model(str(tiny_onert.directory / "decode.circle"))
    path = tmp_path / "both.circle"
    write_model(merge_models({"prefill": prefill, "decode": decode}), path, "circle")
    sess = onert.infer.session(str(path), "cpu")
    dims = [tuple(i.dims[:i.rank]) for i in sess.get_inputs_tensorinfo()]
    assert dims[0] == (1, TINY_PREFILL)  # subgraph 0's input_ids; decode's would be (1, 1)
    assert not any(hasattr(sess, name) for name in ("set_signature", "select_signature", "get_signature_runner"))
    assert not any(hasattr(sess.session, name) for name in ("set_signature", "set_subgraph", "run_signature"))
    ids = np.zeros((1, TINY_PREFILL), np.int64)
    caches = [np.zeros(shape, np.float32) for shape in read_manifest(tiny_onert.directory).cache_shapes]
    outs = sess.infer([ids, np.zeros(1, np.int64), np.zeros(1, np.int64), *caches])
    assert outs[0].shape == (1, 1, 256) and outs[1].shape == (1, TINY_PREFILL, 2, 16)  # it ran the prefill


@pytest.mark.parametrize("family", [f for f in FAMILIES + MOE_FAMILIES if not f.decode_graphs], ids=lambda f: f.name)
def test_families_without_cache_attention_are_refused(tmp_path, family):
    """A family whose attention no adapter knows (multi-head latent attention, attention
    sinks) has no decode graph: a clear error before anything is written."""
    with pytest.raises(CircleOpsError, match="no circleops attention adapter for this class"):
        convert_graphs(family.build(), tmp_path / "out", target="onert", prefill_len=4, max_cache_len=8)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_bad_options(tmp_path):
    model = BY_NAME["llama"].build()
    with pytest.raises(TargetError, match="--max-cache-len >= --seq-len"):
        convert_graphs(model, tmp_path / "a", prefill_len=16, max_cache_len=8)
    with pytest.raises(TargetError, match="max_position_embeddings 128"):
        convert_graphs(model, tmp_path / "b", prefill_len=16, max_cache_len=129)
    with pytest.raises(TargetError, match="comma-separated list of prefill, decode"):
        parse_graph_names("prefill,encode")
    assert parse_graph_names("decode, prefill") == ("prefill", "decode")


def test_an_hf_directory_keeps_its_tokenizer(tmp_path, capsys):
    """``convert DIR --graphs prefill,decode`` of an HF directory that holds a tokenizer saves it
    beside the graphs, so ``generate --prompt`` (and --chat) work on the result as after
    ``convert smollm2`` (it used to keep only the weights: "has no tokenizer")."""
    from chat_fixtures import tiny_chat_tokenizer

    from circleops.cli import main
    from circleops.generation.generator import Generator

    tokenizer = tiny_chat_tokenizer()
    model_dir, out = tmp_path / "hf", tmp_path / "out"
    BY_NAME["llama"].build(vocab_size=len(tokenizer), num_hidden_layers=1).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    assert main(["convert", str(model_dir), "--graphs", "prefill,decode", "--target", "onert", "--seq-len", "8",
                 "--max-cache-len", "32", "-q", "-o", str(out)]) == 0
    assert read_manifest(out).tokenizer == "tokenizer"
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "hi there", "--chat", "-q", "--max-new-tokens", "4"]) == 0
    text = capsys.readouterr().out
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    want = Generator(out).generate(list(ids), 4).tokens
    assert text.strip("\n") == tokenizer.decode(want).strip("\n")

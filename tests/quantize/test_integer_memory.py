"""The memory of the integer (PT2E) path's last stage, issue 32: convert_pt2e's folding of the
weights' quantization, the lowering's dequantized constants and its integers, and the integer
tables each graph of a set holds. Each fix gives the same integers; the peaks are measured as
the rise of the process's resident set (VmHWM after /proc/self/clear_refs) above what it held."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from circleops.quantize import blocked_fold, pt2e
from circleops.quantize.integer import qdq
from circleops.quantize.integer.shared import FOLDED, SharedIntegers

MB = 1 << 20


def _rss(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def peak_rise(fn):
    """(fn's result, how far the resident set rose above its level when fn began): the peak
    counter reset first (Linux: /proc/self/clear_refs 5), then read after fn."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss("VmRSS")
    out = fn()
    return out, _rss("VmHWM") - before


def _int_table(rows: int, cols: int, dtype: np.dtype, seed: int = 0) -> torch.Tensor:
    """Random integers made in their own dtype (no int64 array first: it would raise the peak
    counter before the measurement starts)."""
    info = np.iinfo(dtype)
    return torch.from_numpy(np.random.default_rng(seed).integers(info.min, info.max, (rows, cols), dtype=dtype,
                                                                 endpoint=True))


def _spec(dtype: str, scale: np.ndarray, zp: np.ndarray, axis: int, qmin: int, qmax: int) -> qdq.QSpec:
    return qdq.QSpec(dtype, scale.astype(np.float32), zp.astype(np.int64), axis, qmin, qmax, qdq.QuantPlan())


def _int64_form(spec: qdq.QSpec, q: torch.Tensor) -> torch.Tensor:
    """The dequantization as it was computed before: through int64 (the reference)."""
    s = spec._shaped(spec.scale.astype(np.float32), q.dim())
    z = spec._shaped(spec.zero_point.astype(np.int64), q.dim())
    return (q.to(torch.int64) - z).to(torch.float32) * s


@pytest.mark.parametrize("case", ["int16 per row", "int8 per column", "uint8 per tensor, zero point", "int4"])
def test_dequantize_by_blocks_in_float32_equals_the_int64_form(monkeypatch, case):
    monkeypatch.setattr(qdq, "DEQUANTIZE_BLOCK", 7 * 33)  # blocks that do not divide the rows
    rng = np.random.default_rng(1)
    rows, cols = 101, 33
    if case == "int16 per row":
        q, spec = _int_table(rows, cols, np.int16), _spec("INT16", rng.random(rows) * 1e-3 + 1e-6,
                                                           np.zeros(rows), 0, -32768, 32767)
    elif case == "int8 per column":
        q, spec = _int_table(rows, cols, np.int8), _spec("INT8", rng.random(cols) * 0.1 + 1e-4, np.zeros(cols),
                                                          1, -127, 127)
    elif case == "uint8 per tensor, zero point":
        q, spec = _int_table(rows, cols, np.uint8), _spec("UINT8", np.array([0.0371]), np.array([201]), 0, 0, 255)
    else:
        q = torch.from_numpy(rng.integers(-8, 8, (rows, cols), dtype=np.int8))
        spec = _spec("INT4", rng.random(rows) + 0.01, np.zeros(rows), 0, -8, 7)
    got = spec.dequantize(q)
    assert got.dtype == torch.float32 and torch.equal(got, _int64_form(spec, q))


def test_dequantize_holds_the_float_result_and_blocks_only(monkeypatch):
    # 32M int16 (the 1B shape's int16 embedding is 263M): through int64 two 256 MB temporaries
    # beside the 128 MB result (measured: 512 MB above the start); by blocks the result, two
    # float copies of a block (8 MB) and what the allocator keeps of freed blocks: at most half
    # the result more allowed (measured 1.10-1.28x the result)
    monkeypatch.setattr(qdq, "DEQUANTIZE_BLOCK", 1 << 20)  # blocks of 4 MB: small beside the result
    q = _int_table(8192, 4096, np.int16)
    scale = np.random.default_rng(0).random(8192) * 1e-3 + 1e-6
    spec = _spec("INT16", scale, np.zeros(8192), 0, -32768, 32767)
    _spec("INT16", scale[:1024], np.zeros(1024), 0, -32768, 32767).dequantize(q[:1024])  # the kernels' code
    #                                                        pages and threads, before the counter
    out, rise = peak_rise(lambda: spec.dequantize(q))
    bound = out.numel() * 4 * 3 // 2
    assert rise <= bound, f"dequantize rose {rise / MB:.0f} MB (bound {bound / MB:.0f} MB)"


def _prepared_linear(rows: int, cols: int) -> tuple[torch.nn.Module, tuple]:
    """A linear (int16 activations, int8 per-channel weights), prepared and calibrated."""
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    torch.manual_seed(0)
    lin = torch.nn.Linear(cols, rows, bias=False).eval()
    x = (torch.randn(1, cols),)
    ep = torch.export.export(lin, x, strict=False)
    prepared = prepare_pt2e(ep.module(), pt2e.make_quantizer("int16", weight="int8"))
    with torch.no_grad():
        prepared(*x)
    return prepared, x


def _folded(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module.named_buffers() if k.startswith(FOLDED)}


def test_convert_pt2e_folds_the_same_integers_by_blocks(monkeypatch):
    import copy

    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    prepared, _ = _prepared_linear(300, 64)
    whole = _folded(convert_pt2e(copy.deepcopy(prepared)))
    monkeypatch.setattr(blocked_fold, "FOLD_BLOCK", 7 * 64)  # blocks of 7 rows, not dividing 300
    with blocked_fold.blocked_folding():
        blocks = _folded(convert_pt2e(prepared))
    assert whole and whole.keys() == blocks.keys()
    assert all(torch.equal(whole[k], blocks[k]) and whole[k].dtype == blocks[k].dtype for k in whole)


def test_convert_pt2e_folds_a_large_weight_without_float_copies(monkeypatch):
    # a 16384 x 4096 fp32 weight (256 MB) folded to int8 (64 MB): the fold computed whole, and
    # the dequantized weight it threw away, were temporaries of 256 MB each; by blocks the
    # integers and a block's fp32 temporaries (the op's product, rounding, sum and clamp:
    # four of FOLD_BLOCK x 4 bytes live at once; ten allowed: the allocator keeps freed
    # block-sized chunks in its heap; whole: 1087 MB)
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    monkeypatch.setattr(blocked_fold, "FOLD_BLOCK", 1 << 20)
    with blocked_fold.blocked_folding():  # the kernels' code pages and threads, before the counter
        convert_pt2e(_prepared_linear(2048, 4096)[0])
    prepared, _ = _prepared_linear(16384, 4096)

    def convert():
        with blocked_fold.blocked_folding():
            return convert_pt2e(prepared)

    converted, rise = peak_rise(convert)
    ints = sum(v.numel() * v.element_size() for v in _folded(converted).values())
    assert ints == 16384 * 4096
    bound = ints + 10 * blocked_fold.FOLD_BLOCK * 4
    assert rise <= bound, f"convert_pt2e rose {rise / MB:.0f} MB (bound {bound / MB:.0f} MB)"


def test_lowering_writes_the_converted_integers_not_a_copy():
    """The integer pass writes a weight PT2E quantized as the converted program's own integer
    tensor (read-only), not a second array per graph; the values are those integers."""
    from circleops.quantize.integer.lower import lower_quantized

    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 40)).eval()
    x = (torch.randn(2, 64),)
    _, qep = pt2e.quantize(lin, x, pt2e.make_quantizer("int16", weight="int8"), [x])
    folded = [v for k, v in qep.state_dict.items() if k.startswith(FOLDED) and v.dtype == torch.int8]
    model = lower_quantized(qep, "circle")
    sg = model.subgraphs[0]
    weights = [sg.tensors[op.inputs[1]] for op in sg.operators if op.opcode == "FULLY_CONNECTED"]
    assert len(weights) == 2 == len(folded)
    for w in weights:
        src = next(f for f in folded if tuple(f.shape) == tuple(w.shape))
        assert w.dtype == "INT8" and np.array_equal(w.data, src.numpy())
        assert np.shares_memory(w.data, src.numpy()) and not w.data.flags.writeable


def test_graphs_share_their_equal_folded_integers():
    """Two graphs converted from one module hold one storage of each folded weight; a weight
    whose integers differ keeps its own."""
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16)).eval()
    a, b = (torch.randn(1, 32),), (torch.randn(4, 32),)  # two graphs: other shapes, other calibration
    shared = SharedIntegers()
    conv_a, qep_a = pt2e.quantize(lin, a, pt2e.make_quantizer("int16", weight="int8"), [a])
    assert shared.share(conv_a, qep_a) == 0
    with torch.no_grad():
        lin[2].weight[0, 0] += 1.0  # the second graph's last weight differs in one row
    conv_b, qep_b = pt2e.quantize(lin, b, pt2e.make_quantizer("int16", weight="int8"), [b])
    before = {k: v.clone() for k, v in _folded(conv_b).items()}
    freed = shared.share(conv_b, qep_b)
    fa, fb = _folded(conv_a), _folded(conv_b)
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    same = [k for k in fb if any(ptr(fb[k]) == ptr(v) for v in fa.values())]
    assert len(same) == 1 and freed == fb[same[0]].numel() * fb[same[0]].element_size()
    assert all(torch.equal(fb[k], before[k]) for k in fb)  # the values the graph computes with
    for k, v in qep_b.state_dict.items():  # the program the lowering reads: the same tensors
        if k.startswith(FOLDED):
            assert ptr(v) == ptr(fb[k])


# --------------------------------------------------------------------------- torch's runs of the converted modules

def _decomposed_dequantize(q: torch.Tensor, scales: torch.Tensor, zps: torch.Tensor | None) -> torch.Tensor:
    from circleops.quantize.blocked_dequantize import _dequantize_per_channel

    return _dequantize_per_channel()(
        q, scales, zps, 0, int(torch.iinfo(q.dtype).min), int(torch.iinfo(q.dtype).max), q.dtype)


@pytest.mark.parametrize("case", ["int16 per row", "int8 per row, zero points", "uint8 per row, zero points",
                                  "int4 in int8", "int16 3-d"])
def test_float32_dequantize_equals_the_op(monkeypatch, case):
    from circleops.quantize import blocked_dequantize

    monkeypatch.setattr(blocked_dequantize, "DEQUANTIZE_BLOCK", 7 * 33)  # blocks that do not divide the rows
    rng = np.random.default_rng(2)
    rows, cols = 101, 33
    zps = None
    if case == "int16 per row":
        q = _int_table(rows, cols, np.int16)
    elif case == "int8 per row, zero points":
        q, zps = _int_table(rows, cols, np.int8), torch.from_numpy(rng.integers(-20, 20, rows))
    elif case == "uint8 per row, zero points":
        q, zps = _int_table(rows, cols, np.uint8), torch.from_numpy(rng.integers(0, 255, rows))
    elif case == "int4 in int8":
        q = torch.from_numpy(rng.integers(-8, 8, (rows, cols), dtype=np.int8))
    else:
        q = _int_table(rows, 3, np.int16).reshape(rows, 1, 3).expand(rows, 11, 3).contiguous()
    scales = torch.from_numpy((rng.random(rows) * 1e-2 + 1e-6).astype(np.float32))
    zeros = zps if zps is not None else torch.zeros(rows, dtype=torch.int64)
    want = _decomposed_dequantize(q, scales, zeros)
    got = blocked_dequantize.dequantize_per_channel(q, scales, zeros, 0, int(torch.iinfo(q.dtype).min),
                                                    int(torch.iinfo(q.dtype).max), q.dtype)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_float32_dequantize_holds_the_float_result_and_blocks_only(monkeypatch):
    # 32M int16 (the 1B shape's int16 embedding is 263M): the op's int64 difference (256 MB)
    # beside its 128 MB result; by blocks the result, a block's float copy and what the
    # allocator keeps of freed blocks: at most half the result more allowed
    from circleops.quantize import blocked_dequantize

    monkeypatch.setattr(blocked_dequantize, "DEQUANTIZE_BLOCK", 1 << 20)
    q = _int_table(8192, 4096, np.int16)
    scales = torch.from_numpy((np.random.default_rng(0).random(8192) * 1e-3 + 1e-6).astype(np.float32))
    zps = torch.zeros(8192, dtype=torch.int64)
    args = (0, -32768, 32767, torch.int16)
    blocked_dequantize.dequantize_per_channel(q[:1024], scales[:1024], zps[:1024], *args)  # code pages, threads
    out, rise = peak_rise(lambda: blocked_dequantize.dequantize_per_channel(q, scales, zps, *args))
    bound = out.numel() * 4 * 3 // 2
    assert rise <= bound, f"dequantize rose {rise / MB:.0f} MB (bound {bound / MB:.0f} MB)"


def test_converted_modules_run_float32_dequantize_and_are_restored():
    """Within float32_dequantize a converted module computes the same outputs through the
    float32 form (its dequantize nodes call it), and afterwards its graph is the op's again."""
    from circleops.quantize import blocked_dequantize, dequantize_at_use

    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 40)).eval()
    x = (torch.randn(3, 64),)
    converted, _ = pt2e.quantize(lin, x, pt2e.make_quantizer("int16", weight="int8"), [x])
    op = torch.ops.quantized_decomposed.dequantize_per_channel.default
    targets = lambda: [n.target for n in converted.graph.nodes if n.op == "call_function"]  # noqa: E731
    before = targets()
    n = before.count(op)
    assert n >= 2  # the two weights (and their biases)
    with torch.no_grad():
        want = converted(*x)
        with blocked_dequantize.float32_dequantize([converted]):
            # each dequantize runs the float32 form, or its linear computes from the integers (dequantize_at_use)
            assert op not in targets() and targets().count(blocked_dequantize.dequantize_per_channel) + \
                targets().count(dequantize_at_use._nothing) == n
            got = converted(*x)
    assert targets() == before
    assert torch.equal(got, want)


def test_integer_references_run_on_the_written_file_without_the_lowered_models(monkeypatch, tmp_path):
    """verify's torch runs of the converted modules (references, noise floor, quality) come
    after the file is written and the lowered models are gone (the 1B shape: 14.6 GB held
    by the lowering beside 5 GB of those runs, bench/results/64-npu-1b-verify.yaml), with the
    float32 dequantize in place; the file is verified as before."""
    import weakref

    from families import BY_NAME

    from circleops.package import step
    from circleops.quantize import blocked_dequantize
    from circleops.recipes.llm import LLMRecipe, convert_graphs

    lowered_refs, seen = [], []
    write_files, references = step.write_files, LLMRecipe.integer_references

    def writing(lowered, *args, **kwargs):
        lowered_refs.extend(weakref.ref(m) for m in lowered.values())
        return write_files(lowered, *args, **kwargs)

    def referencing(self, converted, refs):
        nodes = [n.target for m in converted.values() for n in m.graph.nodes if n.op == "call_function"]
        written = list(tmp_path.glob(".*/model.circle"))
        seen.append((len(written), [r() is None for r in lowered_refs],
                     blocked_dequantize.dequantize_per_channel in nodes))
        return references(self, converted, refs)

    monkeypatch.setattr(step, "write_files", writing)
    monkeypatch.setattr(LLMRecipe, "integer_references", referencing)
    torch.manual_seed(0)
    report = convert_graphs(BY_NAME["llama"].build(), tmp_path / "out", target="circle", quantize="int16",
                            prefill_len=4, max_cache_len=16, verify="reference", calibrate=1, rotate="off",
                            source="tiny llama")
    assert len(seen) == 2  # the references and their stochastic rounding
    assert len(lowered_refs) == 2 and all(s == (1, [True, True], True) for s in seen), seen
    assert all(g.max_abs_error is not None for g in report.graphs.values()) and report.quality is not None


def _cyclic_bytes() -> tuple[int, int]:
    """(objects, bytes of the tensors and arrays among or beside them) a full collection finds unreachable now."""
    import gc

    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        found = gc.collect()
        held = 0
        for o in gc.garbage:
            for r in (o, *gc.get_referents(o)):
                if isinstance(r, np.ndarray):
                    held += r.nbytes
                elif isinstance(r, torch.Tensor):
                    held += r.numel() * r.element_size()
        return found, held
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def test_a_graphs_lowering_leaves_no_tables_in_reference_cycles(monkeypatch):
    """What the integer lowering of a graph leaves in reference cycles (its float constants,
    torch.fx graphs) is collected before the next graph's lowering: without that, a 2-layer
    model of the Llama-3.2-1B width (vocabulary 32768) peaked 0.5 GB higher in the lowering
    and 1.0 GB higher in verify's torch runs after it (bench/results/65-npu-1b-verify-memory.yaml)."""
    from circleops.package import step
    from circleops.pipeline import stages

    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).eval()
    x = (torch.randn(3, 512),)
    _, qep = pt2e.quantize(lin, x, pt2e.make_quantizer("int16", weight="int8"), [x])
    opts = stages.Options("circle", torch.float32, quantize="int16")
    # this graph's 2.6 MB stands for a big one (a collection is skipped below COLLECT_FROM_BYTES)
    monkeypatch.setattr(step, "COLLECT_FROM_BYTES", 1 << 20)
    _cyclic_bytes()
    model = step.lower_graph(qep, step.Graph("main", lin, x, ["x"], ["y"]), opts)
    found, held = _cyclic_bytes()
    assert model.subgraphs[0].operators and (found, held) == (0, 0), (found, held)


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    """A tied Llama from disk (its weights in the checkpoint's mapping, as convert loads
    them) with an embedding of 1 MiB: what the rotation unties and writes."""
    from families import BY_NAME

    out = tmp_path_factory.mktemp("tied_llama")
    BY_NAME["llama"].build(vocab_size=4096, tie_word_embeddings=True).save_pretrained(out)
    return out


def test_rotation_gives_back_what_nothing_reads(tied_llama_dir):
    """release_unread: the embedding gets its file's values back (its written pages dropped),
    the untied head's clone is freed; a weight still read keeps its rotated values; the exit
    ties the head again and the model computes what it did."""
    from circleops.quantize import rotate
    from circleops.sources.models import load_hf_dir

    model = load_hf_dir(tied_llama_dir)
    ids = torch.tensor([[5, 77, 3000, 12]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    embed = model.get_input_embeddings().weight
    original = embed.detach().clone()
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    with rotate.rotated(model) as report:
        head = model.get_output_embeddings().weight
        assert report.layers == 2 and head is not embed and report.untied is head
        assert not torch.equal(embed, original)
        rotated_q = q_proj.detach().clone()
        read = {p.untyped_storage().data_ptr() for p in model.parameters() if p is not embed and p is not head}
        released = rotate.release_unread(report, read)
        assert released == 2 * embed.numel() * 4
        assert torch.equal(embed, original) and head.untyped_storage().nbytes() == 0
        assert torch.equal(q_proj, rotated_q)
    assert model.get_output_embeddings().weight is embed
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


def test_converted_graphs_written_the_same_without_the_rotated_tables(tied_llama_dir, monkeypatch, tmp_path):
    """The 16a4w recipe (rotation on) gives the rotated embedding and untied head back once
    PT2E has folded them, before the lowering; the file is byte for byte the one written
    with them kept."""
    from circleops.package import step
    from circleops.quantize import rotate
    from circleops.recipes.llm import convert_graphs
    from circleops.sources.models import load_hf_dir

    held, release = [], rotate.release_unread
    build = step._build

    def building(recipe, *args, **kwargs):
        head = recipe.weights_module().get_output_embeddings().weight
        held.append(head.untyped_storage().nbytes())
        return build(recipe, *args, **kwargs)

    monkeypatch.setattr(step, "_build", building)
    files = []
    for keep in (True, False):
        monkeypatch.setattr(rotate, "release_unread", (lambda *a: 0) if keep else release)
        out = tmp_path / f"keep{keep}"
        convert_graphs(load_hf_dir(tied_llama_dir), out, target="circle", quantize="int16", weight_bits=4,
                       prefill_len=4, max_cache_len=16, calibrate=1, rotate="on", gptq=False, int8_weights="none",
                       source="tied llama")
        files.append((out / "model.circle").read_bytes())
    assert held == [4096 * 64 * 4, 0]
    assert files[0] == files[1]


def _ir_tensor(q: torch.Tensor, scale: np.ndarray, zp: np.ndarray, axis: int):
    from circleops import ir

    dtype = {torch.int8: "INT8", torch.uint8: "UINT8", torch.int16: "INT16"}[q.dtype]
    return ir.Tensor("t", tuple(q.shape), dtype, q.numpy(), ir.QuantParams(scale, zp.astype(np.int64), axis))


@pytest.mark.parametrize("case", ["int16 per row", "int8 per column, zero points", "uint8 per tensor"])
def test_reference_interpreter_dequantize_equals_the_int64_form(case):
    from circleops.runtime.kernels import quantized

    rng = np.random.default_rng(3)
    rows, cols = 101, 33
    if case == "int16 per row":
        q, scale, zp, axis = _int_table(rows, cols, np.int16), rng.random(rows) * 1e-3 + 1e-6, np.zeros(rows), 0
    elif case == "int8 per column, zero points":
        q, scale, zp, axis = _int_table(rows, cols, np.int8), rng.random(cols) * 0.1, rng.integers(-9, 9, cols), 1
    else:
        q, scale, zp, axis = _int_table(rows, cols, np.uint8), np.array([0.0371]), np.array([201]), 0
    t = _ir_tensor(q, scale, zp, axis)
    s, z = quantized.params(t, q.dim())
    want = (q.to(torch.int64) - z).to(torch.float32) * s.to(torch.float32)
    got = quantized.dequantize(q, t)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_reference_interpreter_dequantize_holds_the_float_result_only():
    # 32M int16: through int64 a 256 MB difference beside the 128 MB result; in place in
    # float32 the result alone (a quarter more allowed for the allocator)
    from circleops.runtime.kernels import quantized

    q = _int_table(8192, 4096, np.int16)
    scale = np.random.default_rng(0).random(8192) * 1e-3 + 1e-6
    t = _ir_tensor(q, scale, np.zeros(8192), 0)
    quantized.dequantize(q[:64], _ir_tensor(q[:64], scale[:64], np.zeros(64), 0))  # code pages, before the counter
    out, rise = peak_rise(lambda: quantized.dequantize(q, t))
    bound = out.numel() * 4 * 5 // 4
    assert rise <= bound, f"dequantize rose {rise / MB:.0f} MB (bound {bound / MB:.0f} MB)"

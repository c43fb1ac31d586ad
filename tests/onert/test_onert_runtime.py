"""What onert 0.1.0 does with the ops the lowering relies on, pinned with tiny hand-built
files, and the runner's error reporting. When an onert upgrade changes one of these, the
test that fails names the lowering decision to revisit (circleops/lowering/circle_ops.py,
circleops.targets.ONERT, program._copy_consumed_outputs, elementwise.minmax)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from circleops import ir
from circleops.errors import RuntimeRunError
from circleops.ops import REGISTRY
from circleops.runtime import onert
from circleops.serialize import write_model

rng = np.random.default_rng(0)


def one_op(tmp_path, opcode, inputs, out_shape, out_dtype="FLOAT32", options_type=None, **options):
    """A file with one operator. inputs: (shape, dtype, constant data or None = graph input)."""
    sg = ir.Subgraph("main")
    idx = []
    for k, (shape, dtype, data) in enumerate(inputs):
        idx.append(sg.add_tensor(ir.Tensor(f"in{k}", tuple(shape), dtype, data)))
        if data is None:
            sg.inputs.append(idx[-1])
    out = sg.add_tensor(ir.Tensor("out", tuple(out_shape), out_dtype))
    sg.operators.append(ir.Operator(opcode, idx, [out], options_type, options))
    sg.outputs = [out]
    path = tmp_path / f"{opcode.lower()}.circle"
    write_model(ir.Model([sg]), path, "circle")
    return path


def _tables(s, d):
    ang = rng.standard_normal((s, d // 2)).astype(np.float32)
    return np.concatenate([np.cos(ang)] * 2, -1), np.concatenate([np.sin(ang)] * 2, -1)


def _rope_ref(x, cos, sin):
    return REGISTRY["rope"].reference(torch.from_numpy(x), torch.from_numpy(cos), torch.from_numpy(sin)).numpy()


@pytest.mark.parametrize("s", [1, 3])
def test_rope_reads_only_the_first_row_of_its_tables(tmp_path, s):
    x = rng.standard_normal((1, 2, s, 8)).astype(np.float32)
    cos, sin = _tables(s, 8)
    t4 = (1, 1, s, 8)
    path = one_op(tmp_path, "ROPE", [(x.shape, "FLOAT32", None), (t4, "FLOAT32", None), (t4, "FLOAT32", None)],
                  x.shape, options_type="RoPEOptions", mode=0)
    (got,) = onert.run(path, [x, sin.reshape(t4), cos.reshape(t4)])
    first_row = _rope_ref(x, np.broadcast_to(cos[:1], cos.shape).copy(), np.broadcast_to(sin[:1], sin.shape).copy())
    np.testing.assert_allclose(got, first_row, atol=1e-6)  # inputs (x, sin, cos), HF's rotate_half
    exact = np.abs(got - _rope_ref(x, cos, sin)).max() < 1e-5
    assert exact == (s == 1)  # hence: target onert uses ROPE for decode steps (S == 1) only


def test_rope_tables_must_be_rank_4(tmp_path):
    x = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
    cos, sin = _tables(1, 8)
    path = one_op(tmp_path, "ROPE", [(x.shape, "FLOAT32", None), ((1, 8), "FLOAT32", None), ((1, 8), "FLOAT32", None)],
                  x.shape, options_type="RoPEOptions", mode=0)
    with pytest.raises(RuntimeRunError, match="ShapeValidator"):
        onert.run(path, [x, sin, cos])


@pytest.mark.parametrize("shape", [(2, 16), (1, 5, 16), (1, 3, 5, 16), (1, 1, 3, 5, 16)])
def test_rms_norm_runs_rank_3_and_4_only(tmp_path, shape):
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    gamma = (rng.random(16) + 0.5).astype(np.float32)
    path = one_op(tmp_path, "RMS_NORM", [(shape, "FLOAT32", None), ((16,), "FLOAT32", gamma)], shape,
                  options_type="RmsNormOptions", epsilon=0.5)
    if len(shape) not in (3, 4):
        with pytest.raises(RuntimeRunError, match="ShapeValidator"):
            onert.run(path, [x])
        return
    (got,) = onert.run(path, [x])
    want = REGISTRY["rms_norm"].reference(torch.from_numpy(x), torch.from_numpy(gamma), 0.5).numpy()
    np.testing.assert_allclose(got, want, atol=1e-6)  # epsilon honoured


@pytest.mark.parametrize("opcode,message", [
    ("MIRROR_PAD", "Unsupported operation: MIRROR_PAD"),
    ("RESIZE_NEAREST_NEIGHBOR", "NYI for operation 'ResizeNearestNeighbor'"),
    ("INSTANCE_NORM", "NYI for operation 'InstanceNorm'"),
])
def test_missing_builtins_fail_with_the_real_reason(tmp_path, opcode, message):
    """The runner reports onert's stderr text, not just NNFW_STATUS_ERROR; and these are the
    builtins target onert never writes (its profile's missing_builtins)."""
    from circleops.targets import ONERT

    x = np.zeros((1, 4, 4, 2), np.float32)
    i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
    inputs, options = {
        "MIRROR_PAD": ([((4, 2), "INT32", i32([0, 0], [1, 1], [1, 1], [0, 0]))], ("MirrorPadOptions", {"mode": 0})),
        "RESIZE_NEAREST_NEIGHBOR": ([((2,), "INT32", i32(8, 8))], ("ResizeNearestNeighborOptions", {})),
        "INSTANCE_NORM": ([((2,), "FLOAT32", np.ones(2, np.float32)), ((2,), "FLOAT32", np.zeros(2, np.float32))],
                          ("InstanceNormOptions", {"epsilon": 1e-5})),
    }[opcode]
    path = one_op(tmp_path, opcode, [(x.shape, "FLOAT32", None), *inputs], (1, 6, 6, 2) if opcode == "MIRROR_PAD" else
                  (1, 8, 8, 2) if opcode.startswith("RESIZE") else x.shape, options_type=options[0], **options[1])
    with pytest.raises(RuntimeRunError, match=message):
        onert.run(path, [x])
    assert opcode in ONERT.missing_builtins


def test_split_v_is_silently_wrong(tmp_path):
    """Why ONERT lists SPLIT_V as missing (passes.fuse_linears splits unequal parts with
    STRIDED_SLICE instead), while SPLIT of equal parts is right."""
    sg = ir.Subgraph("main")
    t = lambda name, shape, dtype="FLOAT32", data=None: sg.add_tensor(ir.Tensor(name, shape, dtype, data))  # noqa: E731
    x, a, b, c = t("x", (2, 12)), t("a", (2, 6)), t("b", (2, 3)), t("c", (2, 3))
    sg.operators = [ir.Operator("SPLIT_V", [x, t("sizes", (3,), "INT32", np.array([6, 3, 3], np.int32)),
                                            t("axis", (1,), "INT32", np.array([1], np.int32))],
                                [a, b, c], "SplitVOptions", {"numSplits": 3})]
    sg.inputs, sg.outputs = [x], [a, b, c]
    write_model(ir.Model([sg]), tmp_path / "split_v.circle", "circle")
    v = rng.standard_normal((2, 12)).astype(np.float32)
    got = onert.run(tmp_path / "split_v.circle", [v])
    want = np.split(v, [6, 9], axis=1)
    assert any(not np.array_equal(g, w) for g, w in zip(got, want))
    from circleops.targets import ONERT

    assert not ONERT.runs("SPLIT_V")
    sg.operators = [ir.Operator("SPLIT", [t("axis0", (1,), "INT32", np.array([1], np.int32)), x], [a, b, c],
                                "SplitOptions", {"numSplits": 3})]
    for o in (a, b, c):
        sg.tensors[o].shape = (2, 4)
    write_model(ir.Model([sg]), tmp_path / "split.circle", "circle")
    for g, w in zip(onert.run(tmp_path / "split.circle", [v]), np.split(v, 3, axis=1)):
        np.testing.assert_array_equal(g, w)


def test_integer_maximum_is_missing(tmp_path):
    a = np.array([-2, 5, 1], np.int64)
    path = one_op(tmp_path, "MAXIMUM", [((3,), "INT64", None), ((), "INT64", np.array(0, np.int64))], (3,), "INT64")
    with pytest.raises(RuntimeRunError, match="Max: unsupported data type"):
        onert.run(path, [a])


def test_an_output_that_a_transpose_reads_is_corrupted(tmp_path):
    """Why target onert copies such outputs (program._copy_consumed_outputs): once the
    TRANSPOSE has read output y, y's buffer is handed to the next op's result."""
    sg = ir.Subgraph("main")
    t = lambda name, shape, dtype="FLOAT32", data=None: sg.add_tensor(ir.Tensor(name, shape, dtype, data))  # noqa: E731
    x, y, z, w = t("x", (1, 6, 2, 4)), t("y", (1, 6, 2, 4)), t("z", (1, 2, 6, 4)), t("w", (1, 2, 6, 4))
    sg.operators = [
        ir.Operator("ADD", [x, t("one", (), data=np.array(1.0, np.float32))], [y], "AddOptions", {}),
        ir.Operator("TRANSPOSE", [y, t("perm", (4,), "INT32", np.array([0, 2, 1, 3], np.int32))], [z]),
        ir.Operator("MUL", [z, t("two", (), data=np.array(2.0, np.float32))], [w], "MulOptions", {}),
    ]
    sg.inputs, sg.outputs = [x], [w, y]
    path = tmp_path / "consumed.circle"
    write_model(ir.Model([sg]), path, "circle")
    v = rng.standard_normal((1, 6, 2, 4)).astype(np.float32)
    w_out, y_out = onert.run(path, [v])
    np.testing.assert_allclose(w_out, 2 * (v + 1).transpose(0, 2, 1, 3), rtol=1e-6)
    assert np.abs(y_out - (v + 1)).max() > 0.1


def test_runner_checks_inputs_and_paths(tmp_path):
    x = np.zeros((1, 5, 16), np.float32)
    path = one_op(tmp_path, "RMS_NORM", [(x.shape, "FLOAT32", None), ((16,), "FLOAT32", np.ones(16, np.float32))],
                  x.shape, options_type="RmsNormOptions", epsilon=1e-6)
    with pytest.raises(RuntimeRunError, match="takes 1 input"):
        onert.run(path, [x, x])
    with pytest.raises(RuntimeRunError, match=r"has shape \[1, 4, 16\], the file expects \[1, 5, 16\]"):
        onert.run(path, [np.zeros((1, 4, 16), np.float32)])
    with pytest.raises(RuntimeRunError, match="no such file"):
        onert.run(tmp_path / "missing.circle", [x])
    other = tmp_path / "model.bin"  # onert picks its loader by extension; the runner copes
    other.write_bytes(path.read_bytes())
    (got,) = onert.run(other, [np.ones((1, 5, 16), np.float32)])
    np.testing.assert_allclose(got, np.ones((1, 5, 16)), atol=1e-6)


@pytest.mark.parametrize("rank", [5, 6])
def test_strided_slice_runs_up_to_rank_5(tmp_path, rank):
    """onert 0.1.0's STRIDED_SLICE fails at prepare on a rank-6 input (Hiera's q/k/v unbind):
    the onert profile's builtin_ranks says so, and LoweringContext.slice merges dims for it."""
    from circleops.targets import ONERT

    shape = (3, 1, 2, 4, 8, 2) if rank == 6 else (3, 2, 4, 8, 2)
    x = rng.standard_normal(shape).astype(np.float32)
    i32 = lambda v: np.array(v, np.int32)  # noqa: E731
    out_shape = (1,) + shape[1:]
    path = one_op(tmp_path, "STRIDED_SLICE", [(shape, "FLOAT32", None), ((rank,), "INT32", i32([1] + [0] * (rank - 1))),
                                              ((rank,), "INT32", i32([2] + list(shape[1:]))),
                                              ((rank,), "INT32", i32([1] * rank))],
                  out_shape, options_type="StridedSliceOptions")
    assert ONERT.runs("STRIDED_SLICE", None, rank) is (rank <= 5)
    if rank > 5:
        with pytest.raises(RuntimeRunError, match="ShapeValidator"):
            onert.run(path, [x])
        return
    (got,) = onert.run(path, [x])
    np.testing.assert_array_equal(got, x[1:2])


def test_rank_6_slice_converts_for_onert(tmp_path):
    """A slice of a rank-6 tensor (as Hiera's unbind of q, k, v) runs on onert: sliced as
    [before, dim, after] between reshapes."""
    from circleops import convert

    class Unbind(torch.nn.Module):
        def forward(self, x):
            q, k, v = (x * 2).unbind(0)
            return q + k * v

    report = convert(Unbind(), (torch.randn(3, 1, 2, 4, 8, 2),), tmp_path / "u.circle", target="onert", verify=True)
    assert report.verify.passed and report.verify.max_abs_error < 1e-6
    assert report.ops["STRIDED_SLICE"] == 3

"""Plugins: packages with an entry point in group ``circleops.ops``, found by
importlib.metadata, loaded on the first registry lookup that misses (and by `circleops
ops`); a broken one is a warning naming it, never a failure of anything else.

Each test runs a fresh Python whose path holds two installed distributions (dist-info
directories with entry_points.txt, as pip writes them): a working plugin and a broken one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest


def _dist(site, name, entry_name, module, source):
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[circleops.ops]\n{entry_name} = {module}\n")
    (site / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.fixture()
def site(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    _dist(site, "acme-ops", "acme", "acme_ops", """
        import torch, circleops

        @circleops.op("acme::twice(Tensor x, int k=2) -> Tensor")
        def twice(x, k=2):
            return x * k
    """)
    _dist(site, "broken-ops", "broken", "broken_ops", """
        raise ImportError("this plugin needs libnpu.so, which is not installed")
    """)
    return site


def _python(site, code, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)


def test_ops_lists_a_plugin_and_survives_a_broken_one(site):
    run = _python(site, "import sys; from circleops.cli import main; sys.exit(main(sys.argv[1:]))",
                  "ops", "--format", "json")
    assert run.returncode == 0, run.stderr
    rows = {r["op"]: r for r in json.loads(run.stdout)}
    assert rows["acme::twice"]["provider"] == "acme-ops"
    assert rows["acme::twice"]["circle options"] == "flexbuffer {k}"
    assert "circle::rms_norm" in rows
    assert "circleops plugin 'broken' (package broken-ops" in run.stderr
    assert "libnpu.so" in run.stderr and "skipped" in run.stderr


def test_plugins_load_on_the_first_lookup_that_misses(site):
    code = """
        import sys, warnings
        import torch
        import circleops.ops as ops
        assert "acme_ops" not in sys.modules            # importing circleops loads no plugin
        assert ops.lookup("rms_norm") is not None       # a hit loads nothing either
        assert "acme_ops" not in sys.modules
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            spec = ops.lookup("acme::twice")            # the miss loads the plugins
        assert spec is not None and spec.provider == "acme-ops" and "acme_ops" in sys.modules
        assert torch.equal(torch.ops.acme.twice(torch.ones(2), 3), torch.full((2,), 3.0))
        assert [str(w.message).split(" (")[0] for w in seen] == ["circleops plugin 'broken'"]
        assert ops.PLUGINS["acme"] == ("acme-ops", None)
        assert ops.PLUGINS["broken"] == ("broken-ops", "ImportError: this plugin needs libnpu.so, which is not installed")
    """
    run = _python(site, textwrap.dedent(code))
    assert run.returncode == 0, run.stderr


def test_an_unknown_custom_code_names_the_plugin_that_failed(site):
    code = """
        import circleops.ops as ops
        err = ops.unknown_custom_code("broken::fused_moe") if ops.by_custom_code("broken::fused_moe") is None else None
        print(err)
    """
    run = _python(site, textwrap.dedent(code))
    assert run.returncode == 0, run.stderr
    assert "custom_code 'broken::fused_moe': no registered op provides it" in run.stdout
    assert "The package broken-ops provides it, but its plugin failed to load: ImportError" in run.stdout


def test_a_pt2_calling_a_plugins_op_converts_in_a_fresh_process(site, tmp_path):
    """``circleops convert MODEL.pt2`` loads the plugins before torch.export.load (issue 31):
    the program below calls torch.ops.acme.twice, defined only once the plugin is imported.
    An op no package defines is named, with its namespace, not "check the warnings above"."""
    save = f"""
        import torch, acme_ops

        class M(torch.nn.Module):
            def forward(self, x):
                return torch.ops.acme.twice(x, 3) + 1

        torch.export.save(torch.export.export(M(), (torch.randn(2, 4),)), {str(tmp_path / 'acme.pt2')!r})
    """
    assert _python(site, textwrap.dedent(save)).returncode == 0
    import zipfile

    with zipfile.ZipFile(tmp_path / "acme.pt2") as zin, zipfile.ZipFile(tmp_path / "vendor.pt2", "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("models/model.json"):
                data = data.replace(b"torch.ops.acme.twice", b"torch.ops.nosuchvendor.twice")
            zout.writestr(info, data)
    # one fresh process: the first conversion is what a user's `circleops convert acme.pt2` does
    both = """
        import sys
        from circleops.cli import main
        assert "acme_ops" not in sys.modules
        print("rc", main(["convert", sys.argv[1], "-o", sys.argv[2]]), main(["convert", sys.argv[3], "-o", sys.argv[4]]))
    """
    run = _python(site, textwrap.dedent(both), str(tmp_path / "acme.pt2"), str(tmp_path / "a.circle"),
                  str(tmp_path / "vendor.pt2"), str(tmp_path / "v.circle"))
    assert "rc 0 2" in run.stdout, run.stderr
    assert "CUSTOM 1" in run.stdout
    assert "calls nosuchvendor::twice, which no installed package defines" in run.stderr
    assert "'nosuchvendor' op namespace" in run.stderr and "warnings above" not in run.stderr
    assert "Plugins that failed to load: broken-ops (ImportError" in run.stderr
    assert not (tmp_path / "v.circle").exists()


def test_two_plugins_claiming_one_custom_code(tmp_path):
    """The rule (issue 31): the clashing op of the plugin loaded second is disabled with a
    warning naming both packages, every other op of both plugins stays, and reading or
    running a file whose CUSTOM op has the contested code is an error naming both packages
    (never one vendor's kernel for the other's file, exit 0)."""
    site = tmp_path / "site"
    site.mkdir()
    for ns in ("va", "vb"):
        _dist(site, f"vendor-{ns}", ns, f"vendor_{ns}", f"""
            import torch, circleops

            @circleops.op("{ns}::swish(Tensor x) -> Tensor", custom_code="SWISH")
            def swish(x):
                return x * torch.sigmoid(x) * (2.0 if "{ns}" == "vb" else 1.0)

            @circleops.op("{ns}::double(Tensor x) -> Tensor")
            def double(x):
                return x * 2
        """)
    code = """
        import json, sys, warnings
        import torch, circleops
        import circleops.ops as ops
        from circleops.cli import main

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ops.load_plugins()
        mine = sorted(k for k in ops.REGISTRY if k.startswith(("va::", "vb::")))
        winner = "va" if "va::swish" in ops.REGISTRY else "vb"

        class M(torch.nn.Module):
            def forward(self, x):
                return getattr(torch.ops, winner).swish(x)

        circleops.convert(M(), (torch.randn(2, 4),), sys.argv[1], target="circle")
        import numpy as np
        np.save(sys.argv[2], np.ones((2, 4), np.float32))
        try:
            ops.by_custom_code("SWISH")
            lookup = "no error"
        except ops.UnknownCustomOpError as err:
            lookup = str(err)
        print(json.dumps({"ops": mine, "warnings": [str(w.message) for w in seen], "contested": ops.CONTESTED,
                          "lookup": lookup, "rc": main(["run", sys.argv[1], "--input", sys.argv[2], "--runtime", "reference"])}))
    """
    run = _python(site, textwrap.dedent(code), str(tmp_path / "swish.circle"), str(tmp_path / "x.npy"))
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(got["ops"]) == 3 and {"va::double", "vb::double"} <= set(got["ops"]), got["ops"]
    assert sorted(got["contested"]["SWISH"]) == ["vendor-va", "vendor-vb"]
    clash = [w for w in got["warnings"] if "both claim custom_code 'SWISH'" in w]
    assert len(clash) == 1 and "vendor-va" in clash[0] and "vendor-vb" in clash[0] and "is disabled" in clash[0]
    for text in (got["lookup"], run.stderr):
        assert "custom_code 'SWISH'" in text and "vendor-va" in text and "vendor-vb" in text
    assert got["rc"] == 2

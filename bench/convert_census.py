"""Issue 32: what a `circleops convert` holds, by object, at each stage. The convert runs in
this process; at each progress line, around each graph's PT2E (prepare_pt2e, convert_pt2e,
torch.export) and lowering, the live tensors and numpy arrays of at least 1 MiB are counted
once per storage and the largest printed, beside the resident set (VmRSS), its peak since
the last census (VmHWM: /proc/self/clear_refs resets it, Linux) and a 0.2 s RSS sampler.

    python bench/convert_census.py --make /tmp/l2 --layers 2     # the Llama-3.2-1B shape, 2 layers
    python bench/convert_census.py convert /tmp/l2 --graphs prefill,decode --target circle \\
        --quantize int16 --weight-bits 4 --seq-len 8 --max-cache-len 64 --calibrate 2 -o /tmp/out

The 2-layer model keeps the 1B shape's 128256 x 2048 embedding and (rotated, untied) lm_head,
the tables PT2E quantizes per graph: bench/results/61-npu-1b-memory.yaml.

Where the anonymous memory lies (``CENSUS_SMAPS=1``): at each census, /proc/self/smaps's
Anonymous bytes by kind of mapping (the weights' file mappings, glibc's main heap, anonymous
mappings holding tensors, anonymous mappings holding none: thread arenas, allocator pools),
beside the bytes of the live tensor storages (of any size) that lie in each; what no tensor
accounts for is printed by mapping. ``CENSUS_STOP=TAG`` ends the run at the first census
whose tag starts with TAG (e.g. "before calibrate": the rotation's stage and export only).
"""
from __future__ import annotations

import collections
import gc
import os
import runpy
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

T0 = time.time()
PEAK = [0.0, ""]
WHERE = ["start"]


def status() -> dict[str, float]:
    """VmRSS, RssAnon, VmHWM of this process in GB."""
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "VmHWM"):
            out[key] = int(value.split()[0]) / 1e6
    return out


def reset_peak() -> None:
    """VmHWM back to the current RSS (and the sampler's peak)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    PEAK[0] = 0.0


def sampler() -> None:
    while True:
        rss = status()["VmRSS"]
        if rss > PEAK[0]:
            PEAK[0], PEAK[1] = rss, WHERE[0]
        time.sleep(0.2)


def census(tag: str, top: int = 8) -> None:
    """Print the live storages of at least 1 MiB (tensors, and arrays referenced by objects)."""
    import numpy as np
    import torch

    gc.collect()
    WHERE[0] = tag
    storages: dict[int, tuple[int, str]] = {}

    def tensor(t: Any, how: str) -> None:
        try:
            if t.device.type != "cpu" or t.is_meta:
                return
            s = t.untyped_storage()
            ptr, size = s.data_ptr(), s.nbytes()
        except Exception:  # noqa: BLE001 - fake or functional wrappers: no storage of their own
            return
        if size >= 1 << 20 and ptr and ptr not in storages:
            storages[ptr] = (size, f"torch {tuple(t.shape)} {t.dtype} ({how})")

    def array(a: Any, how: str) -> None:
        while isinstance(a.base, np.ndarray):
            a = a.base
        ptr = a.__array_interface__["data"][0]
        if a.nbytes >= 1 << 20 and ptr not in storages:
            storages[ptr] = (a.nbytes, f"numpy {a.shape} {a.dtype} (in {how})")

    seen: set[int] = set()
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            tensor(o, type(o).__name__)
            continue
        for r in gc.get_referents(o):  # numpy arrays are not tracked by gc: found through their holders
            if isinstance(r, np.ndarray) and id(r) not in seen:
                seen.add(id(r))
                array(r, type(o).__name__)
    if os.environ.get("CENSUS_SMAPS"):
        smaps_census()
    s = status()
    total = sum(n for n, _ in storages.values())
    print(f"\n=== [{time.time() - T0:7.1f} s] {tag}: RSS {s['VmRSS']:.2f} GB (anonymous {s['RssAnon']:.2f}), "
          f"peak since the last census {s['VmHWM']:.2f} (sampled {PEAK[0]:.2f} during {PEAK[1]!r}); "
          f"live storages >= 1 MiB: {total:.2e} B in {len(storages)}", flush=True)
    for n, what in sorted(storages.values(), reverse=True)[:top]:
        print(f"    {n / 1e9:7.3f} GB  {what}", flush=True)
    stop = os.environ.get("CENSUS_STOP")
    if stop and tag.startswith(stop):
        print(f"=== stopped at {tag!r} (CENSUS_STOP)", flush=True)
        os._exit(0)


def _mappings() -> list[dict]:
    """/proc/self/smaps: each mapping's start, end, path and Anonymous / Rss bytes."""
    maps: list[dict] = []
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                maps.append({"lo": lo, "hi": hi, "path": head[5].strip() if len(head) == 6 else "",
                             "anon": 0, "rss": 0, "tensors": 0})
            elif line.startswith("Anonymous:"):
                maps[-1]["anon"] = int(line.split()[1]) * 1024
            elif line.startswith("Rss:"):
                maps[-1]["rss"] = int(line.split()[1]) * 1024
    return maps


def smaps_census(top: int = 8) -> None:
    """Anonymous bytes by kind of mapping against the live storages (any size) inside them."""
    import bisect

    import numpy as np
    import torch

    maps = _mappings()
    starts = [m["lo"] for m in maps]
    seen: set[int] = set()

    def place(ptr: int, size: int) -> None:
        if not ptr or ptr in seen:
            return
        seen.add(ptr)
        i = bisect.bisect_right(starts, ptr) - 1
        while size > 0 and 0 <= i < len(maps) and maps[i]["lo"] <= ptr < maps[i]["hi"]:
            part = min(size, maps[i]["hi"] - ptr)
            maps[i]["tensors"] += part
            ptr, size, i = ptr + part, size - part, i + 1

    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            try:
                if o.device.type == "cpu" and not o.is_meta:
                    st = o.untyped_storage()
                    place(st.data_ptr(), st.nbytes())
            except Exception:  # noqa: BLE001 - fake or functional wrappers
                pass
        else:
            for r in gc.get_referents(o):
                if isinstance(r, np.ndarray):
                    a = r
                    while isinstance(a.base, np.ndarray):
                        a = a.base
                    place(a.__array_interface__["data"][0], a.nbytes)

    def kind(m: dict) -> str:
        if m["path"].endswith(".safetensors"):
            return "weights file (written pages)"
        if m["path"] == "[heap]":
            return "glibc main heap"
        if m["path"] == "":
            return "anonymous, tensors" if m["tensors"] else "anonymous, no tensor"
        return "libraries / other"

    kinds: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for m in maps:
        kinds[kind(m)][0] += m["anon"]
        kinds[kind(m)][1] += m["tensors"] if kind(m) != "weights file (written pages)" else 0
    print("    smaps Anonymous by mapping kind (GB): " + "; ".join(
        f"{k} {a / 1e9:.3f} (tensors {t / 1e9:.3f})" for k, (a, t) in sorted(kinds.items())), flush=True)
    loose = sorted(((m["anon"] - min(m["anon"], m["tensors"]), m) for m in maps if m["path"] in ("", "[heap]")),
                   key=lambda x: -x[0])[:top]
    for extra, m in loose:
        print(f"    {extra / 1e9:7.3f} GB anonymous beyond tensors in {m['path'] or 'anon'} {m['lo']:#x} "
              f"size {(m['hi'] - m['lo']) / 1e6:.1f} MB (anonymous {m['anon'] / 1e6:.1f} MB, tensors "
              f"{m['tensors'] / 1e6:.1f} MB)", flush=True)


def around(owner: Any, name: str, label: str) -> None:
    """Census before and after ``owner.name(...)``, the peak counter reset at each."""
    fn: Callable = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        census(f"before {label}")
        reset_peak()
        out = fn(*args, **kwargs)
        census(f"after {label} (its peak)")
        reset_peak()
        return out

    setattr(owner, name, wrapped)


def install() -> None:
    """The census points: each progress line, PT2E's steps, each graph's lowering and the write."""
    import torch
    import torchao.quantization.pt2e.quantize_pt2e as quantize_pt2e

    from circleops.package import step
    from circleops.pipeline import stages

    say = stages.Tracker.say

    def announced(self: Any, name: str) -> None:
        census(f"before {name}")
        reset_peak()
        say(self, name)

    stages.Tracker.say = announced
    around(quantize_pt2e, "prepare_pt2e", "prepare_pt2e")
    around(quantize_pt2e, "convert_pt2e", "convert_pt2e")
    around(torch.export, "export", "torch.export")
    around(step, "lower_graph", "a graph's lowering")
    around(step, "write_files", "write_files")


def main() -> int:
    if sys.argv[1:2] == ["--make"]:
        sys.path.insert(0, str(Path(__file__).parent))
        import convert_scale

        layers = int(sys.argv[sys.argv.index("--layers") + 1]) if "--layers" in sys.argv else 2
        sizes = dict(convert_scale.SHAPES["Llama-3.2-1B shape"], num_hidden_layers=layers)
        convert_scale.make_model(Path(sys.argv[2]), sizes)
        return 0
    threading.Thread(target=sampler, daemon=True).start()
    install()
    sys.argv = ["circleops", *sys.argv[1:]]
    try:
        runpy.run_module("circleops.cli", run_name="__main__")
    except SystemExit as exit_:
        census("end")
        return int(exit_.code or 0)
    census("end")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a generate holds in memory, and how often it loads each file (issue 32).

    PYTHONPATH=. /tmp/circleops-onert-dev/bin/python bench/generate_memory.py DIR --ids 1,504,3458 --new 16
    PYTHONPATH=. python bench/generate_memory.py DIR --ids ... --hold 30 &   # a second generate beside it:
    PYTHONPATH=. python bench/generate_memory.py DIR --ids ...               # its Pss shares the mapped files

Opens a Generator on DIR (runtime onert), prefills the ids and decodes ``--new`` tokens, and
prints one JSON line per stage (opened, generated, and after ``--hold`` seconds): the peak
RSS (VmHWM), what the process holds now split into heap (RssAnon) and file pages (RssFile),
its proportional share (Pss: a page mapped by two processes counts half in each), and how
many times onert's C API loaded each file (circleops.runtime.onert_c; a file per graph on
onert 0.1.0 goes through its Python API and is not counted). ``/usr/bin/time -v circleops
generate`` gives the whole command's peak RSS and CPU beside it.
"""
from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path


def memory_gb() -> dict[str, float]:
    """VmHWM, VmRSS, RssAnon, RssFile (/proc/self/status) and Pss, Pss_Anon, Pss_File
    (/proc/self/smaps_rollup) of this process, GB."""
    out: dict[str, float] = {}
    for source, keys in (("status", ("VmHWM", "VmRSS", "RssAnon", "RssFile")),
                         ("smaps_rollup", ("Pss", "Pss_Anon", "Pss_File"))):
        for line in Path(f"/proc/self/{source}").read_text().splitlines():
            key = line.split(":")[0]
            if key in keys:
                out[key] = round(int(line.split()[1]) * 1024 / 1e9, 3)  # kB (KiB) -> GB
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory")
    ap.add_argument("--ids", required=True, help="prompt token ids, comma-separated")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--hold", type=float, default=0.0, help="seconds to stay alive after generating")
    args = ap.parse_args()
    from circleops.runtime import onert_c

    loads: collections.Counter = collections.Counter()
    load = onert_c._Native.__init__

    def counted(self, path, *rest, **kw):  # noqa: ANN001 - a spy on the one place a file is loaded
        loads[str(path)] += 1
        load(self, path, *rest, **kw)

    onert_c._Native.__init__ = counted
    from circleops.generation.generator import Generator

    gen = Generator(args.directory, runtime="onert")
    print(json.dumps({"stage": "opened", **memory_gb(), "loads": dict(loads)}), flush=True)
    result = gen.generate([int(t) for t in args.ids.split(",")], args.new)
    print(json.dumps({"stage": "generated", **memory_gb(), "loads": dict(loads), "tokens": result.tokens}),
          flush=True)
    if args.hold:
        time.sleep(args.hold)
        print(json.dumps({"stage": "held", **memory_gb()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A fork server for the docs' ``circleops`` commands: one process imports torch, transformers
and circleops once, and each command runs in a child forked from it.

The docs' shell commands (tests/docs/test_readme.py) are ~40 separate ``circleops`` processes,
and each spent ~4 s of CPU importing torch, torch._dynamo and transformers before doing
0.5-5 s of work: about half the docs tests' CPU. Here the ``circleops`` on the commands' PATH
is a small script (stdlib only, no torch) that hands its argv, working directory, environment
and its stdin/stdout/stderr descriptors to the server over a Unix socket and exits with the
status the forked child exits with (a child killed by a signal: the script kills itself with
the same signal, so the shell sees what it would). The child runs ``circleops.cli.main`` as
``python -m circleops.cli`` does.

What a child cannot show, and where that is tested in a fresh process instead: output a
dependency prints while it is imported (tests/cli/test_cli_quiet.py), which modules a command
imports (tests/cli/test_light_imports.py), and anything fixed at interpreter start such as the
hash seed (tests/security/test_outputs.py).

Usage (tests): ``with ForkServer(env, log) as server: env = server.client_env(bin_dir, env)``.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent

# What a command imports lazily; imported once here, inherited by every child.
WARM = ("torch", "torch._dynamo", "torch.export", "numpy", "transformers", "transformers.models.auto.modeling_auto",
        "circleops", "circleops.cli", "circleops.cli.convert", "circleops.cli.generate", "circleops.cli.check",
        "circleops.cli.inspect", "circleops.cli.chat", "circleops.cli.run", "circleops.recipes.llm",
        "circleops.pipeline.stages", "circleops.adapters")
# What a command on a model directory imports besides (ForkServer(..., warm=WARM + MODEL_WARM)):
# transformers' Llama (the docs' MODEL, tests/families.py, is one) and the conversion's own
# modules. Measured on the AVX2 EPYC: a `convert MODEL ... --verify` child spent 3.0-4.1 s of
# CPU, 2.0-2.5 s of it importing these; with them here, 0.8-1.7 s. `generate` of a converted
# directory imports none of them (the SmolLM2 server does without).
MODEL_WARM = ("transformers.models.llama.modeling_llama", "circleops.sources.models", "circleops.pipeline.convert",
              "circleops.lowering.program", "circleops.passes.fusion", "circleops.serialize.writer",
              "circleops.serialize.reader", "circleops.tools.precision", "circleops.tools.quant_report",
              "circleops.quantize.recipe", "circleops.quantize.integer.lower", "torch.export._trace",
              "torch._functorch.aot_autograd", "torch._functorch.partitioners")

CLIENT = '''#!{python} -S
# circleops, run by the fork server at {sock} (tests/zygote.py)
import json, os, signal, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect({sock!r})
req = json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
socket.send_fds(s, [req], [0, 1, 2])
reply = s.recv(64)
code = int(reply or b"1")
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
'''


def _child(conn: socket.socket, server: socket.socket, req: dict, fds: list[int]) -> None:
    """In the forked child: become the command's process, run it, exit with its status."""
    server.close()
    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    code = 1
    try:
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = ["circleops", *req["argv"]]
        from circleops.cli import main

        code = main(req["argv"])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the interpreter would print, then exit 1
        traceback.print_exc()
    finally:
        # what the console script's exit runs (circleops.cli.process.exit_without_teardown):
        # the command's own cleanups, e.g. the XNNPACK scratch directory of its LiteRT children
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe: nothing left to flush to
                pass
        os._exit(int(code or 0) & 0xFF)


def serve(path: str, warm: list[str]) -> None:
    """Import ``warm``, listen at ``path``, run one command at a time (a docs page's commands run
    in order; a second client waits in the backlog)."""
    import importlib

    for name in warm:
        importlib.import_module(name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if os.path.exists(path):
        os.unlink(path)  # left by a server that was killed
    server.bind(path)
    server.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            if len(fds) != 3:
                conn.sendall(b"1")
                continue
            pid = os.fork()
            if pid == 0:
                _child(conn, server, json.loads(msg), fds)
            for fd in fds:
                os.close(fd)
            _, status = os.waitpid(pid, 0)
            conn.sendall(str(os.waitstatus_to_exitcode(status)).encode())


class ForkServer:
    """The server process for one test module; ``client_env`` puts its ``circleops`` on PATH."""

    def __init__(self, env: dict, workdir: Path, warm: tuple[str, ...] = WARM):
        self.sock = str(workdir / "circleops.sock")
        self.log = open(workdir / "fork-server.log", "w")  # what imports print goes here
        argv = [sys.executable, str(Path(__file__).resolve()), self.sock, json.dumps(list(warm))]
        self.proc = subprocess.Popen(argv, env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.close()
            raise RuntimeError(f"the fork server did not start: {(workdir / 'fork-server.log').read_text()[-2000:]}")

    def client_env(self, bin_dir: Path, env: dict) -> dict:
        """``env`` with a ``circleops`` first on PATH that runs commands in the server."""
        bin_dir.mkdir(parents=True, exist_ok=True)
        client = bin_dir / "circleops"
        client.write_text(CLIENT.format(python=sys.executable, sock=self.sock))
        client.chmod(0o755)
        return {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()

    def __enter__(self) -> "ForkServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    serve(sys.argv[1], json.loads(sys.argv[2]))

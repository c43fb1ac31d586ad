"""A budget for the chat templates of a model directory: what one render may compute.

A chat template is a Jinja program shipped with the tokenizer, so with a model from
someone else. transformers renders it in Jinja's immutable sandbox (no attribute escapes,
``range`` capped at 100,000 items), which bounds neither time (nested loops) nor memory
(``'x' * 10**10``). circleops renders every template inside :func:`template_budget`:

- the output and every string/list a ``*`` or ``**`` makes are at most MAX_TEMPLATE_CHARS
  (16 Mi) characters or items (checked before the operation runs);
- the render's address space may grow by at most MAX_TEMPLATE_MEMORY (1 GiB) (an
  ``RLIMIT_AS`` set for the render's duration, Linux), so other ways to build huge values
  (``~`` doubling, filters) end in a MemoryError too;
- the render stops after TEMPLATE_SECONDS (10 s of wall time; a SIGALRM timer, so only
  when the render runs in the main thread);

and whatever the template raises (a SecurityError of the sandbox, a syntax error, an
undefined name, ``raise_exception``, the budget) is a :class:`ChatTemplateError` naming the
tokenizer. A real template renders a conversation in about a millisecond.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Iterator

from circleops.errors import ModelLoadError

MAX_TEMPLATE_CHARS = 1 << 24
MAX_TEMPLATE_MEMORY = 1 << 30
TEMPLATE_SECONDS = 10.0


class ChatTemplateError(ModelLoadError):
    """The chat template of a model's tokenizer or processor failed, or exceeded its budget."""


class _OverBudget(Exception):
    """Raised inside a render that asked for more than the budget."""


def _check_size(n: int, what: str) -> None:
    """``what`` (with ``{}`` for the count) of ``n`` characters/items/digits: over the budget?"""
    if n > MAX_TEMPLATE_CHARS:
        raise _OverBudget(f"it builds {what.format(n)}, over the budget of {MAX_TEMPLATE_CHARS}")


def _bounded_concat(parts: Iterator[str]) -> str:
    out, total = [], 0
    for part in parts:
        total += len(part)
        _check_size(total, "an output of {} characters")
        out.append(part)
    return "".join(out)


_ENV_CLASS: Any = None


def _environment_class() -> Any:
    """ImmutableSandboxedEnvironment with its ``*``/``**`` and output sizes checked."""
    global _ENV_CLASS
    if _ENV_CLASS is None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class BoundedSandbox(ImmutableSandboxedEnvironment):
            intercepted_binops = frozenset({"*", "**"})
            concat = staticmethod(_bounded_concat)

            def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
                if operator == "*":
                    for seq, n in ((left, right), (right, left)):
                        if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                            _check_size(len(seq) * max(n, 0), "a repeated string or list of {} items")
                elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                    _check_size(abs(right) * abs(left).bit_length() // 4, "a number of about {} digits")
                return super().call_binop(context, operator, left, right)

        _ENV_CLASS = BoundedSandbox
    return _ENV_CLASS


def install() -> None:
    """Make transformers compile chat templates in the bounded sandbox (once per process):
    its compiler looks the environment class up in its module at each compilation."""
    from transformers.utils import chat_template_utils as ctu

    cls = _environment_class()
    if getattr(ctu, "ImmutableSandboxedEnvironment", None) is not cls:
        ctu.ImmutableSandboxedEnvironment = cls
        ctu._compile_jinja_template.cache_clear()  # templates compiled before: unbounded


def _alarm(signum: int, frame: Any) -> None:
    raise _OverBudget(f"it ran for more than {TEMPLATE_SECONDS:g} s")


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    previous = signal.signal(signal.SIGALRM, _alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        left, _ = signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if old_delay:  # someone else's timer (a test harness's): put it back with what remains of it
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (seconds - left), 1e-3), old_interval)


@contextlib.contextmanager
def _memory_limit(extra: int) -> Iterator[None]:
    try:
        import resource

        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        yield
        return
    limit = used + extra
    if soft != resource.RLIM_INFINITY and soft <= limit:
        yield
        return
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.contextmanager
def template_budget(owner: Any) -> Iterator[None]:
    """Run a chat-template render (``apply_chat_template`` of ``owner``, a tokenizer or a
    processor) within the budget; its failures become a ChatTemplateError naming ``owner``."""
    install()
    where = getattr(owner, "name_or_path", None) or type(owner).__name__
    fix = "Fix or remove the chat template (chat_template.jinja / tokenizer_config.json), or drop --chat."
    try:
        with _time_limit(TEMPLATE_SECONDS), _memory_limit(MAX_TEMPLATE_MEMORY):
            yield
    except _OverBudget as err:
        raise ChatTemplateError(f"the chat template of {where} exceeds circleops' budget: {err}. {fix}") from None
    except MemoryError:
        raise ChatTemplateError(f"the chat template of {where} needs more than {MAX_TEMPLATE_MEMORY >> 20} MiB more "
                                f"memory (circleops' budget for a template). {fix}") from None
    except ModelLoadError:
        raise
    except Exception as err:  # noqa: BLE001 - anything a template program raises: it is the template's fault
        from jinja2 import TemplateError

        kind = "fails" if isinstance(err, TemplateError) else f"fails ({type(err).__name__})"
        line = getattr(err, "lineno", None)
        at = f" at line {line}" if line else ""
        raise ChatTemplateError(f"the chat template of {where} {kind}{at}: {' '.join(str(err).split())[:200]}. "
                                f"{fix}") from None

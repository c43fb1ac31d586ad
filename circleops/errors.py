"""Errors users see. The CLI prints ``str(err)`` of these as one paragraph, no traceback.

Every message says what is wrong (node, op, shape/dtype, path) and what the user can do.
"""
from __future__ import annotations


class CircleOpsError(Exception):
    """Base of every error circleops reports to a user."""


class ModelLoadError(CircleOpsError):
    """The model could not be found, read or built."""


class CorruptFileError(ModelLoadError):
    """A Circle/TFLite file fails circleops' integrity check (offsets, vtables,
    vectors, indices or buffer sizes out of place): a native runtime would read outside it."""


class ExportError(CircleOpsError):
    """torch.export failed on the model."""


class UnsupportedOpError(CircleOpsError):
    """The graph holds an op that the chosen target cannot write."""


class TargetError(CircleOpsError):
    """The request does not fit the target (dtype, file size, runtime limits)."""


class OutputError(CircleOpsError):
    """The output path cannot be written."""


class RuntimeRunError(CircleOpsError):
    """A runtime (onert, LiteRT, the reference interpreter) failed to run a file."""


class RuntimeCrashError(RuntimeRunError):
    """A native runtime died of a signal (SIGSEGV, SIGBUS...) on a file that passed
    circleops' integrity check; reported by the one-shot commands, which run it in a child."""


class HostCPUError(RuntimeRunError):
    """The runtime cannot run this file on this machine's CPU (onert's GGML kernels need
    AVX-512): the file is fine elsewhere, and another runtime may run it here."""


class VerifyError(CircleOpsError):
    """The written file ran but does not match torch."""


class InternalError(CircleOpsError):
    """circleops itself failed on a valid request (a bug): the message names the node, its
    op and the user's source line where it can, and asks for a report. The original
    exception is kept as ``__cause__``."""


REPORT_BUG = ("This is a bug in circleops, not in your model: please report it "
              "(the model or a snippet that builds it, and this message).")

"""An engine process dies with the server that started it, however the server ended.

The engine ignores SIGINT, SIGTERM and SIGHUP (a process-group signal must not end it while
the server drains), so a server killed outright would leave it running: a forward pass,
or loading a model, can take long before the engine's loop next looks at its parent. On
Linux the kernel sends the signal instead (`PR_SET_PDEATHSIG`), whatever the engine is
doing, stopped or not.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Be killed when the parent goes; exit now if it is already gone.

    SIGKILL, not a signal with a handler: nobody reads the engine's outputs any more, and
    nothing it holds needs an exit hook (shared-memory KV lives in memfds, which the
    kernel frees with their last holder). The kernel sends it when the thread that
    started this process ends; the server starts its engines from the event loop's
    thread, which lives as long as the server. Elsewhere than Linux the engine loop's own
    look at its parent is all there is.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return  # not started by multiprocessing: a process of its own, nobody's engine
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # A parent that died before the call above is never signalled for: look once. The
    # sentinel (a pipe only the parent holds open) says so even once this process has a
    # new parent, where a changed getppid() would need the old pid, read too late.
    if not parent.is_alive():
        sys.exit(0)

"""How Cadence's numba kernels are compiled, threaded and kept safe across a fork.

A ``NumbaKernel`` is built by a function of ``(parallel, cache)`` that returns the
compiled function (having run it once, so that compiling happens at build time and a
failure shows there). It is built on first use (once, under a lock), and:

* cached on disk beside its module (or in numba's cache folder where that is
  read-only), and compiled without a cache where neither is writable. The kernels refer
  to their intrinsics as module globals, not closure cells: numba hashes a closure's
  cells into the cache key, and an intrinsic's hash is new in every process;
* unavailable, with the reason logged once, where numba is missing, fails to build it or
  is told not to compile (``NUMBA_DISABLE_JIT``, which would run it interpreted);
* run on numba's OpenMP threading layer (its workqueue layer is unsafe for two engines'
  threads at once and spins against torch's pool), as many threads as torch uses; starting
  those threads resets the OpenMP thread count torch may share, so torch's is put back;
* serial in a process forked from one that had started numba's threads: GNU OpenMP's
  threads do not survive a fork, and numba ends such a child that enters a parallel
  region, whichever kernel it is. The serial form is compiled afresh (not from the
  cache, whose key does not tell the two forms apart). Whether it gives the parallel
  form's bits depends on the kernel; each kernel's tests check it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

Builder = Callable[[bool, bool], Callable[..., Any]]  # (parallel, cache) -> the compiled kernel


class NumbaKernel:
    """One numba kernel, built on first use in the form this process can run."""

    def __init__(self, name: str, build: Builder) -> None:
        self.name = name
        self._build = build
        self._parallel: Callable[..., Any] | None = None
        self._serial: Callable[..., Any] | None = None
        self._lock = threading.Lock()
        self.unavailable: str | None = None
        _kernels.add(self)

    def function(self) -> Callable[..., Any] | None:
        """The compiled kernel (parallel, or serial after a fork), or None where it cannot be built."""
        kernel = self._serial if _forked else self._parallel
        if kernel is not None or self.unavailable is not None:
            return kernel
        with self._lock:  # two engines starting at once build it once
            if self.unavailable is None and _forked and self._serial is None:
                self._serial = self._compile(parallel=False)
            elif self.unavailable is None and not _forked and self._parallel is None:
                threads = torch.get_num_threads()
                try:
                    self._parallel = self._compile(parallel=True)
                finally:
                    torch.set_num_threads(threads)
        return self._serial if _forked else self._parallel

    def __call__(self, *args: Any) -> None:
        """Run the kernel on as many threads as torch uses; RuntimeError where it is unavailable."""
        kernel = self.function()
        if kernel is None:
            raise RuntimeError(f"the {self.name} kernel is unavailable: {self.unavailable}")
        if not _forked:
            _match_torch_threads()
        kernel(*args)

    def _compile(self, parallel: bool) -> Callable[..., Any] | None:
        try:
            _prepare_numba()
            if not parallel:  # the cache would hand back the parallel form's code
                return self._build(False, False)
            try:
                return self._build(True, True)
            except RuntimeError as exc:
                if "cannot cache" not in str(exc):
                    raise
                # No writable cache folder: compile at every start instead.
                logger.info("numba cannot cache the %s kernel (%s); compiling it without a cache", self.name, exc)
                return self._build(True, False)
        except Exception as exc:  # noqa: BLE001 - numba missing or failing to build: the caller's fallback serves
            self.unavailable = f"{type(exc).__name__}: {exc}"
            logger.warning("the %s kernel is unavailable (%s)", self.name, self.unavailable)
            return None


_kernels: weakref.WeakSet[NumbaKernel] = weakref.WeakSet()
_forked = False  # this process was forked from one whose numba threads had started


def _prepare_numba() -> None:
    import numba

    if numba.config.DISABLE_JIT:  # type: ignore[attr-defined]
        raise RuntimeError("NUMBA_DISABLE_JIT is set: the kernel would run interpreted")
    if "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER = "omp"  # type: ignore[attr-defined]


def _match_torch_threads() -> None:
    import numba

    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)


def _forked_child() -> None:
    global _forked
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    started = parallel is not None and bool(getattr(parallel, "_is_initialized", False))
    if started or any(kernel._parallel is not None for kernel in list(_kernels)):
        _forked = True
    for kernel in list(_kernels):  # a lock held by another thread at the fork stays held
        kernel._lock = threading.Lock()


os.register_at_fork(after_in_child=_forked_child)


def prefetch_intrinsic() -> Any:
    """A numba intrinsic ``prefetch(array, at)``: ask for the cache line holding
    ``array``'s element ``at`` (flat, in elements), for reading, into every cache level.
    It changes no value, only when memory arrives (``llvm.prefetch``)."""
    from llvmlite import ir  # type: ignore[import-untyped]
    from numba import types as nt
    from numba.core import cgutils
    from numba.extending import intrinsic

    i8, i32 = ir.IntType(8), ir.IntType(32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        array, at = args
        data = context.make_array(signature.args[0])(context, builder, array).data
        address = builder.bitcast(builder.gep(data, [at]), i8.as_pointer())
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch.p0"
        )
        read, keep_everywhere, data_cache = (ir.Constant(i32, v) for v in (0, 3, 1))
        builder.call(prefetch, [address, read, keep_everywhere, data_cache])
        return context.get_dummy_value()

    def prefetch(typingctx: Any, array: Any, at: Any) -> tuple[Any, Callable[..., Any]]:
        return nt.void(array, at), codegen

    return intrinsic(prefetch)

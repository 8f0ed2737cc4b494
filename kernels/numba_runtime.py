"""How Cadence's numba kernels are compiled, threaded and kept safe across a fork.

A ``NumbaKernel`` is built by a function of ``(parallel, cache)`` that returns the
compiled function (having run it once, so that compiling happens at build time and a
failure shows there). It is built on first use, and:

* cached on disk beside its module (or in numba's cache folder where that is
  read-only), and compiled without a cache where neither is writable;
* unavailable, with the reason logged once, where numba is missing, fails to build it or
  is told not to compile (``NUMBA_DISABLE_JIT``, which would run it interpreted);
* run on numba's OpenMP threading layer (its workqueue layer is unsafe for two engines'
  threads at once and spins against torch's pool), as many threads as torch uses; starting
  those threads resets the OpenMP thread count torch may share, so torch's is put back;
* serial in a process forked after its parallel form was built: GNU OpenMP's threads do
  not survive a fork. A kernel's per-row arithmetic does not depend on which thread runs
  a row, so the serial form gives the same bits.
"""

from __future__ import annotations

import logging
import os
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
        self._forked = False
        self.unavailable: str | None = None
        _kernels.add(self)

    def function(self) -> Callable[..., Any] | None:
        """The compiled kernel (parallel, or serial after a fork), or None where it cannot be built."""
        if self.unavailable is not None:
            return None
        if self._forked:
            if self._serial is None:
                self._serial = self._compile(parallel=False)
            return self._serial
        if self._parallel is None:
            threads = torch.get_num_threads()
            try:
                self._parallel = self._compile(parallel=True)
            finally:
                torch.set_num_threads(threads)
        return self._parallel

    def __call__(self, *args: Any) -> None:
        """Run the kernel on as many threads as torch uses; RuntimeError where it is unavailable."""
        kernel = self.function()
        if kernel is None:
            raise RuntimeError(f"the {self.name} kernel is unavailable: {self.unavailable}")
        if not self._forked:
            _match_torch_threads()
        kernel(*args)

    def _compile(self, parallel: bool) -> Callable[..., Any] | None:
        try:
            _prepare_numba()
            try:
                return self._build(parallel, True)
            except RuntimeError as exc:  # no writable cache folder: compile at every start instead
                logger.info("numba cannot cache the %s kernel (%s); compiling it without a cache", self.name, exc)
                return self._build(parallel, False)
        except Exception as exc:  # noqa: BLE001 - numba missing or failing to build: the caller's fallback serves
            self.unavailable = f"{type(exc).__name__}: {exc}"
            logger.warning("the %s kernel is unavailable (%s)", self.name, self.unavailable)
            return None

    def _after_fork(self) -> None:
        if self._parallel is not None:
            self._forked = True


_kernels: weakref.WeakSet[NumbaKernel] = weakref.WeakSet()


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
    for kernel in list(_kernels):
        kernel._after_fork()


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

    def prefetch(typingctx, array, at):
        return nt.void(array, at), codegen

    return intrinsic(prefetch)

"""Expert loads off the compute path. On CPU, one worker thread copies (torch releases
the GIL while it copies, so the step computes meanwhile); on CUDA, copies are queued on a
side stream after the work already queued on the compute stream, and each load's end is
an event the compute stream waits on. Loads run in the order they are submitted, so two
loads into one slot land in order."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Ticket:
    """One submitted load: a future on CPU, an event on CUDA."""

    def __init__(self, future: Future[None] | None = None, event: torch.cuda.Event | None = None) -> None:
        self.future = future
        self.event = event


class ExpertTransfers:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pool = None if self.stream is not None else ThreadPoolExecutor(1, thread_name_prefix="cadence-experts")

    def submit(self, load: Callable[[], None]) -> Ticket:
        if self.stream is None:
            assert self.pool is not None
            return Ticket(future=self.pool.submit(load))
        # The slot may still be read by kernels queued before this load.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            load()
            event = torch.cuda.Event()
            event.record(self.stream)
        return Ticket(event=event)

    def wait(self, ticket: Ticket) -> float:
        """Make the compute path wait for the load; the seconds the host waited (on CUDA,
        the host waits only while it copies from pageable memory)."""
        start = time.perf_counter()
        if ticket.future is not None:
            ticket.future.result()
        elif ticket.event is not None:
            torch.cuda.current_stream(self.device).wait_event(ticket.event)
        return time.perf_counter() - start

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

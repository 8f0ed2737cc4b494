"""One EngineCore process, and the pair of sockets the front end bound for it.

Each start of the engine gets sockets of its own (the generation is in their names), so
nothing a dead engine left queued can reach its successor, and nothing sent to the dead
one is mistaken for the new one's. The addresses are abstract names (server/ipc_addresses.py):
nothing of them outlives the sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing

import zmq
import zmq.asyncio

from cadence.engine.core_process import EngineAddresses, run_engine_core
from cadence.engine.engine_args import EngineArgs
from cadence.engine.log_format import current_log_format
from cadence.engine.protocol import EngineDead, EngineReady, Message, Shutdown, decode, encode
from cadence.server.ipc_addresses import bind_for_this_user


class EngineDeadError(RuntimeError):
    """The engine process is gone; nothing more can be served."""


class EngineProcess:
    """Starts one engine process and talks to it: `send` requests, `recv` step outputs."""

    def __init__(
        self,
        args: EngineArgs,
        address_prefix: str,
        generation: int,
        send_context: zmq.Context,
        recv_context: zmq.asyncio.Context,
        cpus: list[int] | None = None,
    ) -> None:
        addresses = EngineAddresses(*(f"ipc://{address_prefix}-{name}-{generation}" for name in ("inputs", "outputs")))
        # A plain (blocking-API) socket for sends: with no high-water mark a send never
        # waits, and an error is raised right here instead of in a Future nobody reads.
        self._inputs = send_context.socket(zmq.PUSH)
        self._outputs = recv_context.socket(zmq.PULL)
        # No high-water marks: admission control bounds the traffic, and a send must
        # never wait or drop (an abort that waited could arrive after its request ended).
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        # spawn, not fork: the engine must not inherit this process's event loop and threads.
        context = multiprocessing.get_context("spawn")
        self.process = context.Process(
            target=run_engine_core,
            args=(args, addresses, logging.getLogger().getEffectiveLevel(), cpus, current_log_format()),
            name="cadence-engine-core",
            daemon=True,
        )
        try:
            bind_for_this_user(self._inputs, addresses.inputs)
            bind_for_this_user(self._outputs, addresses.outputs)
            self.process.start()
        except Exception:
            self._close_sockets()
            raise

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    def send(self, message: Message) -> None:
        """Queue a message for the engine; EngineDeadError when no engine is connected.

        A PUSH socket without a peer blocks a send, which here would freeze the event
        loop: an engine that has just exited (or not yet connected) must fail the send.
        """
        try:
            self._inputs.send(encode(message), flags=zmq.NOBLOCK)
        except zmq.Again as error:
            raise EngineDeadError("the engine process is not connected") from error

    async def recv(self) -> Message:
        return decode(await self._outputs.recv())

    async def wait_ready(self, timeout: float) -> EngineReady:
        """The engine's EngineReady; EngineDeadError if it fails, exits or takes too long."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            if await self._outputs.poll(200):
                message = await self.recv()
                if isinstance(message, EngineReady):
                    return message
                if isinstance(message, EngineDead):
                    raise EngineDeadError(message.message)
                raise EngineDeadError(f"unexpected first message {type(message).__name__}")
            if not self.process.is_alive():
                raise EngineDeadError(f"the engine process exited with code {self.process.exitcode} while starting")
            if asyncio.get_running_loop().time() > deadline:
                raise EngineDeadError(f"the engine did not start within {timeout:.0f} s")

    async def stop(self, timeout: float) -> None:
        """Ask the engine to stop, wait for it, kill it if it will not; then close the sockets
        (which frees their names)."""
        loop = asyncio.get_running_loop()
        if self.process.is_alive():
            with contextlib.suppress(EngineDeadError):
                self.send(Shutdown())
            await loop.run_in_executor(None, self.process.join, timeout)
        if self.process.is_alive():
            self.process.kill()
            await loop.run_in_executor(None, self.process.join, 5.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)

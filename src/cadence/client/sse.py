"""Server-sent events into typed chunks, and the streams that hand them out.

`ChunkParser` is fed the body's lines and returns each event's chunk; it knows nothing of
I/O, so the sync `ChunkStream` and the async `AsyncChunkStream` are thin loops around it.
An error event (`data: {"error": {...}}`, server/errors.py) raises the error class its
type stands for; a body that ends without `data: [DONE]` raises APIConnectionError, since
the answer was cut short.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from types import TracebackType
from typing import Generic, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from cadence.client.errors import APIConnectionError, CadenceError, error_body, error_from_event, transport_errors

T = TypeVar("T", bound=BaseModel)

DONE = "[DONE]"


class ChunkParser(Generic[T]):
    """Turns the lines of an SSE body into chunks of `chunk_type`: `feed` each line
    (without its newline). `headers` are the stream's, for the errors it raises."""

    def __init__(self, chunk_type: type[T], headers: httpx.Headers) -> None:
        self.chunk_type = chunk_type
        self.headers = headers
        self.done = False
        self._data: list[str] = []

    def feed(self, line: str) -> list[T]:
        """The chunk an event ends with this line, if one does (a list of none or one)."""
        if line:
            field, _, value = line.partition(":")
            if field == "data":
                self._data.append(value.removeprefix(" "))
            return []  # comments (":...") and other fields (event, id, retry) carry no chunk
        data = "\n".join(self._data)
        self._data.clear()
        if not data or self.done:
            return []
        if data == DONE:
            self.done = True
            return []
        return [self.read(data)]

    def read(self, data: str) -> T:
        """One event's data as a chunk, or the error the event carries, raised."""
        try:
            return self.chunk_type.model_validate_json(data)
        except ValidationError as invalid:
            body = error_body(data)
            if body is not None:
                raise error_from_event(body.error, self.headers) from None
            name = self.chunk_type.__name__
            raise CadenceError(f"the server sent a chunk that is not a {name}: {data[:200]}") from invalid

    def finish(self) -> None:
        """At the end of the body: raise if the stream did not end properly."""
        if not self.done:
            raise APIConnectionError("the stream ended before data: [DONE]; the answer is incomplete")


class ChunkStream(Generic[T]):
    """The chunks of one streamed call; iterate once. Closing it (or leaving its `with`
    block) ends the call early, which the server sees and aborts."""

    def __init__(self, response: httpx.Response, chunk_type: type[T]) -> None:
        self.response = response
        self._parser = ChunkParser(chunk_type, response.headers)

    def __iter__(self) -> Iterator[T]:
        try:
            with transport_errors():
                for line in self.response.iter_lines():
                    yield from self._parser.feed(line)
            self._parser.finish()
        finally:
            self.response.close()

    def close(self) -> None:
        self.response.close()

    def __enter__(self) -> ChunkStream[T]:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class AsyncChunkStream(Generic[T]):
    """`ChunkStream` for the async client: `async for chunk in stream`."""

    def __init__(self, response: httpx.Response, chunk_type: type[T]) -> None:
        self.response = response
        self._parser = ChunkParser(chunk_type, response.headers)

    async def __aiter__(self) -> AsyncIterator[T]:
        try:
            with transport_errors():
                async for line in self.response.aiter_lines():
                    for chunk in self._parser.feed(line):
                        yield chunk
            self._parser.finish()
        finally:
            await self.response.aclose()

    async def close(self) -> None:
        await self.response.aclose()

    async def __aenter__(self) -> AsyncChunkStream[T]:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

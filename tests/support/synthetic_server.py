"""An OpenAI-style streaming server whose every answer has a fixed, known timeline.

It does no inference: a request for N tokens gets its first text chunk `ttft` seconds
after the server read it and one more every `itl` seconds. A load generator run against
it should report exactly those latencies; whatever it reports above them is what the
harness (and loopback) added. The server keeps account of its own lateness, so that part
is not blamed on the harness.

It speaks just enough HTTP/1.1 for that (one request per connection, closed after the
answer), on raw asyncio streams so that a thousand concurrent streams cost it little.

    python -m tests.support.synthetic_server --port 8123 --ttft 1.0 --itl 0.05  # from the repository root
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import httpx

from tests.support.server_harness import free_port

MODEL = "synthetic"
# Put on the child's PYTHONPATH, so that it finds `tests.support` whatever its working folder
# (a bench runs in bench/) and with PYTHONSAFEPATH set (the tests set it).
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class SyntheticServer:
    def __init__(self, ttft: float, itl: float) -> None:
        self.ttft = ttft
        self.itl = itl
        self.lateness: list[float] = []  # seconds each text chunk left after its due time
        self.served = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            start = time.perf_counter()
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            method, path, _ = request_line.split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if method == "GET" and path == "/v1/models":
                await self._json(writer, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
            elif method == "GET" and path == "/stats":
                await self._json(writer, {"served": self.served, "lateness": self.lateness})
            elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                await self._stream(writer, json.loads(body), start, chat=path.endswith("chat/completions"))
            else:
                await self._json(writer, {"error": {"message": f"no route {method} {path}"}}, "404 Not Found")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _json(self, writer: asyncio.StreamWriter, payload: object, status: str = "200 OK") -> None:
        data = json.dumps(payload).encode()
        writer.write(
            f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()

    async def _stream(self, writer: asyncio.StreamWriter, body: dict, start: float, chat: bool) -> None:
        tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        for i in range(tokens):
            due = start + self.ttft + i * self.itl
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            last = i == tokens - 1
            choice: dict[str, object] = {"index": 0, "finish_reason": "length" if last else None}
            if chat:
                choice["delta"] = {"content": " tok"}
            else:
                choice["text"] = " tok"
            writer.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            self.lateness.append(time.perf_counter() - due)
            await writer.drain()
        usage = {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens}
        writer.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        await writer.drain()
        self.served += 1


async def serve(port: int, ttft: float, itl: float) -> None:
    server = SyntheticServer(ttft, itl)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", port, backlog=4096)
    async with listener:
        await listener.serve_forever()


class SyntheticServerProcess:
    """This server in its own process on a free loopback port; use as a context manager."""

    def __init__(self, ttft: float, itl: float) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        argv = [
            sys.executable,
            "-m",
            "tests.support.synthetic_server",
            "--port",
            str(self.port),
            "--ttft",
            str(ttft),
            "--itl",
            str(itl),
        ]
        path = os.pathsep.join(filter(None, [_REPO_ROOT, os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": path})
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{self.base_url}/v1/models", timeout=2)
                return
            except httpx.HTTPError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("the synthetic server did not start") from None
                time.sleep(0.05)

    def lateness(self) -> list[float]:
        """Seconds each text chunk so far left after its due time."""
        return [float(v) for v in httpx.get(f"{self.base_url}/stats", timeout=10).json()["lateness"]]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)

    def __enter__(self) -> SyntheticServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ttft", type=float, default=1.0, help="seconds from a request to its first chunk")
    ap.add_argument("--itl", type=float, default=0.05, help="seconds between chunks")
    args = ap.parse_args()
    asyncio.run(serve(args.port, args.ttft, args.itl))


if __name__ == "__main__":
    main()

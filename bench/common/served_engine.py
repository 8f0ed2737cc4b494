"""Any OpenAI-compatible server as a subprocess on a free loopback port, stopped for sure.

Each server runs in its own session (process group), so stopping it reaches the workers it
spawned too (vLLM's engine core, Cadence's engine process) and a Ctrl-C in the terminal
reaches only the bench, whose `finally` then stops the servers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import httpx

_HZ = os.sysconf("SC_CLK_TCK")


@dataclass
class EngineSpec:
    """How to start one server. `command` holds `{port}` where the port goes."""

    label: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to (or overriding) os.environ
    drop_env: tuple[str, ...] = ()  # variables the server must not inherit
    startup_timeout: float = 600.0

    def argv(self, port: int) -> list[str]:
        return [part.replace("{port}", str(port)) for part in self.command]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in self.drop_env}
        return {**env, **self.env}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServedEngine:
    """`with ServedEngine(spec) as server:` waits until /health answers 200 and a model is listed."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        slug = "".join(c if c.isalnum() else "-" for c in spec.label)
        fd, self.log_path = tempfile.mkstemp(prefix=f"vs-peers-{slug}-", suffix=".log")
        self._log = os.fdopen(fd, "w+b")
        self.process: subprocess.Popen[bytes] | None = None
        self.model_name = ""
        self.startup_seconds = 0.0

    def __enter__(self) -> ServedEngine:
        start = time.perf_counter()
        self.process = subprocess.Popen(
            self.spec.argv(self.port),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.spec.environment(),
            start_new_session=True,
        )
        try:
            self.model_name = self._wait_ready(self.spec.startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - start
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self, timeout: float) -> str:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.spec.label} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    models = httpx.get(f"{self.base_url}/v1/models", timeout=5).json()["data"]
                    if models:
                        return str(models[0]["id"])
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.spec.label} was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]

    def cpu_seconds(self) -> float:
        """User + system CPU seconds used so far by the live processes of the server's group."""
        if self.process is None:
            return 0.0
        total = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # the process ended meanwhile
                continue
            if int(fields[2]) == self.process.pid:
                total += int(fields[11]) + int(fields[12])
        return total / _HZ

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server's process group, then SIGKILL to what is left of it."""
        if self.process is not None:
            group = self.process.pid  # the session leader: its pid is the group's id
            _signal_group(group, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(group, signal.SIGKILL)  # workers that outlived the leader, or a leader that hung
            self.process.wait(10)
            self.process = None
        if not self._log.closed:
            self._log.close()


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass

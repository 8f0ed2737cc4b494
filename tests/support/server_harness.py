"""Start `cadence serve` as a real subprocess on a free port, and stop it for sure."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx

from cadence.engine.process_name import ENGINE


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of a process, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid`, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry))
    return found


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `condition` until it holds; fail with `what` past `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


class ServerProcess:
    """One `cadence serve` subprocess; use as a context manager."""

    def __init__(
        self,
        model: str | None,
        *extra_args: str,
        startup_timeout: float = 180.0,
        env: dict[str, str] | None = None,
        command: str = "serve",
        host: str = "127.0.0.1",
        port: int | None = None,
        wrapper: tuple[str, ...] = (),
        new_group: bool = False,
    ) -> None:
        """`env` adds to (or overrides) this process's environment for the server;
        `command` is the cadence subcommand; `wrapper` runs it (say, in a network namespace);
        `new_group` makes the server lead a process group of its own (with its engines), so
        a test can signal all of it and nothing of pytest."""
        self.host = host
        self.port = port or free_port()
        # What /metrics needs: a server started with --protect-metrics wants the API key.
        self.metrics_headers: dict[str, str] = {}
        self.base_url = f"http://{host}:{self.port}"
        # -P keeps the working directory off sys.path: run from the checkout root, its
        # kernels/ folder would shadow the PyPI package `kernels` that transformers imports.
        argv = [*wrapper, sys.executable, "-P", "-m", "cadence.server.cli", command]
        if model is not None:
            argv.append(model)
        argv += ["--host", host, "--port", str(self.port), "--log-level", "warning", *extra_args]
        self.log_path = f"/tmp/cadence-test-server-{self.port}.log"
        self._log = open(self.log_path, "w+b")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=None if env is None else {**os.environ, **env},
            start_new_session=new_group,
        )
        self._wait_healthy(startup_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:  # stop() closes it, and a failed start reports the log after that
            self._log.flush()
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-5000:]

    @property
    def engine_pid(self) -> int:
        """The EngineCore process: the server's child that names itself so."""
        return self.engine_pids(ENGINE)[0]

    def engine_pids(self, name: str) -> list[int]:
        """The server's children named `name` (engine/process_name.py)."""
        found = []
        for child in child_pids(self.process.pid):
            try:
                with open(f"/proc/{child}/comm", encoding="ascii", errors="replace") as f:
                    if f.read().strip() == name:
                        found.append(child)
            except OSError:
                continue
        if not found:
            raise RuntimeError(f"no {name} process found")
        return found

    def metric(self, name: str) -> float:
        """The value of one `cadence:` metric (summed over label sets)."""
        text = httpx.get(f"{self.base_url}/metrics", headers=self.metrics_headers, timeout=10).text
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
        if not values:
            raise KeyError(name)
        return sum(values)

    def wait_for_metric(self, name: str, expected: float, timeout: float = 20.0) -> float:
        deadline = time.monotonic() + timeout
        value = self.metric(name)
        while value != expected and time.monotonic() < deadline:
            time.sleep(0.1)
            value = self.metric(name)
        return value

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the server, wait, and kill it and its children if it lingers."""
        children = child_pids(self.process.pid)
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        for child in children:
            if pid_alive(child):
                os.kill(child, signal.SIGKILL)
        self._log.close()
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

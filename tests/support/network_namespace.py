"""A second "host" for cross-host tests: a network namespace joined to this one by a
veth pair, where `ip netns` works (root on Linux); loopback where it does not."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Hosts:
    """Where a test's "other host" listens, how to run a command there, and what it is."""

    here: str  # this host's address on the link
    there: str  # the other host's address
    wrapper: tuple[str, ...]  # prefix that runs a command on the other host
    kind: str  # "netns" or "loopback"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextmanager
def other_host() -> Iterator[Hosts]:
    """A namespace with its own stack, at 10.231.x.2, reached from here at 10.231.x.1."""
    tag = f"{os.getpid() % 100000}"
    namespace, outside, inside = f"cadence-{tag}", f"cdv{tag}a", f"cdv{tag}b"
    subnet = f"10.231.{os.getpid() % 256}"  # distinct from concurrent runs' (their pids differ)
    if shutil.which("ip") is None or os.geteuid() != 0:
        yield Hosts("127.0.0.1", "127.0.0.1", (), "loopback")
        return
    try:
        _ip("netns", "add", namespace)
    except (subprocess.CalledProcessError, OSError):
        yield Hosts("127.0.0.1", "127.0.0.1", (), "loopback")
        return
    try:
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", namespace)
        _ip("addr", "add", f"{subnet}.1/30", "dev", outside)
        _ip("link", "set", outside, "up")
        _ip("-n", namespace, "addr", "add", f"{subnet}.2/30", "dev", inside)
        _ip("-n", namespace, "link", "set", inside, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        yield Hosts(f"{subnet}.1", f"{subnet}.2", ("ip", "netns", "exec", namespace), "netns")
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", outside], capture_output=True, timeout=10)

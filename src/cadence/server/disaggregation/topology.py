"""Which engines a server drives: one beside it, prefill and decode engines beside it,
one engine of a role that routers on other hosts drive, or (a router) workers elsewhere."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

from cadence.engine.engine_args import EngineArgs
from cadence.server.disaggregation.placement import PlacementPolicy

WORKER_ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Topology:
    """Engines beside the server, on its host. With neither prefill nor decode engines it
    runs one, of `role`: colocated, or prefill or decode for routers elsewhere."""

    num_prefill: int = 0
    num_decode: int = 0
    kv_transport: str = "shared-memory"
    placement: PlacementPolicy = field(default_factory=PlacementPolicy)  # where the router computes prompts
    role: str = "colocated"

    @property
    def disaggregated(self) -> bool:
        """Whether this server routes between prefill and decode engines of its own."""
        return self.num_prefill + self.num_decode > 0

    def __post_init__(self) -> None:
        if self.role != "colocated" and (self.role not in WORKER_ROLES or self.disaggregated):
            raise ValueError(f"a worker's role is one of {WORKER_ROLES}, with no engines of other roles beside it")
        if self.disaggregated and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError("disaggregated serving needs at least one prefill and one decode engine")

    def engines(self, args: EngineArgs) -> dict[str, EngineArgs]:
        """Each engine's name and arguments."""
        if self.role != "colocated":
            return {self.role: replace(args, kv_role=self.role, kv_transport=self.kv_transport)}
        if not self.disaggregated:
            return {"engine": args}
        engines = {}
        # They share the memory of the machine the server runs on: each sizes its KV cache as one of them.
        on_host = self.num_prefill + self.num_decode
        for role, count in (("prefill", self.num_prefill), ("decode", self.num_decode)):
            for index in range(count):
                engines[f"{role}-{index}"] = replace(
                    args, kv_role=role, kv_transport=self.kv_transport, engines_per_host=on_host
                )
        return engines


@dataclass(frozen=True)
class WorkerList:
    """A router's workers, by HTTP URL: from its flags, plus those a file lists.

    The file is JSON, `{"prefill": [URL, ...], "decode": [URL, ...]}`, and is re-read
    while the router runs, so an orchestrator can add and remove workers by rewriting it.
    """

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    path: str | None = None

    def current(self) -> dict[str, str]:
        """Every worker's URL and role, the file read now (ValueError if it is malformed)."""
        listed: dict[str, str] = {}

        def add(urls: object, role: str, where: str) -> None:
            if not isinstance(urls, list | tuple) or not all(isinstance(url, str) for url in urls):
                raise ValueError(f"{where}: {role!r} must be a list of URLs")
            for url in urls:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"{where}: {url!r} is not an http(s) URL (a MODEL goes before the flags)")
                if listed.setdefault(url.rstrip("/"), role) != role:
                    raise ValueError(f"{where}: {url} is listed as both prefill and decode")

        add(self.prefill, "prefill", "--prefill")
        add(self.decode, "decode", "--decode")
        if self.path is not None:
            with open(self.path, encoding="utf-8") as f:
                document = json.load(f)
            if not isinstance(document, dict) or set(document) - set(WORKER_ROLES):
                raise ValueError(f'{self.path}: expected {{"prefill": [URL, ...], "decode": [URL, ...]}}')
            for role, urls in document.items():
                add(urls, role, self.path)
        return listed


@dataclass(frozen=True)
class LinkTiming:
    """How often an idle link speaks, and how long a silent one is trusted."""

    heartbeat: float = 0.5
    timeout: float = 5.0


def split_cpus(names: list[str]) -> dict[str, list[int] | None]:
    """Give each engine its own share of this process's CPUs, or none when there are
    fewer CPUs than engines (then they share, as one engine alone would)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(names) < 2 or len(cpus) < len(names):
        return dict.fromkeys(names)
    share = len(cpus) // len(names)
    return {name: cpus[i * share : (i + 1) * share] for i, name in enumerate(names)}

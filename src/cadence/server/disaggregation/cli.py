"""The command line of prefill/decode disaggregation: `cadence serve`'s flags for engines
beside the server and for workers, and `cadence router`, which fronts workers elsewhere."""

from __future__ import annotations

import argparse
import ipaddress
import socket

from cadence.server.disaggregation.placement import PLACEMENTS, PlacementPolicy
from cadence.server.disaggregation.topology import LinkTiming, Topology, WorkerList

_WILDCARDS = ("0.0.0.0", "::", "")


def at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive seconds, got {text}")
    return value


def add_disaggregation_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "prefill/decode disaggregation",
        "run prompts (prefill) and generation (decode) on separate engines: in processes beside the server, each "
        "pinned to its own share of the CPUs (--prefill-workers, --decode-workers), or as workers on other hosts "
        "that a `cadence router` drives (--role)",
    )
    group.add_argument("--prefill-workers", type=int, default=0, help="prefill engines (with --decode-workers)")
    group.add_argument("--decode-workers", type=int, default=0, help="decode engines (with --prefill-workers)")
    group.add_argument(
        "--role",
        choices=["colocated", "prefill", "decode"],
        default="colocated",
        help="prefill or decode: this server's engine works for routers (`cadence router --prefill/--decode URL`)",
    )
    group.add_argument(
        "--link-port", type=int, default=0, help="with --role: the port routers drive the engine on (0: any free one)"
    )
    group.add_argument(
        "--kv-transport",
        default=None,
        help="how decode engines read prompt KV: shared-memory (one host; the default beside the server), tcp "
        "(any hosts; the default for --role), or nixl (UCX, as vLLM, SGLang and Dynamo do; install it with "
        "pip install --no-deps nixl-cu12)",
    )
    group.add_argument(
        "--kv-host",
        default=None,
        help="with --role prefill and --kv-transport tcp: the address decode workers read KV from (default: --host, "
        "or the address the host name resolves to when --host is a wildcard)",
    )
    group.add_argument("--kv-wait-timeout", type=float, default=None, help="seconds a decode engine waits for KV")
    group.add_argument(
        "--kv-hold-timeout", type=float, default=None, help="seconds a prefill engine holds KV nobody acknowledged"
    )
    add_routing_flags(group)


def add_routing_flags(group: argparse._ArgumentGroup) -> None:
    """Flags of whoever routes requests between engines."""
    group.add_argument(
        "--prefill-placement",
        choices=PLACEMENTS,
        default="cost",
        help="where prompts are computed: cost weighs, per prompt, the prefill engines' queue and the transfer "
        "against the decode engine's queue, computed there in chunks of --max-local-prefill-stall seconds beside "
        "its streams (from measured rates); remote sends every prompt to a prefill engine; local computes them "
        "all on decode engines",
    )
    group.add_argument(
        "--max-local-prefill-stall",
        type=float,
        default=PlacementPolicy.max_local_stall,
        help="seconds one step of a prompt computed on a decode engine may add to its token streams: the size "
        "of its chunks there",
    )
    group.add_argument(
        "--min-remote-prefill-tokens",
        type=at_least_one,
        default=1,
        help="prompts with fewer uncached tokens are computed on their decode engine",
    )
    group.add_argument(
        "--link-timeout",
        type=_positive,
        default=LinkTiming.timeout,
        help="seconds of silence after which a router and a worker count each other gone (and free what the "
        "other started)",
    )


def add_router_command(commands: argparse._SubParsersAction, add_http_flags: object) -> argparse.ArgumentParser:
    router = commands.add_parser(
        "router",
        help="serve the OpenAI-compatible API over prefill and decode workers on other hosts",
        description="Route each request to a decode worker and a prefill worker (each a `cadence serve MODEL "
        "--role decode|prefill`); prompt KV moves between them directly. MODEL gives the tokenizer.",
    )
    router.add_argument(
        "model", nargs="?", default=None, help="HF folder or .gguf file the workers serve (default: SmolLM2-135M)"
    )
    assert callable(add_http_flags)
    add_http_flags(router)
    group = router.add_argument_group("workers")
    group.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill workers' HTTP URLs")
    group.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode workers' HTTP URLs")
    group.add_argument(
        "--workers-file",
        default=None,
        help='JSON {"prefill": [URL, ...], "decode": [URL, ...]}, re-read while the router runs',
    )
    add_routing_flags(group)
    return router


def topology_from(args: argparse.Namespace) -> Topology:
    role = getattr(args, "role", "colocated")
    default_transport = "tcp" if role != "colocated" else "shared-memory"
    try:
        return Topology(
            getattr(args, "prefill_workers", 0),
            getattr(args, "decode_workers", 0),
            getattr(args, "kv_transport", None) or default_transport,
            PlacementPolicy(args.prefill_placement, args.min_remote_prefill_tokens, args.max_local_prefill_stall),
            role,
        )
    except ValueError as error:
        raise SystemExit(f"cadence {args.command}: {error}") from error


def worker_list_from(args: argparse.Namespace) -> WorkerList | None:
    """A router's workers; None for `cadence serve`."""
    if args.command != "router":
        return None
    workers = WorkerList(tuple(args.prefill), tuple(args.decode), args.workers_file)
    try:
        listed = workers.current()  # a bad file or flags fail at start, not later
    except (OSError, ValueError) as error:
        raise SystemExit(f"cadence router: {error}") from error
    if args.workers_file is None and not ("prefill" in listed.values() and "decode" in listed.values()):
        raise SystemExit("cadence router: give --prefill and --decode worker URLs, or --workers-file")
    return workers


def kv_host_for(args: argparse.Namespace) -> str | None:
    """Where a prefill worker's TCP transport listens: the one address its readers reach."""
    if getattr(args, "kv_host", None) is not None:
        return str(args.kv_host)
    if getattr(args, "role", "colocated") != "prefill":
        return None
    if args.host not in _WILDCARDS:
        return str(args.host)
    address = socket.gethostbyname(socket.gethostname())
    if ipaddress.ip_address(address).is_loopback and (args.kv_transport or "tcp") == "tcp":
        raise SystemExit(
            f"cadence serve: the host name resolves to {address}, a loopback address that decode workers "
            "elsewhere cannot reach; give --kv-host the address they reach this worker at"
        )
    return address

"""The command line of workers and routers: the worker list (flags and a re-read file),
where a prefill worker's KV listens, and refusals that name the mistake."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from cadence.server.cli import build_parser
from cadence.server.disaggregation.cli import kv_host_for, topology_from, worker_list_from
from cadence.server.disaggregation.topology import WorkerList


def test_the_worker_list_joins_flags_and_file(tmp_path: Path) -> None:
    path = tmp_path / "workers.json"
    path.write_text(json.dumps({"decode": ["http://d2:8000/"]}))
    workers = WorkerList(("http://p:8000",), ("http://d1:8000",), str(path))
    assert workers.current() == {"http://p:8000": "prefill", "http://d1:8000": "decode", "http://d2:8000": "decode"}
    path.write_text(json.dumps({"prefill": ["http://d1:8000"]}))
    with pytest.raises(ValueError, match="both prefill and decode"):
        workers.current()
    path.write_text(json.dumps({"decoders": []}))
    with pytest.raises(ValueError, match="expected"):
        workers.current()


def test_a_model_after_the_urls_is_named_as_the_mistake() -> None:
    args = build_parser().parse_args(["router", "--prefill", "http://p:1", "--decode", "http://d:1", "/models/x"])
    with pytest.raises(SystemExit, match="not an http"):
        worker_list_from(args)


def test_a_router_needs_both_roles() -> None:
    args = build_parser().parse_args(["router", "--decode", "http://d:1"])
    with pytest.raises(SystemExit, match="--prefill and --decode"):
        worker_list_from(args)


def test_a_worker_role_takes_no_engines_beside_it() -> None:
    args = build_parser().parse_args(["serve", "--role", "decode", "--prefill-workers", "1", "--decode-workers", "1"])
    with pytest.raises(SystemExit, match="worker's role"):
        topology_from(args)
    worker = topology_from(build_parser().parse_args(["serve", "--role", "prefill"]))
    assert worker.kv_transport == "tcp" and worker.placement.mode == "cost"


def test_a_prefill_worker_listens_for_kv_where_decode_workers_reach_it(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = build_parser().parse_args
    assert kv_host_for(parse(["serve", "--role", "prefill", "--host", "10.1.2.3"])) == "10.1.2.3"
    given = parse(["serve", "--role", "prefill", "--host", "0.0.0.0", "--kv-host", "10.9.9.9"])
    assert kv_host_for(given) == "10.9.9.9"
    assert kv_host_for(parse(["serve", "--role", "decode", "--host", "0.0.0.0"])) is None
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.4.4.4")
    assert kv_host_for(parse(["serve", "--role", "prefill", "--host", "0.0.0.0"])) == "10.4.4.4"
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")  # Debian's /etc/hosts
    with pytest.raises(SystemExit, match="--kv-host"):
        kv_host_for(parse(["serve", "--role", "prefill", "--host", "0.0.0.0"]))

"""What .ci/wheel_check runs: build the wheel and check its files, then, from the installed wheel, import
every module and serve one chat request.

    python .ci/wheel_check.py build REPO DIST      # with the CI's python: the wheel into DIST
    python -I .ci/wheel_check.py installed WORK    # with the fresh venv's python, cwd outside the checkout

Only the standard library: the second step runs in a venv that holds the wheel and its dependencies, and
nothing of the checkout may be importable there.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pkgutil
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from types import FrameType
from typing import Any, NoReturn

# Imports the wheel's dependencies do not provide: a module that needs one of these is importable only
# where it is installed. Any other import error fails the check.
OPTIONAL_IMPORTS = {
    "triton": "the GPU kernels; CUDA builds of torch bring it, the CPU build has none",
    "nixl_cu12": "the NIXL KV transport; installed by hand with --no-deps",
    "grafana_foundation_sdk": "the dashboard generator, a developer tool (the test extra)",
}

# The first start converts the default model's GGUF into the (empty) HOME and times the CPU kernels: 20-30 s
# on a quiet 2-core machine, and several times that while other work runs.
HEALTH_DEADLINE_S = 600.0
REQUEST_TIMEOUT_S = 300.0
QUESTION = "What is the capital of France?"


def fail(message: str) -> NoReturn:
    print(f"wheel check: {message}", file=sys.stderr)
    sys.exit(1)


# ---- build: with the CI's python, in the checkout ----


def source_files(repo: Path) -> list[PurePosixPath]:
    """The files a fresh clone would have, plus new ones not yet committed (not the ignored ones: build
    output, caches, virtual environments)."""
    listed = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout.decode()
    # A tracked file deleted in the work tree is still listed; the build would not see it either.
    return sorted(PurePosixPath(name) for name in listed.split("\0") if name and (repo / name).is_file())


def package_files(sources: list[PurePosixPath]) -> list[PurePosixPath]:
    """The source files that must be in the wheel: everything under src/ (the package `cadence`). A data
    file there is read at run time, so it must ship (as package data) or live elsewhere."""
    return [path for path in sources if path.parts[0] == "src" and len(path.parts) > 2]


def in_wheel(path: PurePosixPath) -> str:
    """A source file's name in the wheel: its path under src/."""
    return str(path.relative_to("src"))


def folders_without_init(paths: list[PurePosixPath], sources: list[PurePosixPath]) -> list[str]:
    """Folders holding the given files that lack an `__init__.py`: find_packages skips such a folder and
    everything under it, which is the usual reason a module is missing from the wheel."""
    have = set(sources)
    missing = set()
    for path in paths:
        for folder in path.parents:
            if folder not in (PurePosixPath("."), PurePosixPath("src")) and folder / "__init__.py" not in have:
                missing.add(f"{folder}/")
    return sorted(missing)


def check_wheel_files(wheel: Path, sources: list[PurePosixPath]) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = {name for name in archive.namelist() if not name.endswith("/")}
    expected = package_files(sources)
    missing = [path for path in expected if in_wheel(path) not in names]
    problems = []
    if missing:
        problems.append("missing from the wheel: " + ", ".join(map(str, missing)))
        no_init = folders_without_init(missing, sources)
        if no_init:
            problems.append("these folders have no __init__.py, so the build skips them: " + ", ".join(no_init))
        data = [str(path) for path in missing if path.suffix != ".py"]
        if data:
            problems.append("a data file ships only if [tool.setuptools.package-data] names it: " + ", ".join(data))
    wanted = {in_wheel(path) for path in expected}
    stray = sorted(name for name in names if name not in wanted and not name.split("/")[0].endswith(".dist-info"))
    if stray:
        problems.append("in the wheel but not part of the package: " + ", ".join(stray))
    if problems:
        fail("\n  ".join(["the wheel's files do not match the source tree:", *problems]))
    print(f"wheel check: {wheel.name} holds all {len(expected)} files of the package, and nothing else")


def build(repo: Path, dist: Path) -> None:
    """Builds the wheel from a copy of the source files, as a fresh clone would: in place, setuptools reuses
    its build/ folder, where a module deleted since the last build would linger and ship."""
    sources = source_files(repo)
    with tempfile.TemporaryDirectory(prefix="cadence-src-") as copy:
        for path in sources:
            target = Path(copy, path)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / path, target)
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(dist), copy], check=True
        )
    (wheel,) = dist.glob("cadence-*.whl")
    check_wheel_files(wheel, sources)


# ---- installed: with the venv's python, outside the checkout ----


def import_everything() -> None:
    """Imports every module of the installed package; fails on any import error but a missing optional one."""
    import cadence

    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    where = Path(cadence.__file__ or "").resolve()
    if not where.is_relative_to(site_packages):
        fail(f"cadence imports from {where}, not from the installed wheel in {site_packages}")

    imported: list[str] = []
    optional: dict[str, list[str]] = {}
    errors: dict[str, str] = {}
    # walk_packages imports each package to look inside it; a package that fails is reported below, by
    # the import of the same name, so its own error callback has nothing to add.
    for module in pkgutil.walk_packages(cadence.__path__, "cadence.", onerror=lambda name: None):
        try:
            importlib.import_module(module.name)
        except ModuleNotFoundError as error:
            missing = (error.name or "").split(".")[0]
            if missing in OPTIONAL_IMPORTS:
                optional.setdefault(missing, []).append(module.name)
            else:
                errors[module.name] = traceback.format_exc()
        except Exception:  # noqa: BLE001 - any failure at import is a finding to report, not to raise at once
            errors[module.name] = traceback.format_exc()
        else:
            imported.append(module.name)
    for missing, modules in sorted(optional.items()):
        print(f"wheel check: without {missing} ({OPTIONAL_IMPORTS[missing]}), skipped {', '.join(modules)}")
    if errors:
        fail("".join(f"\n--- import {name} failed:\n{trace}" for name, trace in sorted(errors.items())))
    print(f"wheel check: imported {len(imported)} modules of {where.parent}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    """The status and body of a GET, or of a POST of `body` as JSON; an error status is returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def empty_home_env(home: Path) -> dict[str, str]:
    """The environment with an empty HOME, and without the variables that would point the server, or the
    libraries it loads, at caches the CI user already has."""
    moved = ("XDG_", "HF_", "NUMBA_", "TRITON_", "CADENCE_")
    env = {name: value for name, value in os.environ.items() if not name.startswith(moved)}
    env["HOME"] = str(home)
    return env


@contextlib.contextmanager
def running_server(work: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """`cadence serve` (the venv's entry point) on a free port, with an empty HOME; killed, engines and all,
    however the check ends."""
    home = work / "home"
    home.mkdir()
    log = work / "serve.log"
    port = free_port()
    cadence = Path(sys.executable).parent / "cadence"
    with open(log, "wb") as output:
        # Its own session, so that one signal to the group also reaches the engine processes it starts.
        server = subprocess.Popen(
            [str(cadence), "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=work,
            env=empty_home_env(home),
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield server, f"http://127.0.0.1:{port}", log
    finally:
        stop(server)


def stop(server: subprocess.Popen[bytes]) -> None:
    for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=grace)
            return


def log_tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def wait_healthy(server: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + HEALTH_DEADLINE_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            fail(f"cadence serve exited with {server.returncode} before it was healthy:\n{log_tail(log)}")
        with contextlib.suppress(OSError):  # not listening yet
            status, _ = http(f"{url}/health", timeout=5.0)
            if status == 200:
                return
        time.sleep(1.0)
    fail(f"cadence serve was not healthy after {HEALTH_DEADLINE_S:.0f} s:\n{log_tail(log)}")


def serve_one_request(work: Path) -> None:
    started = time.monotonic()
    with running_server(work) as (server, url, log):
        wait_healthy(server, url, log)
        print(f"wheel check: healthy after {time.monotonic() - started:.0f} s (a first start, from an empty HOME)")
        _, models = http(f"{url}/v1/models")
        model = json.loads(models)["data"][0]["id"]
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 16,
            "temperature": 0,
        }
        status, reply = http(f"{url}/v1/chat/completions", body, timeout=REQUEST_TIMEOUT_S)
        content = json.loads(reply)["choices"][0]["message"]["content"] if status == 200 else None
        if not content:
            fail(f"POST /v1/chat/completions answered {status}: {reply.decode(errors='replace')}\n{log_tail(log)}")
        print(f"wheel check: {model} answered {QUESTION!r} with {content!r}")
    if not (work / "home" / ".cache" / "cadence").is_dir():
        fail("the server did not convert the model into the empty HOME's cache")


def installed(work: Path) -> None:
    # A SIGTERM (a CI timeout) unwinds like an error, so the server is still stopped.
    def terminate(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    import_everything()
    serve_one_request(work)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="step", required=True)
    build_step = steps.add_parser("build", help="build the wheel into DIST and check its files against REPO")
    build_step.add_argument("repo", type=Path)
    build_step.add_argument("dist", type=Path)
    installed_step = steps.add_parser("installed", help="import every module and serve one request")
    installed_step.add_argument("work", type=Path, help="an empty folder outside the checkout")
    args = parser.parse_args()
    if args.step == "build":
        build(args.repo.resolve(), args.dist.resolve())
    else:
        installed(args.work.resolve())


if __name__ == "__main__":
    main()

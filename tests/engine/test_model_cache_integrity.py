"""What is read from the conversion cache is verified, and a model's files or a cache that
cannot be used give one line naming the path and what to do.

A converted GGUF folder carries checksums written last; every start checks them. A folder
changed since (same size, other bytes), cut off half-way (no checksum file) or truncated is
converted again, or refused with a message naming it where the cache is read-only. Tests
run as root, whom file modes do not stop, so a read-only cache is a read-only bind mount in
a mount namespace of the command's own (`unshare --mount`), which refuses writes with
EROFS even to root and vanishes with the command; a cache folder that cannot even be
created lies below a regular file (ENOTDIR), which needs no privileges.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from cadence import LLM, SamplingParams
from cadence.engine import gguf_loader
from cadence.engine.cache_checksums import CHECKSUM_FILE, checksum_problem, write_checksums
from cadence.engine.engine_args import engine_args_for
from cadence.engine.gguf_loader import convert_gguf
from cadence.engine.model_files_error import ModelFilesError
from cadence.server.cli import build_parser, engine_args_from
from tests.support.gguf_writer import write_tiny_gguf_in
from tests.support.tiny_models import build_tiny_model

FLAGS = {"dtype": "float32", "max_model_len": 64, "num_gpu_blocks": 64}
PROMPTS = [[5, 9, 13, 2], [20 + i for i in range(11)]]
CLI_TIMEOUT = 180.0  # seconds: a deadline for a refusal that comes before any server starts


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_gguf_in(tmp_path_factory.mktemp("cache-integrity"), build_tiny_model("llama"), "tiny.gguf")


@pytest.fixture(scope="module")
def reference_tokens(tiny_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """Greedy tokens from a fresh conversion."""
    return greedy(LLM(tiny_gguf, download_dir=str(tmp_path_factory.mktemp("fresh-cache")), **FLAGS))


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, params)]


def overwrite_keeping_size(path: str) -> None:
    """Random bytes over a stretch of the tensor data, as a bad disk or a stray write would."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(os.urandom(max(1, min(1 << 16, size // 4))))
    assert os.path.getsize(path) == size


def count_conversions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = gguf_loader.write_hf_folder

    def recording(gguf_path: str, folder: str) -> None:
        calls.append(folder)
        real(gguf_path, folder)

    monkeypatch.setattr(gguf_loader, "write_hf_folder", recording)
    return calls


def run_cli(*argv: str, wrapper: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*wrapper, sys.executable, "-P", "-m", "cadence.server.cli", *argv],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
    )


def read_only_wrapper(folder: str) -> tuple[str, ...]:
    """A command prefix that runs the command with `folder` mounted read-only, for it alone."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.decode().strip()}")
    mount = f'mount --bind -o ro "{folder}" "{folder}" && exec "$@"'
    return ("unshare", "--mount", "sh", "-c", mount, "read-only")


def assert_one_line_refusal(result: subprocess.CompletedProcess[str], *names: str) -> str:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for name in names:
        assert name in lines[0]
    return lines[0]


# --- the checksums ------------------------------------------------------------------------


def test_checksums_catch_a_changed_missing_or_unlisted_file(tmp_path: Path) -> None:
    folder = str(tmp_path)
    for name, data in (("model.safetensors", os.urandom(4096)), ("config.json", b"{}")):
        (tmp_path / name).write_bytes(data)
    assert "no cadence_checksums.json" in (checksum_problem(folder) or "")  # cut off before the end
    write_checksums(folder)
    assert checksum_problem(folder) is None
    overwrite_keeping_size(str(tmp_path / "model.safetensors"))
    assert "model.safetensors does not match its checksum" in (checksum_problem(folder) or "")
    write_checksums(folder)
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert "model.safetensors has 100 bytes, not the 4096" in (checksum_problem(folder) or "")
    os.remove(tmp_path / "config.json")
    assert "config.json is missing" in (checksum_problem(folder) or "")
    (tmp_path / CHECKSUM_FILE).write_text('{"algorithm": "sha256", "files": {"x": {"size": 1}}}')
    assert "unreadable" in (checksum_problem(folder) or "")


# --- a corrupted or unfinished cache is converted again, never served ---------------------


def test_a_corrupted_cache_is_converted_again_and_serves_the_right_tokens(
    tiny_gguf: str,
    reference_tokens: list[list[int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache = str(tmp_path / "cache")
    folder = engine_args_for(tiny_gguf, download_dir=cache).model
    overwrite_keeping_size(os.path.join(folder, "model.safetensors"))
    with monkeypatch.context() as unverified:  # what serving it unchecked would answer
        unverified.setattr(gguf_loader, "checksum_problem", lambda folder: None)
        assert greedy(LLM(tiny_gguf, download_dir=cache, **FLAGS)) != reference_tokens
    conversions = count_conversions(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="cadence.engine.gguf_loader"):
        llm = LLM(tiny_gguf, download_dir=cache, **FLAGS)
    assert llm.engine.args.model == folder and len(conversions) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(folder in w and "does not match its checksum" in w and "converting it again" in w for w in warnings)
    assert greedy(llm) == reference_tokens
    assert checksum_problem(folder) is None
    assert os.listdir(cache) == [os.path.basename(folder)]  # the corrupt copy is gone


@pytest.mark.parametrize("cut", ["no checksum file", "truncated weights"])
def test_a_conversion_cut_off_half_way_is_converted_again(
    tiny_gguf: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    cache = str(tmp_path / "cache")
    folder = convert_gguf(tiny_gguf, cache)
    if cut == "no checksum file":
        os.remove(os.path.join(folder, CHECKSUM_FILE))
    else:
        with open(os.path.join(folder, "model.safetensors"), "r+b") as f:
            f.truncate(os.path.getsize(f.name) // 2)
    conversions = count_conversions(monkeypatch)
    assert convert_gguf(tiny_gguf, cache) == folder
    assert len(conversions) == 1 and checksum_problem(folder) is None
    assert convert_gguf(tiny_gguf, cache) == folder and len(conversions) == 1  # trusted from now on


def test_a_moved_gguf_keeps_its_verified_folder(
    tiny_gguf: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = str(tmp_path / "cache")
    first = tmp_path / "first.gguf"
    shutil.copy2(tiny_gguf, first)
    folder = convert_gguf(str(first), cache)
    moved = tmp_path / "elsewhere" / "first.gguf"
    moved.parent.mkdir()
    os.rename(first, moved)
    conversions = count_conversions(monkeypatch)
    assert convert_gguf(str(moved), cache) == folder and conversions == []
    assert checksum_problem(folder) is None  # the rewritten source record was checksummed again


# --- errors a user can act on -------------------------------------------------------------


def test_truncated_weights_in_a_model_folder_are_named(tiny_model_dir: Callable[[str], str], tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    weights = folder / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) - 10)
    with pytest.raises(ModelFilesError, match="is truncated or corrupt") as refused:
        LLM(str(folder), **FLAGS)
    assert str(weights) in str(refused.value) and "\n" not in str(refused.value)
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ModelFilesError, match="has a corrupt header"):
        engine_args_for(str(folder))
    with pytest.raises(ModelFilesError, match="does not exist"):
        engine_args_for(str(tmp_path / "no-such-model"))


def test_an_unwritable_cache_is_one_line_from_llm(tiny_gguf: str, tmp_path: Path) -> None:
    below_a_file = tmp_path / "a-file"
    below_a_file.write_text("")
    with pytest.raises(ModelFilesError, match="point --download-dir") as refused:
        LLM(tiny_gguf, download_dir=str(below_a_file / "cache"), **FLAGS)
    assert str(below_a_file / "cache") in str(refused.value) and "\n" not in str(refused.value)


def test_download_dir_is_a_flag_of_serve_router_and_quantize(tiny_gguf: str, tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    served = engine_args_from(build_parser().parse_args(["serve", tiny_gguf, "--download-dir", cache]))
    assert served == engine_args_for(tiny_gguf, download_dir=cache)
    assert os.path.dirname(served.model) == cache
    router = build_parser().parse_args(["router", tiny_gguf, "--decode", "http://d:1", "--download-dir", cache])
    assert engine_args_from(router).model == served.model  # the router's tokenizer comes from there
    assert build_parser().parse_args(["quantize", tiny_gguf, "out", "--download-dir", cache]).download_dir == cache


def test_cli_names_a_truncated_weights_file_in_one_line(tiny_model_dir: Callable[[str], str], tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    with open(folder / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    line = assert_one_line_refusal(run_cli("serve", str(folder)), str(folder / "model.safetensors"))
    assert "copy or download the model again" in line


def test_cli_refuses_a_cache_it_cannot_create_in_one_line(tiny_gguf: str, tmp_path: Path) -> None:
    below_a_file = tmp_path / "a-file"
    below_a_file.write_text("")
    cache = str(below_a_file / "cache")
    line = assert_one_line_refusal(run_cli("serve", tiny_gguf, "--download-dir", cache), cache)
    assert "point --download-dir" in line


def test_cli_refuses_a_read_only_home_cache_in_one_line(tiny_gguf: str, tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True)
    wrapper = read_only_wrapper(str(home / ".cache"))
    result = subprocess.run(
        [*wrapper, sys.executable, "-P", "-m", "cadence.server.cli", "serve", tiny_gguf],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
        env={**os.environ, "HOME": str(home)},
    )
    line = assert_one_line_refusal(result, str(home / ".cache" / "cadence"))
    assert "point --download-dir" in line


def test_cli_refuses_a_corrupt_read_only_cache_naming_the_folder(tiny_gguf: str, tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    folder = convert_gguf(tiny_gguf, cache)
    overwrite_keeping_size(os.path.join(folder, "model.safetensors"))
    result = run_cli("serve", tiny_gguf, "--download-dir", cache, wrapper=read_only_wrapper(cache))
    line = assert_one_line_refusal(result, folder)
    assert "cannot be trusted: model.safetensors does not match its checksum" in line and "delete that folder" in line
    assert checksum_problem(folder) is not None  # refused, not served, and left for the user to delete

"""Convert a llama-architecture GGUF file into a Hugging Face folder, once, into a cache.

The rest of Cadence loads HF folders (config.json + safetensors + tokenizer files), so a
GGUF is dequantized with the `gguf` package, its tensors renamed to HF names, and the
llama.cpp row permutation of the Q/K projections undone. The folder is cached under
`<cache_root>/<file stem>-<key>/`, keyed on the file's size, mtime and header bytes so an
edited or replaced file converts again, and published with one atomic rename so a crash
never leaves a folder that a later start would trust. A checksum of every converted file,
written last, is checked at every start: a folder changed since it was written is
converted again, never served.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from cadence.engine.cache_checksums import checksum_problem, record_checksum, write_checksums
from cadence.engine.model_files_error import CACHE_HINT, ModelFilesError
from cadence.tokenization.gguf_tokenizer import save_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_CACHE_ROOT = os.path.join("~", ".cache", "cadence")
# Part of every cache key: bump it when the converted layout changes, so that folders
# written by an older converter are not reused.
CONVERTER_VERSION = 2
_HEADER_BYTES = 1 << 16
_PARTIAL = ".partial-"
# Names the GGUF a folder came from, so `--quantization gguf` can read its quantized blocks.
SOURCE_FILE = "gguf_source.json"

# GGUF per-layer tensor names -> HF Llama module names.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# HF module -> its GGUF per-layer name part (the projections' blocks are read back by name).
HF_TO_GGUF = {hf: part for part, hf in _LAYER_NAMES.items()}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def cache_key(gguf_path: str) -> str:
    """A short key that changes when the file (or the converter) changes.

    Size and mtime catch a rewritten file; the header bytes catch a different file copied
    in with the same size and an old mtime. Hashing all the data would cost seconds.
    """
    stat = os.stat(gguf_path)
    digest = hashlib.sha256(f"v{CONVERTER_VERSION}:{stat.st_size}:{stat.st_mtime_ns}:".encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(_HEADER_BYTES))
    return digest.hexdigest()[:16]


def cached_folder(gguf_path: str, cache_root: str = DEFAULT_CACHE_ROOT) -> str:
    """Where `convert_gguf` puts (or finds) the converted folder for this file."""
    stem = os.path.basename(gguf_path)
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem)
    return os.path.join(os.path.abspath(os.path.expanduser(cache_root)), f"{stem}-{cache_key(gguf_path)}")


def convert_gguf(gguf_path: str, cache_root: str | None = None) -> str:
    """Return an HF folder with the GGUF's weights, config and tokenizer, converting on a miss.

    A cached folder is used only when every file matches the checksums written last by
    its conversion (engine/cache_checksums.py); one that does not is converted again, with
    a warning. `cache_root` None means DEFAULT_CACHE_ROOT.

    Raises FileNotFoundError for a missing file, ValueError for a GGUF that is not a
    llama-architecture model or holds tensors we cannot map or dequantize, and
    ModelFilesError (one line, naming the folder and what to do) where the cache cannot be
    written or a corrupt folder in it cannot be replaced.
    """
    gguf_path = os.path.abspath(os.path.expanduser(gguf_path))
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    final = cached_folder(gguf_path, cache_root or DEFAULT_CACHE_ROOT)
    parent = os.path.dirname(final)
    try:
        if os.path.isdir(final):
            problem = checksum_problem(final)
            if problem is None:
                _point_source_at(final, gguf_path)
                return final
            _set_aside(final, problem)
        return _convert_into(gguf_path, final)
    except OSError as error:
        if isinstance(error, ModelFilesError) or not _is_cache_write_failure(error, parent):
            raise
        raise ModelFilesError(
            f"cannot write the converted model into {parent} ({error.strerror or error}); {CACHE_HINT} "
            "that is writable and has room for it"
        ) from error


def _convert_into(gguf_path: str, final: str) -> str:
    """Convert into a partial folder beside `final`, then publish it with one rename."""
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    _remove_orphaned_partials(final)
    # The pid in the name lets a later run tell a crashed conversion from a live one.
    partial = tempfile.mkdtemp(prefix=f"{os.path.basename(final)}{_PARTIAL}{os.getpid()}-", dir=parent)
    logger.info("converting %s once into %s", gguf_path, final)
    try:
        write_hf_folder(gguf_path, partial)
        write_checksums(partial)  # last: a folder without it is never trusted
        try:
            os.replace(partial, final)
        except OSError:
            if not os.path.isdir(final):
                raise
            shutil.rmtree(partial, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return final


def _set_aside(final: str, problem: str) -> None:
    """Take a folder that failed its checksums out of the way of the conversion that replaces it.

    It is renamed like a partial conversion of this process, so that if we die before it
    is deleted, the next start deletes it (`_remove_orphaned_partials`).
    """
    doomed = f"{final}{_PARTIAL}{os.getpid()}-corrupt-{os.urandom(4).hex()}"
    try:
        os.rename(final, doomed)
    except FileNotFoundError:
        return  # another start set it aside first
    except OSError as error:
        raise ModelFilesError(
            f"the cached model {final} cannot be trusted: {problem}; it cannot be converted again there "
            f"({error.strerror or error}): delete that folder, or {CACHE_HINT}"
        ) from error
    logger.warning("the cached model %s cannot be trusted: %s; converting it again", final, problem)
    shutil.rmtree(doomed, ignore_errors=True)


def _is_cache_write_failure(error: OSError, cache_parent: str) -> bool:
    """Whether an OSError came from writing the cache (not from reading the GGUF): a
    read-only or full disk, or a path in the cache or on the way to it."""
    if error.errno in (errno.EROFS, errno.ENOSPC, errno.EDQUOT):
        return True
    if not isinstance(error.filename, str):
        return False
    name = os.path.abspath(error.filename)
    return os.path.commonpath([name, cache_parent]) in (name, cache_parent)


def _point_source_at(folder: str, gguf_path: str) -> None:
    """Record where the file is now: the cache key ignores the file's location, so a moved
    file finds its old folder, and `--quantization gguf` must read the file from here."""
    marker = os.path.join(folder, SOURCE_FILE)
    if not os.path.isfile(marker):
        return
    with open(marker, encoding="utf-8") as f:
        source = json.load(f)
    if source.get("gguf_path") == gguf_path:
        return
    partial = f"{marker}{_PARTIAL}{os.getpid()}"
    _write_json(partial, {**source, "gguf_path": gguf_path})
    os.replace(partial, marker)
    record_checksum(folder, SOURCE_FILE)


def _remove_orphaned_partials(final: str) -> None:
    """Delete half-written folders for this model left by conversions that died."""
    parent, prefix = os.path.dirname(final), os.path.basename(final) + _PARTIAL
    for name in os.listdir(parent):
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """The file's key/value metadata as plain Python values (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def write_hf_folder(gguf_path: str, folder: str) -> None:
    """Convert `gguf_path` into `folder` (config, generation config, safetensors, tokenizer)."""
    reader = GGUFReader(gguf_path)
    metadata = read_metadata(reader)
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"{os.path.basename(gguf_path)}: GGUF architecture {arch!r} is not supported; "
            "only 'llama' (Llama, Mistral, SmolLM2 GGUFs) can be converted"
        )
    config = hf_config(metadata, reader)
    tensors = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        weight = _dequantized(tensor)
        # llama.cpp interleaves the two RoPE halves of every Q/K head; HF keeps them apart.
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_rope_rows(weight, config["num_attention_heads"])
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_rope_rows(weight, config["num_key_value_heads"])
        tensors[name] = weight
    dtype = _lossless_dtype(tensors.values())
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    weights = {name: tensor.to(dtype).contiguous() for name, tensor in tensors.items()}
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(folder, "config.json"), config)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": _generation_eos(metadata)}
    _write_json(os.path.join(folder, "generation_config.json"), {k: v for k, v in generation.items() if v is not None})
    save_tokenizer(metadata, folder)
    _write_json(
        os.path.join(folder, SOURCE_FILE), {"gguf_path": os.path.abspath(gguf_path), "tensors": tensor_index(reader)}
    )


def tensor_index(reader: GGUFReader) -> dict[str, dict[str, Any]]:
    """Where each tensor's raw bytes lie in the file, so they can be read without parsing
    the whole header again (for SmolLM2 that parse, mostly the vocabulary, takes seconds)."""
    return {
        t.name: {"type": t.tensor_type.name, "offset": int(t.data_offset), "shape": [int(d) for d in t.data.shape]}
        for t in reader.tensors
    }


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head, rows (0, h, 1, h+1, ...) -> (0, 1, ..., h, ...).

    llama.cpp's converter views each head's rows as (2 halves, head_dim/2) and transposes
    them so the two members of a rotary pair sit side by side. Transposing back restores the
    HF layout, where the first half of a head's rows rotates against the second.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def hf_config(metadata: dict[str, Any], reader: GGUFReader) -> dict[str, Any]:
    """An HF LlamaForCausalLM config.json built from the GGUF's `llama.*` metadata."""

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata is missing llama.{key}")
        return value

    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # some files store one count per layer
        if len(set(kv_heads)) != 1:
            raise ValueError("GGUF with a different number of KV heads per layer is not supported")
        kv_heads = kv_heads[0]
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("GGUF with RoPE on part of each head is not supported")
    names = {tensor.name: tensor for tensor in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF with per-frequency RoPE factors (rope_freqs, Llama 3.1 style) is not supported")
    if "token_embd.weight" not in names:
        raise ValueError("GGUF has no token_embd.weight tensor")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        # The embedding's row count is the true vocabulary; llama.vocab_size is optional.
        "vocab_size": int(names["token_embd.weight"].shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length")),
        # GGUF stores these as float32; printing through float32 recovers e.g. 1e-05.
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(metadata),
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }


def _rope_scaling(metadata: dict[str, Any]) -> dict[str, Any] | None:
    kind = metadata.get("llama.rope.scaling.type", "none")
    factor = metadata.get("llama.rope.scaling.factor", metadata.get("llama.rope.scale_linear"))
    if kind == "none" and factor is None:
        return None
    if kind in ("none", "linear") and factor is not None:
        return None if float(factor) == 1.0 else {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn" and factor is not None:
        original = metadata.get("llama.rope.scaling.original_context_length")
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": _f32(factor)}
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise ValueError(f"GGUF RoPE scaling {kind!r} is not supported")


def _generation_eos(metadata: dict[str, Any]) -> int | list[int] | None:
    # Chat models often end a turn with an end-of-turn token distinct from EOS.
    ids = [metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    unique = [int(i) for i in dict.fromkeys(i for i in ids if i is not None)]
    return None if not unique else unique[0] if len(unique) == 1 else unique


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def _dequantized(tensor: Any) -> torch.Tensor:
    """The tensor as float32 in torch (row-major, HF) shape."""
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as error:
        raise ValueError(f"cannot dequantize {tensor.name} of type {tensor.tensor_type.name}: {error}") from error
    # GGUF lists dimensions fastest-first; torch wants them slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def _lossless_dtype(tensors: Any) -> torch.dtype:
    """The narrowest dtype that holds every dequantized value exactly.

    F16/BF16 files keep their width. Q4_1/Q8_0 values (an f16 scale times a small integer,
    plus an f16 offset) need more mantissa bits than bf16 (8) or fp16 (11) have, so
    quantized files, SmolLM2's included, are stored as float32.
    """
    tensors = list(tensors)
    for dtype in (torch.bfloat16, torch.float16):
        if all(torch.equal(t.to(dtype).to(torch.float32), t) for t in tensors):
            return dtype
    return torch.float32


def _f32(value: Any) -> float:
    return float(str(np.float32(value)))


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")

"""Where an offloaded expert's weights live, and how they reach a slot.

Each expert is a list of ``TensorCopy``: a source tensor and the rows of a slot tensor it
fills. With ``host`` the sources are the expert's own tensors as the engine runs them
(quantized when the model is), in host memory (pinned on CUDA, so copies are
asynchronous). With ``disk`` they are views of memory-mapped files: a dense expert's
gate, up and down rows straight from the checkpoint's safetensors (cast to the model's
dtype as they are copied), a quantized expert's packed tensors from a spill file written
once at load. A mapped view's pages are released after each copy, so resident memory
holds the slots and not the experts.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch
from torch import nn

from cadence.engine.experts.mapped_file import MappedFile, MappedTensor


def slot_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor that makes an expert what it is: parameters and buffers (persistent or
    not), by name. A slot with the same names and shapes becomes the expert by copying."""
    tensors = {name: p.data for name, p in module.named_parameters()}
    tensors.update((name, b) for name, b in module.named_buffers() if b is not None)
    return tensors


@dataclass(frozen=True)
class TensorCopy:
    """``src`` fills rows ``row`` to ``row + len(src)`` of the slot tensor ``dst``."""

    dst: str
    row: int
    src: torch.Tensor
    mapped: MappedTensor | None = None  # the file range behind ``src``, released after copying


@dataclass(frozen=True)
class ExpertSource:
    copies: tuple[TensorCopy, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.src.numel() * c.src.element_size() for c in self.copies)

    def copy_into(self, tensors: dict[str, torch.Tensor], non_blocking: bool = False) -> int:
        """Fill a slot's tensors with this expert; the bytes read."""
        for c in self.copies:
            dst = tensors[c.dst]
            if c.row or c.src.shape[0] != dst.shape[0]:
                dst = dst.narrow(0, c.row, c.src.shape[0])
            dst.copy_(c.src, non_blocking=non_blocking)
            if c.mapped is not None:
                c.mapped.release()
        return self.nbytes

    def bind_into(self, module: nn.Module) -> None:
        """Make a slot's tensors these very sources (each fills its whole tensor): no copy."""
        for c in self.copies:
            owner, _, name = c.dst.rpartition(".")
            sub = module.get_submodule(owner)
            if c.row or tuple(c.src.shape) != tuple(getattr(sub, name).shape):
                raise ValueError(f"{c.dst}: a source that fills part of a tensor cannot be bound")
            if name in sub._parameters:
                param = sub._parameters[name]
                assert param is not None
                param.data = c.src
            else:
                sub._buffers[name] = c.src


def host_source(expert: nn.Module, pin: bool) -> ExpertSource:
    """An expert built on the device, moved to host memory (pinned for async copies)."""
    copies = []
    for name, tensor in slot_tensors(expert).items():
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
        host.copy_(tensor)
        copies.append(TensorCopy(name, 0, host))
    return ExpertSource(tuple(copies))


class SpillFile:
    """Quantized experts written once, one after another, then mapped: the disk store for
    formats the checkpoint does not hold. Unlinked at once, so it is gone with the process."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        # Open for the engine's life: the mapped views read it until the process ends.
        self.handle = tempfile.TemporaryFile(dir=directory, prefix="cadence-experts-")  # noqa: SIM115
        self.entries: list[list[tuple[str, int, torch.dtype, tuple[int, ...]]]] = []
        self.file: MappedFile | None = None

    def append(self, expert: nn.Module) -> int:
        """Write an expert's tensors; its index in the file."""
        entry = []
        for name, tensor in slot_tensors(expert).items():
            data = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
            entry.append((name, self.handle.tell(), tensor.dtype, tuple(tensor.shape)))
            self.handle.write(data.tobytes())
            pad = -self.handle.tell() % 64  # keep every view aligned
            self.handle.write(b"\0" * pad)
        self.entries.append(entry)
        return len(self.entries) - 1

    def sources(self) -> list[ExpertSource]:
        """Every appended expert, as views of the finished file."""
        self.handle.flush()
        self.file = MappedFile(f"/proc/self/fd/{self.handle.fileno()}")
        out = []
        for entry in self.entries:
            views = [self.file.view(offset, dtype, shape) for _, offset, dtype, shape in entry]
            out.append(ExpertSource(tuple(TensorCopy(name, 0, v.tensor, v) for (name, *_), v in zip(entry, views))))
        self.file.release()
        return out

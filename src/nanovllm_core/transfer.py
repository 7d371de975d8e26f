"""Host lists to device tensors without making the CPU wait for the GPU.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, and such a copy
is synchronous: the CPU stops until the GPU has finished everything queued before it, so
the next step cannot be prepared while this one runs. Copying from pinned (page-locked)
memory with ``non_blocking=True`` is queued like a kernel and returns at once; PyTorch's
pinned-memory allocator keeps the buffer alive until the copy has run. This is how vLLM's
GPU model runner ships each step's ``input_ids``, ``positions`` and ``slot_mapping``.

On the CPU both are plain tensors; nothing changes there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D tensor ``[len(values)]`` of ``dtype`` on ``device``, copied without a sync on CUDA."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class Staging:
    """Several host lists of one dtype gathered while a step is planned, then copied in ONE transfer.

    ``add`` returns a handle; after :meth:`upload`, ``tensors[handle]`` is that list's slice
    of the device buffer (1-D, contiguous). One copy per step instead of one per list.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.values: list[int] = []
        self.spans: list[tuple[int, int]] = []

    def add(self, values: Sequence[int]) -> int:
        """Queue ``values``; returns the handle of its slice."""
        self.spans.append((len(self.values), len(values)))
        self.values.extend(values)
        return len(self.spans) - 1

    def upload(self, device: torch.device) -> list[torch.Tensor]:
        """Copy everything queued to ``device``; one 1-D tensor per :meth:`add`, in order."""
        buffer = to_device(self.values, self.dtype, device)
        return [buffer[start:start + n] for start, n in self.spans]

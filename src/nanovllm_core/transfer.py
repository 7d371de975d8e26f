"""Host lists to device tensors without making the CPU wait for the GPU.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, and such a copy
is synchronous: the CPU stops until the GPU has finished everything queued before it, so
the next step cannot be prepared while this one runs. Copying from pinned (page-locked)
memory with ``non_blocking=True`` is queued like a kernel and returns at once; PyTorch's
pinned-memory allocator keeps the buffer alive until the copy has run. This is how vLLM's
GPU model runner ships each step's ``input_ids``, ``positions`` and ``slot_mapping``.

On the CPU there is no transfer: a list becomes a tensor over a NumPy array built from it
(``np.array`` parses a short list of Python ints in a fraction of what ``torch.tensor``'s
generic sequence parser takes, and ``torch.from_numpy`` shares that memory), the same values
in the same dtype. The engine builds several such tensors every step, so at batch-1 decode on
the CPU this is part of the per-token overhead (issue 27).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# dtypes the CPU path builds through NumPy (same conversion of Python numbers: exact for
# integers in range, round-to-nearest for float32); any other dtype goes through torch.tensor.
_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def _host(values: Sequence[int] | Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a new 1-D CPU tensor ``[len(values)]`` of ``dtype``."""
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        return torch.tensor(values, dtype=dtype)
    return torch.from_numpy(np.array(values, dtype=np_dtype))


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D tensor ``[len(values)]`` of ``dtype`` on ``device``, copied without a sync on CUDA."""
    if device.type == "cpu":
        return _host(values, dtype)
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
        if device.type == "cpu" and self.dtype in _NUMPY_DTYPES:  # no copy: slices of one NumPy array, shared
            host = np.array(self.values, dtype=_NUMPY_DTYPES[self.dtype])
            return [torch.from_numpy(host[start:start + n]) for start, n in self.spans]
        buffer = to_device(self.values, self.dtype, device)
        return [buffer[start:start + n] for start, n in self.spans]

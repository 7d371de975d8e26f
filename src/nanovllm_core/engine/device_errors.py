"""Which step failures the engine can recover from by retrying each request alone.

On the CPU an exception in a step is local: the engine retries each sequence by itself and
finishes only those that still fail. On CUDA that holds for running out of memory (a
smaller batch may fit) but not for the other CUDA errors: after a device-side assert (an
index out of range inside a kernel, say) or an illegal memory access the CUDA context is
broken, every later kernel launch fails with the same error, and retrying would only report
it once per request. Those errors end the engine: reported once, every live request finished
with the error (vLLM's engine core likewise shuts down on an error it cannot attribute to
one request).
"""

from __future__ import annotations

import torch

# Text PyTorch puts in the RuntimeError it raises for a failed CUDA, cuBLAS or cuDNN call.
_CUDA_ERROR_MARKERS = ("CUDA error", "CUDA driver error", "CUBLAS_STATUS", "CUDNN_STATUS", "cuDNN error",
                       "device-side assert", "illegal memory access")


def is_fatal_device_error(error: BaseException, device: torch.device) -> bool:
    """True when ``error`` leaves ``device`` unusable for every request, not just the failing one.

    Only on CUDA, and never for ``torch.cuda.OutOfMemoryError`` (recoverable: fewer tokens at
    once may fit). Python errors raised by our own checks (a ``ValueError``, say) stay per request.
    """
    if device.type != "cuda" or isinstance(error, torch.cuda.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8 raises this for CUDA errors
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _CUDA_ERROR_MARKERS)

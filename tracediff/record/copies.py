"""Moving tensors to host memory as raw bits, without importing torch unless one is passed in.

The caller of ``log`` pays only for starting a copy: a CUDA tensor is copied non-blocking into
pinned memory and a CUDA event marks when it is done; the writer thread waits on that event.
Tensors a trace cannot hold are recognised here, before any copy (``unrecordable``), so that one
never reaches the writer thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tracediff.trace.dtypes import tag_of
from tracediff.trace.schema import MAX_NDIM

PAGE = 4096  # the least host memory one pinned (page-locked) allocation takes

if TYPE_CHECKING:
    import torch

_TORCH_TAGS: dict[Any, str] | None = None
_STRIDED: Any = None  # torch.strided, once torch is known to be loaded


# the numpy dtype a tensor of each tag is copied into (bfloat16: its bits, as int16 like torch's view)
_NUMPY_OF: dict[str, np.dtype] = {
    tag: np.dtype(tag)
    for tag in ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")
}
_NUMPY_OF["bfloat16"] = np.dtype(np.int16)


def is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _torch_tags() -> dict[Any, str]:
    global _TORCH_TAGS, _STRIDED
    if _TORCH_TAGS is None:
        import torch

        _STRIDED = torch.strided
        _TORCH_TAGS = {
            torch.float64: "float64", torch.float32: "float32", torch.float16: "float16",
            torch.bfloat16: "bfloat16", torch.int64: "int64", torch.int32: "int32",
            torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool",
        }
    return _TORCH_TAGS


def tag_of_tensor(x: Any) -> str:
    """The dtype tag of a torch tensor or numpy array."""
    if is_torch_tensor(x):
        try:
            return _torch_tags()[x.dtype]
        except KeyError:
            raise ValueError(f"dtype {x.dtype} cannot be recorded") from None
    return tag_of(np.asarray(x).dtype)


def unrecordable(x: Any) -> str | None:
    """Why a trace cannot hold this tensor (an unknown dtype, more dims than every format holds, no
    data: a meta tensor, a sparse layout), or None; cheap enough for every ``log`` call."""
    if is_torch_tensor(x):
        if x.dtype not in _torch_tags():
            return f"dtype {x.dtype}"
        if x.is_meta:
            return "meta tensor (no data)"
        if x.layout is not _STRIDED:
            return f"layout {x.layout}"
        ndim = x.dim()
    else:
        try:
            tag_of(np.asarray(x).dtype)
        except (TypeError, ValueError):
            return f"dtype {np.asarray(x).dtype}"
        ndim = np.ndim(x)
    return f"{ndim} dims (at most {MAX_NDIM})" if ndim > MAX_NDIM else None


def host_bytes(x: Any) -> int:
    """Host memory a copy of ``x`` holds: its bytes, or for a CUDA tensor the pinned block torch's
    caching host allocator gives it (rounded up to a power of two, at least a page)."""
    if not is_torch_tensor(x):
        return int(np.asarray(x).nbytes)
    nbytes = int(x.nelement() * x.element_size())
    return max(PAGE, 1 << max(nbytes - 1, 0).bit_length()) if x.is_cuda else nbytes


class HostCopy:
    """A copy of a tensor in host memory; ``numpy()`` waits for it (CUDA) and returns raw bits."""

    __slots__ = ("tag", "_buffer", "_event")

    def __init__(self, x: Any) -> None:
        self.tag = tag_of_tensor(x)
        self._buffer: np.ndarray | torch.Tensor
        self._event: torch.cuda.Event | None = None
        if not is_torch_tensor(x):
            self._buffer = np.array(x, copy=True, order="C")
            return
        import torch

        x = x.detach()
        if x.is_cuda:
            self._buffer = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            self._buffer.copy_(x, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            return
        # anywhere else (CPU, another accelerator): torch copies into memory numpy owns, and the
        # writer thread never holds a torch object. Freeing a torch tensor releases the GIL inside
        # C++ code; a writer abandoned at exit that did so as the interpreter finalized was ended
        # there by CPython (pthread_exit), and the unwinding aborted the host (std::terminate)
        buffer = np.empty(tuple(x.shape), dtype=_NUMPY_OF[self.tag])
        target = torch.from_numpy(buffer)
        (target.view(torch.bfloat16) if self.tag == "bfloat16" else target).copy_(x)
        self._buffer = buffer.view(np.uint16) if self.tag == "bfloat16" else buffer

    def numpy(self) -> np.ndarray:
        buf = self._buffer
        if isinstance(buf, np.ndarray):
            return buf
        if self._event is not None:
            self._event.synchronize()
        if self.tag == "bfloat16":
            import torch

            return buf.view(torch.int16).numpy().view(np.uint16)
        return buf.numpy()


def to_int64(x: Any) -> np.ndarray:
    """Row keys (positions, token ids) as an int64 numpy array."""
    if is_torch_tensor(x):
        x = x.detach().cpu().numpy()
    return np.array(x, dtype=np.int64)  # a copy: the caller may reuse its array after log returns

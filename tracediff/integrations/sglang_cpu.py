"""Running SGLang's real model code in-process on a CPU-only machine (tests, the seed-bug script).

Not needed to record from a real server: there SGLang runs as built. On a machine without a GPU,
``import sglang`` needs triton (and a few modules torchvision), and the model constructors read
process-global state a server would have set up. ``prepare()`` does the least that makes SGLang
0.5.23's Llama target and EAGLE-3 draft build and run their ``forward_native`` paths:

1. import stubs: SGLang ships a triton stub for macOS (``sglang._platform_stubs``); we install it on
   any platform, and serve a torchvision stub to SGLang's own imports only;
2. torch.compile off (SGLang compiles a draft-loop helper; on CPU that is a C++ build of 5-25 s);
3. the rotary embedding told it runs on CPU (otherwise it imports ``vllm._custom_ops``).

``start(server_args, port)`` then publishes the server arguments the constructors read and starts a
world-size-1 gloo process group. Do not set ``SGLANG_USE_CPU_ENGINE=1``: it routes KV copies to a
CPU build of sgl-kernel that is not on PyPI.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import platform
import sys
from types import ModuleType
from typing import Any

SUPPORTED_SGLANG = ("0.5.23",)
_prepared = False


def sglang_missing() -> str | None:
    """Why SGLang's model code cannot run here (None when it can): the reason a test skips with."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (see docs/INTEGRATIONS.md for the CPU setup)"
    from importlib.metadata import version

    found = version("sglang")
    if found not in SUPPORTED_SGLANG:
        return f"sglang {found} is installed; the CPU harness supports {', '.join(SUPPORTED_SGLANG)}"
    return None


class _SglangOnlyStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a stub for ``prefixes`` to imports made from SGLang's own files, and to no one else,
    so a real torchvision elsewhere (or its absence) stays what it is for user code."""

    def __init__(self, prefixes: tuple[str, ...], stub_type: type[ModuleType]) -> None:
        self.prefixes = prefixes
        self.stub_type = stub_type

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not any(fullname == p or fullname.startswith(p + ".") for p in self.prefixes):
            return None
        frame: Any = sys._getframe(1)
        while frame is not None and ("importlib" in frame.f_code.co_filename
                                     or frame.f_code.co_filename.startswith("<frozen")):
            frame = frame.f_back
        if frame is None or f"{os.sep}sglang{os.sep}" not in frame.f_code.co_filename:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        return self.stub_type(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        return None


def _install_import_stubs() -> None:
    """SGLang's own triton stub (written for macOS, where triton does not exist), plus torchvision."""
    import torch

    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None
    path = os.path.join(os.path.dirname(spec.origin), "_platform_stubs.py")
    loader_spec = importlib.util.spec_from_file_location("_tracediff_sglang_stubs", path)
    assert loader_spec is not None and loader_spec.loader is not None
    stubs = importlib.util.module_from_spec(loader_spec)
    sys.modules[loader_spec.name] = stubs
    loader_spec.loader.exec_module(stubs)
    # install_platform_stubs() acts only on Apple silicon: let it believe it runs there, briefly.
    mps: Any = torch.backends.mps
    saved = sys.platform, platform.machine, mps.is_available
    sys.platform, platform.machine = "darwin", lambda: "arm64"
    mps.is_available = lambda: True
    try:
        stubs.install_platform_stubs()
    finally:
        sys.platform, platform.machine, mps.is_available = saved
    if importlib.util.find_spec("torchvision") is None:
        sys.meta_path.insert(0, _SglangOnlyStub(("torchvision",), stubs._MockModule))


def prepare() -> None:
    """Make ``import sglang`` and its Llama/EAGLE-3 model code work on this CPU; idempotent.
    Call before the first sglang import of the process."""
    global _prepared
    if _prepared:
        return
    reason = sglang_missing()
    if reason:
        raise RuntimeError(reason)
    if importlib.util.find_spec("triton") is None:
        _install_import_stubs()
    import torch._dynamo

    torch._dynamo.config.disable = True
    import sglang.srt.layers.rotary_embedding.base as rotary

    rotary._is_cpu = True
    from sglang.kernels.fused_op import KernelBackend, set_fused_op_backend

    set_fused_op_backend(KernelBackend.TORCH)
    _prepared = True


def start(server_args: Any, port: int) -> None:
    """Publish ``server_args`` (what SGLang's model constructors read) and start a world-size-1 gloo
    group on ``port`` (one port per concurrent process); the model-parallel groups follow."""
    prepare()
    import torch
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.runtime_context import SpawnRanks, publish

    publish(server_args, role="tracediff", ranks=SpawnRanks(world_rank=0))
    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
    if not model_parallel_is_initialized():
        initialize_model_parallel(backend="gloo")

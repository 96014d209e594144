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

``CpuServer`` is a mini-scheduler over those classes (EAGLE-3 prefill, decode and draft chains, and
``capture`` of training features), and ``tiny_checkpoint`` writes a tiny target and draft the way
they ship: scaffolding for the tests and for scripts, recorded through ``integrations.sglang``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import platform
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np

from tracediff.integrations.sglang import SUPPORTED_SGLANG

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


# ---- a CPU serving harness over SGLang's real classes (tests, and a user's script) -----------------------


def free_port() -> int:
    """A TCP port nothing listens on now, for this process's gloo group."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiny_checkpoint(workdir: str | os.PathLike, *, aux_ids: Sequence[int] | None = (1, 3, 5), layers: int = 8,
                    hidden: int = 64, vocab: int = 512, draft_vocab: int = 128, seed: int = 0
                    ) -> tuple[str, dict, str, dict]:
    """A tiny Llama target and EAGLE-3 draft written the way they ship: HF config directories and
    state dicts (the target's in HF names, the draft's in SpecForge's export names, d2t/t2d
    included); built from a fixed seed, nothing downloaded. Returns (target_dir, target_weights,
    draft_dir, draft_weights). ``aux_ids`` None leaves them out of the draft config (SGLang's default)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    heads, kv_heads, inter = 4, 2, 2 * hidden
    head_dim = hidden // heads
    common: dict[str, Any] = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                  num_attention_heads=heads, num_key_value_heads=kv_heads,
                                  max_position_embeddings=512, tie_word_embeddings=False)
    target_cfg = LlamaConfig(num_hidden_layers=layers, **common)
    target_cfg.architectures = ["LlamaForCausalLM"]
    draft_cfg = LlamaConfig(num_hidden_layers=1, **common)
    draft_cfg.architectures = ["LlamaForCausalLMEagle3"]
    draft_cfg.draft_vocab_size = draft_vocab
    draft_cfg.target_hidden_size = hidden
    if aux_ids is not None:
        draft_cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(aux_ids),
                                  "use_aux_hidden_state": True}
    target_dir, draft_dir = os.path.join(workdir, "tiny_target"), os.path.join(workdir, "tiny_draft")
    target_cfg.save_pretrained(target_dir)
    draft_cfg.save_pretrained(draft_dir)
    torch.manual_seed(seed)
    target = LlamaForCausalLM(target_cfg)
    g = torch.Generator().manual_seed(seed + 1)
    hot = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values  # draft i -> target hot[i]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    k = len(aux_ids) if aux_ids is not None else 3

    def rnd(*shape: int, base: float = 0.0) -> torch.Tensor:
        return base + torch.randn(*shape, generator=g) * 0.05

    draft = {
        "fc.weight": rnd(hidden, k * hidden), "norm.weight": rnd(hidden, base=1),
        "lm_head.weight": rnd(draft_vocab, hidden), "d2t": hot - torch.arange(draft_vocab), "t2d": t2d,
        **{f"midlayer.{norm}.weight": rnd(hidden, base=1)
           for norm in ("hidden_norm", "input_layernorm", "post_attention_layernorm")},
        "midlayer.self_attn.q_proj.weight": rnd(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rnd(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rnd(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rnd(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rnd(inter, hidden),
        "midlayer.mlp.up_proj.weight": rnd(inter, hidden),
        "midlayer.mlp.down_proj.weight": rnd(hidden, inter),
    }
    weights = {name: value.detach().clone() for name, value in target.state_dict().items()}
    return target_dir, weights, draft_dir, draft


@dataclass
class Features:
    """What a SpecForge training step reads for one prompt, from SGLang's target code."""

    input_ids: list[int]
    aux: Any  # [L, K*H]: the packed aux hidden states (LogitsProcessorOutput.hidden_states)
    last_hidden: Any  # [L, H]: the last hidden state after the final norm
    logits: Any  # [L, V]: last_hidden through the target's lm_head


@dataclass(frozen=True)
class ServedChain:
    """One chain ``EagleDraftWorker.draft_forward`` returned: the target-vocab tokens it drafted
    from request ``rid``'s row ``anchor`` (the last row of a forward), for positions anchor + 2 on."""

    rid: str
    anchor: int
    tokens: tuple[int, ...]

    def accepted(self, text: Sequence[int]) -> int | None:
        """What a greedy verify accepts of this chain against the request's final ``text`` (prompt +
        output): 1 + the leading drafts equal to the target's tokens; None where a drafted position
        lies past the text (the chain reaches past what was generated), whatever its outcome."""
        if self.anchor + 1 + len(self.tokens) >= len(text):
            return None
        for depth, token in enumerate(self.tokens):
            if text[self.anchor + 2 + depth] != token:
                return 1 + depth
        return 1 + len(self.tokens)


@dataclass
class _Running:
    """One request in the harness: SGLang's Req, its KV row, and the draft's state for its next chain."""

    req: Any
    pool_index: int
    tokens: list[int]  # prompt + output so far
    fed: int = 0  # positions whose KV (target and draft) is written
    draft_input: Any = None  # (topk_p, topk_index, hidden) for the next draft chain


class CpuServer:
    """A mini-scheduler over SGLang's real classes on CPU: LlamaForCausalLM and LlamaForCausalLMEagle3
    loaded through their own ``load_weights``, real KV pools, TorchNativeAttnBackend, LogitsProcessor,
    and ``EagleDraftWorker.draft_forward`` (topk = 1) called on a stand-in worker as the server's
    worker would call it. Scaffolding for tests and scripts, not a server: one process, float32,
    greedy, requests prefilled one at a time (a later one reuses an earlier one's KV for a shared
    prefix, as SGLang's radix cache does), then decoded together one token per step.

    Verify does not run here (SGLang's verify needs CUDA kernels): after each target step the
    draft extends the new row and drafts its chain, and the drafts are recorded, not verified.
    Each batch calls ``tracediff.integrations.sglang.batch_context`` with its ``Req`` objects, the
    same call a server's scheduler patch makes, so rows are keyed the same way on CPU and GPU.
    ``num_draft_tokens``: what the user asks for (default ``num_steps + 1``); SGLang's own
    resolution then sets what the server uses (with topk 1: ``num_steps + 1``, a warning only).
    ``recorder``: install tracediff's recording (else nothing is recorded unless the launcher's
    plugin attached itself as the models loaded). ``family``: a target family of the test bed
    (``testbed.sglang_family_configs``, e.g. ``deepseek_v2``) whose checkpoint ``target_dir``
    holds, loaded through SGLang's loader with that family's KV pool and server arguments."""

    def __init__(self, target_dir: str, target_weights: dict, draft_dir: str | None = None,
                 draft_weights: dict | None = None, *, num_steps: int = 3,
                 num_draft_tokens: int | None = None, port: int | None = None,
                 recorder: Any = None, served_model_name: str = "tiny-llama", max_requests: int = 32,
                 max_len: int = 256, family: str | None = None, **record_options: Any) -> None:
        prepare()
        from sglang.srt.server_args import ServerArgs
        from transformers import AutoConfig

        spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=draft_dir,
                    speculative_num_steps=num_steps, speculative_eagle_topk=1,
                    speculative_num_draft_tokens=num_draft_tokens or num_steps + 1) if draft_dir else {}
        self.family = None if family is None else _family(family)
        args = dict(model_path=target_dir, served_model_name=served_model_name, device="cpu",
                    attention_backend="torch_native", dtype="float32", skip_tokenizer_init=True,
                    disable_cuda_graph=True, tp_size=1, **spec)
        self.server_args = ServerArgs(**{**args, **(self.family.server_args if self.family else {})})
        if draft_dir:  # resolve the speculative arguments as SGLang's launcher does (topk 1 clamps)
            from sglang.srt.arg_groups.speculative_hook import _handle_eagle_family

            _handle_eagle_family(self.server_args)
        start(self.server_args, port or free_port())
        from sglang.srt.models.llama import LlamaForCausalLM
        from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

        if self.family is None:
            self.target = LlamaForCausalLM(AutoConfig.from_pretrained(target_dir)).eval()
            self.target.load_weights(list(target_weights.items()))
        else:  # the family's checkpoint in target_dir, through SGLang's loader (target_weights unused)
            from testbed.sglang_families import load_target

            self.target = load_target(self.server_args)
        self.draft: Any = None
        self.num_steps = num_steps
        self.max_len, self.max_requests = max_len, max_requests
        self.aux_ids: list[int] | None = None
        if draft_dir:
            self.draft = LlamaForCausalLMEagle3(AutoConfig.from_pretrained(draft_dir)).eval()
            self.draft.load_weights(list((draft_weights or {}).items()))
            self._bind_draft_embedding()
            self.aux_ids = self._configure_aux_capture()
        self._make_pools()
        self.worker: Any = self._stand_in_worker() if self.draft is not None else None
        self.running: list[_Running] = []
        self.chains: list[ServedChain] = []  # every chain draft_forward returned, in order
        self._captured = 0
        self.installation: Any = None
        if recorder is not None:
            self.attach(recorder, **record_options)

    def attach(self, recorder: Any, **options: Any) -> Any:
        """Record this server into ``recorder`` through ``install`` (options: logits_topk, requests,
        match_prefix), replacing what an earlier call installed; returns the installation."""
        from tracediff.integrations.sglang import install

        self.close()
        self.installation = install(recorder, target=self.target, draft=self.draft, worker=self.worker,
                                    server_args=self.server_args, **options)
        return self.installation

    def close(self) -> None:
        """Detach the recording this server installed (the recorder stays open: the caller's)."""
        if self.installation is not None:
            self.installation.remove()
            self.installation = None

    # -- building ------------------------------------------------------------------------------

    def _make_pools(self) -> None:
        """One request-to-token table shared by target and draft, a KV pool each (as the server's
        draft worker shares the target's table and allocator, with its own KV cache)."""
        import torch
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        self.req_to_token = ReqToTokenPool(size=self.max_requests + 1, max_context_len=self.max_len,
                                           device="cpu", enable_memory_saver=False)
        self.size = (self.max_requests + 1) * self.max_len * 2
        self._next_slot = 1  # slot 0 is the padding slot

        def backend(config: Any) -> Any:
            heads = config.num_key_value_heads
            kv = MHATokenToKVPool(size=self.size, page_size=1, dtype=torch.float32, head_num=heads,
                                  head_dim=config.hidden_size // config.num_attention_heads,
                                  layer_num=config.num_hidden_layers, device="cpu", enable_memory_saver=False,
                                  enable_alt_stream=False)
            runner = SimpleNamespace(device="cpu", req_to_token_pool=self.req_to_token, token_to_kv_pool=kv)
            return TorchNativeAttnBackend(runner)

        if self.family is None:
            self.target_backend = backend(self.target.config)
        else:
            from testbed.sglang_families import attention_backend, kv_pool

            kv = kv_pool(self.family, self.target.config, self.size)
            self.target_backend = attention_backend(self.family, self.req_to_token, kv)
        self.draft_backend: Any = backend(self.draft.config) if self.draft is not None else None

    def _bind_draft_embedding(self) -> None:
        """What EagleDraftWorker.init_lm_head does: the draft embeds with the target's embedding
        (and takes its lm_head too when the draft config names no draft vocab)."""
        assert self.draft is not None
        embed, head = self.target.get_embed_and_head()
        if self.draft.load_lm_head_from_target:
            self.draft.set_embed_and_head(embed, head)
        else:
            self.draft.set_embed(embed)

    def _configure_aux_capture(self) -> list[int] | None:
        """The aux layer ids exactly as a server resolves them from the draft config."""
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
            configure_aux_hidden_state_capture,
        )
        from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
            resolve_spec_aux_hidden_state_config,
        )
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        resolved = resolve_spec_aux_hidden_state_config(
            server_args=self.server_args, model_config=ModelConfig.from_server_args(self.server_args),
            spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE3"), is_draft_worker=False)
        configure_aux_hidden_state_capture(
            model=self.target, eagle_use_aux_hidden_state=resolved.eagle_use_aux_hidden_state,
            eagle_aux_hidden_state_layer_ids=resolved.eagle_aux_hidden_state_layer_ids,
            dflash_use_aux_hidden_state=False, dflash_target_layer_ids=None, is_dspark=False)
        ids = resolved.eagle_aux_hidden_state_layer_ids
        return None if ids is None else list(ids)

    def _stand_in_worker(self) -> Any:
        """The attributes ``EagleDraftWorker.draft_forward`` reads on its worker, for topk = 1.
        Its runner runs the draft model; SGLang's multi-step draft backends (not on CPU) would
        offset seq_lens per step, which the runner does itself."""
        import torch

        draft, steps, server = self.draft, self.num_steps, self

        class Runner:
            model = draft
            model_config = SimpleNamespace(hf_config=draft.config, model_is_mrope=False)
            canary_manager = None

            def forward(self, fb: Any) -> Any:
                fb.seq_lens = fb.positions.to(torch.int64) + 1
                fb.seq_lens_cpu = fb.seq_lens.clone()
                fb.seq_lens_sum = int(fb.seq_lens.sum())
                table = server.req_to_token.req_to_token
                table[fb.req_pool_indices, fb.positions] = fb.out_cache_loc.to(torch.int32)
                return SimpleNamespace(logits_output=draft.forward(fb.input_ids, fb.positions, fb))

        bs = self.max_requests
        return SimpleNamespace(
            hot_token_id=draft.get_hot_token_id(), topk=1, speculative_num_steps=steps,
            speculative_num_draft_tokens=steps + 1, index_share_for_mtp_iteration=False,
            seed_dsa_topk_from_draft_extend=False, draft_runner=Runner(),
            _topk1_parents_prealloc=torch.zeros(bs, max(steps - 1, 1), dtype=torch.long),
            _topk1_score_indices_prealloc=torch.arange(steps).repeat(bs, 1),
            draft_attn_backend=SimpleNamespace(attn_backends=[self.draft_backend] * steps,
                                               init_forward_metadata=self.draft_backend.init_forward_metadata))

    # -- serving -------------------------------------------------------------------------------

    def serve(self, prompts: list[list[int]], new_tokens: int,
              rids: Sequence[str] | None = None) -> list[list[int]]:
        """Greedy speculative serving of ``prompts`` (token ids); returns each request's new tokens.
        ``rids``: one per prompt, distinct (SGLang refuses a rid already in flight; a rid of an
        earlier, finished call may be reused). Bad arguments raise ValueError before anything runs."""
        from tracediff.integrations.sglang import batch_context

        if self.draft is None:
            raise RuntimeError("serve needs a draft model")
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
            raise ValueError(f"new_tokens must be an int >= 1, got {new_tokens!r}")
        if not prompts:
            raise ValueError("no prompts to serve")
        if rids is None:
            rids = [f"req{len(self.running) + i}" for i in range(len(prompts))]
        if isinstance(rids, str) or not all(isinstance(rid, str) and rid for rid in rids):
            raise ValueError(f"rids must be a list of non-empty strings, one per prompt, got {rids!r}")
        if len(rids) != len(prompts):
            raise ValueError(f"{len(rids)} rids for {len(prompts)} prompts: give one rid per prompt")
        repeated = sorted(rid for rid, n in Counter(rids).items() if n > 1)
        if repeated:
            raise ValueError(f"duplicate rids in one call: {repeated} (SGLang refuses a rid already in "
                             "flight)")
        if len(self.running) + len(prompts) > self.max_requests:
            raise ValueError(f"{len(self.running)} requests served + {len(prompts)} new > max_requests "
                             f"{self.max_requests}: the harness keeps every request's KV for prefix reuse "
                             "and never frees it; build it with a larger max_requests")
        self._check_prompts(prompts, new_tokens)
        batch = [self._admit(rid, prompt, new_tokens) for rid, prompt in zip(rids, prompts)]
        for run in batch:
            batch_context([run.req])
            self._prefill(run)
        for _ in range(new_tokens - 1):
            batch_context([run.req for run in batch])
            self._decode(batch)
        return [list(run.req.output_ids) for run in batch]

    def _check_prompts(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> None:
        """A ValueError naming the first prompt that is empty, holds a token outside the vocab, or
        does not fit max_len with its new tokens (before anything runs: the harness stays usable)."""
        vocab = int(self.target.config.vocab_size)
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
                raise ValueError(f"prompt {i} is not a list of token ids: {prompt!r} (serve takes a list of "
                                 "prompts)")
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty: a request needs at least one token")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError(f"prompt {i} holds token ids that are not ints: {list(prompt)[:5]}")
            bad = [int(t) for t in prompt if not 0 <= int(t) < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside the vocab [0, {vocab}): {bad[:5]}")
            if len(prompt) + new_tokens > self.max_len:
                raise ValueError(f"prompt {i}: {len(prompt)} tokens + {new_tokens} new > max_len "
                                 f"{self.max_len}")

    def _admit(self, rid: str, prompt: Sequence[int], new_tokens: int) -> _Running:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid=rid, origin_input_text="", origin_input_ids=[int(t) for t in prompt],
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=new_tokens))
        run = _Running(req, len(self.running), list(req.origin_input_ids))
        self.running.append(run)
        return run

    def _capture_request(self, prompt: Sequence[int]) -> _Running:
        """A request of one forward, in the table's spare row (it is never served or cached)."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        self._captured += 1
        req = Req(rid=f"capture{self._captured}", origin_input_text="",
                  origin_input_ids=[int(t) for t in prompt],
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
        return _Running(req, self.max_requests, list(req.origin_input_ids))

    def _slots(self, n: int) -> Any:
        import torch

        if self._next_slot + n > self.size:
            raise RuntimeError("the harness's KV pool is full")
        self._next_slot += n
        return torch.arange(self._next_slot - n, self._next_slot)

    def _cached_prefix(self, run: _Running) -> int:
        """Reuse the KV an earlier request already wrote for a shared prefix, keeping at least one
        token to extend; returns the cached length. EAGLE keys SGLang's radix cache by bigrams
        (position t is cached only when tokens t and t+1 match: the draft's row t was fed t+1)."""
        best, source = 0, None
        for other in self.running:
            common = 0
            limit = min(len(other.tokens), len(run.tokens))
            while other is not run and common < limit and other.tokens[common] == run.tokens[common]:
                common += 1
            cached = min(common - 1, other.fed, len(run.tokens) - 1)
            if cached > best:
                best, source = cached, other
        if source is not None:
            table = self.req_to_token.req_to_token
            table[run.pool_index, :best] = table[source.pool_index, :best]
        return best

    def _batch(self, mode: Any, runs: list[_Running], ids: list[int], positions: list[int], lens: list[int],
               slots: Any, capture: Any, spec_info: Any = None) -> Any:
        import torch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        seq = [p + 1 for p in _last_positions(positions, lens)]
        fb = ForwardBatch(forward_mode=mode, batch_size=len(runs), input_ids=torch.tensor(ids),
                          req_pool_indices=torch.tensor([r.pool_index for r in runs]),
                          seq_lens=torch.tensor(seq), seq_lens_cpu=torch.tensor(seq), out_cache_loc=slots,
                          seq_lens_sum=sum(seq), positions=torch.tensor(positions))
        if mode.is_extend():
            prefix = [s - n for s, n in zip(seq, lens)]
            fb.extend_prefix_lens, fb.extend_prefix_lens_cpu = torch.tensor(prefix), prefix
            fb.extend_seq_lens, fb.extend_seq_lens_cpu = torch.tensor(lens), list(lens)
            fb.extend_num_tokens = sum(lens)
            fb.extend_start_loc = torch.tensor([0, *np.cumsum(lens)[:-1].tolist()])
        fb.capture_hidden_mode = capture
        fb.spec_info = spec_info
        return fb

    def _run(self, model: Any, backend: Any, fb: Any) -> Any:
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        backend.init_forward_metadata(fb)
        with forward_context(ForwardContext(attn_backend=backend), forward_batch=fb):
            return model.forward(fb.input_ids, fb.positions, fb)

    def _step(self, runs: list[_Running], starts: list[int], mode: Any) -> None:
        """One target forward over each run's tokens from ``starts[i]``, then the draft extend of the
        same rows (row t fed token t+1, the last one the token the target just chose) and a chain."""
        import torch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
        from sglang.srt.speculative.eagle_info import EagleDraftExtendInput
        from sglang.srt.speculative.spec_utils import fast_topk

        lens = [len(r.tokens) - s for r, s in zip(runs, starts)]
        positions = [p for r, s in zip(runs, starts) for p in range(s, len(r.tokens))]
        slots = self._slots(len(positions))
        at, table = 0, self.req_to_token.req_to_token
        for run, start, n in zip(runs, starts, lens):
            table[run.pool_index, start : start + n] = slots[at : at + n].to(torch.int32)
            at += n
        ids = [r.tokens[p] for r, s in zip(runs, starts) for p in range(s, len(r.tokens))]
        out = self._run(self.target, self.target_backend,
                        self._batch(mode, runs, ids, positions, lens, slots, CaptureHiddenMode.FULL))
        chosen = out.next_token_logits.argmax(-1).tolist()
        shifted = [t for r, s, c in zip(runs, starts, chosen) for t in [*r.tokens[s + 1 :], c]]
        spec = EagleDraftExtendInput(hidden_states=out.hidden_states, num_tokens_per_req=1,
                                     num_tokens_for_logprob_per_req=1)
        dout = self._run(self.draft, self.draft_backend, self._batch(
            ForwardMode.EXTEND, runs, shifted, positions, lens, slots, CaptureHiddenMode.LAST, spec))
        topk_p, topk_index = fast_topk(torch.softmax(dout.next_token_logits, -1), 1, dim=-1)
        for i, (run, token) in enumerate(zip(runs, chosen)):
            run.fed = len(run.tokens)
            run.draft_input = (topk_p[i : i + 1], topk_index[i : i + 1], dout.hidden_states[i : i + 1])
            run.req.output_ids.append(token)
            run.tokens.append(token)
        self._chain(runs)

    def _prefill(self, run: _Running) -> None:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        self._step([run], [self._cached_prefix(run)], ForwardMode.EXTEND)

    def _decode(self, runs: list[_Running]) -> None:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        self._step(runs, [len(r.tokens) - 1 for r in runs], ForwardMode.DECODE)

    def _chain(self, runs: list[_Running]) -> Any:
        """``EagleDraftWorker.draft_forward`` from each run's last draft row, as ``draft()`` calls it."""
        import torch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
        from sglang.srt.speculative.eagle_info import EagleDraftInput
        from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

        topk_p, topk_index, hidden = (torch.cat(parts) for parts in zip(*(r.draft_input for r in runs)))
        seq = torch.tensor([r.fed for r in runs])  # the chain's first token goes at the next position
        fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=len(runs), input_ids=None,
                          req_pool_indices=torch.tensor([r.pool_index for r in runs]), seq_lens=seq + 1,
                          seq_lens_cpu=seq + 1, out_cache_loc=self._slots(len(runs) * self.num_steps),
                          seq_lens_sum=int(seq.sum()) + len(runs), positions=seq.clone())
        fb.capture_hidden_mode = CaptureHiddenMode.LAST
        fb.spec_info = EagleDraftInput(topk_p=topk_p, topk_index=topk_index, hidden_states=hidden,
                                       capture_hidden_mode=CaptureHiddenMode.LAST, num_tokens_per_req=1,
                                       num_tokens_for_logprob_per_req=1)
        fb.sampling_info = SimpleNamespace(is_all_greedy=True)
        if self.num_steps > 1:
            self.worker.draft_attn_backend.init_forward_metadata(fb)
        result = EagleDraftWorker.draft_forward(self.worker, fb)
        drafted = result[2]  # [bs, num_steps] target-vocab tokens (topk 1: a chain per request)
        self.chains += [ServedChain(run.req.rid, run.fed - 1, tuple(int(t) for t in row))
                        for run, row in zip(runs, drafted.tolist())]
        return result

    def texts(self) -> dict[str, list[int]]:
        """Each request's prompt and output so far, by rid."""
        return {run.req.rid: list(run.tokens) for run in self.running}

    # -- capture (training features) ------------------------------------------------------------------

    def capture(self, prompts: list[list[int]], aux_ids: Sequence[int] | None) -> list[Features]:
        """The target's packed aux states, final hidden and logits for every token of each prompt,
        with ``aux_ids`` set through ``set_eagle3_layers_to_capture`` as SpecForge's SGLang capture
        backend sets its training config's ids; the serving ids are restored afterwards."""
        import torch
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

        from tracediff.integrations.sglang import batch_context

        self._check_prompts(prompts, 0)
        self.target.set_eagle3_layers_to_capture(None if aux_ids is None else list(aux_ids))
        final: list[Any] = []
        handle = self.target.model.register_forward_hook(lambda m, a, out: final.append(out[0]))
        features = []
        try:
            for prompt in prompts:
                run = self._capture_request(prompt)
                batch_context([run.req])
                n = len(run.tokens)
                slots = self._slots(n)
                self.req_to_token.req_to_token[run.pool_index, :n] = slots.to(torch.int32)
                fb = self._batch(ForwardMode.EXTEND, [run], run.tokens, list(range(n)), [n], slots,
                                 CaptureHiddenMode.FULL)
                out = self._run(self.target, self.target_backend, fb)
                last = final.pop()
                logits = last @ self.target.lm_head.weight.T
                features.append(Features(list(run.tokens), out.hidden_states, last, logits))
        finally:
            handle.remove()
            if self.draft is not None:
                self.target.set_eagle3_layers_to_capture(self.aux_ids)
        return features


def rename_batch_argument(monkeypatch: Any, part: str, base: type) -> None:
    """From now on, give each ``CpuServer``'s ``part`` model ("target" or "draft"), once built (the
    integration installed, its hooks where they were put), a body class derived from ``base`` whose
    forward names its batch argument ``batch``: SGLang passes it by position, so the server serves
    as before, while an integration that finds it by name cannot (and must stop, not crash)."""

    class RenamedBody(base):  # type: ignore[misc, valid-type]
        def forward(self, input_ids, positions, batch, input_embeds=None, pp_proxy_tensors=None):
            return super().forward(input_ids, positions, batch, input_embeds, pp_proxy_tensors)

    built = CpuServer.__init__

    def build(self: CpuServer, *args: Any, **kwargs: Any) -> None:
        built(self, *args, **kwargs)
        getattr(self, part).model.__class__ = RenamedBody

    monkeypatch.setattr(CpuServer, "__init__", build)


def _family(name: str) -> Any:
    """A target family of the test bed (testbed/sglang_family_configs.py), its CPU stand-ins in place."""
    from testbed import sglang_cpu_standins
    from testbed.sglang_family_configs import FAMILIES

    sglang_cpu_standins.install()
    return FAMILIES[name]


def _last_positions(positions: list[int], lens: list[int]) -> list[int]:
    ends = np.cumsum(lens) - 1
    return [positions[int(e)] for e in ends]


@dataclass
class ServedSample:
    """A serving run of the committed sample's target and draft through SGLang's real code."""

    trace: Any  # Path of the serving trace (recorded through tracediff.integrations.sglang)
    draft_dir: Any  # Path of the draft checkpoint as served
    target_dir: Any  # Path of the target checkpoint
    accepted: list[int]  # what a greedy verify accepts of each chain draft_forward returned (scored ones)
    chains: int  # chains draft_forward returned
    texts: list[list[int]]  # each request's prompt and output
    drafted: list[tuple[ServedChain, list[int]]]  # each chain draft_forward returned, its request's text


SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "eagle3"
SAMPLE_AUX = [-1, 1, 3]  # SGLang's ids for what the sample draft was trained on: [embed, layer 1, layer 3]


def serve_sample(workdir: str | os.PathLike, *, config: dict | None = None, without_d2t: bool = False,
                 num_steps: int = 7, requests: int = 4, new_tokens: int = 24, seed: int = 1,
                 aux_ids: Sequence[int] = SAMPLE_AUX) -> ServedSample:
    """Serve ``requests`` chat-like prompts (a shared 3-token system prefix, then 2 tokens of their
    own) with the sample's trained target and draft (traces/eagle3/), topk 1, greedy, through
    ``CpuServer``; the draft's config.json gets ``aux_ids`` (default: SGLang's ids for the fc input it
    was trained on; the sample's own config says [1, 3, 5], the aux-layer bug) and
    ``config``'s keys (e.g. ``{"norm_output": True}``); ``without_d2t`` exports it without d2t/t2d
    (an exporter's bug: SGLang then takes draft ids for target ids). A d2t written as ids instead
    of offsets is not servable here: SGLang's next draft step embeds ids past the vocab and raises
    (IndexError on CPU, a device assert on GPU). Each chain is scored as a verify scores it."""
    import torch
    from safetensors.torch import load_file, save_file

    import tracediff as td

    work = Path(workdir)
    draft = work / "draft"
    draft.mkdir(parents=True, exist_ok=True)
    raw = json.loads((SAMPLE / "draft" / "config.json").read_text())
    raw["eagle_config"] = {**raw.get("eagle_config", {}), "eagle_aux_hidden_state_layer_ids": list(aux_ids)}
    raw.update(config or {})
    (draft / "config.json").write_text(json.dumps(raw, indent=1))
    weights = load_file(SAMPLE / "draft" / "model.safetensors")
    if without_d2t:
        weights = {k: v for k, v in weights.items() if k not in ("d2t", "t2d")}
    save_file(weights, draft / "model.safetensors")
    target = SAMPLE / "target"
    g = torch.Generator().manual_seed(seed)
    prompts = [[11, 500, 422] + torch.randint(0, 1024, (2,), generator=g).tolist() for _ in range(requests)]
    trace = work / "serving.h5"
    with td.record(trace) as rec:
        server = CpuServer(str(target), load_file(target / "model.safetensors"), str(draft), weights,
                           num_steps=num_steps, recorder=rec)
        server.serve(prompts, new_tokens)
        server.close()
    texts = server.texts()
    scores = [chain.accepted(texts[chain.rid]) for chain in server.chains]
    return ServedSample(trace, draft, target, [s for s in scores if s is not None], len(server.chains),
                        list(texts.values()), [(chain, texts[chain.rid]) for chain in server.chains])


def train_sample(workdir: str | os.PathLike, texts: Sequence[Sequence[int]], *,
                 captured_ids: Sequence[int] = SAMPLE_AUX, ttt_length: int = 4,
                 **record_options: Any) -> Path:
    """A training trace of the sample's draft on ``texts``, from the real producers: features from
    SGLang's real target code after ``set_eagle3_layers_to_capture(captured_ids)`` (as SpecForge's
    capture backend gets them; default: what the draft was trained on), then one real SpecForge
    0.2.0 training step (``OnlineEagle3Model``, TTT of ``ttt_length``) recorded through the SpecForge
    integration, with the recorder ``record_options`` (e.g. ``queue_bytes``). Returns the trace's path."""
    import torch
    from safetensors.torch import load_file
    from specforge.algorithms.eagle3.model import OnlineEagle3Model

    import tracediff as td
    from testbed.specforge_cpu import CpuTrainer, build_draft, collate
    from tracediff.integrations import specforge

    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    out = work / "training.h5"
    target = SAMPLE / "target"
    target_weights = load_file(target / "model.safetensors")
    with td.record(out, source="training", exclude=["target.logits"], **record_options) as rec:
        server = CpuServer(str(target), target_weights, recorder=rec)
        try:
            features = server.capture([list(t) for t in texts], list(captured_ids))
        finally:
            server.close()
        config = json.loads((SAMPLE / "draft" / "config.json").read_text())
        weights = {**load_file(SAMPLE / "draft" / "model.safetensors"),
                   "embed_tokens.weight": target_weights["model.embed_tokens.weight"]}
        model = OnlineEagle3Model(build_draft(config, weights=weights), length=ttt_length)
        samples = [{"input_ids": torch.tensor(f.input_ids), "loss_mask": torch.ones(len(f.input_ids),
                                                                                     dtype=torch.long),
                    "aux_hidden_state": f.aux[None], "hidden_state": f.last_hidden[None]} for f in features]
        batch = collate(samples, sample_ids=[f"sample{i}" for i in range(len(samples))])
        handle = specforge.install(rec, model, aux_layer_ids=list(captured_ids))
        CpuTrainer(model, target_weights["lm_head.weight"]).step(batch)
        handle.remove()
    return out

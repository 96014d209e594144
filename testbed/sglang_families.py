"""SGLang's EAGLE-3 target families run on CPU next to HF transformers on the same weights (test bed).

``family_bed(name)`` writes a tiny random HF checkpoint of that family (fixed seed), and its
``load()`` builds the target through SGLang's own loader (``model_loader.get_model``: the registry,
the model's ``load_weights``); ``serve(model, prompt)`` runs a prefill and one decode through
``TorchNativeAttnBackend`` over real KV pools (latent MLA pools for DeepSeek-style models), calling
``batch_context`` per batch as SGLang's scheduler patch does; ``reference(tokens)`` is HF's forward
on the same tokens. Configs: ``sglang_family_configs``; kernels CPU lacks: ``sglang_cpu_standins``.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace
from typing import Any

import torch

from testbed import sglang_cpu_standins
from testbed.sglang_cpu import free_port, prepare, start
from testbed.sglang_family_configs import FAMILIES, Family

PROMPT = [5, 17, 42, 99, 3, 250, 7, 301, 12]
_POOL_SLOTS, _MAX_LEN = 64, 32


@dataclass
class Served:
    """One request through SGLang's target: its tokens and the logits processor's outputs."""

    tokens: list[int]  # the prompt and the token the prefill chose (fed by the decode)
    prefill: Any  # LogitsProcessorOutput of the prefill (rows 0 .. len(prompt) - 1)
    decode: Any  # LogitsProcessorOutput of the decode (row len(prompt))


@dataclass
class Reference:
    """HF transformers on the same weights and tokens, every tensor [T, H] (T = all tokens)."""

    hidden_states: list[torch.Tensor]  # HF ``output_hidden_states``: embed, then each layer (last normed)
    pre_norm: torch.Tensor  # the last layer's output before the final norm
    branch: list[torch.Tensor]  # per layer, the branch its last residual add takes (MLP, or its post-norm)
    logits: torch.Tensor  # [T, V]


class FamilyBed:
    """One family's tiny checkpoint, the server arguments SGLang's constructors read, and HF's model."""

    def __init__(self, family: Family, workdir: str, seed: int = 0) -> None:
        from sglang.srt.server_args import ServerArgs
        from transformers import AutoModelForCausalLM

        self.family = family
        config = family.config()
        config.architectures = [family.text_arch or family.arch]
        torch.manual_seed(seed)
        self.hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
        self.hf.eval()
        self.path = os.path.join(workdir, family.name)
        self.hf.save_pretrained(self.path)
        _add_config_fields(self.path, config)
        if family.wrap is not None:
            family.wrap(self.path)
        args = dict(model_path=self.path, device="cpu", dtype="float32", tp_size=1, skip_tokenizer_init=True,
                    attention_backend="torch_native", disable_cuda_graph=True)
        self.server_args = ServerArgs(**{**args, **family.server_args})
        self.activate()

    @property
    def num_layers(self) -> int:
        return int(self.hf.config.num_hidden_layers)

    def activate(self) -> None:
        """Publish this family's server arguments (SGLang reads them at build and in forwards)."""
        start(self.server_args, _port())

    def load(self) -> Any:
        """A fresh SGLang target of this family, its weights through SGLang's loader."""
        self.activate()
        return load_target(self.server_args)

    def serve(self, model: Any, prompt: list[int] = PROMPT, rid: str = "req0") -> Served:
        """A prefill of ``prompt`` and one decode of the token it chose, on fresh KV pools."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.sampling.sampling_params import SamplingParams

        from tracediff.integrations.sglang import batch_context

        self.activate()
        table, backend = self._pools()
        req = Req(rid=rid, origin_input_text="", origin_input_ids=list(prompt),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=2))
        n = len(prompt)
        table.req_to_token[0, : n + 1] = torch.arange(1, n + 2, dtype=torch.int32)
        batch_context([req])
        prefill = _forward(model, backend, _batch(ForwardMode.EXTEND, prompt, 0))
        token = int(prefill.next_token_logits[-1].argmax())
        req.output_ids.append(token)
        batch_context([req])
        decode = _forward(model, backend, _batch(ForwardMode.DECODE, [token], n))
        return Served([*prompt, token], prefill, decode)

    def reference(self, tokens: list[int]) -> Reference:
        """HF's forward on ``tokens``: hidden states, the pre-norm last layer and each layer's branch."""
        model = self.hf.model
        pre_norm: list[torch.Tensor] = []
        branch: dict[int, torch.Tensor] = {}

        def keep_branch(i: int) -> Any:
            def hook(module: Any, args: Any, out: Any) -> None:
                branch[i] = out[0] if isinstance(out, tuple) else out

            return hook

        hooks = [model.norm.register_forward_hook(lambda m, args, out: pre_norm.append(args[0]))]
        for i, layer in enumerate(model.layers):
            last = getattr(layer, "post_feedforward_layernorm", None) or layer.mlp
            hooks.append(last.register_forward_hook(keep_branch(i)))
        try:
            with torch.no_grad():
                out = self.hf(torch.tensor([tokens]), output_hidden_states=True)
        finally:
            for hook in hooks:
                hook.remove()
        branches = [branch[i].reshape(len(tokens), -1) for i in range(len(model.layers))]
        return Reference([h[0] for h in out.hidden_states], pre_norm[0][0], branches, out.logits[0])

    def _pools(self) -> tuple[Any, Any]:
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        table = ReqToTokenPool(size=1, max_context_len=_MAX_LEN, device="cpu", enable_memory_saver=False)
        return table, attention_backend(self.family, table, kv_pool(self.family, self.hf.config, _POOL_SLOTS))


def load_target(server_args: Any) -> Any:
    """The target ``server_args.model_path`` holds, built by SGLang's loader (its model registry, the
    model's own ``load_weights``), as the model runner builds it. Publish ``server_args`` first."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import get_model

    return get_model(model_config=ModelConfig.from_server_args(server_args),
                     load_config=LoadConfig(load_format="auto"), device_config=DeviceConfig("cpu")).eval()


def kv_pool(family: Family, config: Any, size: int) -> Any:
    """The family's KV pool of ``size`` float32 slots: MHA, or MLA's latent pool (DeepSeek-style)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    common = dict(size=size, page_size=1, dtype=torch.float32, layer_num=config.num_hidden_layers,
                  device="cpu", enable_memory_saver=False)
    if family.kv == "mla":
        return MLATokenToKVPool(kv_lora_rank=config.kv_lora_rank, qk_rope_head_dim=config.qk_rope_head_dim,
                                **common)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return MHATokenToKVPool(head_num=config.num_key_value_heads, head_dim=head_dim, enable_alt_stream=False,
                            **common)


def attention_backend(family: Family, table: Any, kv: Any) -> Any:
    """TorchNativeAttnBackend (with attention sinks where the family has them) over a stand-in for
    what it reads of SGLang's ModelRunner: the request table and the KV pool."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    runner = SimpleNamespace(device="cpu", req_to_token_pool=table, token_to_kv_pool=kv)
    if family.kv == "sinks":
        return sglang_cpu_standins.sinks_backend(runner)
    return TorchNativeAttnBackend(runner)


def _add_config_fields(path: str, config: Any) -> None:
    """Fields set on the config that its class does not save (a real checkpoint's config.json has them)."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        saved = json.load(f)
    extra = {k: v for k, v in vars(config).items() if k not in saved and not k.startswith("_")
             and isinstance(v, (int, float, str, bool))}
    if extra:
        with open(file, "w") as f:
            json.dump({**saved, **extra}, f, indent=2)


def _batch(mode: Any, ids: list[int], start_pos: int) -> Any:
    """A ForwardBatch of one request (pool row 0) over ``ids`` at positions ``start_pos``...; KV slot
    of position p is p + 1 (slot 0 is the padding slot)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch

    n, seq = len(ids), start_pos + len(ids)
    fb = ForwardBatch(forward_mode=mode, batch_size=1, input_ids=torch.tensor(ids),
                      req_pool_indices=torch.tensor([0]), seq_lens=torch.tensor([seq]),
                      seq_lens_cpu=torch.tensor([seq]), out_cache_loc=torch.arange(start_pos + 1, seq + 1),
                      seq_lens_sum=seq, positions=torch.arange(start_pos, seq))
    if mode.is_extend():
        fb.extend_prefix_lens, fb.extend_prefix_lens_cpu = torch.tensor([start_pos]), [start_pos]
        fb.extend_seq_lens, fb.extend_seq_lens_cpu = torch.tensor([n]), [n]
        fb.extend_num_tokens, fb.extend_start_loc = n, torch.tensor([0])
        fb.extend_logprob_start_lens_cpu = [n]
    fb.req_pool_indices_cpu = torch.tensor([0])
    fb.capture_hidden_mode = CaptureHiddenMode.FULL
    return fb


def _forward(model: Any, backend: Any, fb: Any) -> Any:
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    backend.init_forward_metadata(fb)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend), forward_batch=fb):
        return model(fb.input_ids, fb.positions, fb)


@cache
def _port() -> int:
    return free_port()


@cache
def _workdir() -> tempfile.TemporaryDirectory:
    """Where the checkpoints go; removed when the process exits."""
    return tempfile.TemporaryDirectory(prefix="tracediff-families-")


@cache
def family_bed(name: str) -> FamilyBed:
    """The test bed of family ``name`` (one per process: its checkpoint written once)."""
    prepare()
    sglang_cpu_standins.install()
    return FamilyBed(FAMILIES[name], _workdir().name)

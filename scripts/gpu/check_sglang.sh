#!/usr/bin/env bash
# The SGLang backend against a real SGLang server: run on a machine with an NVIDIA GPU and PyPI.
#
# SGLang pins its own CUDA torch, so it goes into a separate venv (never the project's). The model
# is a tiny random Qwen3-MoE written here with transformers (no hub download), small enough to
# load in seconds, MoE so that routed experts (R3) are exercised too, with a dense layer between
# its MoE layers (mlp_only_layers) so that rows sized by num_hidden_layers must be cut to the
# sparse layers. Then tests/test_engine_sglang_gpu.py runs from the project venv, pointed at both
# by env vars: generation and a weight swap, plus issue 22's three regressions (stop strings
# answered without --skip-tokenizer-init; weights swapped under load with pause in_place and no
# cache flush, the server alive after; routed experts of a model with dense layers decoded).
#   ROLLMESH_SGLANG_WORK  where the venv and the model go (default: ~/.cache/rollmesh-sglang)
#   ROLLMESH_SGLANG_SPEC  what pip installs (default: sglang); pin a version to compare builds
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
work_dir="${ROLLMESH_SGLANG_WORK:-${XDG_CACHE_HOME:-${HOME}/.cache}/rollmesh-sglang}"
venv="${work_dir}/venv"
model="${work_dir}/tiny-qwen3-moe-dense1"

if [[ ! -x "${venv}/bin/python" ]]; then
  python3 -m venv "${venv}"
  "${venv}/bin/pip" install --upgrade pip
  "${venv}/bin/pip" install "${ROLLMESH_SGLANG_SPEC:-sglang}"
fi

if [[ ! -f "${model}/config.json" ]]; then
  "${venv}/bin/python" - "${model}" <<'PY'
import sys

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

# 3 layers, the middle one dense: 2 MoE layers of 8 experts, top-2 (the test reads the shape
# from this config.json, as the mesh does).
config = Qwen3MoeConfig(
    vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=3, mlp_only_layers=[1], decoder_sparse_step=1,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    num_experts=8, num_experts_per_tok=2, max_position_embeddings=2048,
    bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
)
torch.manual_seed(0)
Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(sys.argv[1])
PY
fi

cd "${repo_root}"
export ROLLMESH_SGLANG_PYTHON="${venv}/bin/python"
export ROLLMESH_SGLANG_MODEL="${model}"
.venv/bin/python -m pytest tests/test_engine_sglang_gpu.py -m gpu -q -rs -s "$@"

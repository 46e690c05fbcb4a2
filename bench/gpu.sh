#!/usr/bin/env bash
# The one-command GPU proof, on one CUDA GPU, nothing downloaded: QLoRA and LoRA on a
# random-weight Llama-3.1-8B shape, full fine-tune of a Llama-3.2-1B shape, 4096-token packed rows;
# tokens/s, MFU, peak memory and `llmft plan`'s estimate for each, and the same run with each speed
# switch (model.compile, model.liger_kernels, flash_attention_2) off; and long context: LoRA on the
# 8B shape with one 131,072-token packed row a step, sp 1, activation offload, tiled MLP, chunked
# loss and flash-attention varlen (tokens/s, peak); and a mixture of experts (moe-qwen3): a random
# qwen3_moe of Qwen3-30B-A3B's layers at 24 layers and 64 experts top-8 (hidden 2048, expert FFN 768;
# 8.3B parameters, 2.0B active), LoRA on attention and experts, with the router's balancing loss over
# the global batch, per micro-batch and off (tokens/s, MFU of the active parameters, peak, side by
# side). bench/gpu.py has the details.
#
#   bash bench/gpu.sh                        # writes runs/bench-gpu/gpu.md and prints it
#   bash bench/gpu.sh --quick                # qlora-8b + full-1b, compile off, the HF Trainer + PEFT peer row
#   bash bench/gpu.sh --check                # CPU, tiny shapes, 2 steps per run: CI keeps this working
#   bash bench/gpu.sh --quick --check        # the same for --quick (tests/integration/test_bench_gpu_check.py)
#   bash bench/gpu.sh --cases full-1b --steps 20 --out runs/bench-1b
#   bash bench/gpu.sh --cases long-8b --steps 4 --warmup 1 --long-seq 262144   # long context only
#   bash bench/gpu.sh --cases moe-qwen3      # the MoE case only (not in --quick; --check runs it only when named)
#
# First run on a machine: the 8B, 1B and MoE model directories (~16 GB + ~2.5 GB + ~17 GB of random
# bf16 safetensors) are generated once under <out>/models and reused afterwards.
set -euo pipefail

cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${PYTHON:-python}" bench/gpu.py "$@"

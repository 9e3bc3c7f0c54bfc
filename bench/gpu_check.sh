#!/bin/bash
# Issue 63's checks that need a GPU (item 7), one chip, PyTorch and transformers (no vLLM): run from
# the repository's root on a GPU machine, then write what it prints into bench/results/gpu.md
# (dated, with the commit and the machine). About 5 minutes on an H100/H200.
#   bash bench/gpu_check.sh 2>&1 | tee gpu_check.log
set -euo pipefail
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
# 1. the collectives' rule on the multi-backend group, the device queries, the plan (seconds)
torchrun --nproc_per_node 1 bench/gpu_rules.py
# 2. sharded loading of a random 1.5B model (device peak) and the sync's gather + cast + bucket
#    against a device-to-device copy of the same bytes, on the multi-backend group
torchrun --nproc_per_node 1 bench/gpu_load.py
# 3. the trainer side at one rank (a one-rank FSDP2 mesh) through the multi-backend group
torchrun --nproc_per_node 1 bench/gpu_update.py --algos grpo,sdpo

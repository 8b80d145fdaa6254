#!/usr/bin/env bash
# TL;DR with Pythia-2.8B-deduped: SFT -> reward model -> PPO, RLOO, DPO -> judged win rates, per seed.
# DeepSpeed ZeRO-2 throughout. Per-device batches sized for 80 GB GPUs; the global batches are fixed.
# Usage: bash benchmark/tldr/prepare_data.sh && SEEDS="44413" bash benchmark/tldr/pythia_2.8b.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODEL=EleutherAI/pythia-2.8b-deduped
MODEL_TAG=pythia-2.8b-deduped
TRAIN_CONFIG=deepspeed_zero2.yaml
RL_CONFIG=deepspeed_zero2.yaml
SFT_PER_DEVICE=4
RM_PER_DEVICE=4
DPO_PER_DEVICE=2
PPO_PER_DEVICE=4
RLOO_PER_DEVICE=4
ROLLOUT_FORWARD_BATCH=32

run_all_seeds

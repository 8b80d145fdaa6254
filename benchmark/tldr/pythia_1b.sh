#!/usr/bin/env bash
# TL;DR with Pythia-1B-deduped: SFT -> reward model -> PPO, RLOO, DPO -> judged win rates, per seed.
# DeepSpeed ZeRO-2 throughout. Per-device batches sized for 80 GB GPUs; the global batches are fixed.
# Usage: bash benchmark/tldr/prepare_data.sh && SEEDS="44413" bash benchmark/tldr/pythia_1b.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODEL=EleutherAI/pythia-1b-deduped
MODEL_TAG=pythia-1b-deduped
TRAIN_CONFIG=deepspeed_zero2.yaml
RL_CONFIG=deepspeed_zero2.yaml
SFT_PER_DEVICE=16
RM_PER_DEVICE=8
DPO_PER_DEVICE=4
PPO_PER_DEVICE=16
RLOO_PER_DEVICE=8
ROLLOUT_FORWARD_BATCH=64

run_all_seeds

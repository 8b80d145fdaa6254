#!/usr/bin/env bash
# TL;DR with Pythia-6.9B-deduped: SFT -> reward model -> PPO, RLOO, DPO -> judged win rates, per seed.
# SFT, reward model and DPO under DeepSpeed ZeRO-3; PPO and RLOO, which hold policy, reference policy and
# reward model (and PPO's value model) at once, under ZeRO-3 with weights and optimizer offloaded to CPU.
# Usage: bash benchmark/tldr/prepare_data.sh && SEEDS="44413" bash benchmark/tldr/pythia_6.9b.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODEL=EleutherAI/pythia-6.9b-deduped
MODEL_TAG=pythia-6.9b-deduped
TRAIN_CONFIG=deepspeed_zero3.yaml
RL_CONFIG=deepspeed_zero3_offload.yaml
SFT_PER_DEVICE=1
RM_PER_DEVICE=1
DPO_PER_DEVICE=1
PPO_PER_DEVICE=1
RLOO_PER_DEVICE=1
ROLLOUT_FORWARD_BATCH=2

run_all_seeds

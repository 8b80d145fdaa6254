#!/usr/bin/env bash
# Settings and stages shared by the TL;DR reproduction scripts (pythia_1b.sh, pythia_2.8b.sh,
# pythia_6.9b.sh). Sourced by them, not run on its own.
#
# Hyperparameters are the published ones:
#   SFT, reward model, PPO, DPO: "The N+ Implementation Details of RLHF with PPO: A Case Study on TL;DR
#     Summarization" (Huang et al. 2024, code: vwxyzjn/summarize_from_feedback_details);
#   RLOO: TRL's RLOO TL;DR experiment (rloo_k 2, kl_coef 0.03, 2 epochs of 2 mini-batches).
# Global batch sizes assume nothing about the number of GPUs: gradient accumulation is derived from
# NUM_GPUS and the per-device batch that each model size sets.
#
# Environment variables (all optional):
#   SEEDS         seeds to run, one full pipeline each   (default: the N+ code's "44413 55513 66613 77713")
#   NUM_GPUS      processes per launch                    (default: 8)
#   STAGES        subset of "sft reward ppo rloo dpo eval" (default: all, in that order)
#   DATA_DIR      output of prepare_data.sh               (default: data/tldr)
#   OUTPUT_ROOT   where models, logs and judgements go    (default: models/tldr)
#   JUDGE_MODEL   judge model for judge_tldr.py           (default: gpt-4o-mini)
#   JUDGE_BASE_URL OpenAI-compatible endpoint             (default: https://api.openai.com/v1; key in OPENAI_API_KEY)
#   NUM_EVAL      posts of the EVAL_SPLIT that are judged (default: 1000, split "validation")
#   WANDB_PROJECT W&B project for --track                 (default: tldr_summarize)
set -euo pipefail

TLDR_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$TLDR_DIR/../.." && pwd)"

SEEDS="${SEEDS:-44413 55513 66613 77713}"
NUM_GPUS="${NUM_GPUS:-8}"
STAGES="${STAGES:-sft reward ppo rloo dpo eval}"
DATA_DIR="${DATA_DIR:-$REPO_ROOT/data/tldr}"
OUTPUT_ROOT="${OUTPUT_ROOT:-$REPO_ROOT/models/tldr}"
JUDGE_MODEL="${JUDGE_MODEL:-gpt-4o-mini}"
JUDGE_BASE_URL="${JUDGE_BASE_URL:-https://api.openai.com/v1}"
NUM_EVAL="${NUM_EVAL:-1000}"
EVAL_SPLIT="${EVAL_SPLIT:-validation}"
export WANDB_PROJECT="${WANDB_PROJECT:-tldr_summarize}"

# ---- published hyperparameters -------------------------------------------------------------------------
LEARNING_RATE=3e-6          # every stage
ADAM_EPSILON=1e-5           # N+ details (passed where the script has the flag: reward.py, ppo.py)
MAX_QUERY_LENGTH=512        # prepare_dataset.py cuts posts so that queries fit
RESPONSE_LENGTH=53          # longest reference summary (EOS included) and tokens generated per rollout
MAX_PREFERENCE_RESPONSE=169 # longest chosen/rejected summary kept by prepare_dataset.py
SFT_MAX_LENGTH=$((MAX_QUERY_LENGTH + RESPONSE_LENGTH))
PREFERENCE_MAX_LENGTH=$((MAX_QUERY_LENGTH + MAX_PREFERENCE_RESPONSE))

SFT_BATCH=128               # 1 epoch over the ~117k filtered TL;DR posts
SFT_EPOCHS=1
RM_BATCH=64                 # 1 epoch over the ~93k TL;DR comparisons
RM_EPOCHS=1
PPO_BATCH=512               # episodes per optimizer step (num_mini_batches 1)
PPO_TOTAL_EPISODES=1000000
PPO_EPOCHS=4
PPO_MINI_BATCHES=1
PPO_KL_COEF=0.05
RLOO_BATCH=512              # completions per optimizer step; a rollout is RLOO_MINI_BATCHES of them
RLOO_TOTAL_EPISODES=1000000
RLOO_EPOCHS=2
RLOO_MINI_BATCHES=2
RLOO_K=2
RLOO_KL_COEF=0.03
TEMPERATURE=0.7             # sampling temperature of PPO / RLOO rollouts
MISSING_EOS_PENALTY=1.0     # subtracted from the score of a rollout that never wrote EOS
DPO_BATCH=64
DPO_EPOCHS=1
DPO_BETA=0.05
DPO_LOSS=sigmoid

# ---- helpers ---------------------------------------------------------------------------------------------

# git_revision: short commit of the repository, with -dirty when there are uncommitted changes.
git_revision() {
    local rev
    rev="$(git -C "$REPO_ROOT" rev-parse --short HEAD 2>/dev/null || echo nogit)"
    if [ "$rev" != nogit ] && ! git -C "$REPO_ROOT" diff --quiet HEAD -- 2>/dev/null; then
        rev="$rev-dirty"
    fi
    echo "$rev"
}

# grad_accum TOTAL PER_DEVICE [GPUS]: gradient accumulation steps giving a global batch of TOTAL.
grad_accum() {
    local total=$1 per_device=$2 gpus=${3:-$NUM_GPUS}
    local micro=$((per_device * gpus))
    if [ $((total % micro)) -ne 0 ]; then
        echo "error: per-device batch $per_device x $gpus GPUs = $micro does not divide the global batch" \
            "$total; change the per-device batch of this model size or NUM_GPUS" >&2
        return 1
    fi
    echo $((total / micro))
}

# want STAGE: whether STAGE is listed in $STAGES.
want() {
    [[ " $STAGES " == *" $1 "* ]]
}

# done_in DIR: whether DIR already holds a trained model (a finished stage is not run again).
done_in() {
    [ -f "$1/config.json" ]
}

# launch CONFIG LOG SCRIPT ARGS...: accelerate launch of a repository script, output also kept in LOG.
launch() {
    local config=$1 log=$2 script=$3
    shift 3
    mkdir -p "$(dirname "$log")"
    accelerate launch --config_file "$REPO_ROOT/accelerate_configs/$config" --num_processes "$NUM_GPUS" \
        "$REPO_ROOT/$script" "$@" 2>&1 | tee "$log"
}

# generate_summaries MODEL_DIR OUT_JSONL SEED: summaries of the first NUM_EVAL posts of EVAL_SPLIT, written as
# {prompt, completion, reference} rows for judge_tldr.py by benchmark/tldr/evaluate_tldr.py (greedy decoding,
# at most RESPONSE_LENGTH new tokens, cut after EOS; the same settings for every model).
generate_summaries() {
    python "$REPO_ROOT/benchmark/tldr/evaluate_tldr.py" \
        --model_path "$1" \
        --dataset_name "$DATA_DIR/sft" \
        --split "$EVAL_SPLIT" \
        --max_samples "$NUM_EVAL" \
        --response_length "$RESPONSE_LENGTH" \
        --temperature 0 \
        --seed "$3" \
        --output_jsonl "$2"
}

# ---- the pipeline of one seed ----------------------------------------------------------------------------
# Needs, from the model-size script: MODEL, MODEL_TAG, TRAIN_CONFIG (SFT/RM/DPO), RL_CONFIG (PPO/RLOO) and the
# per-device batches SFT_PER_DEVICE, RM_PER_DEVICE, DPO_PER_DEVICE, PPO_PER_DEVICE, RLOO_PER_DEVICE,
# ROLLOUT_FORWARD_BATCH.

run_seed() {
    local seed=$1
    local rev
    rev="$(git_revision)"
    local root="$OUTPUT_ROOT/$MODEL_TAG/seed$seed"
    local sft_dir="$root/sft" rm_dir="$root/reward" logs="$root/logs"
    echo "=== $MODEL seed $seed (commit $rev): stages [$STAGES] -> $root"

    # N+ details: the SFT loss covers the query tokens too (--no_completion_only_loss); cosine decay, and
    # the reward model is shifted so that the SFT references score 0 on average (--normalize_*).
    if want sft && ! done_in "$sft_dir"; then
        launch "$TRAIN_CONFIG" "$logs/sft.log" sft.py \
            --model_name_or_path "$MODEL" \
            --dataset_name "$DATA_DIR/sft" \
            --dataset_train_split train \
            --dataset_test_split validation \
            --output_dir "$sft_dir" \
            --learning_rate "$LEARNING_RATE" \
            --num_train_epochs "$SFT_EPOCHS" \
            --per_device_train_batch_size "$SFT_PER_DEVICE" \
            --gradient_accumulation_steps "$SFT_GRAD_ACCUM" \
            --max_length "$SFT_MAX_LENGTH" \
            --no_completion_only_loss \
            --lr_scheduler_type cosine \
            --bf16 \
            --seed "$seed" \
            --track \
            --exp_name tldr_sft \
            --run_name "tldr__${MODEL_TAG}__sft__s${seed}__${rev}"
    fi

    if want reward && ! done_in "$rm_dir"; then
        launch "$TRAIN_CONFIG" "$logs/reward.log" reward.py \
            --model_name_or_path "$sft_dir" \
            --dataset_name "$DATA_DIR/preference" \
            --dataset_train_split train \
            --dataset_test_split validation \
            --output_dir "$rm_dir" \
            --learning_rate "$LEARNING_RATE" \
            --num_train_epochs "$RM_EPOCHS" \
            --per_device_train_batch_size "$RM_PER_DEVICE" \
            --gradient_accumulation_steps "$RM_GRAD_ACCUM" \
            --max_length "$PREFERENCE_MAX_LENGTH" \
            --lr_scheduler_type cosine \
            --adam_epsilon "$ADAM_EPSILON" \
            --normalize_dataset "$DATA_DIR/sft" \
            --normalize_split train \
            --bf16 \
            --seed "$seed" \
            --track \
            --exp_name tldr_reward \
            --run_name "tldr__${MODEL_TAG}__reward__s${seed}__${rev}"
    fi

    if want ppo && ! done_in "$root/ppo"; then
        launch "$RL_CONFIG" "$logs/ppo.log" ppo.py \
            --sft_model_path "$sft_dir" \
            --reward_model_path "$rm_dir" \
            --dataset_name "$DATA_DIR/prompts" \
            --dataset_train_split train \
            --dataset_test_split validation \
            --output_dir "$root/ppo" \
            --learning_rate "$LEARNING_RATE" \
            --per_device_train_batch_size "$PPO_PER_DEVICE" \
            --gradient_accumulation_steps "$PPO_GRAD_ACCUM" \
            --total_episodes "$PPO_TOTAL_EPISODES" \
            --num_ppo_epochs "$PPO_EPOCHS" \
            --num_mini_batches "$PPO_MINI_BATCHES" \
            --local_rollout_forward_batch_size "$ROLLOUT_FORWARD_BATCH" \
            --response_length "$RESPONSE_LENGTH" \
            --temperature "$TEMPERATURE" \
            --stop_token eos \
            --missing_eos_penalty "$MISSING_EOS_PENALTY" \
            --kl_coef "$PPO_KL_COEF" \
            --adam_epsilon "$ADAM_EPSILON" \
            --bf16 \
            --seed "$seed" \
            --track \
            --exp_name tldr_ppo \
            --run_name "tldr__${MODEL_TAG}__ppo__s${seed}__${rev}"
    fi

    if want rloo && ! done_in "$root/rloo"; then
        launch "$RL_CONFIG" "$logs/rloo.log" rloo.py \
            --model_name_or_path "$sft_dir" \
            --sft_model_path "$sft_dir" \
            --reward_model_path "$rm_dir" \
            --dataset_name "$DATA_DIR/prompts" \
            --dataset_train_split train \
            --output_dir "$root/rloo" \
            --learning_rate "$LEARNING_RATE" \
            --per_device_train_batch_size "$RLOO_PER_DEVICE" \
            --gradient_accumulation_steps "$RLOO_GRAD_ACCUM" \
            --total_episodes "$RLOO_TOTAL_EPISODES" \
            --num_ppo_epochs "$RLOO_EPOCHS" \
            --num_mini_batches "$RLOO_MINI_BATCHES" \
            --rloo_k "$RLOO_K" \
            --local_rollout_forward_batch_size "$ROLLOUT_FORWARD_BATCH" \
            --response_length "$RESPONSE_LENGTH" \
            --temperature "$TEMPERATURE" \
            --stop_token eos \
            --missing_eos_penalty "$MISSING_EOS_PENALTY" \
            --kl_coef "$RLOO_KL_COEF" \
            --bf16 \
            --seed "$seed" \
            --track \
            --exp_name tldr_rloo \
            --run_name "tldr__${MODEL_TAG}__rloo__s${seed}__${rev}"
    fi

    if want dpo && ! done_in "$root/dpo"; then
        launch "$TRAIN_CONFIG" "$logs/dpo.log" dpo.py \
            --model_name_or_path "$sft_dir" \
            --dataset_name "$DATA_DIR/preference" \
            --dataset_train_split train \
            --dataset_test_split validation \
            --output_dir "$root/dpo" \
            --learning_rate "$LEARNING_RATE" \
            --num_train_epochs "$DPO_EPOCHS" \
            --per_device_train_batch_size "$DPO_PER_DEVICE" \
            --gradient_accumulation_steps "$DPO_GRAD_ACCUM" \
            --beta "$DPO_BETA" \
            --loss_type "$DPO_LOSS" \
            --max_length "$PREFERENCE_MAX_LENGTH" \
            --max_prompt_length "$MAX_QUERY_LENGTH" \
            --lr_scheduler_type cosine \
            --bf16 \
            --seed "$seed" \
            --track \
            --exp_name tldr_dpo \
            --run_name "tldr__${MODEL_TAG}__dpo__s${seed}__${rev}"
    fi

    if want eval; then
        if [[ "$JUDGE_BASE_URL" == *api.openai.com* ]]; then
            : "${OPENAI_API_KEY:?set OPENAI_API_KEY for the judge (or JUDGE_BASE_URL for another endpoint)}"
        fi
        local method
        for method in sft ppo rloo dpo; do
            if ! done_in "$root/$method"; then
                echo "skip eval of $method: no model in $root/$method"
                continue
            fi
            local out="$root/eval/$method.jsonl"
            mkdir -p "$root/eval"
            [ -f "$out" ] || generate_summaries "$root/$method" "$out" "$seed"
            python "$REPO_ROOT/benchmark/tldr/judge_tldr.py" \
                --input_jsonl "$out" \
                --output_jsonl "$root/eval/$method.judged.jsonl" \
                --base_url "$JUDGE_BASE_URL" \
                --model "$JUDGE_MODEL" \
                --seed "$seed"
        done
    fi
}

# run_all_seeds: the whole pipeline for every seed in $SEEDS, one after the other.
run_all_seeds() {
    if [ ! -d "$DATA_DIR/sft" ] || [ ! -d "$DATA_DIR/preference" ] || [ ! -d "$DATA_DIR/prompts" ]; then
        echo "error: $DATA_DIR lacks sft/, preference/ or prompts/; run benchmark/tldr/prepare_data.sh first" >&2
        return 1
    fi
    # All batch arithmetic is checked before anything is trained.
    SFT_GRAD_ACCUM="$(grad_accum "$SFT_BATCH" "$SFT_PER_DEVICE")" || return 1
    RM_GRAD_ACCUM="$(grad_accum "$RM_BATCH" "$RM_PER_DEVICE")" || return 1
    PPO_GRAD_ACCUM="$(grad_accum "$PPO_BATCH" "$PPO_PER_DEVICE")" || return 1
    RLOO_GRAD_ACCUM="$(grad_accum "$RLOO_BATCH" "$RLOO_PER_DEVICE")" || return 1
    DPO_GRAD_ACCUM="$(grad_accum "$DPO_BATCH" "$DPO_PER_DEVICE")" || return 1
    local seed
    for seed in $SEEDS; do
        run_seed "$seed"
    done
}

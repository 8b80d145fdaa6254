#!/usr/bin/env bash
# Build the TL;DR datasets once (every Pythia size shares the tokenizer):
#   DATA_DIR/sft         prompt/completion   117k posts with reference summaries (train/validation/test)
#   DATA_DIR/prompts     prompt only         the same posts, for PPO / RLOO rollouts
#   DATA_DIR/preference  prompt/chosen/rejected  93k human comparisons (train/validation; CNN/DM rows dropped)
# Needs the Hugging Face Hub. Usage: bash benchmark/tldr/prepare_data.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SFT_SOURCE="${SFT_SOURCE:-vwxyzjn/summarize_from_feedback_tldr_3_filtered}"
PREFERENCE_SOURCE="${PREFERENCE_SOURCE:-openai/summarize_from_feedback}"
PREFERENCE_CONFIG="${PREFERENCE_CONFIG:-comparisons}"
TOKENIZER="${TOKENIZER:-EleutherAI/pythia-1b-deduped}"

if [ -f "$DATA_DIR/prepare_summary.json" ]; then
    echo "$DATA_DIR already prepared (delete it to rebuild)"
    exit 0
fi
python "$TLDR_DIR/prepare_dataset.py" \
    --tokenizer_name_or_path "$TOKENIZER" \
    --sft_dataset_name "$SFT_SOURCE" \
    --preference_dataset_name "$PREFERENCE_SOURCE" \
    --preference_dataset_config "$PREFERENCE_CONFIG" \
    --max_query_length "$MAX_QUERY_LENGTH" \
    --max_response_length "$RESPONSE_LENGTH" \
    --max_preference_response_length "$MAX_PREFERENCE_RESPONSE" \
    --output_dir "$DATA_DIR" \
    --num_proc "${NUM_PROC:-8}"

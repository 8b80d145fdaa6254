#!/usr/bin/env bash
# One GPU session's measurements for docs/speed_gpu.md, most wanted first, while a time budget lasts.
#
#   bash benchmark/speed/speed_gpu.sh OUT [SECONDS]
#
# OUT gets one json and one log per command and table.md (speed_compare.py --gpu of each json), rewritten after
# every command. SECONDS (default 480) bounds the whole: a command starts only with time left and is stopped at the
# budget. SPEED_GPU_DRY=1 runs the same commands on a CPU with a 2-layer body, to check them before a GPU session.
set -u
out=$(mkdir -p "${1:?usage: bash benchmark/speed/speed_gpu.sh OUT [SECONDS]}" && cd "$1" && pwd) || exit 1
budget=${2:-480}
py=$(command -v python3)
cd "$(dirname "$0")/../.."

# A GPU machine without network: the wheels of ../shared/gpu/README.md's recipe, copied along in .whl/
if ! "$py" -c "import transformers, trl, tyro, datasets" 2>/dev/null; then
    site=$(mktemp -d)
    "$py" -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

common=(--precision bf16 --trl_python "$py")
steps=10 short=()
if [ -n "${SPEED_GPU_DRY:-}" ]; then  # a small body and vocabulary, 2 steps or updates
    common+=(--device cpu --no_bare --num_layers 2 --hidden_size 256 --intermediate_size 512 --num_heads 4
        --vocab_size 8192)
    steps=2 short=(--steps 2 --updates 2)
fi
tldr=(--preset tldr_qwen05b --work_dir /tmp/speed-tldr_qwen05b)

run() {  # run NAME ARGS...: one speed.py command, if time is left
    local name=$1 left=$((budget - SECONDS))
    shift
    if ((left < 30)); then
        echo "$name: skipped, $left s of the budget left" | tee -a "$out/skipped.txt"
        return
    fi
    echo "$name: started at $SECONDS s"
    timeout "$left" "$py" benchmark/speed/speed.py "${common[@]}" "$@" --output "$out/$name.json" \
        >"$out/$name.log" 2>&1
    echo "$name: exit $? at $SECONDS s; $(tail -n 1 "$out/$name.log")"
    for f in "$out"/*.json; do
        echo "### $(basename "$f")"
        "$py" benchmark/speed/speed_compare.py --gpu "$f" 2>&1
    done >"$out/table.md"
}

# H1 of docs/speed_gpu.md: our LM head in 4 tiles (the code's GPU size), in 16 (the size of the measurement), TRL
run sft_base "${tldr[@]}" --algorithms sft --steps "$steps" --runs 1
run sft_tile22 "${tldr[@]}" --algorithms sft --steps "$steps" --runs 1 --sides ours --ours_logit_tile_elements 4194304
run sft_profile "${tldr[@]}" --algorithms sft --steps "$((steps < 6 ? steps : 6))" --runs 1 --profile
# the reference table's other rows
run tldr "${tldr[@]}" --algorithms dpo rloo online_dpo --runs 1 "${short[@]}"
run grpo --preset grpo_qwen05b --work_dir /tmp/speed-grpo_qwen05b --algorithms grpo --runs 1 "${short[@]}"
echo "done at $SECONDS s; results in $out"

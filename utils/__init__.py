"""Shared helpers of the scripts, one module per job; nothing algorithm-specific lives here.

    utils/run.py         command line, one-sentence errors, the accelerator (DDP, DeepSpeed), frozen models
    utils/checkpoint.py  checkpoints, exact resume, SIGTERM, the output folder
    utils/saving.py      the final model: weights, tokenizer, model card, hub push
    utils/tracking.py    metrics (TensorBoard, metrics.jsonl, W&B), sample tables, the non-finite guard
    utils/loading.py     models and tokenizers from the hub or a folder
    utils/data.py        datasets: loading, TRL's formats, texts by type, batch orders
    utils/chat.py        chat templates, rendering conversations, tokenizing with the right EOS and BOS
    utils/logprobs.py    forward passes, token log-probabilities without the [B, T, V] logits
    utils/generation.py  padding, truncation, sampling
    utils/stats.py       masked statistics
    utils/scoring.py     reward models, reward functions, scoring across tokenizers
    utils/vllm.py        the colocated vLLM engine

The helpers the scripts call most are importable from `utils` itself (utils.generate, utils.masked_mean, ...);
the rest by module (utils.run.make_accelerator, utils.data.load_split, ...). Importing here never imports the
heavy optional libraries (datasets, deepspeed, vllm, wandb): each module imports them where it uses them.

Shape names: B batch, T sequence length, Q query (prompt) length, R response length, V vocabulary.
"""

from utils import chat, checkpoint, data, generation, loading, logprobs, run, saving, scoring, stats, tracking  # noqa: F401
from utils.chat import tokenize_prompts  # noqa: F401
from utils.checkpoint import check_output_dir  # noqa: F401
from utils.data import check_columns, load_split, prompt_batches, shuffled_micro_batch  # noqa: F401
from utils.generation import (  # noqa: F401
    complete,
    first_true_indices,
    generate,
    left_pad,
    lengths_to_mask,
    pad,
    query_response_rows,
    sampling_generator,
    truncate_response,
)
from utils.loading import disable_dropout, enable_gradient_checkpointing, from_pretrained, load_tokenizer  # noqa: F401
from utils.logprobs import (  # noqa: F401
    batched_response_logprobs,
    chunked_token_logprobs,
    entropy_from_logits,
    forward,
    logprobs_from_logits,
    position_ids_from_mask,
    response_logits,
    response_logprobs,
    token_logprobs,
)
from utils.run import exact_div  # noqa: F401
from utils.saving import write_model_card  # noqa: F401
from utils.scoring import (  # noqa: F401
    batched_score,
    call_reward_fn,
    compute_scores,
    get_score,
    last_token_indices,
    load_reward_fn,
    load_reward_model,
    per_token_scores,
    score_head,
)
from utils.stats import masked_mean, masked_var, masked_whiten  # noqa: F401
from utils.tracking import print_samples  # noqa: F401

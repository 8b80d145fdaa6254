"""Shared helpers of the scripts, one module per job; nothing algorithm-specific lives here. This file imports
nothing: a script imports the modules it uses (`import utils.generation`), so a copy needs only those
(`python benchmark/readability.py` lists them).

What a reader meets while following an algorithm:
    utils/data.py        datasets: loading, TRL's formats, RL prompts, their batch order
    utils/examples.py    the offline scripts' examples: SFT rows, preference texts, reward-model ids
    utils/generation.py  padding, truncation at the stop token, sampling
    utils/logprobs.py    forward passes and token log-probabilities
    utils/stats.py       masked statistics
    utils/reward_model.py  a reward model's score: per token, at the last token, in chunks
    utils/scoring.py     reward models and functions on query + response rows
    utils/chat.py        chat templates, rendering conversations

Plumbing one can skip on a first read:
    utils/run.py         command line (tyro), errors as one line, the accelerator (DDP, DeepSpeed), frozen models
    utils/checkpoint.py  checkpoints, exact resume, SIGTERM, the output folder
    utils/saving.py      the final model: weights, tokenizer, model card, hub push
    utils/tracking.py    metrics (TensorBoard, metrics.jsonl, W&B), sample tables, the non-finite guard
    utils/loading.py     models and tokenizers from the hub or a folder

Optional, imported only on the path that needs it: behind a flag (a copy without the file says which to copy)
or, for the last five, whenever the file is there (a copy without it takes the plain path named):
    utils/reward_funcs.py  reward functions, TRL's contract (with --reward_funcs / --reward_fn)
    utils/trl_flags.py   TRL 1.16 command lines of rloo.py (with a TRL 1.16 flag)
    utils/reward_tokenizer.py  reward models that read text: another tokenizer, a chat template
    utils/vllm.py        the colocated vLLM engine (with --use_vllm)
    utils/lora.py        LoRA adapters, the adapter-off reference, merged saving (with --use_peft)
    utils/tools.py       multi-turn rollouts with tools in grpo.py and rloo.py (with --tools; it uses
                         reward_funcs.py)
    utils/environments.py  one environment per rollout (with --environment_factory; it builds on tools.py)
    utils/dynamic_sampling.py  DAPO's dynamic sampling in grpo.py (with --filter_groups)
    utils/sampling_knobs.py  top-k, top-p, min-p, repetition penalty (with one of their flags)
    utils/rollout_func.py  TRL's rollout_func: grpo.py trains on your own loop's rollouts (with --rollout_func;
                         it uses reward_funcs.py)
    utils/lm_head.py     the tiled LM head: log-probabilities without the [B, T, V] logits (a copy without
                         it computes them from the full logits, as TRL does)
    utils/plots.py       curves.png of the model card (a copy without it saves the card without curves)
    utils/safeguards.py  a stop between micro-batches, damaged checkpoints skipped, a resume with other flags
                         refused (a copy without it stops at the step's end and trusts the flags)
    utils/cli.py         TRL's flags translated or refused, one sentence per bad flag, grouped --help (a copy
                         without it parses with tyro alone)
    utils/paths.py       a path or hub id checked before it loads, the exact reason in one sentence (a copy
                         without it says a path is missing more plainly)

Shape names: B batch, T sequence length, Q query (prompt) length, R response length, V vocabulary.
"""

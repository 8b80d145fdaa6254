"""sft.py: the data rules and the loss against slow loops and hand cases, then the real command line on the tiny
world (learning, determinism, 2 processes, the copy test, bad input)."""

import json
import math
import random
import shutil

import pytest
import torch

import sft
from conftest import ROOT, run_script, run_torchrun

EOS, PAD = 0, 1


# ---------------------------------------------------------------------------------------------- truncation rules
def test_truncate_hand_cases():
    t = sft.truncate
    ids, mask = [5, 6, 7, 8, 9, EOS], [0, 0, 0, 1, 1, 1]
    assert t(ids, mask, 6, "keep_start") == (ids, mask, "kept")  # exactly full
    assert t(ids, mask, 5, "keep_start") == (
        [5, 6, 7, 8, 9],
        [0, 0, 0, 1, 1],
        "truncated",
    )  # the EOS goes first
    assert t(ids, mask, 4, "keep_start") == ([5, 6, 7, 8], [0, 0, 0, 1], "truncated")  # into the completion
    assert t(ids, mask, 3, "keep_start") == ([], [], "dropped")  # no loss token left
    assert t(ids, mask, 3, "keep_end") == ([8, 9, EOS], [1, 1, 1], "truncated")  # the prompt's start goes
    assert t([5, 6], [1, 1], 1, "keep_start") == ([5], [1], "truncated")  # plain text


def slow_truncate(ids, mask, max_length, mode):
    """Drop tokens one at a time from the end (keep_start) or the start (keep_end); drop a row left untrained."""
    ids, mask, cut = list(ids), list(mask), False
    while len(ids) > max_length:
        ids.pop(-1 if mode == "keep_start" else 0)
        mask.pop(-1 if mode == "keep_start" else 0)
        cut = True
    if 1 not in mask:
        return [], [], "dropped"
    return ids, mask, "truncated" if cut else "kept"


def test_truncate_matches_slow_loop():
    rng = random.Random(0)
    statuses = set()
    for _ in range(2000):
        prompt_length, completion_length = rng.randrange(0, 12), rng.randrange(0, 6)
        ids = [rng.randrange(2, 50) for _ in range(prompt_length + completion_length)] + [EOS]
        mask = [0] * prompt_length + [1] * (completion_length + 1)
        max_length, mode = rng.randrange(1, 16), rng.choice(["keep_start", "keep_end"])
        got = sft.truncate(ids, mask, max_length, mode)
        assert got == slow_truncate(ids, mask, max_length, mode)
        statuses.add(got[2])
    assert statuses == {"kept", "truncated", "dropped"}


# ---------------------------------------------------------------------------------------------- packing
def slow_best_fit_decreasing(lengths, capacity):
    """Longest first (ties in order); scan every bin for the least room that fits, ties to the bin that has had
    that room the longest; else open a bin."""
    bins, rooms, since = [], [], []  # since: the step at which the bin reached its room
    for step, i in enumerate(sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))):
        fits = [b for b in range(len(bins)) if rooms[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (rooms[b], since[b]))
        else:
            b = len(bins)
            bins.append([]), rooms.append(capacity), since.append(step)
        bins[b].append(i)
        rooms[b] -= lengths[i]
        since[b] = step
    return bins


def test_best_fit_decreasing_matches_slow_loop():
    assert sft.best_fit_decreasing([3, 5, 2, 4, 1], 6) == [[1, 4], [3, 2], [0]]
    rng = random.Random(1)
    for _ in range(300):
        capacity = rng.randrange(1, 20)
        lengths = [rng.randrange(1, capacity + 1) for _ in range(rng.randrange(0, 40))]
        bins = sft.best_fit_decreasing(lengths, capacity)
        assert bins == slow_best_fit_decreasing(lengths, capacity)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= capacity for b in bins)


def slow_wrap(sequences, block_size):
    blocks, current = [], []
    for sequence in sequences:
        for token in sequence:
            current.append(token)
            if len(current) == block_size:
                blocks.append(current)
                current = []
    return blocks + ([current] if current else [])


def test_pack_rows_by_strategy():
    rows = [
        {"input_ids": ids, "loss_mask": [1] * len(ids)}
        for ids in ([5, 6, EOS], [7, EOS], [8, 9, 10, 11, EOS])
    ]
    bfd = sft.pack_rows(rows, 4, "bfd")
    assert bfd == [
        {"input_ids": [8, 9, 10, 11], "loss_mask": [0, 1, 1, 1], "seq_lengths": [4]},  # cut: its EOS is lost
        {"input_ids": [5, 6, EOS], "loss_mask": [0, 1, 1], "seq_lengths": [3]},
        {"input_ids": [7, EOS], "loss_mask": [0, 1], "seq_lengths": [2]},
    ]
    split = sft.pack_rows(rows, 4, "bfd_split")
    assert [r["input_ids"] for r in split] == [[8, 9, 10, 11], [5, 6, EOS, EOS], [7, EOS]]
    assert split[1]["seq_lengths"] == [3, 1] and split[1]["loss_mask"] == [0, 1, 1, 0]
    wrapped = sft.pack_rows(rows, 4, "wrapped")
    assert [r["input_ids"] for r in wrapped] == [[5, 6, EOS, 7], [EOS, 8, 9, 10], [11, EOS]]
    assert all("seq_lengths" not in r and r["loss_mask"] == [1] * len(r["input_ids"]) for r in wrapped)
    # TRL packs each 1,000 examples apart: the row at the seam is short
    many = [{"input_ids": [5, 6, EOS], "loss_mask": [1, 1, 1]}] * (sft.PACKING_CHUNK + 1)
    assert [len(r["input_ids"]) for r in sft.pack_rows(many, 7, "wrapped")][-3:] == [7, 4, 3]
    rng = random.Random(2)
    for _ in range(100):
        docs = [
            [rng.randrange(2, 50) for _ in range(rng.randrange(0, 9))] + [EOS]
            for _ in range(rng.randrange(1, 8))
        ]
        block = rng.randrange(1, 12)
        rows = [{"input_ids": d, "loss_mask": [1] * len(d)} for d in docs]
        assert [r["input_ids"] for r in sft.pack_rows(rows, block, "wrapped")] == slow_wrap(docs, block)
        for strategy in ("bfd", "bfd_split"):
            packed = sft.pack_rows(rows, block, strategy)
            assert all(len(r["input_ids"]) == sum(r["seq_lengths"]) <= block for r in packed)
            kept = sum(len(d) if strategy == "bfd_split" else min(len(d), block) for d in docs)
            assert sum(len(r["input_ids"]) for r in packed) == kept


# ---------------------------------------------------------------------------------------------- collate and loss
@pytest.mark.parametrize("pad_id", [PAD, EOS])  # pad distinct from, and equal to, EOS
def test_collate_labels_from_masks_not_pad_ids(pad_id):
    rows = [
        {"input_ids": [5, 6, 7, EOS], "loss_mask": [0, 0, 1, 1]},
        {"input_ids": [8, EOS], "loss_mask": [0, 1]},
    ]
    batch = sft.collate(rows, pad_id)
    x = sft.IGNORE_INDEX
    assert batch["input_ids"].tolist() == [[5, 6, 7, EOS], [8, EOS, pad_id, pad_id]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[x, x, 7, EOS], [x, EOS, x, x]]


def test_sum_token_nll_matches_loop():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=11, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(config)
    input_ids = torch.randint(0, 11, (3, 6))
    labels = input_ids.clone()
    labels[0, :3] = sft.IGNORE_INDEX
    labels[2, 4:] = sft.IGNORE_INDEX
    attention_mask = torch.ones_like(input_ids)
    attention_mask[2, 5:] = 0  # right padding, as collate makes it
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    total, count = 0.0, 0
    for b in range(3):
        for t in range(1, 6):  # position t is predicted by the logits at t - 1
            if labels[b, t] != sft.IGNORE_INDEX:
                row = logits[b, t - 1].tolist()
                log_z = math.log(sum(math.exp(v) for v in row))
                total += log_z - row[labels[b, t]]
                count += 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    nll, n = sft.sum_token_nll(model, batch)
    assert n.item() == count == 11
    assert nll.item() == pytest.approx(total, rel=1e-5)


# ---------------------------------------------------------------------------------------------- tokenization
@pytest.fixture(scope="module")
def tokenizer(world):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(world / "policy")


def args_for(**kwargs):
    return sft.Args(**{"max_length": 128, **kwargs})


def test_completion_only_labels_cover_the_completion_and_one_eos(world, tokenizer):
    import datasets

    data = datasets.load_from_disk(str(world / "dataset"))["sft"].select(range(20))
    eos = tokenizer.eos_token_id
    for completion_only in (True, False):
        rows, counts = sft.tokenize_split(
            data, tokenizer, args_for(completion_only_loss=completion_only), "sft"
        )
        assert counts == {"kept": 20, "truncated": 0, "dropped": 0}
        batch = sft.collate(rows, tokenizer.pad_token_id)
        for i, example in enumerate(data):
            prompt_ids = tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]
            completion_ids = tokenizer(example["completion"], add_special_tokens=False)["input_ids"] + [eos]
            length = len(prompt_ids) + len(completion_ids)
            expected = [
                t if (j >= len(prompt_ids) or not completion_only) and j < length else sft.IGNORE_INDEX
                for j, t in enumerate(batch["input_ids"][i].tolist())
            ]
            assert batch["input_ids"][i, :length].tolist() == prompt_ids + completion_ids
            assert batch["labels"][i].tolist() == expected
        if completion_only:
            trained = [t for t in batch["labels"][0].tolist() if t != sft.IGNORE_INDEX]
            assert tokenizer.decode(trained) == data[0]["completion"] + tokenizer.eos_token
    # A completion that already carries the EOS text gets no second EOS.
    with_eos = datasets.Dataset.from_dict(
        {"prompt": ["TL;DR:"], "completion": [" dog" + tokenizer.eos_token]}
    )
    (row,), _ = sft.tokenize_split(with_eos, tokenizer, args_for(), "x")
    assert row["input_ids"].count(eos) == 1 and row["input_ids"][-1] == eos


def test_tokenize_split_counts_truncated_and_dropped(tokenizer):
    import datasets

    long_prompt = "TITLE: " + " ".join(["dog"] * 30) + " TL;DR:"
    data = datasets.Dataset.from_dict(
        {"prompt": ["TL;DR:", long_prompt, "TL;DR:"], "completion": [" cat", " cat", " cat" * 20]}
    )
    rows, counts = sft.tokenize_split(data, tokenizer, args_for(max_length=12), "x")
    assert counts == {"kept": 1, "truncated": 1, "dropped": 1}  # the long prompt fills the 12 tokens: dropped
    assert [len(r["input_ids"]) for r in rows] == [6, 12]
    assert tokenizer.decode(rows[1]["input_ids"]) == "TL;DR:" + " cat" * 8  # the completion's end is cut
    rows, counts = sft.tokenize_split(
        data, tokenizer, args_for(max_length=12, truncation_mode="keep_end"), "x"
    )
    assert counts == {"kept": 1, "truncated": 2, "dropped": 0}
    assert tokenizer.decode(rows[1]["input_ids"]).endswith("dog TL;DR: cat" + tokenizer.eos_token)
    rows, counts = sft.tokenize_split(data, tokenizer, args_for(max_length=40, max_prompt_length=5), "x")
    assert counts == {"kept": 2, "truncated": 1, "dropped": 0}  # "TL;DR:" is 4 tokens, the long prompt 37
    assert len(rows[1]["input_ids"]) == 5 + 2 and rows[2]["loss_mask"] == [0] * 4 + [1] * 21
    with pytest.raises(ValueError, match="all 1 examples were dropped"):
        sft.tokenize_split(data.select([1]), tokenizer, args_for(max_length=12), "x")


def test_plain_text_with_and_without_packing(tokenizer):
    import datasets

    texts = ["the dog and the cat", "a loan", "the vet " * 10]
    data = datasets.Dataset.from_dict({"content": texts})
    eos = tokenizer.eos_token_id
    docs = [tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts]
    rows, counts = sft.tokenize_split(
        data, tokenizer, args_for(dataset_text_field="content", max_length=8), "x"
    )
    assert counts == {"kept": 2, "truncated": 1, "dropped": 0}
    assert [r["input_ids"] for r in rows] == [docs[0], docs[1], docs[2][:8]]
    args = args_for(dataset_text_field="content", max_length=8, packing=True, packing_strategy="wrapped")
    rows, counts = sft.tokenize_split(data, tokenizer, args, "x")
    assert counts["truncated"] == 0 and all(len(r["input_ids"]) == 8 for r in rows[:-1])
    assert [t for r in rows for t in r["input_ids"]] == [t for d in docs for t in d]
    assert all(m == [1] * len(r["input_ids"]) for r in rows for m in [r["loss_mask"]])
    rows, counts = sft.tokenize_split(
        data, tokenizer, args_for(**{**vars(args), "packing_strategy": "bfd"}), "x"
    )
    assert counts == {"kept": 2, "truncated": 1, "dropped": 0}  # whole examples; the long one cut to a row
    assert sorted(n for r in rows for n in r["seq_lengths"]) == sorted(min(len(d), 8) for d in docs)


# ---------------------------------------------------------------------------------------------- command line
def common_flags(world, tmp_path, name, steps, **extra):
    flags = {
        "model_name_or_path": world / "policy", "dataset_name": world / "dataset",
        "dataset_train_split": "sft", "dataset_test_split": "validation", "max_length": 96,
        "response_length": 8, "num_samples": 4, "logging_steps": 1, "eval_steps": 0,
        "total_steps": steps, "output_dir": tmp_path / name, "logging_dir": tmp_path / "runs",
        "run_name": name, **extra,
    }  # fmt: skip
    return [f"--{k}={v}" for k, v in flags.items()]


def tensorboard_scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_sft_learns_the_tiny_world(world, tmp_path):
    """From the random policy, 24 steps lower the validation loss (completion tokens) far below the start."""
    flags = common_flags(world, tmp_path, "learn", 24, per_device_train_batch_size=16, learning_rate=3e-3,
                         warmup_ratio=0.1, lr_scheduler_type="cosine", logging_steps=10, eval_steps=12)  # fmt: skip
    run_script(["sft.py", *flags], timeout=300)
    out, run_dir = tmp_path / "learn", tmp_path / "runs" / "learn"
    metrics = json.loads((out / "metrics.json").read_text())
    # The random model is near uniform over the vocabulary; the trained one has learned the task's format
    # (measured: 6.40 -> 2.94 after 20 steps).
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    assert metrics["eval/initial_loss"] == pytest.approx(math.log(vocab), abs=0.5)
    assert metrics["eval/loss"] < metrics["eval/initial_loss"] - 2.5
    assert metrics["loss"] < metrics["eval/initial_loss"] - 2.0
    assert metrics["data/num_kept"] == 600 and metrics["global_step"] == 24
    scalars = tensorboard_scalars(run_dir)
    assert [step for step, _ in scalars["eval/loss"]] == [0, 12, 24]
    assert scalars["eval/loss"][-1][1] == pytest.approx(metrics["eval/loss"])
    assert [step for step, _ in scalars["num_tokens"]] == [10, 20, 24]
    assert scalars["num_tokens"][-1][1] == metrics["num_tokens"] > 24 * 16 * 50  # prompts ~52 tokens
    assert scalars["perf/tokens_per_second"][0][1] > 0
    progress = (10 - 3) / (24 - 3)  # ceil(10% of 24) = 3 warmup steps, then cosine down to 0
    assert scalars["learning_rate"][0] == (10, pytest.approx(3e-3 * 0.5 * (1 + math.cos(math.pi * progress))))
    assert scalars["learning_rate"][-1] == (24, pytest.approx(0.0, abs=1e-12))
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").open()]
    assert [s["step"] for s in samples] == [0] * 4 + [12] * 4 + [24] * 4
    assert {"prompt", "sample", "reference"} <= set(samples[0]) and samples[0]["prompt"].endswith("TL;DR:")
    assert "## Final metrics" in (out / "README.md").read_text()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(out) is not None
    assert AutoTokenizer.from_pretrained(out).eos_token_id is not None


def test_determinism_and_two_processes_see_the_same_batch(world, tmp_path):
    """Same seed twice -> identical weights. Two processes x 1 micro-batch compute the same first-step loss,
    gradient norm and validation loss as one process x 2 accumulated micro-batches (the same 8 sequences)."""
    from safetensors.torch import load_file

    small = {"per_device_train_batch_size": 4, "learning_rate": 1e-3, "dataset_test_split": "test"}
    for name in ("a", "b"):
        run_script(
            ["sft.py", *common_flags(world, tmp_path, name, 2, gradient_accumulation_steps=2, **small)]
        )
    run_torchrun(["sft.py", *common_flags(world, tmp_path, "ddp", 2, **small)])
    weights = {name: load_file(tmp_path / name / "model.safetensors") for name in ("a", "b", "ddp")}
    assert weights["a"].keys() == weights["b"].keys()
    assert all(torch.equal(weights["a"][k], weights["b"][k]) for k in weights["a"])
    initial = load_file(world / "policy" / "model.safetensors")
    assert not all(torch.equal(weights["a"][k], initial[k]) for k in initial)  # it did train
    one, two = tensorboard_scalars(tmp_path / "runs" / "a"), tensorboard_scalars(tmp_path / "runs" / "ddp")
    for tag in ("loss", "grad_norm", "eval/loss"):
        assert two[tag][0][1] == pytest.approx(one[tag][0][1], rel=1e-4), tag
    # Each process of the 2-process run holds 4 sequences per step: equal token counts mean both were counted.
    assert one["num_tokens"][0][1] == two["num_tokens"][0][1]
    assert [step for step, _ in two["loss"]] == [1, 2]
    for (_, loss_one), (_, loss_two) in zip(one["loss"], two["loss"]):
        assert loss_two == pytest.approx(loss_one, rel=1e-3)  # later steps: float rounding through Adam


def test_copy_test_with_packing_and_lora(world, tmp_path):
    """sft.py + utils/ alone in an empty directory: --help, then plain text with --packing and a LoRA that is
    merged into a plain model directory."""
    workdir = tmp_path / "copy"
    workdir.mkdir()
    shutil.copy(ROOT / "sft.py", workdir)
    shutil.copytree(ROOT / "utils", workdir / "utils", ignore=shutil.ignore_patterns("__pycache__"))
    assert "--completion_only_loss" in run_script(["sft.py", "--help"], cwd=workdir).stdout
    data = tmp_path / "text"
    data.mkdir()
    for split, source in (("train", "sft"), ("test", "validation")):
        rows = [json.loads(line) for line in (world / "dataset" / f"{source}.jsonl").open()][:200]
        with (data / f"{split}.jsonl").open("w") as f:
            f.writelines(json.dumps({"text": r["prompt"] + r["completion"]}) + "\n" for r in rows)
    flags = common_flags(world, tmp_path, "lora", 3, dataset_name=data, dataset_train_split="train",
                         dataset_test_split="test", max_length=64, per_device_train_batch_size=4,
                         learning_rate=1e-2, lora_r=4, lora_target_modules="q_proj")  # fmt: skip
    run_script(["sft.py", *flags, "--packing", "--use_peft", "--gradient_checkpointing"], cwd=workdir)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(world / "policy").state_dict()
    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "lora").state_dict()
    assert tuned.keys() == base.keys()  # merged: no adapter weights left
    changed = {k for k in base if not torch.equal(base[k], tuned[k])}
    assert changed and all("q_proj" in k for k in changed)
    assert not (tmp_path / "runs" / "lora" / "samples.jsonl").exists()  # plain text: no prompts to sample


# ---------------------------------------------------------------------------------------------- bad input
@pytest.fixture
def kept_output_dir(tmp_path):
    """An existing output_dir, passed with --overwrite_output_dir so that only the bad input can stop the run."""
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    yield out
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"


def bad_args(world, out, **kwargs):
    base = {"model_name_or_path": str(world / "policy"), "dataset_name": str(world / "dataset"),
            "dataset_train_split": "sft", "dataset_test_split": None, "max_length": 96,
            "output_dir": str(out), "overwrite_output_dir": True, "logging_dir": str(out.parent / "runs")}  # fmt: skip
    return sft.Args(**{**base, **kwargs})


def test_bad_flags_fail_with_one_sentence(world, kept_output_dir):
    with pytest.raises(
        ValueError, match=r"--max_prompt_length \(96\) must be .* smaller than --max_length \(64\)"
    ):
        sft.main(bad_args(world, kept_output_dir, max_length=64, max_prompt_length=96))
    with pytest.raises(ValueError, match="--per_device_train_batch_size must be at least 1"):
        sft.main(bad_args(world, kept_output_dir, per_device_train_batch_size=0))
    with pytest.raises(ValueError, match="fewer than one batch of 1000"):
        sft.main(bad_args(world, kept_output_dir, per_device_train_batch_size=1000))


def test_bad_datasets_fail_with_one_sentence(world, tmp_path, kept_output_dir):
    import datasets

    with pytest.raises(
        ValueError, match=r"missing column\(s\) \['completion'\]: expected .* found \['prompt', 'chosen'"
    ):
        sft.main(bad_args(world, kept_output_dir, dataset_train_split="preference"))
    empty = tmp_path / "empty"
    columns = datasets.Features({"prompt": datasets.Value("string"), "completion": datasets.Value("string")})
    split = datasets.Dataset.from_dict({"prompt": [], "completion": []}, features=columns)
    datasets.DatasetDict({"train": split}).save_to_disk(empty, num_shards={"train": 1})
    with pytest.raises(ValueError, match="split 'train' has no rows"):
        sft.main(bad_args(world, kept_output_dir, dataset_name=str(empty), dataset_train_split="train"))
    with pytest.raises(ValueError, match="has no split 'nope'"):
        sft.main(bad_args(world, kept_output_dir, dataset_train_split="nope"))


def test_existing_output_dir_is_refused(world, tmp_path):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(ValueError, match="exists and is not empty"):
        sft.main(bad_args(world, out, overwrite_output_dir=False))
    assert (out / "keep.txt").read_text() == "precious" and len(list(out.iterdir())) == 1

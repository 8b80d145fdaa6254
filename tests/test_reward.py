"""reward.py: the loss against hand computation and a loop, the single forward pass, truncation, normalisation
after a reload, and runs through the command line on the tiny world (one and two processes, copied alone)."""

import json
import math
import shutil

import datasets
import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForSequenceClassification,
)

import reward
import utils.reward_model
import utils.scoring
from conftest import ROOT, run_script, run_torchrun

PAD, EOS = 1, 0


def tiny_classifier(seed=0, num_labels=1):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=num_labels,
                         pad_token_id=PAD, eos_token_id=EOS)  # fmt: skip
    return LlamaForSequenceClassification(config).eval()


def card_metrics(output_dir) -> dict:
    """The final metrics (metrics.json), checked against the model card's table."""
    metrics = json.loads((output_dir / "metrics.json").read_text())
    card = (output_dir / "README.md").read_text()
    assert (
        "reward model (Bradley-Terry)" in card
        and f"| eval/accuracy | {metrics['eval/accuracy']:.6g} |" in card
    )
    return metrics


def score_rows(model, rows, batch_size=16):
    """Scores [N, k] of tokenized rows, one process, in order."""
    out = []
    for i in range(0, len(rows), batch_size):
        batch = reward.collate(rows[i : i + batch_size], PAD)
        scores = utils.reward_model.get_score(model, batch["input_ids"], batch["attention_mask"])
        out.append(scores.view(-1, len(rows[i : i + batch_size])).T)
    return torch.cat(out)


# ---------------------------------------------------------------------------------------------------- the loss
def test_reward_loss_hand_computed():
    chosen, rejected, margin = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.5])
    # -log sigmoid(x) = log(1 + e^-x): pair 1 has x = 1, pair 2 has x = 0 - 0.5
    expected = (math.log(1 + math.exp(-1.0)) + math.log(1 + math.exp(0.5))) / 2
    assert reward.reward_loss(chosen, rejected, margin).item() == pytest.approx(expected, rel=1e-6)
    assert reward.reward_loss(chosen, rejected).item() == pytest.approx(
        (0.313262 + math.log(2)) / 2, rel=1e-5
    )
    # centering adds 0.01 * mean((2 + 1)^2, (0 + 0)^2) = 0.045
    centered = reward.reward_loss(chosen, rejected, margin, center_rewards_coefficient=0.01)
    assert centered.item() == pytest.approx(expected + 0.045, rel=1e-6)


def slow_bradley_terry(chosen, rejected, margin, coefficient):
    nll, center = 0.0, 0.0
    for c, r, m in zip(chosen, rejected, margin):
        nll -= math.log(1.0 / (1.0 + math.exp(-(c - r - m))))
        center += (c + r) ** 2
    return nll / len(chosen) + coefficient * center / len(chosen)


@pytest.mark.parametrize("coefficient", [0.0, 0.01])
def test_reward_loss_matches_loop(coefficient):
    g = torch.Generator().manual_seed(0)
    chosen, rejected, margin = (torch.randn(3, 64, generator=g, dtype=torch.float64) * 3).unbind()
    expected = slow_bradley_terry(chosen.tolist(), rejected.tolist(), margin.tolist(), coefficient)
    assert reward.reward_loss(chosen, rejected, margin, coefficient).item() == pytest.approx(
        expected, rel=1e-10
    )


def test_eval_metrics_hand_computed():
    scores = torch.tensor(
        [[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [3.0, 1.0]]
    )  # right, wrong, tie (wrong), right
    metrics = reward.eval_metrics(scores, torch.zeros(4), torch.tensor([0, 1, 1, 1]), ["a", "b"])
    assert metrics["eval/accuracy"] == 0.5
    assert metrics["eval/accuracy/a"] == 1.0 and metrics["eval/accuracy/b"] == pytest.approx(1 / 3)
    assert metrics["eval/mean_reward"] == pytest.approx(10 / 8)
    assert metrics["eval/std_reward"] == pytest.approx(scores.flatten().std().item())
    assert metrics["eval/loss"] == pytest.approx(reward.reward_loss(scores[:, 0], scores[:, 1]).item())
    assert metrics["eval/num_pairs"] == 4
    assert "eval/accuracy/" not in " ".join(reward.eval_metrics(scores, torch.zeros(4), torch.zeros(4), [""]))


# ------------------------------------------------------------------------------------------ data and truncation
def test_completion_ids_end_with_one_eos(world):
    tokenizer = AutoTokenizer.from_pretrained(world / "tokenizer")
    eos = tokenizer.eos_token_id
    texts = [" landlord tbh", " landlord tbh" + tokenizer.eos_token, ""]
    rows = datasets.Dataset.from_list([{"prompt": " rent", "completion": text} for text in texts])
    plain, ended, empty = reward.utils.examples.reward_ids(rows, tokenizer, "rows", ["completion"])[
        "completion"
    ]
    assert plain == ended and plain[-1] == eos and plain.count(eos) == 1
    assert empty == [eos]


def test_tokenize_rows_drops_rows_longer_than_max_length(world):
    """A pair with a chosen or rejected sequence over --max_length is dropped whole, never cut, as TRL 1.16's
    RewardTrainer filters it."""
    tokenizer = AutoTokenizer.from_pretrained(world / "tokenizer")
    long = " rent deposit boss salary promotion sister brother wedding"
    dataset = datasets.Dataset.from_dict({
        "prompt": [" so then but really just", " so", " so then"], "chosen": [" rent", " rent", long],
        "rejected": [" tbh", " rent tbh", " tbh"], "margin": [0.5, 0.0, 1.0], "kind": ["p", "q", "p"],
    })  # fmt: skip

    def length(text):
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    lengths = [length(t) for t in (" so then but really just", " rent", " tbh", " rent tbh", long)]
    assert lengths == [5, 1, 1, 2, 8]
    # max_length 6: row 0 (5 + 1 + EOS) is dropped, row 1 (1 + 2 + EOS) fits, row 2 (2 + 8 + EOS) is dropped
    rows, counts, groups = reward.tokenize_rows(tokenizer, dataset, ["chosen", "rejected"], 6, "kind")
    assert counts == {"rows": 3, "dropped": 2} and groups == ["p", "q"]
    assert [(r["index"], r["margin"], r["group"]) for r in rows] == [(1, 0.0, 1)]
    assert [len(s) for s in rows[0]["sequences"]] == [3, 4]
    rows, counts, _ = reward.tokenize_rows(tokenizer, dataset, ["chosen", "rejected"], 7, "kind")
    assert counts == {"rows": 3, "dropped": 1} and [len(s) for s in rows[0]["sequences"]] == [7, 7]
    assert all(s[-1] == tokenizer.eos_token_id for r in rows for s in r["sequences"])
    so_then = tokenizer(" so then but really just", add_special_tokens=False)["input_ids"]
    assert rows[0]["sequences"][0][:5] == so_then  # the whole prompt


# ----------------------------------------------------------------------------------------------------- the model
def test_one_forward_pass_equals_separate_passes_and_the_classifier_itself():
    model = tiny_classifier()
    rows = [
        {"sequences": [[3, 4, 5, 6, EOS], [3, 4, EOS]], "margin": 0.0, "group": 0},
        {"sequences": [[7, EOS], [7, 8, 9, 10, 11, 12, EOS]], "margin": 0.0, "group": 0},
        {"sequences": [[13, 14, EOS], [13, 15, EOS]], "margin": 0.0, "group": 0},
    ]
    batch = reward.collate(rows, PAD)
    assert batch["input_ids"].shape == (6, 7)
    with torch.no_grad():
        joint = reward.ScoreModel(model)(batch["input_ids"], batch["attention_mask"])
        for j in range(2):  # chosen alone, rejected alone: each padded to its own width
            alone = reward.collate([{**r, "sequences": [r["sequences"][j]]} for r in rows], PAD)
            separate = utils.reward_model.get_score(model, alone["input_ids"], alone["attention_mask"])
            torch.testing.assert_close(joint[3 * j : 3 * j + 3], separate, atol=1e-5, rtol=1e-5)
        # the classifier's own forward (last non-pad token, pad != eos, right padding) reads the same place
        own = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    torch.testing.assert_close(joint, own, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("normalize_std", [False, True])
def test_normalization_survives_a_reload(tmp_path, normalize_std):
    model = tiny_classifier(seed=1)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 9, (40,), generator=g).tolist()
    sequences = [torch.randint(2, 32, (n,), generator=g).tolist() + [EOS] for n in lengths]
    rows = [{"sequences": [s], "margin": 0.0, "group": 0} for s in sequences]
    with torch.no_grad():
        before = score_rows(model, rows)[:, 0]
    mean, std = before.mean().item(), before.std().item() if normalize_std else 1.0
    assert abs(mean) > 1e-3
    reward.normalize_score_head(model, mean, std)
    reward.save_reward_model(model, tmp_path)
    loaded = reward.load_reward_model(str(tmp_path))
    with torch.no_grad():
        after = score_rows(loaded, rows)[:, 0]
    torch.testing.assert_close(after, (before - mean) / std, atol=1e-5, rtol=1e-5)
    assert abs(after.mean().item()) < 1e-5
    if normalize_std:
        assert after.std().item() == pytest.approx(1.0, abs=1e-5)
    # the weights load cleanly with a plain from_pretrained (the head without bias), and utils.reward_model.get_score adds
    # the shift kept in the config, so ppo.py and rloo.py see the normalized scores too
    plain, info = AutoModelForSequenceClassification.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"] and plain.score.bias is None
    with torch.no_grad():
        torch.testing.assert_close(score_rows(plain, rows)[:, 0], after, atol=1e-5, rtol=0)
    # normalising a loaded (biased) head again composes, and saving again keeps the bias
    reward.normalize_score_head(loaded, -1.0, 0.5)
    reward.save_reward_model(loaded, tmp_path / "again")
    with torch.no_grad():
        again = score_rows(reward.load_reward_model(str(tmp_path / "again")), rows)[:, 0]
    torch.testing.assert_close(again, (after + 1.0) / 0.5, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------- through the command line
def common_flags(world, tmp_path, name="out", dataset=None, test_split="preference_validation"):
    return [
        "reward.py", "--model_name_or_path", str(world / "policy"), "--dataset_name", str(dataset or world / "dataset"),
        "--dataset_train_split", "preference", "--dataset_test_split", test_split,
        "--output_dir", str(tmp_path / name), "--logging_dir", str(tmp_path / "runs"),
    ]  # fmt: skip


def short_prompts(world, path, chars=24):
    """The world's splits with each prompt cut to its last `chars` characters: short rows keep this test fast, and
    the completions (key words vs hedges) carry most of the signal."""
    data = datasets.load_from_disk(str(world / "dataset"))
    names = ("preference", "preference_validation", "sft")
    splits = {name: data[name].map(lambda row: {"prompt": row["prompt"][-chars:]}) for name in names}
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return path


def test_end_to_end_learns_and_the_output_serves_ppo(world, tmp_path):
    dataset = short_prompts(world, tmp_path / "short")
    flags = ["--max_length", "32", "--learning_rate", "1e-3", "--per_device_train_batch_size", "16",
             "--total_steps", "80", "--lr_scheduler_type", "constant_with_warmup", "--warmup_ratio", "0.1",
             "--eval_steps", "40", "--logging_steps", "20", "--normalize_std", "--seed", "2"]  # fmt: skip
    proc = run_script(common_flags(world, tmp_path, dataset=dataset) + flags, timeout=300)
    out = tmp_path / "out"
    metrics = card_metrics(out)
    assert metrics["eval/accuracy"] > 0.6, proc.stdout[-3000:]
    assert metrics["eval/num_pairs"] == 200 and metrics["data/train_rows"] == 600
    assert metrics["data/train_dropped"] == 0 and "data/train_prompt_cut" not in metrics
    for name in (
        "loss",
        "accuracy",
        "margin",
        "eval/loss",
        "eval/mean_reward",
        "eval/std_reward",
    ):
        assert math.isfinite(metrics[name])
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {
        p.name for p in out.iterdir()
    }
    assert list((tmp_path / "runs").glob("*/events.out.tfevents.*"))
    assert "step 40: eval/accuracy" in proc.stdout

    # normalised on the sft split's references: mean 0 and std 1 after a reload
    model = reward.load_reward_model(str(out)).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    sft = datasets.load_from_disk(str(dataset))["sft"]
    rows, counts, _ = reward.tokenize_rows(tokenizer, sft, ["completion"], 32)
    assert counts["dropped"] == 0
    with torch.no_grad():
        scores = score_rows(model, rows, batch_size=128)[:, 0]
    assert abs(scores.mean().item()) < 1e-4 and scores.std().item() == pytest.approx(1.0, abs=1e-4)
    assert metrics["normalize/mean_after"] == pytest.approx(0.0, abs=1e-4)

    # what ppo.py / rloo.py do: left-padded queries + responses, score at the last real token, critic values
    query = tokenizer("TL;DR:", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([[tokenizer.pad_token_id] * 2 + query + [tokenizer.eos_token_id]])
    mask = (ids != tokenizer.pad_token_id).long()
    with torch.no_grad():
        values = utils.reward_model.per_token_scores(model, ids, mask)
        score = utils.reward_model.get_score(model, ids, mask)
    assert values.shape == ids.shape and score.shape == (1,)
    torch.testing.assert_close(values[:, -1], score)


def with_group_column(world, tmp_path):
    """The world's preference data as jsonl files, with a margin column (train) and a group column (validation)."""
    data = tmp_path / "data"
    data.mkdir()
    for split in ("preference", "preference_validation"):
        with open(world / "dataset" / f"{split}.jsonl") as f, open(data / f"{split}.jsonl", "w") as g:
            for line in f:
                row = json.loads(line)
                row["kind"] = "hedged" if "tbh" in row["chosen"] + row["rejected"] else "plain"
                row["margin"] = 0.1 if split == "preference" else 0.0
                g.write(json.dumps(row) + "\n")
    return data


def test_two_processes_gather_every_evaluation_pair(world, tmp_path):
    data = with_group_column(world, tmp_path)
    flags = common_flags(world, tmp_path, dataset=data) + ["--eval_group_by", "kind", "--normalize_dataset", str(world / "dataset"), "--total_steps", "3",
              "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "3", "--eval_steps", "2",
              "--learning_rate", "1e-3", "--normalize_split", "validation"]  # fmt: skip
    run_torchrun(flags, nproc=2)
    out = tmp_path / "out"
    metrics = card_metrics(out)
    assert (
        metrics["eval/num_pairs"] == 200
    )  # 200 pairs in batches of 3 on 2 processes: padded, then deduplicated
    # the same accuracies recomputed on one process from the saved (normalised: order-preserving) model
    model = reward.load_reward_model(str(out)).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    validation = datasets.load_dataset("json", data_files=str(data / "preference_validation.jsonl"))["train"]
    rows, _, groups = reward.tokenize_rows(tokenizer, validation, ["chosen", "rejected"], 1024, "kind")
    with torch.no_grad():
        scores = score_rows(model, rows)
    expected = reward.eval_metrics(
        scores, torch.zeros(len(rows)), torch.tensor([r["group"] for r in rows]), groups
    )
    for name in ("eval/accuracy", "eval/accuracy/hedged", "eval/accuracy/plain"):
        assert metrics[name] == pytest.approx(expected[name], abs=1e-6), name
    assert abs(metrics["normalize/mean_after"]) < 1e-4


def test_copied_script_runs_and_two_runs_give_the_same_weights(world, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(ROOT / "reward.py", copy)
    shutil.copytree(ROOT / "utils", copy / "utils", ignore=shutil.ignore_patterns("__pycache__"))
    assert "--center_rewards_coefficient" in run_script(["reward.py", "--help"], cwd=copy).stdout
    flags = ["--per_device_train_batch_size", "4", "--total_steps", "3", "--learning_rate", "1e-3",
             "--center_rewards_coefficient", "0.01", "--seed", "3", "--normalize_split", "validation"]  # fmt: skip
    run_script(common_flags(world, tmp_path, "a", test_split="None") + flags, cwd=copy)
    run_script(common_flags(world, tmp_path, "b", test_split="None") + flags)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    config_a, config_b = (json.loads((tmp_path / n / "config.json").read_text()) for n in "ab")
    assert config_a["score_bias"] == config_b["score_bias"]
    policy = load_file(world / "policy" / "model.safetensors")
    assert not torch.equal(a["model.embed_tokens.weight"], policy["model.embed_tokens.weight"])  # it trained


# ------------------------------------------------------------------------------------------------------ bad input
def bad_args(world, tmp_path, **overrides):
    defaults = dict(model_name_or_path=str(world / "policy"), dataset_name=str(world / "dataset"),
                    dataset_train_split="preference", dataset_test_split="preference_validation",
                    output_dir=str(tmp_path / "out"), logging_dir=str(tmp_path / "runs"))  # fmt: skip
    return reward.Args(**(defaults | overrides))


def test_bad_input_fails_with_one_clear_sentence(world, tmp_path):
    only_two = tmp_path / "two.jsonl"
    only_two.write_text(json.dumps({"prompt": "p", "chosen": " x"}) + "\n")
    classifier = tmp_path / "classifier"
    config = LlamaConfig.from_pretrained(world / "reward")
    config.num_labels = 2
    LlamaForSequenceClassification(config).save_pretrained(classifier)
    AutoTokenizer.from_pretrained(world / "tokenizer").save_pretrained(classifier)
    cases = [
        (
            dict(dataset_name=str(only_two), dataset_train_split="train", dataset_test_split=None),
            r"missing column\(s\) \['rejected'\]",
        ),
        (dict(model_name_or_path=str(classifier)), "classifier with 2 labels"),
        (dict(max_length=2), "every row is longer than --max_length 2"),
        (dict(eval_group_by="kind"), r"missing column\(s\) \['kind'\]"),
        (dict(normalize_split="nope"), "has no split 'nope'"),
        (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps must be >= 1"),
        (dict(total_steps=0), "total_steps and"),
        (dict(model_name_or_path=str(tmp_path / "missing")), "does not exist"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            reward.main(bad_args(world, tmp_path, **overrides))
    assert not (tmp_path / "out").exists()


def test_empty_split_is_refused(world, tmp_path, monkeypatch):
    # an empty split cannot be saved to disk by `datasets`, so it is handed over in memory
    empty = datasets.Dataset.from_dict({"prompt": [], "chosen": [], "rejected": []})
    monkeypatch.setattr(utils.data, "load_split", lambda *args, **kwargs: empty)
    with pytest.raises(ValueError, match="split 'preference' is empty"):
        reward.main(bad_args(world, tmp_path))


def test_existing_output_dir_is_left_untouched(world, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    proc = run_script(common_flags(world, tmp_path) + ["--total_steps", "1"], check=False, timeout=120)
    assert proc.returncode != 0
    assert "--output_dir" in proc.stderr.strip().splitlines()[-1] and "not empty" in proc.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"

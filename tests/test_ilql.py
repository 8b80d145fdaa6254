"""ilql.py: every loss term against loops written from the ILQL equations, the reward layout, the target-Q sync,
decoding with the advantage, and end-to-end runs through the command line on the tiny world."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import ilql
import utils.chat
import utils.generation
from conftest import run_script

GAMMA, TAU = 0.9, 0.7


def tiny_backbone(vocab=40, hidden=16, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def tiny_ilql(two_qs=True, seed=0):
    model = ilql.ILQLModel(tiny_backbone(seed=seed), two_qs)
    with torch.no_grad():  # targets that differ from the Q heads, so that using the wrong one shows
        for p in model.heads.target_q_heads.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


# ----------------------------------------------------------------------------------------------------------------
# Loss terms against loops over actions
# ----------------------------------------------------------------------------------------------------------------
def random_batch(B=3, R=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 2, 1])[:B]
    return lengths, utils.generation.lengths_to_mask(lengths, R), torch.randn(B, generator=g), g


def test_reward_on_the_last_token_and_zero_value_after_it():
    lengths = torch.tensor([3, 1, 4])
    rewards = ilql.token_rewards(torch.tensor([2.0, -1.0, 0.5]), lengths, 4)
    expected = torch.tensor([[0, 0, 2.0, 0], [-1.0, 0, 0, 0], [0, 0, 0, 0.5]])
    torch.testing.assert_close(rewards, expected)
    values = torch.arange(1.0, 6.0).repeat(3, 1)  # V(s_0..s_4) = 1..5 for every row
    next_values = ilql.next_state_values(values, utils.generation.lengths_to_mask(lengths, 4))
    # V(s_{t+1}) for t < len - 1; 0 at the last token (the next state is terminal) and on padding
    torch.testing.assert_close(next_values, torch.tensor([[2.0, 3, 0, 0], [0, 0, 0, 0], [2.0, 3, 4, 0]]))


def test_q_loss_against_loop():
    lengths, mask, scores, g = random_batch()
    B, R = mask.shape
    qs = [torch.randn(B, R, generator=g) for _ in range(2)]
    values = torch.randn(B, R + 1, generator=g)
    rewards = ilql.token_rewards(scores, lengths, R)
    loss = ilql.q_loss(qs, rewards, ilql.next_state_values(values, mask), mask, GAMMA)
    expected = 0.0
    for q in qs:
        errors = []
        for b in range(B):
            for t in range(int(lengths[b])):
                last = t == lengths[b] - 1
                target = (scores[b] if last else 0.0) + GAMMA * (0.0 if last else values[b, t + 1])
                errors.append((q[b, t] - target) ** 2)
        expected += sum(errors) / len(errors)
    torch.testing.assert_close(loss, torch.as_tensor(expected))


def test_q_loss_does_not_differentiate_the_next_value():
    values = torch.randn(1, 3, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    q = torch.randn(1, 2, requires_grad=True)
    ilql.q_loss([q], torch.zeros(1, 2), ilql.next_state_values(values, mask), mask, GAMMA).backward()
    assert values.grad is None and q.grad is not None


def test_expectile_loss_against_loop_and_by_hand():
    lengths, mask, _, g = random_batch()
    target_q, values = torch.randn(*mask.shape, generator=g), torch.randn(*mask.shape, generator=g)
    terms = []
    for b in range(mask.size(0)):
        for t in range(int(lengths[b])):
            u = target_q[b, t] - values[b, t]
            terms.append((TAU if u >= 0 else 1 - TAU) * u**2)
    torch.testing.assert_close(ilql.expectile_loss(target_q, values, mask, TAU), sum(terms) / len(terms))
    # by hand: u = +2 weighs tau * 4, u = -2 weighs (1 - tau) * 4; tau 0.5 is half the squared error
    one = torch.ones(1, 2, dtype=torch.bool)
    loss = ilql.expectile_loss(torch.tensor([[2.0, -2.0]]), torch.zeros(1, 2), one, 0.9)
    assert loss.item() == pytest.approx((0.9 * 4 + 0.1 * 4) / 2)
    loss = ilql.expectile_loss(torch.tensor([[3.0, 1.0]]), torch.zeros(1, 2), one, 0.5)
    assert loss.item() == pytest.approx(0.5 * (9 + 1) / 2)


def test_expectile_above_the_mean_for_tau_above_half():
    """Minimizing over a constant V: tau 0.5 gives the mean of the targets, tau near 1 their maximum side."""
    targets = torch.tensor([[0.0, 1.0, 2.0, 10.0]])
    mask = torch.ones_like(targets, dtype=torch.bool)
    grid = torch.linspace(-1, 11, 12001)
    for tau, low, high in ((0.5, 3.249, 3.251), (0.99, 8.0, 10.0)):
        losses = torch.stack([ilql.expectile_loss(targets, v.expand_as(targets), mask, tau) for v in grid])
        assert low < grid[losses.argmin()] < high


def test_cql_and_awac_against_loops():
    lengths, mask, _, g = random_batch()
    B, R, V = *mask.shape, 7
    actions = torch.randint(0, V, (B, R), generator=g)
    q_all = [torch.randn(B, R, V, generator=g) for _ in range(2)]
    logits, advantages = torch.randn(B, R, V, generator=g), torch.randn(B, R, generator=g)
    cql, awac, awac_plain = 0.0, [], []
    for q in q_all:
        terms = [
            -torch.log_softmax(q[b, t], -1)[actions[b, t]] for b in range(B) for t in range(int(lengths[b]))
        ]
        cql += sum(terms) / len(terms)
    for b in range(B):
        for t in range(int(lengths[b])):
            nll = -torch.log_softmax(logits[b, t], -1)[actions[b, t]]
            awac.append(torch.exp(2.0 * advantages[b, t]) * nll)
            awac_plain.append(nll)
    torch.testing.assert_close(ilql.cql_loss(q_all, actions, mask), torch.as_tensor(cql))
    torch.testing.assert_close(ilql.awac_loss(logits, actions, advantages, mask, 2.0), sum(awac) / len(awac))
    plain = ilql.awac_loss(logits, actions, advantages, mask, 0.0)  # awac_beta 0: plain cross-entropy
    torch.testing.assert_close(plain, sum(awac_plain) / len(awac_plain))


@pytest.mark.parametrize("two_qs", [True, False])
def test_batched_losses_equal_a_loop_over_unpadded_rows(two_qs):
    """ilql_losses on a padded batch (left-padded prompts, right-padded completions) against a loop that runs
    every row alone, unpadded, and writes each term from the equations: checks the state indexing, padding,
    the terminal state, the min over target heads and which heads each term uses."""
    model = tiny_ilql(two_qs)
    rows = [{"prompt": [5, 6, 7, 8], "completion": [9, 10, 11], "reward": 1.5},
            {"prompt": [12], "completion": [13, 14, 15, 16, 17], "reward": -0.5},
            {"prompt": [18, 19], "completion": [20], "reward": 2.0}]  # fmt: skip
    args = ilql.Args(gamma=GAMMA, tau=TAU, awac_beta=0.5, cql_scale=0.3, awac_scale=0.7)
    batch = ilql.collate(rows, pad_token_id=0, reward_mean=0.5, reward_std=2.0)
    with torch.no_grad():
        total, stats = ilql.ilql_losses(model, batch, args)
    heads, lm_head = model.heads, model.backbone.get_output_embeddings()
    q_terms, cql_terms = [[] for _ in heads.q_heads], [[] for _ in heads.q_heads]
    v_terms, awac_terms = [], []
    with torch.no_grad():
        for row in rows:
            p, c = row["prompt"], row["completion"]
            hidden = model.backbone.model(input_ids=torch.tensor([p + c])).last_hidden_state[0]
            states = [hidden[len(p) - 1 + t] for t in range(len(c) + 1)]  # s_0 .. s_L
            reward = (row["reward"] - 0.5) / 2.0
            for t, a in enumerate(c):
                v_t = heads.v_head(states[t])[0]
                v_next = heads.v_head(states[t + 1])[0] if t + 1 < len(c) else 0.0
                r_t = reward if t == len(c) - 1 else 0.0
                target_q = min(head(states[t])[a] for head in heads.target_q_heads)
                for i, head in enumerate(heads.q_heads):
                    q_terms[i].append((head(states[t])[a] - (r_t + GAMMA * v_next)) ** 2)
                    cql_terms[i].append(-torch.log_softmax(head(states[t]), -1)[a])
                u = target_q - v_t
                v_terms.append((TAU if u >= 0 else 1 - TAU) * u**2)
                awac_terms.append(torch.exp(0.5 * u) * -torch.log_softmax(lm_head(states[t]), -1)[a])
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    expected = [sum(map(mean, q_terms)), mean(v_terms), sum(map(mean, cql_terms)), mean(awac_terms)]
    torch.testing.assert_close(stats[1:5], torch.stack(expected).float(), atol=1e-5, rtol=1e-5)
    combined = expected[0] + expected[1] + 0.3 * expected[2] + 0.7 * expected[3]
    torch.testing.assert_close(total, combined.float(), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Target Q heads
# ----------------------------------------------------------------------------------------------------------------
def test_polyak_sync_and_no_gradient_into_the_targets():
    model = tiny_ilql()
    heads = model.heads
    before = [p.clone() for p in heads.target_q_heads.parameters()]
    online = [p.clone() for p in heads.q_heads.parameters()]
    heads.sync_target_q_heads(0.25)
    for new, old, q in zip(heads.target_q_heads.parameters(), before, online):
        torch.testing.assert_close(new, 0.25 * q + 0.75 * old)
    heads.sync_target_q_heads(1.0)  # alpha 1 copies
    for new, q in zip(heads.target_q_heads.parameters(), online):
        torch.testing.assert_close(new, q)
    assert not any(p.requires_grad for p in heads.target_q_heads.parameters())
    batch = ilql.collate([{"prompt": [3, 4], "completion": [5, 6], "reward": 1.0}], 0, 0.0, 1.0)
    ilql.ilql_losses(model, batch, ilql.Args(awac_beta=1.0))[0].backward()
    assert all(p.grad is None for p in heads.target_q_heads.parameters())
    assert all(p.grad is not None for p in heads.q_heads.parameters())


# ----------------------------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------------------------
def test_decoding_scores_shift_the_logprobs_by_the_advantage():
    g = torch.Generator().manual_seed(1)
    logits, q, v = (
        torch.randn(4, 9, generator=g),
        torch.randn(4, 9, generator=g),
        torch.randn(4, 1, generator=g),
    )
    scores = ilql.advantage_scores(logits, q, v, 3.0, top_k=0)
    torch.testing.assert_close(scores - torch.log_softmax(logits, -1), 3.0 * (q - v))
    top = ilql.advantage_scores(logits, q, v, 3.0, top_k=2)
    kept = torch.isfinite(top)
    assert (kept.sum(-1) == 2).all()
    assert torch.equal(kept, torch.zeros_like(kept).scatter(1, scores.topk(2, -1).indices, True))
    torch.testing.assert_close(top[kept], scores[kept])


def test_beta_zero_is_the_behaviour_model():
    model = tiny_ilql()
    g = torch.Generator().manual_seed(2)
    logits, q, v = (
        torch.randn(3, 40, generator=g),
        torch.randn(3, 40, generator=g),
        torch.randn(3, 1, generator=g),
    )
    behaviour = ilql.advantage_scores(logits, q, v, 0.0, top_k=0).softmax(-1)
    torch.testing.assert_close(behaviour, logits.softmax(-1))
    queries, query_mask = utils.generation.left_pad([[5, 6, 7], [8]], 0)
    ours = ilql.generate(model, queries, query_mask, 6, beta=0.0, top_k=0)
    plain, _ = utils.generation.generate(model.backbone, queries, query_mask, 6, 0.0, 8)
    assert torch.equal(ours, plain)


def test_decoding_follows_the_advantage():
    """Target heads that value token 33 far above the rest: with a large beta every greedy token is 33 (the
    minimum over both heads is used, so both must agree); with beta 0 the backbone decides."""
    model = tiny_ilql()
    with torch.no_grad():
        for i, head in enumerate(model.heads.target_q_heads):
            head[2].weight.zero_()
            head[2].bias.zero_()
            head[2].bias[33] = 5.0
            head[2].bias[34] = 10.0 if i == 0 else -10.0  # high on one head only: the minimum ignores it
    queries, query_mask = utils.generation.left_pad([[5, 6, 7], [8, 9]], 0)
    shifted = ilql.generate(model, queries, query_mask, 4, beta=50.0, top_k=20)[:, 3:]
    assert (shifted == 33).all()
    behaviour = ilql.generate(model, queries, query_mask, 4, beta=0.0, top_k=20)[:, 3:]
    assert not (behaviour == 33).all()


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------
def test_standard_and_conversational_rows(world):
    """A conversational row is rendered with the chat template; its completion is what follows the prompt and
    the generation prompt, then EOS; the reward is read as a float; length flags cut prompt and completion."""
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(world / "tokenizer")
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    conversational = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}],
                                                  "completion": [{"role": "assistant", "content": "yo"}],
                                                  "reward": 2}])  # fmt: skip
    standard = datasets.Dataset.from_list(
        [{"prompt": "<user>hi\n<assistant>", "completion": "yo\n", "reward": 2}]
    )
    args = ilql.Args(max_length=64, max_prompt_length=32)
    rows, counts = ilql.tokenize_split(conversational, tokenizer, args, "conversational")
    assert rows == ilql.tokenize_split(standard, tokenizer, args, "standard")[0]
    assert rows[0]["completion"][-1] == tokenizer.eos_token_id and rows[0]["reward"] == 2.0
    assert tokenizer.decode(rows[0]["prompt"]) == "<user>hi\n<assistant>"
    short = ilql.Args(max_length=4, max_prompt_length=2)
    rows, counts = ilql.tokenize_split(standard, tokenizer, short, "standard")
    assert len(rows[0]["prompt"]) == 2 and len(rows[0]["prompt"] + rows[0]["completion"]) <= 4
    assert counts["prompts_truncated"] == 1


def ilql_dataset(world, tmp_path, rows=48):
    """prompt, completion, reward (the gold score of the reference) from the tiny world's sft split."""
    import datasets

    from tiny_world import gold_score

    source = datasets.load_from_disk(str(world / "dataset"))
    out = {}
    for name, split, n in (("train", "sft", rows), ("validation", "validation", 8)):
        part = source[split].select(range(n))
        out[name] = [{"prompt": r["prompt"], "completion": r["completion"],
                      "reward": gold_score(r["facts"], r["completion"])} for r in part]  # fmt: skip
    path = tmp_path / "data"
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in out.items()}).save_to_disk(str(path))
    return path


def ilql_flags(world, data, output_dir, tmp_path):
    return ["ilql.py", "--model_name_or_path", str(world / "policy"), "--dataset_name", str(data),
            "--dataset_train_split", "train", "--dataset_test_split", "validation", "--max_length", "128", "--max_prompt_length", "100",
            "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "4", "--learning_rate", "3e-3",
            "--response_length", "4", "--logging_steps", "1", "--eval_steps", "0", "--logging_dir",
            str(tmp_path / "runs"), "--output_dir", str(output_dir)]  # fmt: skip


def test_end_to_end_sync_schedule_resume_and_saved_heads(world, tmp_path):
    """4 steps, target sync every 3rd step with alpha 0.5, a checkpoint every step. From the checkpoints:
    the targets stay put at steps 1-2, become 0.5 * Q + 0.5 * old at step 3, stay put at step 4. Resuming from
    checkpoint 2 gives the same final weights. The saved directory loads as a plain causal LM and with heads."""
    from transformers import AutoModelForCausalLM

    data, out = ilql_dataset(world, tmp_path), tmp_path / "ilql"
    flags = ilql_flags(world, data, out, tmp_path) + ["--max_steps", "4", "--save_steps", "1", "--alpha", "0.5",
                                                      "--steps_for_target_q_sync", "3", "--run_name", "a"]  # fmt: skip
    run_script(flags)
    ckpt = [load_file(out / f"checkpoint-{s}" / "model.safetensors") for s in range(1, 5)]
    targets = [k for k in ckpt[0] if k.startswith("heads.target_q_heads.")]
    assert len(targets) == 8  # two heads of two linear layers, weight and bias
    for key in targets:
        online = key.replace("target_q_heads", "q_heads")
        assert torch.equal(ckpt[0][key], ckpt[1][key]) and torch.equal(ckpt[2][key], ckpt[3][key])
        torch.testing.assert_close(ckpt[2][key], 0.5 * ckpt[2][online] + 0.5 * ckpt[1][key])
        assert not torch.equal(ckpt[2][online], ckpt[1][online])  # the Q heads did train
    heads = load_file(out / ilql.HEADS_FILE)
    for key, value in heads.items():
        torch.testing.assert_close(value, ckpt[3]["heads." + key])
    metrics = [json.loads(line) for line in open(tmp_path / "runs" / "a" / "metrics.jsonl")]
    train = [m for m in metrics if "loss" in m]
    for term in ("q", "v", "cql", "awac"):
        assert all(f"loss/{term}" in m for m in train)
    final_eval = [m for m in metrics if "eval/loss" in m][-1]
    assert final_eval["eval/loss/awac"] < train[0]["loss/awac"] - 0.3  # the language model learned

    # Resume from checkpoint 2 into a copy: the same final weights and heads.
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoint-2", resumed / "checkpoint-2")
    flags = ilql_flags(world, data, resumed, tmp_path) + ["--max_steps", "4", "--alpha", "0.5",
                                                          "--steps_for_target_q_sync", "3",
                                                          "--resume_from_checkpoint", "latest"]  # fmt: skip
    run_script(flags)
    assert load_file(resumed / ilql.HEADS_FILE).keys() == heads.keys()
    for key, value in load_file(resumed / ilql.HEADS_FILE).items():
        assert torch.equal(value, heads[key]), key
    for key, value in load_file(resumed / "model.safetensors").items():
        assert torch.equal(value, load_file(out / "model.safetensors")[key]), key

    backbone = AutoModelForCausalLM.from_pretrained(out)  # the backbone alone, as any causal LM
    model = ilql.ILQLModel.from_pretrained(str(out))
    assert model.decoding == {"beta": 1.0, "top_k": 20, "temperature": 0.0}
    for key, value in backbone.state_dict().items():
        assert torch.equal(value, model.backbone.state_dict()[key])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt_ids = utils.chat.tokenize_prompts(
        tokenizer, ["SUBREDDIT: r/pets\n\nTITLE: a\n\nPOST: dog vet\n\nTL;DR:"]
    )
    responses, lengths = ilql.complete(model, tokenizer, prompt_ids, 4, 4)
    assert responses.shape == (1, 4) and 1 <= lengths.item() <= 4


def test_bad_input_is_one_line(world, tmp_path):
    import datasets

    path = tmp_path / "no_reward.jsonl"
    datasets.Dataset.from_list([{"prompt": "a", "completion": "b"}]).to_json(str(path))
    proc = run_script(["ilql.py", "--model_name_or_path", str(world / "policy"), "--dataset_name", str(path),
                       "--output_dir", str(tmp_path / "o")], check=False)  # fmt: skip
    assert proc.returncode == 2
    assert "ilql.py: error:" in proc.stderr and "reward" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_script(["ilql.py", "--tau", "1.5", "--output_dir", str(tmp_path / "o")], check=False)
    assert proc.returncode == 2 and "--tau" in proc.stderr


@pytest.mark.slow
def test_two_processes(world, tmp_path):
    from conftest import run_torchrun

    data = ilql_dataset(world, tmp_path)
    run_torchrun(ilql_flags(world, data, tmp_path / "two", tmp_path)[0:] + ["--max_steps", "2"])
    assert (tmp_path / "two" / ilql.HEADS_FILE).exists()


def test_overwrite_moves_the_old_output_aside_before_the_saved_model_moves_in(world, tmp_path):
    """--overwrite_output_dir without checkpoints: the final save moves a stale checkpoint aside, not mixed in."""
    data, out = ilql_dataset(world, tmp_path, rows=16), tmp_path / "ilql"
    (out / "checkpoint-9").mkdir(parents=True)
    flags = ilql_flags(world, data, out, tmp_path) + [
        "--max_steps",
        "1",
        "--run_name",
        "o",
        "--overwrite_output_dir",
    ]
    proc = run_script(flags)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("ilql.replaced-")]
    assert len(aside) == 1 and (aside[0] / "checkpoint-9").is_dir() and not (out / "checkpoint-9").exists()
    assert (out / "config.json").exists() and "moved the previous contents of" in proc.stdout

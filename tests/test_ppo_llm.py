"""ppo_llm.py: numerics against hand-computed values, end-to-end runs on tiny models, one-line errors."""

import glob
import json
import math
import os
import signal
import sys
import types

import huggingface_hub
import pytest
import torch
import transformers
from conftest import (
    char_tokenizer,
    ends_at,
    interrupt_generation,
    lm,
    saved_update,
    saved_weights,
    tiny_config,
    untimed_metrics,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel

import ppo_llm
from ppo_llm import (
    adaptive_kl_coef,
    compute_gae,
    kl_penalty,
    lm_head_logprobs,
    masked_mean,
    masked_whiten,
    normalize_scores,
    policy_loss,
    truncate_after_eos,
    value_loss,
)

T = torch.tensor


# ---- numerics ---------------------------------------------------------------------------------------------


def head(*logit_per_unit_hidden):
    """An output embedding whose logits at hidden state [1.0] are the given numbers."""
    layer = torch.nn.Linear(1, len(logit_per_unit_hidden), bias=False)
    layer.weight.data = T([[x] for x in logit_per_unit_hidden])
    return layer


def test_lm_head_logprobs_and_entropy_by_hand():
    # logits (0, 0, ln 2): softmax = (1/4, 1/4, 2/4); label 2 -> ln(1/2), label 0 -> ln(1/4)
    # entropy = -(2 * 1/4 * ln(1/4) + 1/2 * ln(1/2)) = ln 2 + ln(2) / 2 = 1.5 ln 2 = 1.039721
    hidden = torch.ones(1, 2, 1)
    logprobs, entropy = lm_head_logprobs(hidden, lm(head(0.0, 0.0, math.log(2))), T([[2, 0]]), 1.0)
    assert torch.allclose(logprobs, T([[math.log(0.5), math.log(0.25)]]))
    assert torch.allclose(entropy, T([[1.5 * math.log(2)] * 2]))
    # temperature 2: logits (0, 0, ln(2) / 2): p(2) = sqrt 2 / (2 + sqrt 2) = 0.414214, ln = -0.881374
    logprobs, _ = lm_head_logprobs(hidden[:, :1], lm(head(0.0, 0.0, math.log(2))), T([[2]]), 2.0)
    assert logprobs.item() == pytest.approx(-0.881374, abs=1e-6)
    # scale 2 (Cohere's logit_scale): logits (0, 0, 2 ln 2): p(2) = 4 / 6, ln(2/3) = -0.405465
    logprobs, _ = lm_head_logprobs(hidden[:, :1], lm(head(0.0, 0.0, math.log(2)), logit_scale=2.0), T([[2]]), 1.0)
    assert logprobs.item() == pytest.approx(-0.405465, abs=1e-6)
    # softcap 1 (Gemma 2): logits tanh(0, 0, ln 2) = (0, 0, 0.6) (tanh ln 2 = (2 - 1/2) / (2 + 1/2)):
    # ln p(2) = 0.6 - ln(2 + e^0.6) = 0.6 - ln(3.822119) = 0.6 - 1.340805 = -0.740805
    logprobs, _ = lm_head_logprobs(hidden[:, :1], lm(head(0.0, 0.0, math.log(2)), softcap=1.0), T([[2]]), 1.0)
    assert logprobs.item() == pytest.approx(-0.740805, abs=1e-6)


@pytest.mark.parametrize("chunk_logits", [5, 13, 2**24])  # one token per chunk, a ragged split, everything at once
def test_lm_head_logprobs_equals_the_full_computation(monkeypatch, chunk_logits):
    # values and gradients (hidden states, weight, bias) against log_softmax over the full (B, T, V) logits
    monkeypatch.setattr(ppo_llm, "LM_HEAD_CHUNK", chunk_logits)
    g = torch.Generator().manual_seed(0)
    hidden, labels = torch.randn(3, 4, 6, generator=g), torch.randint(0, 5, (3, 4), generator=g)
    layer = torch.nn.Linear(6, 5)
    weights = torch.randn(3, 4, generator=g)

    def grads(logprobs, entropy):
        hidden.grad = layer.weight.grad = layer.bias.grad = None
        ((logprobs + 0.3 * entropy) * weights).sum().backward()
        return [hidden.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()]

    hidden.requires_grad_(True)
    scale, softcap, temperature = 1.5, 2.0, 0.7
    logits = softcap * torch.tanh(scale * layer(hidden) / softcap) / temperature
    expected = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    expected_entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    expected_grads = grads(expected, expected_entropy)
    got, got_entropy = lm_head_logprobs(hidden, lm(layer, scale, softcap), labels, temperature, entropy_grad=True)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_entropy, expected_entropy)
    for a, b in zip(grads(got, got_entropy), expected_grads):
        torch.testing.assert_close(a, b)


def test_masked_mean():
    values, mask = T([[1.0, 2.0], [3.0, 4.0]]), T([[1.0, 1.0], [0.0, 1.0]])
    assert masked_mean(values, mask).item() == pytest.approx(7 / 3)  # (1 + 2 + 4) / 3
    assert torch.allclose(masked_mean(values, mask, axis=1), T([1.5, 4.0]))  # (1 + 2) / 2, 4 / 1


def test_masked_whiten_bessel():
    # real entries 2, 4, 6: mean 4, squared deviations 4 + 0 + 4 = 8, Bessel variance 8 / (3 - 1) = 4, std 2
    values, mask = T([2.0, 4.0, 6.0, 100.0]), T([1.0, 1.0, 1.0, 0.0])
    got = masked_whiten(values, mask)
    assert torch.allclose(got[:3], T([-1.0, 0.0, 1.0]), atol=1e-6)  # (x - 4) / 2
    assert torch.allclose(masked_whiten(values, mask, shift_mean=False)[:3], T([3.0, 4.0, 5.0]), atol=1e-6)


def test_normalize_scores_whiten_then_penalty_then_clip():
    # 1, 2, 3, 6: mean 3, Bessel variance (4 + 1 + 0 + 9) / 3 = 14 / 3, std 2.160247
    # whitened (-2, -1, 0, 3) / 2.160247 = (-0.925820, -0.462910, 0, 1.388730); clipped at 1: 1.388730 -> 1
    scores, ended = T([1.0, 2.0, 3.0, 6.0]), torch.ones(4, dtype=torch.bool)
    whitened = T([-0.925820, -0.462910, 0.0, 1.388730])
    assert torch.allclose(normalize_scores(scores, ended, True, None, None), whitened, atol=1e-6)
    assert torch.allclose(
        normalize_scores(scores, ended, True, None, 1.0), T([-0.925820, -0.462910, 0.0, 1.0]), atol=1e-6
    )
    assert torch.equal(normalize_scores(scores, ended, False, None, 2.0), T([1.0, 2.0, 2.0, 2.0]))  # clip alone
    assert normalize_scores(scores, ended, False, None, None) is scores
    # the missing-EOS penalty after the whitening, in its units: the third response never ended, 0 - 1 = -1; then
    # clipped at 1. Had the penalty come first, the whitening would have rescaled it
    ended = T([True, True, False, True])
    got = normalize_scores(scores, ended, True, 1.0, 1.0)
    assert torch.allclose(got, T([-0.925820, -0.462910, -1.0, 1.0]), atol=1e-6)
    # when no response ends, every score loses the penalty: whitened - 1 (taken first, whitening would remove it)
    got = normalize_scores(scores, torch.zeros(4, dtype=torch.bool), True, 1.0, None)
    assert torch.allclose(got, whitened - 1.0, atol=1e-6)


def test_kl_penalty_estimators():
    # r = logp - ref = -1 - (-2) = 1:  k1 = 1, k2 = 1/2, k3 = e^-1 - 1 + 1 = 0.367879
    # r = -2 - (-1.5) = -0.5:         k1 = -0.5, k2 = 0.125, k3 = e^0.5 - 1 - 0.5 = 0.148721
    logp, ref = T([-1.0, -2.0]), T([-2.0, -1.5])
    assert torch.allclose(kl_penalty(logp, ref, "k1"), T([1.0, -0.5]))
    assert torch.allclose(kl_penalty(logp, ref, "k2"), T([0.5, 0.125]))
    assert torch.allclose(kl_penalty(logp, ref, "k3"), T([0.367879, 0.148721]), atol=1e-6)


def test_compute_gae_masked_episode():
    # gamma 0.9, lam 0.5; the third token is masked, so r_2 and V_2 count as 0 (the episode ends at t = 1):
    # delta_1 = 1 + 0.9 * 0 - 0.8 = 0.2               A_1 = 0.2
    # delta_0 = 0 + 0.9 * 0.8 - 0.5 = 0.22            A_0 = 0.22 + 0.9 * 0.5 * 0.2 = 0.31
    # returns = A + V = (0.81, 1.0, 0)
    rewards, values, mask = T([[0.0, 1.0, 5.0]]), T([[0.5, 0.8, 9.0]]), T([[1.0, 1.0, 0.0]])
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, lam=0.5)
    assert torch.allclose(advantages, T([[0.31, 0.2, 0.0]]))
    assert torch.allclose(returns, T([[0.81, 1.0, 0.0]]))


def test_compute_gae_monte_carlo_and_td():
    rewards, values, mask = T([[1.0, 2.0, 3.0]]), T([[0.3, 0.1, 0.2]]), torch.ones(1, 3)
    # gamma = lam = 1: returns are the reward sums to go (6, 5, 3) whatever V is; A = returns - V
    advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(returns, T([[6.0, 5.0, 3.0]]))
    assert torch.allclose(advantages, T([[5.7, 4.9, 2.8]]))
    # lam = 0: one-step TD, A_t = r_t + V_{t+1} - V_t = (1 + 0.1 - 0.3, 2 + 0.2 - 0.1, 3 + 0 - 0.2)
    advantages, _ = compute_gae(rewards, values, mask, gamma=1.0, lam=0.0)
    assert torch.allclose(advantages, T([[0.8, 2.1, 2.8]]))


def test_policy_loss_clipping():
    # eps 0.2. token 0: rho 1.5, A +1 -> max(-1.5, -1.2) = -1.2 (clipped)
    #          token 1: rho 0.5, A +1 -> max(-0.5, -0.8) = -0.5 (not clipped: the pessimistic side)
    #          token 2: rho 0.5, A -1 -> max( 0.5,  0.8) =  0.8 (clipped); token 3 is masked
    # loss = (-1.2 - 0.5 + 0.8) / 3 = -0.3, clipfrac 2/3, approxkl = (ln^2 1.5 + 2 ln^2 0.5) / 3 / 2 = 0.187551
    logprobs = torch.log(T([[1.5, 0.5, 0.5, 1.5]]))
    loss, stats = policy_loss(logprobs, torch.zeros(1, 4), T([[1.0, 1.0, -1.0, -1.0]]), T([[1.0, 1.0, 1.0, 0.0]]), 0.2)
    assert loss.item() == pytest.approx(-0.3)
    assert stats["policy/clipfrac_avg"].item() == pytest.approx(2 / 3)
    assert stats["policy/approxkl_avg"].item() == pytest.approx(0.187551, abs=1e-6)
    assert stats["val/ratio"].item() == pytest.approx(2.5 / 3)  # (1.5 + 0.5 + 0.5) / 3


def test_value_loss_clipping():
    # c 0.2. token 0: V 1.0, V_old 0.5, R 2: (1 - 2)^2 = 1; clipped V 0.7: (0.7 - 2)^2 = 1.69 -> 1.69
    #        token 1: V 0.0, V_old 0.5, R 1: (0 - 1)^2 = 1; clipped V 0.3: (0.3 - 1)^2 = 0.49 -> 1
    # loss = 1/2 * (1.69 + 1) / 2 = 0.6725, clipfrac 1/2
    loss, stats = value_loss(T([[1.0, 0.0]]), T([[0.5, 0.5]]), T([[2.0, 1.0]]), torch.ones(1, 2), 0.2)
    assert loss.item() == pytest.approx(0.6725)
    assert stats["val/clipfrac_avg"].item() == pytest.approx(0.5)


def test_adaptive_kl_controller():
    beta = adaptive_kl_coef(0.1, 12.0, target=6.0, horizon=10000, n_steps=100)
    assert beta == pytest.approx(0.1002)  # error clip(12/6 - 1, -0.2, 0.2) = 0.2: beta = 0.1 * (1 + 0.2 * 100/10000)
    beta = adaptive_kl_coef(beta, 5.4, target=6.0, horizon=10000, n_steps=1000)
    assert beta == pytest.approx(0.099198)  # error 5.4/6 - 1 = -0.1: beta = 0.1002 * (1 - 0.1 * 0.1) = 0.099198


def test_truncate_after_eos():
    responses, mask, ended = truncate_after_eos(T([[5, 1, 7, 1], [5, 6, 7, 8]]), eos_ids=[1], pad_token_id=0)
    assert responses.tolist() == [[5, 1, 0, 0], [5, 6, 7, 8]]  # the first EOS stays, what follows is pad
    assert mask.tolist() == [[True, True, False, False], [True, True, True, True]]
    assert ended.tolist() == [True, False]  # the second ran to the end without an EOS
    # two EOS ids (a chat model's end of turn and end of text): whichever comes first ends the response
    responses, mask, ended = truncate_after_eos(T([[5, 9, 1, 7], [1, 9, 6, 7]]), eos_ids=[1, 9], pad_token_id=0)
    assert responses.tolist() == [[5, 9, 0, 0], [1, 0, 0, 0]]
    assert mask.tolist() == [[True, True, False, False], [True, False, False, False]]
    assert ended.tolist() == [True, True]


def test_reward_functions():
    assert ppo_llm.REWARD_FNS["arithmetic"]([" 522", "5220", "52"], ["522"] * 3) == [1.0, 0.0, 0.0]
    answer = "48 / 2 = 24 clips in May.\n#### 1234"
    got = ppo_llm.REWARD_FNS["gsm8k"](["So the total is 1,234.", "1234 or maybe 43", "no number"], [answer] * 3)
    assert got == [1.0, 0.0, 0.0]


def test_embedded_task_files():
    # the embedded task is two files of the general data path: 256 held-out problems, none of them in the training file
    tokenizer = AutoTokenizer.from_pretrained("assets/arith-sft")
    train = ppo_llm.load_prompts(ppo_llm.Args(), tokenizer)
    arithmetic = [ppo_llm.load_reward_fn("arithmetic", 600)]
    test = ppo_llm.eval_rows(ppo_llm.Args(), tokenizer, arithmetic)  # test.jsonl beside train.jsonl, unasked
    assert len(test) == 256 and not {r["prompt"] for r in test} & {r["prompt"] for r in train}
    # 100 x 100 problems a+b with a, b in 0..99, less the 256 held out: 10,000 - 256 = 9,744
    assert len(train) == 9744 and len({r["prompt"] for r in train}) == 9744
    for row in train[:50] + test[:50]:
        a, b = map(int, row["prompt"][:-1].split("+"))
        assert row["answer"] == str(a + b) and 0 <= a <= 99 and 0 <= b <= 99


def test_padded_prompt_sees_unpadded_positions(tiny):
    # Left padding with position ids from the mask: a prompt's log-probs do not depend on its padding.
    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"]).eval()
    ids = T([[20, 21, 22, 23]])
    padded = torch.cat([T([[0, 0]]), ids], dim=1)
    mask = torch.cat([T([[0, 0]]), torch.ones(1, 4, dtype=torch.long)], dim=1)
    with torch.no_grad():
        lp, _ = lm_head_logprobs(ppo_llm.hidden_states(policy, ids, torch.ones_like(ids), 2), policy, ids[:, 2:], 1.0)
        lp_padded, _ = lm_head_logprobs(ppo_llm.hidden_states(policy, padded, mask, 4), policy, ids[:, 2:], 1.0)
    assert torch.allclose(lp, lp_padded, atol=1e-5)


def test_sampling_sees_the_mask_of_left_padded_prompts(tiny):
    # what generate samples from, prompts of 2 to 4 tokens left-padded, is the masked forward with position ids from
    # the mask that scores the tokens afterwards. transformers' warning of padding without a mask comes from batches
    # that need no padding, whose all-ones mask generate drops: a false alarm (docs/grpo_llm.md)
    policy = AutoModelForCausalLM.from_pretrained(tiny["policy"]).eval()
    ids = T([[0, 0, 20, 21], [0, 22, 23, 24], [25, 26, 27, 28]])
    mask = (ids != 0).long()
    torch.manual_seed(0)
    out = policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=0, eos_token_id=1,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    responses, response_mask, _ = ppo_llm.truncate_after_eos(out.sequences[:, 4:], [1], 0)
    full_mask = torch.cat([mask, response_mask.long()], 1)
    with torch.no_grad():
        scored = policy(input_ids=out.sequences, attention_mask=full_mask, position_ids=ppo_llm.position_ids(full_mask))
    sampled = torch.stack(out.logits, 1)  # (B, R, V)
    real = response_mask.bool()
    torch.testing.assert_close(sampled[real], scored.logits[:, 3:-1][real], rtol=1e-4, atol=1e-4)


# ---- end to end --------------------------------------------------------------------------------------------


def run(tiny, tmp_path, **kwargs):
    """main() for a couple of updates on the tiny policy; returns the logged metrics."""
    defaults = dict(
        model=tiny["policy"], total_steps=2, prompts_per_update=8, num_mini_batches=2, micro_batch_size=2,
        num_ppo_epochs=2, max_new_tokens=3, eval_every=0, sample_every=1, output_dir=str(tmp_path),
    )  # fmt: skip
    run_dir = ppo_llm.main(ppo_llm.Args(**{**defaults, **kwargs}))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return run_dir, [json.loads(line) for line in f]


def test_first_ratio_is_exactly_one(tiny, tmp_path):
    # lr 0: the weights never move, so every minibatch (shuffled, of another composition than the rollout
    # chunks) must reproduce the rollout's log-probs bit for bit: ratio 1, approx-KL 0, nothing clipped.
    for critic in ["head", "separate"]:
        _, metrics = run(tiny, tmp_path, learning_rate=0.0, critic=critic)
        for m in metrics:
            assert m["val/ratio"] == 1.0 and m["policy/approxkl_avg"] == 0.0 and m["policy/clipfrac_avg"] == 0.0


def test_old_logprobs_are_scored_in_the_first_epochs_micro_batches(tiny, tmp_path, monkeypatch):
    # Detail 5 on a GPU: a row's log-probs depend on the rows beside it (CUDA picks its attention kernel by the
    # micro-batch's padding), so the no-grad passes (policy and critic, then the reference) score the very
    # micro-batches the first epoch trains, in its shuffled order. On a CPU one kernel serves every shape: only the
    # structure can be checked here.
    calls, real = [], ppo_llm.policy_forward

    def spy(model, batch, micro_batch, args):
        calls.append((torch.is_grad_enabled(), micro_batch.tolist()))
        return real(model, batch, micro_batch, args)

    monkeypatch.setattr(ppo_llm, "policy_forward", spy)
    run(tiny, tmp_path, total_steps=1, prompts_per_update=16, micro_batch_size=4, kl_coef=0.05, critic="separate")
    scored = [rows for grad, rows in calls if not grad]
    trained = [rows for grad, rows in calls if grad]
    first_epoch = trained[:4]  # 16 responses in micro-batches of 4
    assert scored == first_epoch + first_epoch
    assert sorted(sum(first_epoch, [])) == list(range(16))
    assert first_epoch != [list(range(i, i + 4)) for i in range(0, 16, 4)]  # shuffled
    assert len(trained) == 8 and trained[4:] != first_epoch  # the second epoch reshuffles


def test_run_logs_saves_and_loads_back(tiny, tmp_path, capsys):
    run_dir, metrics = run(tiny, tmp_path, eval_every=1, save_every=1, critic="separate")
    assert (
        {"update", "episode", "eval/accuracy", "eval/accuracy_stderr"}
        <= set(metrics[0])
        <= {
            "update",
            "episode",
            "eval/accuracy",
            "eval/accuracy_stderr",
            "eval/mean_reward",
            "eval/clipped_ratio",
            "eval/mean_length_right",
            "eval/mean_length_wrong",
        }
    )
    assert "eval/mean_length_wrong" in metrics[0]  # the random tiny policy is wrong on most problems
    # 256 held-out problems scored 0 or 1: sample variance 256 p (1 - p) / 255, standard error sqrt(p (1 - p) / 255)
    p = metrics[0]["eval/accuracy"]
    assert metrics[0]["eval/accuracy_stderr"] == pytest.approx((p * (1 - p) / 255) ** 0.5)
    assert "ETA 00:00:" in capsys.readouterr().out
    events = EventAccumulator(run_dir)  # TensorBoard beside metrics.jsonl, the same names and steps
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("objective/kl")] == [
        (m["update"], pytest.approx(m["objective/kl"], rel=1e-6, abs=1e-6)) for m in metrics[1:]
    ]
    trl_names = ["objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
                 "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg",
                 "loss/value_avg", "val/clipfrac_avg", "val/ratio", "val/num_eos_tokens", "lr", "episode"]  # fmt: skip
    for name in trl_names + ["time/generation", "time/scoring", "time/update", "perf/tokens_per_sec",
                             "perf/peak_memory_mb", "eval/accuracy"]:  # fmt: skip
        assert name in metrics[-1], name
    assert metrics[-1]["episode"] == 16
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "policy"))
    assert policy.config.vocab_size == GPT2LMHeadModel.from_pretrained(tiny["policy"]).config.vocab_size
    assert set(torch.load(os.path.join(run_dir, "policy", "critic", "value_head.pt"))) == {"weight", "bias"}
    assert saved_update(run_dir) == metrics[-1]["update"]
    assert sorted(glob.glob(os.path.join(run_dir, "checkpoint*"))) == [  # updates 1 and 2 saved once each: a, then b
        f"{run_dir}/checkpoint",
        f"{run_dir}/checkpoint.b",
    ]
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        assert {"prompt", "completion", "score"} <= set(json.loads(f.readline()))


def test_the_last_update_is_saved_once(tiny, tmp_path, monkeypatch):
    # 4 updates at --save-every 2 (as the defaults, 300 at 20): updates 2 and 4 are saved, the last one once, not again
    # after the loop (at 7B each save writes tens of GB and gathers policy/)
    saved, real = [], ppo_llm.save_checkpoint

    def save_checkpoint(run_dir, models, optimizer, state, tokenizer, merged=False):
        saved.append(state["update"])
        real(run_dir, models, optimizer, state, tokenizer, merged)

    monkeypatch.setattr(ppo_llm, "save_checkpoint", save_checkpoint)
    run(tiny, tmp_path, total_steps=4, save_every=2)
    assert saved == [2, 4]


def test_resume_logs_what_one_run_logs(tiny, tmp_path):
    # 2 updates, then --resume to 4, log what 4 updates in one go do (timings and memory aside; lr constant): the
    # weights, AdamW, the adaptive beta, the moving reference, the RNG states and the prompt position come back.
    options = dict(critic="separate", kl_target=1.0, kl_horizon=100, ref_update_every=1)
    whole, _ = run(tiny, tmp_path / "whole", total_steps=4, **options)
    run_dir, _ = run(tiny, tmp_path / "split", **options)
    assert ppo_llm.main(ppo_llm.parse_args(["--resume", run_dir, "--total-steps", "4"])) == run_dir
    assert [m["update"] for m in untimed_metrics(run_dir)] == [1, 2, 3, 4]
    assert untimed_metrics(run_dir) == untimed_metrics(whole)
    assert json.load(open(os.path.join(run_dir, "args.json")))["total_steps"] == 4


def test_a_stop_inside_an_update_resumes_by_redoing_it(tiny, tmp_path, monkeypatch, capsys):
    # Ctrl-C in update 2's generation: the checkpoint holds the state after update 1, so the resume runs update 2
    # again; as the weights had not moved yet and each update seeds its own random numbers, it logs what one run logs
    whole, _ = run(tiny, tmp_path / "whole", total_steps=3)
    interrupt_generation(monkeypatch, 2)
    with pytest.raises(SystemExit) as stop:
        run(tiny, tmp_path / "split", total_steps=3)
    monkeypatch.undo()
    (run_dir,) = (tmp_path / "split").iterdir()
    assert stop.value.code == 1 and [m["update"] for m in untimed_metrics(run_dir)] == [1]
    assert saved_update(run_dir) == 1
    assert f"python ppo_llm.py --resume {run_dir} goes on" in capsys.readouterr().err
    ppo_llm.main(ppo_llm.parse_args(["--resume", str(run_dir)]))
    assert untimed_metrics(run_dir) == untimed_metrics(whole)


def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    # killed once its shards are written, before the link points to them: the checkpoint is update 1's, whole
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    monkeypatch.setattr(ppo_llm, "save_policy", lambda *args: None)  # checkpoint/ alone
    models = torch.nn.ModuleDict({"policy": model})
    ppo_llm.save_checkpoint(str(tmp_path), models, optimizer, {"update": 1}, None)
    saved, real_save = model.weight.detach().clone(), ppo_llm.dcp.save

    def killed(*args, **kwargs):
        real_save(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(ppo_llm.dcp, "save", killed)
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        ppo_llm.save_checkpoint(str(tmp_path), models, optimizer, {"update": 2}, None)
    assert saved_update(tmp_path) == 1 and torch.equal(saved_weights(tmp_path, "policy")["weight"], saved)
    assert not ppo_llm.SAVING  # a second signal may stop the run at once again


def test_prompt_stream_shards_and_resumes():
    # one process draws the seeded stream s0, s1, s2, ...; two ranks draw s0, s2, s4 ... and s1, s3, s5 ...; a stream
    # resumed after 6 prompts goes on at s6 (the rows reshuffle every pass: 10 rows, 3 passes drawn here)
    rows = list(range(10))
    one = list(ppo_llm.itertools.islice(ppo_llm.prompt_stream(rows, 3, 0, 0, 1), 30))
    assert sorted(one[:10]) == sorted(one[10:20]) == rows and one[:10] != one[10:20]
    two = [list(ppo_llm.itertools.islice(ppo_llm.prompt_stream(rows, 3, 0, rank, 2), 15)) for rank in (0, 1)]
    assert two[0] == one[0::2] and two[1] == one[1::2]
    assert list(ppo_llm.itertools.islice(ppo_llm.prompt_stream(rows, 3, 6, 0, 1), 24)) == one[6:]


def test_pad_token_never_ends_a_response():
    # Qwen2.5-Instruct's pad <|endoftext|> is one of its EOS ids: a reward model would read a padded end as padding
    tokenizer = char_tokenizer("ab")  # <pad> 0, <eos> 1
    ppo_llm.add_pad_token(tokenizer, [], [1, 0])
    assert tokenizer.pad_token == "[PAD]" and tokenizer.pad_token_id == 5
    tokenizer = char_tokenizer("ab")
    ppo_llm.add_pad_token(tokenizer, [], [1])
    assert tokenizer.pad_token_id == 0  # a pad that ends nothing stays


def test_evaluation_prompts_are_fixed_and_cut_as_in_training(tiny, tmp_path):
    # the evaluation draws the same prompts whatever --seed, from --eval-split FILE
    tokenizer = AutoTokenizer.from_pretrained(tiny["policy"])
    args = [ppo_llm.Args(dataset=tiny["jsonl"], eval_split=tiny["jsonl"], eval_size=5, seed=s) for s in (1, 2)]
    arithmetic = [ppo_llm.load_reward_fn("arithmetic", 600)]
    assert ppo_llm.eval_rows(args[0], tokenizer, arithmetic) == ppo_llm.eval_rows(args[1], tokenizer, arithmetic)
    # prompts longer than the context (32) lose their start in evaluation too, as in training (--max-prompt-length)
    long = tmp_path / "long.jsonl"
    long.write_text("".join(json.dumps({"prompt": "1+" * 20 + f"{i}=", "answer": "2"}) + "\n" for i in range(4)))
    _, m = run(tiny, tmp_path, dataset=tiny["jsonl"], reward_fn="gsm8k", eval_split=str(long), eval_every=1)
    assert [("eval/accuracy" in x) for x in m] == [True, True, True]


def test_resume_needs_a_readable_run(tiny, tmp_path):
    # no args.json, a truncated one, one that is no {flag: value} object; no checkpoint (killed before its first
    # save), one of other models (resumed with another --critic), a truncated one: one line each
    with pytest.raises(SystemExit, match=r"^error: --resume /no/such/run: args.json unreadable \(FileNotFoundError"):
        ppo_llm.parse_args(["--resume", "/no/such/run"])
    for text, error in [('{"seed": 1, "mod', "JSONDecodeError"), ("[1, 2]", "AttributeError")]:
        (tmp_path / "args.json").write_text(text)
        with pytest.raises(SystemExit, match=rf"^error: --resume .*: args.json unreadable \({error}"):
            ppo_llm.parse_args(["--resume", str(tmp_path)])
    run_dir, _ = run(tiny, tmp_path / "runs", total_steps=1)
    (tmp_path / "runs" / "no_checkpoint").mkdir()
    (tmp_path / "runs" / "no_checkpoint" / "args.json").write_text(open(os.path.join(run_dir, "args.json")).read())
    for bad, flags in [(str(tmp_path / "runs" / "no_checkpoint"), []), (run_dir, ["--critic", "head"])]:
        with pytest.raises(SystemExit) as e:
            ppo_llm.main(ppo_llm.parse_args(["--resume", bad, *flags]))
        assert str(e.value).startswith(f"error: --resume {bad}: checkpoint unreadable, or of other models (")
        assert "\n" not in str(e.value)
    shards = os.path.join(run_dir, "checkpoint", "__0_0.distcp")
    with open(shards, "r+b") as f:
        f.truncate(os.path.getsize(shards) // 2)  # a disk that filled up, a copy cut short: its checksum names it
    with pytest.raises(SystemExit, match=r"^error: --resume .*: .*/__0_0.distcp is damaged or missing[^\n]*$"):
        ppo_llm.main(ppo_llm.parse_args(["--resume", run_dir]))


def test_resume_with_another_model_names_both(tmp_path):
    # the embedded arithmetic run resumed with the running-sums policy (another shape): one line naming both
    run_dir = ppo_llm.main(ppo_llm.Args(total_steps=1, prompts_per_update=4, eval_every=0, output_dir=str(tmp_path)))
    with pytest.raises(SystemExit) as e:
        ppo_llm.main(ppo_llm.parse_args(["--resume", run_dir, "--model", "assets/sums-sft", "--total-steps", "2"]))
    assert str(e.value).startswith(f"error: --resume {run_dir}: checkpoint unreadable, or of other models (")
    assert str(e.value).endswith("; the run trained --model assets/arith-sft, not --model assets/sums-sft)")


def test_options_all_run(tiny, tmp_path):
    # Every option at least once, combined into a few runs to stay fast.
    _, m = run(tiny, tmp_path, critic="head", kl_estimator="k3", kl_target=1.0, kl_horizon=100,
               ref_update_every=1, whiten_rewards=True, missing_eos_penalty=1.0, score_norm="on", score_clip=0.5,
               anneal_lr=True, target_kl=1e-9, ent_coef=0.01, gradient_checkpointing=True, temperature=0.7)  # fmt: skip
    assert m[-1]["objective/kl_coef"] != 0.05  # the adaptive controller moved beta
    assert m[-1]["lr"] == pytest.approx(1e-4 / 2)  # update 2 of 2: 1e-4 * (1 - 1/2)
    _, m = run(tiny, tmp_path, kl_coef=0.0, kl_estimator="k2", dataset=tiny["jsonl"], reward_fn="gsm8k")
    assert m[-1]["objective/kl"] == 0.0  # no reference model, no KL
    _, m = run(tiny, tmp_path, reward_model=tiny["rm"], critic="separate")
    _, m = run(tiny, tmp_path, reward_model=tiny["rm_other"], dataset=tiny["jsonl"])  # decode and re-encode
    _, m = run(tiny, tmp_path, reward_model=tiny["rm_two_labels"], reward_label=1, critic="head")
    assert all(isinstance(x["objective/scores"], float) for x in m[1:])


def test_score_goes_on_the_last_real_token(tiny, tmp_path, monkeypatch):
    # detail 3: response i (EOS at i % 3) gets score i + 1 at its last real token, and beta 0 leaves no other reward
    ends_at(monkeypatch, [i % 3 for i in range(8)])
    monkeypatch.setitem(ppo_llm.REWARD_FNS, "gsm8k", lambda completions, answers: [i + 1.0 for i in range(8)])
    seen, real_gae = [], ppo_llm.compute_gae
    monkeypatch.setattr(ppo_llm, "compute_gae", lambda r, v, m, *a: seen.append((r, m)) or real_gae(r, v, m, *a))
    run(tiny, tmp_path, dataset=tiny["jsonl"], reward_fn="gsm8k", kl_coef=0.0, total_steps=1)
    rewards, mask = seen[0]
    assert mask.sum(1).tolist() == [1, 2, 3, 1, 2, 3, 1, 2]
    expected = torch.zeros(8, 3)
    expected[torch.arange(8), [0, 1, 2, 0, 1, 2, 0, 1]] = torch.arange(1.0, 9.0)
    assert torch.equal(rewards, expected)


def test_missing_eos_penalty_early_stop_and_whitened_advantages(tiny, tmp_path, monkeypatch):
    # the even responses end (EOS first), the odd ones never do: reward 0 - 1 = -1 for 4 of 8, mean score -0.5
    ends_at(monkeypatch, [0, None] * 4)
    monkeypatch.setitem(ppo_llm.REWARD_FNS, "gsm8k", lambda completions, answers: [0.0] * len(completions))
    seen, real = [], ppo_llm.accumulate_gradients
    monkeypatch.setattr(ppo_llm, "accumulate_gradients", lambda *a: seen.append(a[3]) or real(*a))
    _, m = run(tiny, tmp_path, dataset=tiny["jsonl"], reward_fn="gsm8k", missing_eos_penalty=1.0, total_steps=1)
    assert m[0]["objective/scores"] == -0.5 and m[0]["val/num_eos_tokens"] == 4
    assert len(seen) == 2 * 2  # 2 epochs of 2 minibatches
    # detail 9: the advantages, whitened over the batch's real tokens (Bessel): mean 0, std 1
    r = seen[0]
    mean = masked_mean(r["advantages"], r["mask"])
    var = ((r["advantages"] - mean) ** 2 * r["mask"]).sum() / (r["mask"].sum() - 1)
    assert abs(mean.item()) < 1e-6 and var.item() == pytest.approx(1.0, abs=1e-5)
    # detail 11: once the first epoch's mean approx-KL passes --target-kl, the second epoch is skipped
    seen.clear()
    run(
        tiny, tmp_path, dataset=tiny["jsonl"], reward_fn="gsm8k", missing_eos_penalty=1.0, total_steps=1, target_kl=1e-9
    )
    assert len(seen) == 2


def test_value_head_starts_at_zero_and_dropout_is_off(tiny, tmp_path, monkeypatch):
    # detail 8: the value head is zero-initialised, so the first values are 0
    policy = ppo_llm.load_model(AutoModelForCausalLM, tiny["policy"], "--model")
    tokenizer = AutoTokenizer.from_pretrained(tiny["policy"])
    args, cpu = ppo_llm.Args(critic="head"), torch.device("cpu")
    critic, head = ppo_llm.build_value_model(args, cpu, policy, tokenizer, None, None)
    assert critic is None and not head.weight.any() and not head.bias.any()
    # detail 6: dropout 0 in the config and in every nn.Dropout, also one that ignores the config
    model = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    model.config.resid_pdrop = model.config.attn_pdrop = 0.1
    model.save_pretrained(tmp_path / "dropout")
    real = ppo_llm.from_pretrained

    def hard_coded(cls, name, flag, **kwargs):
        loaded = real(cls, name, flag, **kwargs)
        if cls is not ppo_llm.AutoConfig:
            loaded.extra = torch.nn.Dropout(0.3)
        return loaded

    monkeypatch.setattr(ppo_llm, "from_pretrained", hard_coded)
    model = ppo_llm.load_model(AutoModelForCausalLM, str(tmp_path / "dropout"), "--model")
    assert model.config.resid_pdrop == 0.0 and model.config.attn_pdrop == 0.0 and model.extra.p == 0.0
    assert all(module.p == 0.0 for module in model.modules() if isinstance(module, torch.nn.Dropout))


def test_entropy_bonus_raises_the_entropy(tiny):
    # A = 0 and vf_coef 0: the whole gradient is -ent_coef * d(mean entropy): the bonus pushes the entropy up
    torch.manual_seed(0)
    policy = ppo_llm.load_model(AutoModelForCausalLM, tiny["policy"], "--model")
    value_head = torch.nn.Linear(policy.config.hidden_size, 1)
    B, Q, R = 4, 3, 4
    qr = torch.randint(3, 20, (B, Q + R))
    zeros, mask = torch.zeros(B, R), torch.ones(B, R)
    r = dict(query_responses=qr, attention_mask=torch.ones_like(qr), responses=qr[:, Q:], mask=mask, prompt_width=Q,
             old_logprobs=zeros, values=zeros, advantages=zeros, returns=zeros)  # fmt: skip
    args = ppo_llm.Args(micro_batch_size=4, ent_coef=1.0, vf_coef=0.0, critic="head")
    micro_batches = [torch.arange(B)]
    ppo_llm.accumulate_gradients(policy, None, value_head, r, micro_batches, args, torch.autocast("cpu", enabled=False))
    got = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    _, entropy, _ = ppo_llm.training_forward(policy, None, value_head, r, torch.arange(B), args)
    (-masked_mean(entropy, mask)).backward()
    for a, p in zip(got, policy.parameters()):
        torch.testing.assert_close(a, p.grad)


def test_eval_only_prints_accuracy_and_its_stderr_and_writes_nothing(tmp_path, capsys):
    # the embedded SFT policy on its 256 held-out problems (1.3M parameters: about a second)
    result = ppo_llm.main(ppo_llm.Args(eval_only=True, output_dir=str(tmp_path / "runs")))
    p, stderr = result["eval/accuracy"], result["eval/accuracy_stderr"]
    # the SFT model's sampled accuracy, 56.6% over its build's evaluation (assets/README), within 3 standard errors
    assert p == pytest.approx(0.566, abs=3 * 0.031) and stderr == pytest.approx((p * (1 - p) / 255) ** 0.5)  # n - 1
    assert f"held-out accuracy {p:.3f} ± {stderr:.3f} (pass@1; two evaluations of one policy differ by <" in (
        capsys.readouterr().out
    )
    assert not os.path.exists(tmp_path / "runs")


class FakeWandb:
    """wandb stood in for: each init's settings, and the run id it gives (a resumed run's own)."""

    def __init__(self):
        self.inits, self.finished = [], 0

    def init(self, **settings):
        self.inits.append(settings)
        return types.SimpleNamespace(id=settings.get("id", "run-1"))

    def finish(self):
        self.finished += 1


def test_track_starts_a_wandb_run_and_a_resume_goes_on_with_it(tiny, tmp_path, monkeypatch):
    # wandb itself is stood in for here (tests/test_grpo_llm.py starts a real one offline, which takes seconds): the
    # run's settings, its id in args.json, and on --resume that id with resume="allow", wandb's "go on with this run"
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    run_dir, _ = run(tiny, tmp_path, track=True, total_steps=1)
    ppo_llm.main(ppo_llm.parse_args(["--resume", run_dir, "--total-steps", "2"]))
    first, resumed = wandb.inits
    assert first["project"] == "rlhf-reference" and first["sync_tensorboard"] and first["dir"] == run_dir
    assert first["name"] == os.path.basename(run_dir) and first["config"]["track"] and "id" not in first
    assert resumed["id"] == "run-1" and resumed["resume"] == "allow" and wandb.finished == 2
    assert json.load(open(os.path.join(run_dir, "args.json")))["wandb_id"] == "run-1"


def test_tokenizer_without_pad_gets_its_own(tmp_path):
    # A GPT-2-like tokenizer with EOS but no pad: the script adds [PAD] rather than reusing EOS.
    tok = char_tokenizer([chr(c) for c in range(32, 127)])
    GPT2LMHeadModel(tiny_config(tok)).save_pretrained(tmp_path / "nopad")
    tok.pad_token = None
    tok.save_pretrained(tmp_path / "nopad")
    run_dir, _ = run({"policy": str(tmp_path / "nopad")}, tmp_path, total_steps=1)
    saved = ppo_llm.AutoTokenizer.from_pretrained(os.path.join(run_dir, "policy"))
    assert saved.pad_token == "[PAD]" and saved.pad_token_id != saved.eos_token_id


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_after_saving_and_resume_goes_on(tiny, tmp_path, monkeypatch, capsys, signum):
    # Ctrl-C or SIGTERM (a preemption) in update 2's generation: the run stops at the next check, saves the state after
    # update 1, exits with 128 + the signal, and --resume logs what a run that never stopped logs
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]  # SIGINT is ignored under nohup or &
    whole, _ = run(tiny, tmp_path / "whole", total_steps=3)
    real, calls = transformers.GenerationMixin.generate, []

    def signalled(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signum)  # delivered to the script's handler, in the middle of generation
        return real(self, *args, **kwargs)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", signalled)
    with pytest.raises(SystemExit) as stop:
        run(tiny, tmp_path / "split", total_steps=3)
    monkeypatch.undo()
    (run_dir,) = (tmp_path / "split").iterdir()
    assert stop.value.code == 128 + signum and "Traceback" not in capsys.readouterr().err
    assert os.path.isfile(run_dir / "policy" / "model.safetensors")
    ppo_llm.main(ppo_llm.parse_args(["--resume", str(run_dir)]))
    assert untimed_metrics(run_dir) == untimed_metrics(whole)
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers  # main() gives them back


def test_nan_loss_stops_with_last_good_weights(tiny, tmp_path, monkeypatch, capsys):
    real_policy_loss = ppo_llm.policy_loss

    def nan_loss(*args):
        loss, *extras = real_policy_loss(*args)
        return (loss * float("nan"), *extras)

    monkeypatch.setattr(ppo_llm, "policy_loss", nan_loss)
    with pytest.raises(SystemExit) as e:
        run(tiny, tmp_path)
    err = capsys.readouterr().err
    assert e.value.code == 1 and "stopped in update 1 (the gradient norm is nan: try a lower --learning-rate)" in err
    assert "Traceback" not in err  # a non-finite loss is no bug of the user's: one line
    (saved,) = tmp_path.glob("*/policy")
    reloaded = AutoModelForCausalLM.from_pretrained(saved)
    original = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    assert all(torch.equal(a, b) for a, b in zip(reloaded.parameters(), original.parameters()))


def test_reward_rises(tiny, tmp_path):
    # Seeded learning: PPO raises the (random, tiny) reward model's score of the tiny policy's responses.
    settings = dict(total_steps=30, prompts_per_update=32, micro_batch_size=16, num_mini_batches=2, max_new_tokens=2)
    _, m = run(
        tiny, tmp_path, reward_model=tiny["rm"], learning_rate=3e-3, kl_coef=0.0, sample_every=0, seed=3, **settings
    )
    scores = [x["objective/scores"] for x in m[1:]]
    # seen: about 0.11 over the first five updates, 0.21 over the last five
    assert sum(scores[-5:]) / 5 > sum(scores[:5]) / 5 + 0.05, scores


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(model="/no/such/dir"), "--model /no/such/dir is no directory, nor reachable on the hub"),
        # a hub id without the network: tests/test_chat.py (offline, so without huggingface_hub's ~26 s of retries)
        (dict(num_mini_batches=3), "--num-mini-batches must divide --prompts-per-update"),
        (dict(micro_batch_size=3), "into minibatches that --micro-batch-size (3) divides"),
        (dict(max_new_tokens=32), "--max-new-tokens 32 and a prompt (--max-prompt-length None) do not fit"),
        (dict(max_prompt_length=30), "(--max-prompt-length 30) do not fit the model's context of 32 tokens"),
        (dict(temperature=0.0), "--temperature must be > 0"),
        (dict(dataset="/no/such.jsonl"), "--dataset /no/such.jsonl could not be loaded (FileNotFoundError"),
        (dict(prompts_per_update=1, score_norm="on", num_mini_batches=1, micro_batch_size=1), "needs --prompts-per"),
        (dict(kl_target=1.0, kl_coef=0.0), "--kl-target scales --kl-coef up or down: start it above 0"),
        (
            dict(ref_update_every=1, kl_coef=0.0),
            "--ref-update-every needs a reference to refresh: --kl-coef > 0 or --kl-target",
        ),
        (dict(eval_split="test", eval_every=1), "--dataset assets/arith/train.jsonl is a file, with no split test"),
    ],
)
def test_bad_input_one_line(tiny, tmp_path, monkeypatch, kwargs, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub refuses at once instead of retrying for a minute
    with pytest.raises(SystemExit) as e:
        run(tiny, tmp_path, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_reward_model_labels(tiny, tmp_path):
    with pytest.raises(SystemExit, match="has num_labels=2: --reward-label \\(0 to 1\\) chooses the logit that is the"):
        run(tiny, tmp_path, reward_model=tiny["rm_two_labels"])


def test_no_forward_keeps_every_layers_states(tiny, tmp_path, monkeypatch):
    # A forward that asks for every layer's hidden states keeps all L + 1 of them until it returns; in a no-grad pass
    # (old log-probs, values, the reference) that is memory for nothing (at 7B, 32 layers x 64 x 1,024 tokens in bf16:
    # about 17 GB). The scripts keep the trunk's output alone (benchmarks/passes.py measures both).
    asked, real = [], GPT2LMHeadModel.forward

    def forward(self, *args, **kwargs):
        asked.append((torch.is_grad_enabled(), kwargs.get("output_hidden_states")))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(GPT2LMHeadModel, "forward", forward)
    run(tiny, tmp_path, total_steps=1, kl_coef=0.05, critic="head")
    assert (False, None) in asked and (True, None) in asked  # no-grad passes and the training's, none asking
    assert not any(every_layer for _, every_layer in asked)


def test_beside_a_reward_model_an_accuracy_comes_only_from_a_reward_function_given(tiny, tmp_path):
    # --reward-fn unset is arithmetic, the embedded tasks' exact match; beside a reward model none is assumed (on
    # GSM8K's rationales an exact match reads near 0, a broken run's look): neither objective/accuracy nor a held-out
    # accuracy is logged unless a reward function is named, and --eval-only asks for one
    options = dict(
        reward_model=tiny["rm"], dataset=tiny["jsonl"], eval_split=tiny["jsonl"], eval_every=1, total_steps=1
    )
    _, metrics = run(tiny, tmp_path / "none", **options)
    assert not any(key.endswith("accuracy") for m in metrics for key in m)
    _, metrics = run(tiny, tmp_path / "given", reward_fn="gsm8k", **options)
    assert "objective/accuracy" in metrics[-1] and "eval/accuracy" in metrics[-1]
    with pytest.raises(SystemExit, match="^error: --eval-only beside --reward-model needs a --reward-fn$"):
        ppo_llm.main(ppo_llm.Args(model=tiny["policy"], reward_model=tiny["rm"], eval_only=True))


def test_the_reference_never_trains_and_a_refreshed_one_is_saved(tiny):
    # frozen_copy: no gradient, and eval mode also after models.train(), which the update calls on what it holds; with
    # --ref-update-every the reference is in checkpoint/ (a frozen LoRA base is not)
    policy = ppo_llm.load_model(AutoModelForCausalLM, tiny["policy"], "--model")
    reference = ppo_llm.frozen_copy(policy, torch.device("cpu"), bf16=False)
    models = torch.nn.ModuleDict({"policy": policy, "ref_policy": reference})
    models.train()
    assert policy.training and not any(module.training for module in reference.modules())
    assert not any(p.requires_grad for p in reference.parameters())
    optimizer = torch.optim.AdamW(policy.parameters())
    saved = ppo_llm.trained_state(models, optimizer)["models"]
    assert any(key.startswith("ref_policy.") for key in saved) and any(key.startswith("policy.") for key in saved)


def test_the_embedded_default_runs_from_elsewhere_and_a_copy_says_what_to_give(tmp_path, monkeypatch):
    # run from another directory, the embedded model and task are found beside the script; a copy of the script
    # without the repository's assets/ says that they ship with it and what to give instead
    monkeypatch.chdir(tmp_path)
    argv = ["--total-steps", "1", "--prompts-per-update", "4", "--num-mini-batches", "1", "--eval-every", "0"]
    args = ppo_llm.parse_args(argv)
    assert os.path.isabs(args.model) and os.path.isfile(os.path.join(args.model, "config.json"))
    assert os.path.isfile(args.dataset) and os.listdir(ppo_llm.main(args))
    monkeypatch.setattr(ppo_llm, "__file__", str(tmp_path / "ppo_llm.py"))  # the script alone, copied here
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as with no network, without its retries
    with pytest.raises(SystemExit) as e:
        ppo_llm.main(ppo_llm.parse_args(argv))
    assert str(e.value).startswith("error: --model assets/arith-sft is no directory")
    assert "the embedded models ship in the repository's assets/: give --model" in str(e.value)

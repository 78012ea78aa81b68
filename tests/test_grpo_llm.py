"""Tests of grpo_llm.py: numerics against hand-computed values, short end-to-end runs with tiny models, bad input."""

import contextlib
import importlib.util
import json
import math
import os

import huggingface_hub
import pytest
import torch
from conftest import ends_at, interrupt_generation, saved_update, untimed_metrics
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

import grpo_llm


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def grpo_loss(logprobs, old, ref, advantages, mask, entropy_mask=1.0, **flags):
    """grpo_llm.grpo_loss of the whole batch (its share is 1) with these flags and its defaults otherwise, but for
    --max-new-tokens 4 (dr_grpo's normaliser) and the plain k3 term that the hand computations below assume."""
    args = grpo_llm.Args(**({"max_new_tokens": 4, "use_bias_correction_kl": False} | flags))
    return grpo_llm.grpo_loss(logprobs, old, ref, advantages, mask, len(mask), mask.sum(), args, entropy_mask)


# ---------------------------------------------------------------------------------------------------------
# group_advantages: G = 3, two groups, rewards [1, 2, 3 | 5, 5, 5]
# ---------------------------------------------------------------------------------------------------------
REWARDS = t([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])


def test_group_advantages_group_scale():
    # group 1: mean 2, std = sqrt((1 + 0 + 1) / 2) = 1 -> (r - 2) / (1 + 1e-4); group 2: equal rewards -> 0
    expected = t([-1 / 1.0001, 0.0, 1 / 1.0001, 0.0, 0.0, 0.0])
    advantages, zero_std = grpo_llm.group_advantages(REWARDS, 3, "group")
    torch.testing.assert_close(advantages, expected)
    assert zero_std.tolist() == [False, True]


def test_group_advantages_batch_scale():
    # group means 2 and 5; batch std: mean 21/6 = 3.5, squares 6.25 + 2.25 + 0.25 + 3 * 2.25 = 15.5,
    # var = 15.5 / 5 = 3.1, std = 1.7606817
    expected = t([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]) / (math.sqrt(3.1) + 1e-4)
    torch.testing.assert_close(grpo_llm.group_advantages(REWARDS, 3, "batch")[0], expected)


def test_group_advantages_no_scale():
    torch.testing.assert_close(grpo_llm.group_advantages(REWARDS, 3, "none")[0], t([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]))


def test_overlong_penalty():
    # max_new_tokens 10, buffer 4: the penalty starts past 10 - 4 = 6 tokens and reaches penalty 2 at 10:
    # L = 5, 6 -> 0; L = 8 -> 2 * (8 - 6) / 4 = 1; L = 10 -> 2 * 4 / 4 = 2
    lengths = t([5.0, 6.0, 8.0, 10.0])
    torch.testing.assert_close(grpo_llm.overlong_penalty(lengths, 10, 4, 2.0), t([0.0, 0.0, 1.0, 2.0]))
    torch.testing.assert_close(grpo_llm.overlong_penalty(lengths, 10, 0, 2.0), t([0.0, 0.0, 0.0, 0.0]))  # off


def test_group_advantages_leave_one_out():
    # baselines of group 1: (2 + 3) / 2 = 2.5, (1 + 3) / 2 = 2, (1 + 2) / 2 = 1.5 -> -1.5, 0, 1.5
    out, _ = grpo_llm.group_advantages(REWARDS, 3, "none", leave_one_out=True)
    torch.testing.assert_close(out, t([-1.5, 0.0, 1.5, 0.0, 0.0, 0.0]))
    # with group scale: / (std 1 + 1e-4)
    out, _ = grpo_llm.group_advantages(REWARDS, 3, "group", leave_one_out=True)
    torch.testing.assert_close(out, t([-1.5, 0.0, 1.5, 0.0, 0.0, 0.0]) / 1.0001)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_group_advantages_equal_rewards_are_exactly_zero(scale, leave_one_out):
    # 0.1 and 0.7 are not exact in binary: the group mean may be off by an ulp, yet the advantage is 0
    rewards = t([0.1, 0.1, 0.1, 0.7, 0.7, 0.7])
    out, zero_std = grpo_llm.group_advantages(rewards, 3, scale, leave_one_out)
    assert torch.equal(out, torch.zeros(6))
    assert zero_std.tolist() == [True, True]


# ---------------------------------------------------------------------------------------------------------
# grpo_loss on a (2, 3) batch: old log-probs 0, so rho = exp(logprobs) is the table below
#   row 0, A = +1: rho = 1.5, 1.0, 0.5      (all real)
#   row 1, A = -1: rho = 0.7, 1.1, [2.0]    (last token masked out)
# per token -min(rho A, clip(rho, 1 - 0.2, 1 + 0.28) A):
#   row 0: -min(1.5, 1.28) = -1.28 (high-clipped), -1.0, -min(0.5, 0.8) = -0.5
#   row 1: max(0.7, 0.8) = 0.8 (low-clipped), max(1.1, 1.1) = 1.1
# sum over real tokens: -2.78 + 1.9 = -0.88
# ---------------------------------------------------------------------------------------------------------
MASK = t([[1, 1, 1], [1, 1, 0]])
ADV = t([1.0, -1.0])


def loss_inputs(ratios):
    return torch.log(t(ratios)), torch.zeros(2, 3)


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("grpo", ((-2.78 / 3) + (1.9 / 2)) / 2),  # per-row means -0.926667 and 0.95, then their mean
        ("dapo", -0.88 / 5),  # 5 real tokens
        ("dr_grpo", -0.88 / (2 * 4)),  # 2 completions x max_completion_length 4
    ],
)
def test_grpo_loss_types_with_clip_higher(loss_type, expected):
    logprobs, old = loss_inputs([[1.5, 1.0, 0.5], [0.7, 1.1, 2.0]])
    loss, stats = grpo_loss(logprobs, old, None, ADV, MASK, epsilon_high=0.28, loss_type=loss_type)
    torch.testing.assert_close(loss, torch.tensor(expected))
    # 1 high-clipped and 1 low-clipped token of 5 real ones
    torch.testing.assert_close(stats["clip_ratio/high_mean"], torch.tensor(0.2))
    torch.testing.assert_close(stats["clip_ratio/low_mean"], torch.tensor(0.2))
    torch.testing.assert_close(stats["clip_ratio/region_mean"], torch.tensor(0.4))
    assert "kl" not in stats


def test_grpo_loss_symmetric_clip_and_per_token_advantages():
    # epsilon_high = epsilon = 0.2: the first token is clipped at 1.2, row 0 mean (-1.2 - 1 - 0.5) / 3 = -0.9,
    # loss = (-0.9 + 0.95) / 2 = 0.025; advantages given per token (B, T) give the same
    logprobs, old = loss_inputs([[1.5, 1.0, 0.5], [0.7, 1.1, 2.0]])
    loss, _ = grpo_loss(logprobs, old, None, ADV[:, None].expand(2, 3), MASK, loss_type="grpo")
    torch.testing.assert_close(loss, torch.tensor(0.025))


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("grpo", ((-2.78 / 3) + (1.9 / 2)) / 2 + 0.1 * (1 - math.log(2))),  # every row mean gains beta * k3
        ("dapo", -0.88 / 5 + 0.1 * (1 - math.log(2))),
        ("dr_grpo", (-0.88 + 5 * 0.1 * (1 - math.log(2))) / 8),
    ],
)
def test_grpo_loss_k3_term(loss_type, expected):
    # ref = logp + ln 2 everywhere: k3 = exp(ln 2) - ln 2 - 1 = 1 - ln 2 = 0.306853; beta = 0.1
    logprobs, old = loss_inputs([[1.5, 1.0, 0.5], [0.7, 1.1, 2.0]])
    ref = logprobs + math.log(2)
    loss, stats = grpo_loss(logprobs, old, ref, ADV, MASK, epsilon_high=0.28, beta=0.1, loss_type=loss_type)
    torch.testing.assert_close(loss, torch.tensor(expected))
    torch.testing.assert_close(stats["kl"], torch.tensor(1 - math.log(2)))


def test_grpo_loss_sequence_level_importance_ratio():
    # GSPO: rho_i = exp(mean of log rho over real tokens), one per completion
    #   row 0 (A = +1): (1.5 * 1.0 * 0.5)^(1/3) = 0.75^(1/3) = 0.9085603, inside [0.8, 1.28]: -0.9085603
    #   row 1 (A = -1): (0.5 * 0.8)^(1/2) = 0.4^(1/2) = 0.6324555 (the masked 2.0 is ignored), low-clipped: 0.8
    # grpo: (-0.9085603 + 0.8) / 2 = -0.0542802; 2 of 5 tokens low-clipped
    logprobs, old = loss_inputs([[1.5, 1.0, 0.5], [0.5, 0.8, 2.0]])
    loss, stats = grpo_loss(
        logprobs, old, None, ADV, MASK, epsilon_high=0.28, loss_type="grpo", importance_sampling_level="sequence"
    )
    torch.testing.assert_close(loss, torch.tensor((-(0.75 ** (1 / 3)) + 0.8) / 2))
    torch.testing.assert_close(stats["clip_ratio/low_mean"], torch.tensor(0.4))
    torch.testing.assert_close(stats["clip_ratio/high_mean"], torch.tensor(0.0))
    # mean ratio over real tokens: (3 * 0.9085603 + 2 * 0.6324555) / 5
    torch.testing.assert_close(stats["importance_ratio/mean"], torch.tensor((3 * 0.75 ** (1 / 3) + 2 * 0.4**0.5) / 5))


def test_grpo_loss_gradient_at_ratio_one_is_the_policy_gradient():
    # old = logprobs detached: rho = 1, d loss / d logp_t = -A_i / |o_i| / B (grpo), -A_i / tokens (dapo)
    logprobs = torch.zeros(2, 3, requires_grad=True)
    loss, _ = grpo_loss(logprobs, logprobs.detach(), None, ADV, MASK, loss_type="grpo")
    loss.backward()
    torch.testing.assert_close(logprobs.grad, t([[-1 / 6, -1 / 6, -1 / 6], [1 / 4, 1 / 4, 0.0]]))
    logprobs.grad = None
    loss, _ = grpo_loss(logprobs, logprobs.detach(), None, ADV, MASK, loss_type="dapo")
    loss.backward()
    torch.testing.assert_close(logprobs.grad, t([[-1 / 5, -1 / 5, -1 / 5], [1 / 5, 1 / 5, 0.0]]))


# ---------------------------------------------------------------------------------------------------------
# the rest of the family (issue #18), on the same (2, 3) batch: rho = [[1.5, 1.0, 0.5], [0.7, 1.1, (2.0)]]
# ---------------------------------------------------------------------------------------------------------
RATIOS = [[1.5, 1.0, 0.5], [0.7, 1.1, 2.0]]


def test_cispo_weights_log_probs_by_the_capped_detached_ratio():
    # -sg(min(rho, 1 + 0.28)) * A * log rho (old = 0), dapo's normaliser (5 real tokens):
    #   row 0, A = +1: -1.28 * ln 1.5 = -0.5189955, -1 * ln 1 = 0, -0.5 * ln 0.5 = +0.3465736
    #   row 1, A = -1: +0.7 * ln 0.7 = -0.2496725, +1.1 * ln 1.1 = +0.1048412
    logprobs, old = loss_inputs(RATIOS)
    logprobs.requires_grad_(True)
    loss, stats = grpo_loss(logprobs, old, None, ADV, MASK, epsilon_high=0.28, loss_type="cispo")
    expected = (-1.28 * math.log(1.5) - 0.5 * math.log(0.5) + 0.7 * math.log(0.7) + 1.1 * math.log(1.1)) / 5
    torch.testing.assert_close(loss, torch.tensor(expected))
    loss.backward()  # d/d logp = -sg(w) * A / 5: the weight carries no gradient
    torch.testing.assert_close(logprobs.grad, t([[-1.28, -1.0, -0.5], [0.7, 1.1, 0.0]]) / 5)
    torch.testing.assert_close(stats["cispo_clip_ratio"], torch.tensor(0.2))  # rho 1.5 > 1.28 with A > 0: 1 of 5


def test_sapo_soft_gate_with_two_temperatures():
    # -sigmoid(tau (rho - 1)) * 4 / tau * A, tau 1 for A > 0, 1.05 otherwise; grpo's normaliser:
    #   row 0: -4 (s(0.5) + s(0) + s(-0.5)) / 3 = -4 * 1.5 / 3 = -2 (s(x) + s(-x) = 1)
    #   row 1: +(4 / 1.05) (s(1.05 * -0.3) + s(1.05 * 0.1)) / 2 = 3.8095238 * (0.4218947 + 0.5262259) / 2 = 1.8059440
    def s(x):
        return 1 / (1 + math.exp(-x))

    logprobs, old = loss_inputs(RATIOS)
    loss, _ = grpo_loss(
        logprobs, old, None, ADV, MASK, loss_type="sapo", sapo_temperature_pos=1, sapo_temperature_neg=1.05
    )
    expected = (-4 * (s(0.5) + s(0) + s(-0.5)) / 3 + 4 / 1.05 * (s(-0.315) + s(0.105)) / 2) / 2
    torch.testing.assert_close(loss, torch.tensor(expected))
    torch.testing.assert_close(loss, torch.tensor((-2 + 1.8059440) / 2))


def test_two_sided_clipping_caps_the_ratio_of_negative_advantages():
    # row 1 rho = 0.7, 3.0 with A = -1: max(0.7, 0.8) = 0.8, and max(min(3, delta 2), 1.28) = 2 (3 without delta);
    # row 0 as before (-2.78: min(min(rho, 2), clip) is unchanged for A > 0). dapo: (-2.78 + 0.8 + 2) / 5 = 0.004
    logprobs, old = loss_inputs([[1.5, 1.0, 0.5], [0.7, 3.0, 2.0]])
    logprobs.requires_grad_(True)
    loss, _ = grpo_loss(logprobs, old, None, ADV, MASK, epsilon_high=0.28, loss_type="dapo", delta=2.0)
    torch.testing.assert_close(loss, torch.tensor(0.004))
    loss.backward()  # the capped token has no gradient; the clipped ones neither
    torch.testing.assert_close(logprobs.grad, t([[0.0, -1.0, -0.5], [0.0, 0.0, 0.0]]) / 5)
    loss, _ = grpo_loss(logprobs, old, None, ADV, MASK, epsilon_high=0.28, loss_type="dapo")
    torch.testing.assert_close(loss, torch.tensor((-2.78 + 0.8 + 3.0) / 5))


def accumulated(monkeypatch, logprobs, old, vllm_logprobs=None, **flags):
    """accumulate_gradients' loss on the (2, 3) batch, one micro-batch, policy_forward giving `logprobs` (B, T)."""

    def forward(policy, batch, micro_batch, args):  # (hidden states, log-probs, entropies)
        return None, logprobs[micro_batch], torch.zeros_like(logprobs)

    monkeypatch.setattr(grpo_llm, "policy_forward", forward)
    batch = dict(loss_mask=MASK, entropy_mask=torch.ones_like(MASK), advantages=ADV, vllm_logprobs=vllm_logprobs)
    if old is not None:  # mu > 1: the old log-probs of the scoring pass
        batch["old_logprobs"] = old
    args = grpo_llm.Args(**({"max_new_tokens": 4, "epsilon_high": 0.28} | flags))
    loss, _ = grpo_llm.accumulate_gradients(None, batch, [torch.arange(2)], args, contextlib.nullcontext())
    return loss, batch


@pytest.mark.parametrize("threshold, expected", [(0.05, -2.78 / 5), (0.1, -2.78 / 5), (0.2, -0.88 / 5)])
def test_off_policy_mask_drops_negative_completions_far_from_the_rollout_policy(monkeypatch, threshold, expected):
    # mu = 2, the old log-probs 0: the mean of old - logp per completion: row 0 -(ln 1.5 + ln 0.5) / 3 = 0.0958940
    # (A > 0: kept anyway), row 1 -(ln 0.7 + ln 1.1) / 2 = 0.1306822: dropped at 0.1 (its +1.9 goes; the normaliser
    # stays 5), kept at 0.2; at 0.05 both are past the threshold, and only row 1 (A < 0) is dropped: as at 0.1
    logprobs, old = loss_inputs(RATIOS)
    flags = dict(loss_type="dapo", num_iterations=2, off_policy_mask_threshold=threshold)
    loss, _ = accumulated(monkeypatch, logprobs.requires_grad_(True), old, **flags)
    torch.testing.assert_close(loss, torch.tensor(expected))


@pytest.mark.parametrize("threshold, expected", [(0.5, -0.5), (0.6, (-1 + 5 / 9) / 2)])
def test_under_vllm_the_off_policy_mask_reads_the_engines_log_probs_at_mu_1(monkeypatch, threshold, expected):
    # mu = 1: the old log-probs are the current ones (ratio 1, grpo's per-token loss -A w), p = 0.5 on every token.
    # Row 0 (A = +1): the engine's p is 0.5 too, w = 1: the row's mean -1. Row 1 (A = -1): the engine's p is 0.9, so
    # KL(engine || pi) = ln 0.9 - ln 0.5 = ln 1.8 = 0.5878 a token, and w = 0.5 / 0.9 = 5/9 (token_truncate, < 3).
    # At 0.5 row 1 is masked: (-1 + 0) / 2 = -0.5; at 0.6 it stays: (-1 + 5/9) / 2 = -0.2222
    logprobs = torch.full((2, 3), math.log(0.5), requires_grad=True)
    engine = t([[0.5, 0.5, 0.5], [0.9, 0.9, 1.0]]).log() * MASK
    flags = dict(loss_type="grpo", vllm=True, off_policy_mask_threshold=threshold)
    loss, batch = accumulated(monkeypatch, logprobs, None, engine, **flags)
    torch.testing.assert_close(loss, torch.tensor(expected))
    torch.testing.assert_close(batch["old_logprobs"], logprobs.detach())  # what vllm_metrics reads
    real = importlib.util.find_spec  # as if vLLM were installed: --vllm is not refused at mu = 1
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: real("torch") if name == "vllm" else real(name, *a)
    )
    grpo_llm.check_args(grpo_llm.Args(vllm=True, off_policy_mask_threshold=threshold), 1)


def test_high_entropy_mask_and_loss():
    # real entropies 0.1 0.5 0.9 | 0.3 0.7 (5.0 is padding); top 40%: quantile 0.6 of [0.1, 0.3, 0.5, 0.7, 0.9]
    # at position 0.6 * 4 = 2.4: 0.5 + 0.4 * 0.2 = 0.58 -> 0.9 and 0.7 carry the gradient
    entropy = t([[0.1, 0.5, 0.9], [0.3, 0.7, 5.0]])
    entropy_mask = grpo_llm.high_entropy_mask(entropy, MASK, 0.4)
    torch.testing.assert_close(entropy_mask, t([[0, 0, 1], [0, 1, 0]]))
    # dapo: only -0.5 (row 0, rho 0.5) and +1.1 (row 1, rho 1.1) remain, over all 5 tokens: 0.6 / 5 = 0.12
    logprobs, old = loss_inputs(RATIOS)
    loss, _ = grpo_loss(logprobs, old, None, ADV, MASK, epsilon_high=0.28, loss_type="dapo", entropy_mask=entropy_mask)
    torch.testing.assert_close(loss, torch.tensor(0.12))


def test_bias_corrected_kl_value_and_gradient():
    # ref = logp + ln 2: k3 = 1 - ln 2 per token; corrected, rho k3: sum of real rho 1.5 + 1 + 0.5 + 0.7 + 1.1 = 4.8
    logprobs, old = loss_inputs(RATIOS)
    ref = logprobs + math.log(2)
    loss, stats = grpo_loss(
        logprobs, old, ref, ADV, MASK, epsilon_high=0.28, beta=0.1, loss_type="dapo", use_bias_correction_kl=True
    )
    torch.testing.assert_close(loss, torch.tensor((-0.88 + 0.1 * 4.8 * (1 - math.log(2))) / 5))
    torch.testing.assert_close(stats["kl"], torch.tensor(4.8 / 5 * (1 - math.log(2))))
    # at mu = 1 (rho = 1 in value) the gradient still differs: d(rho k3)/d logp = k3 + d k3/d logp =
    # (1 - ln 2) + (1 - exp(ref - logp)) = (1 - ln 2) - 1 = -ln 2, against -1 without the ratio; A = 0, beta 1, dapo
    for corrected, per_token in [(True, -math.log(2)), (False, -1.0)]:
        logprobs = torch.zeros(2, 3, requires_grad=True)
        loss, _ = grpo_loss(
            logprobs,
            logprobs.detach(),
            logprobs.detach() + math.log(2),
            torch.zeros(2),
            MASK,
            beta=1.0,
            loss_type="dapo",
            use_bias_correction_kl=corrected,
        )
        loss.backward()
        torch.testing.assert_close(logprobs.grad, MASK * per_token / 5)


@pytest.mark.parametrize("loss_type, base", [("cispo", "dapo"), ("sapo", "grpo")])
def test_at_ratio_one_cispo_and_sapo_have_the_gradient_of_their_base(loss_type, base):
    # cispo: -1 * A * grad logp = dapo's; sapo: d/d rho [sigmoid(tau (rho - 1)) 4 / tau] at 1 = tau / 4 * 4 / tau = 1
    grads = []
    for name in [loss_type, base]:
        logprobs = torch.zeros(2, 3, requires_grad=True)
        grpo_loss(logprobs, logprobs.detach(), None, ADV, MASK, loss_type=name)[0].backward()
        grads.append(logprobs.grad)
    torch.testing.assert_close(grads[0], grads[1])


# ---------------------------------------------------------------------------------------------------------
# end to end, in-process, tiny models (tests/conftest.py)
# ---------------------------------------------------------------------------------------------------------
def run(tiny, tmp_path, **kwargs):
    """main() for 2 updates of 8 completions (2 prompts x 4); returns (run_dir, metrics records)."""
    settings = dict(
        model=tiny["policy"], output_dir=str(tmp_path / "runs"), prompts_per_update=2, num_generations=4,
        micro_batch_size=4, max_new_tokens=4, total_steps=2, eval_every=0, sample_every=1, num_samples=2,
    )  # fmt: skip
    run_dir = grpo_llm.main(grpo_llm.Args(**(settings | kwargs)))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return run_dir, [json.loads(line) for line in f]


TRL_NAMES = {
    "reward", "reward_std", "frac_reward_zero_std", "entropy", "completions/mean_length",
    "completions/clipped_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
    "loss", "grad_norm", "learning_rate", "time/generation", "time/scoring", "time/update",
    "perf/tokens_per_sec", "perf/peak_memory_mb",
}  # fmt: skip


def test_default_variant_with_kl_eval_samples_and_saving(tiny, tmp_path, capsys):
    run_dir, records = run(
        tiny, tmp_path, beta=0.1, num_iterations=2, eval_every=2, prompts_per_update=8, num_generations=8,
        micro_batch_size=16, total_steps=2, save_every=1,
    )  # fmt: skip
    # random policy, held-out at start: accuracy 0, standard error sqrt(0 * 1 / 256) = 0; every response wrong
    wrong = records[0]["eval/mean_length_wrong"]
    assert records[0] == {
        "update": 0,
        "episode": 0,
        "eval/accuracy": 0.0,
        "eval/accuracy_stderr": 0.0,
        "eval/mean_reward": 0.0,  # arithmetic's: 0 on each
        "eval/clipped_ratio": records[0]["eval/clipped_ratio"],  # most of the random policy's responses
        "eval/mean_length_wrong": wrong,
    }
    assert 1 <= records[0]["eval/mean_length_wrong"] <= 4  # tokens, at most --max-new-tokens
    assert [r["update"] for r in records[1:]] == [1, 2] and records[-1]["episode"] == 128
    assert TRL_NAMES | {"kl", "eval/accuracy", "rewards/arithmetic/mean"} <= set(records[-1])
    assert 0 <= records[1]["kl"] < 1e-6  # the reference is the initial policy (2nd iteration: one step away)
    assert records[-1]["time/update"] > 0 and records[-1]["perf/peak_memory_mb"] > 0
    out = capsys.readouterr().out
    assert "held-out accuracy 0.000 ± 0.000" in out and "update 2/2: " in out and "ETA 00:00:00)" in out
    events = EventAccumulator(run_dir)  # TensorBoard beside metrics.jsonl, the same names and steps
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(0, 0.0), (2, 0.0)]
    assert {"reward", "kl", "loss", "rewards/arithmetic/mean"} <= set(events.Tags()["scalars"])
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert len(samples) == 4 and {"prompt", "completion", "reward", "advantage"} <= set(samples[0])
    assert json.load(open(os.path.join(run_dir, "args.json")))["beta"] == 0.1
    AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "policy"))  # save_pretrained round trip


def test_eval_only_on_a_dataset_and_eval_split_during_training(tiny, tmp_path, capsys):
    # --eval-only on the 20 distinct prompts of the JSONL file (not --eval-size 256 rows of it), nothing written
    args = grpo_llm.Args(model=tiny["policy"], dataset=tiny["jsonl"], reward_fn=("gsm8k",), max_new_tokens=4,
                         eval_only=True, output_dir=str(tmp_path / "runs"))  # fmt: skip
    result = grpo_llm.main(args)
    assert "20 held-out prompts, 1 sample each" in capsys.readouterr().out and not os.path.exists(tmp_path / "runs")
    assert set(result) == {
        "eval/accuracy", "eval/accuracy_stderr", "eval/mean_reward", "eval/clipped_ratio", "eval/mean_length_wrong"
    }  # fmt: skip
    # --eval-split FILE: the periodic evaluation of a prompt file; a local --dataset has no split to name
    _, records = run(
        tiny, tmp_path, dataset=tiny["jsonl"], reward_fn=("gsm8k",), eval_split=tiny["jsonl"], eval_every=1
    )
    assert [("eval/accuracy_stderr" in r) for r in records] == [True, True, True]
    with pytest.raises(
        SystemExit, match=r"^error: --dataset .*prompts.jsonl is a file, with no split test: --eval-split"
    ):
        run(tiny, tmp_path, dataset=tiny["jsonl"], reward_fn=("gsm8k",), eval_split="test", eval_every=1)
    (tmp_path / "no_answers.jsonl").write_text('{"prompt": "1+1="}\n')
    with pytest.raises(SystemExit, match=r"^error: --dataset .*no_answers.jsonl: row 1 has no --answer-column answer"):
        grpo_llm.main(grpo_llm.Args(**(vars(args) | {"dataset": str(tmp_path / "no_answers.jsonl")})))


@pytest.mark.parametrize(
    "options",
    [
        dict(loss_type="dr_grpo", scale_rewards="none", anneal_lr=True),
        dict(
            loss_type="dapo",
            epsilon_high=0.28,
            dynamic_sampling=True,
            overlong_buffer=2,
            reward_model="RM",
            dataset="JSONL",
        ),
        dict(gradient_checkpointing=True, micro_batch_size=8, reward_model="RM", dataset="JSONL"),
        dict(importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4, num_iterations=2),
        dict(leave_one_out=True, scale_rewards="batch", temperature=0.7),
        dict(reward_fn=("arithmetic", "gsm8k"), reward_weights=(1.0, 0.5), mask_truncated_completions=True),
    ],
)
def test_variants_run(tiny, tmp_path, options):
    paths = {"RM": tiny["rm"], "JSONL": tiny["jsonl"]}
    _, records = run(tiny, tmp_path, **{k: paths.get(v, v) if isinstance(v, str) else v for k, v in options.items()})
    assert [r["update"] for r in records] == [1, 2]
    for r in records:
        assert all(math.isfinite(v) for v in r.values())
    if options.get("anneal_lr"):
        assert [r["learning_rate"] for r in records] == [1e-4, 5e-5]
    if "reward_weights" in options:
        assert {"rewards/arithmetic/mean", "rewards/gsm8k/mean"} <= set(records[0])


def test_reward_model_jsonl_prompts_and_overlong_penalty(tiny, tmp_path):
    # the tiny policy rarely emits EOS in 4 tokens; a buffer of 4 at length 4 costs the full penalty 10
    _, records = run(
        tiny, tmp_path, reward_model=tiny["rm"], dataset=tiny["jsonl"], overlong_buffer=4, overlong_penalty=10
    )
    rm_name = os.path.basename(tiny["rm"])
    for r in records:
        assert math.isfinite(r["reward"]) and r[f"rewards/{rm_name}/mean"] != 0
        expected = r[f"rewards/{rm_name}/mean"] - 10 * r["completions/mean_length"] / 4
        assert r["reward"] == pytest.approx(expected, abs=1e-5)


def test_reward_model_with_another_tokenizer_and_a_label(tiny, tmp_path):
    _, records = run(tiny, tmp_path, reward_model=tiny["rm_other"], dataset=tiny["jsonl"])
    assert all(math.isfinite(r["reward"]) and r["reward"] != 0 for r in records)
    _, records = run(
        tiny, tmp_path, exp_name="two_labels", reward_model=tiny["rm_two_labels"], reward_label=1, dataset=tiny["jsonl"]
    )
    assert all(math.isfinite(r["reward"]) for r in records)


def test_dynamic_sampling_drops_equal_groups(tiny, tmp_path, monkeypatch):
    # rewards: group 1 all equal (advantage 0), group 2 not; lr 0 and one token per completion, so both runs
    # see the same 8 tokens. dapo divides by the loss tokens: 4 with the filter, 8 without, so the gradient
    # (of group 2 only, group 1's advantages being 0) doubles; grpo divides by the completions (8) either way
    monkeypatch.setitem(grpo_llm.REWARD_FNS, "arithmetic", lambda completions, answers: [1, 1, 1, 1, 0, 0, 0, 1])
    grad_norms = {}
    for loss_type in ["dapo", "grpo"]:
        for dynamic_sampling in [False, True]:
            _, records = run(
                tiny, tmp_path, exp_name=f"{loss_type}{dynamic_sampling}", loss_type=loss_type, learning_rate=0.0,
                max_new_tokens=1, dynamic_sampling=dynamic_sampling, total_steps=1,
            )  # fmt: skip
            assert records[0]["frac_reward_zero_std"] == 0.5
            grad_norms[loss_type, dynamic_sampling] = records[0]["grad_norm"]
    assert grad_norms["dapo", True] == pytest.approx(2 * grad_norms["dapo", False], rel=1e-5)
    assert grad_norms["grpo", True] == pytest.approx(grad_norms["grpo", False], rel=1e-5)


def test_a_group_is_one_prompts_completions(tiny, tmp_path, monkeypatch):
    # detail 1: the G = 4 completions of a prompt are contiguous, so rewards.view(-1, G) rows are groups
    seen = []
    monkeypatch.setitem(grpo_llm.REWARD_FNS, "gsm8k", lambda completions, answers: seen.append(answers) or [0.0] * 8)
    run(tiny, tmp_path, dataset=tiny["jsonl"], reward_fn=("gsm8k",), total_steps=1)
    answers = seen[0]
    assert answers == [answers[0]] * 4 + [answers[4]] * 4 and answers[0] != answers[4]


def test_mask_truncated_completions_leaves_out_responses_without_eos(tiny, tmp_path, monkeypatch, capsys):
    # no completion ends (its EOS turned into a character): --mask-truncated-completions leaves no token in the loss
    ends_at(monkeypatch, [None] * 8)
    options = dict(reward_model=tiny["rm"], dataset=tiny["jsonl"], mask_truncated_completions=True)
    _, records = run(tiny, tmp_path, **options)
    assert all(r["completions/clipped_ratio"] == 1.0 and "loss" not in r for r in records)
    assert "(no loss tokens)" in capsys.readouterr().out
    _, records = run(tiny, tmp_path, **(options | dict(mask_truncated_completions=False)))
    assert all("loss" in r for r in records)


def test_entropy_bonus_raises_the_entropy(tiny):
    # A = 0, beta 0: the whole gradient is -ent_coef * d(token mean of the entropy): the bonus pushes it up (--ent-coef)
    torch.manual_seed(0)
    policy = grpo_llm.load_model(AutoModelForCausalLM, tiny["policy"], "--model")
    B, Q, R = 4, 3, 4
    qr, mask = torch.randint(3, 20, (B, Q + R)), torch.ones(B, R)
    r = dict(query_responses=qr, attention_mask=torch.ones_like(qr), responses=qr[:, Q:], loss_mask=mask,
             prompt_width=Q, advantages=torch.zeros(B), old_logprobs=None,
             entropy_mask=torch.ones_like(mask))  # fmt: skip
    args = grpo_llm.Args(micro_batch_size=4, ent_coef=1.0, max_new_tokens=R)
    grpo_llm.accumulate_gradients(policy, r, [torch.arange(B)], args, torch.autocast("cpu", enabled=False))
    got = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    _, _, entropy = grpo_llm.policy_forward(policy, r, torch.arange(B), args)
    (-(entropy * mask).sum() / mask.sum()).backward()
    for a, p in zip(got, policy.parameters()):
        torch.testing.assert_close(a, p.grad)


def test_dynamic_sampling_with_only_equal_groups_trains_nothing(tiny, tmp_path, capsys):
    # the arithmetic reward of a random policy is 0 everywhere: every group leaves the loss
    _, records = run(tiny, tmp_path, dynamic_sampling=True, loss_type="dapo", top_entropy_quantile=0.5)
    assert [r["frac_reward_zero_std"] for r in records] == [1.0, 1.0]
    assert all("loss" not in r for r in records) and "(no loss tokens)" in capsys.readouterr().out


@pytest.mark.parametrize("num_iterations", [1, 3])
def test_ratio_is_exactly_one_at_unchanged_weights(tiny, tmp_path, num_iterations):
    # lr 0: the weights never change, so the old log-probs (detached, or recomputed in the training's
    # micro-batch shapes) equal the new ones exactly; the reward model gives non-zero advantages
    _, records = run(
        tiny, tmp_path, learning_rate=0.0, num_iterations=num_iterations, beta=0.1, reward_model=tiny["rm"],
        dataset=tiny["jsonl"],
    )  # fmt: skip
    for r in records:
        assert r["importance_ratio/mean"] == 1.0 and r["clip_ratio/region_mean"] == 0.0 and r["kl"] == 0.0
        assert r["grad_norm"] > 0


@pytest.mark.parametrize(
    "options",
    [
        dict(loss_type="cispo", epsilon_high=4.0),
        dict(loss_type="sapo"),
        dict(top_entropy_quantile=0.3),
        # grpo, and rewards all 0 (arithmetic, random policy): the gradient is the bonus alone, a token mean
        dict(ent_coef=0.1, reward_model=None, dataset="assets/arith/train.jsonl"),
        dict(beta=0.1, delta=2.0, off_policy_mask_threshold=0.0, num_iterations=2),
    ],
)
def test_new_variants_accumulate_the_whole_batch_gradient(tiny, tmp_path, monkeypatch, options):
    # lr 0: the weights never change, so one micro-batch of 8 and two of 4 must give the same gradient; EOS
    # after 1, 2, 3, 1, 2, ... tokens, so that the micro-batches hold 7 and 8 tokens and the weights differ
    ends_at(monkeypatch, [i % 3 for i in range(8)])
    grad_norms = []
    for micro_batch_size in [8, 4]:
        _, records = run(
            tiny, tmp_path, exp_name=f"mb{micro_batch_size}", learning_rate=0.0, micro_batch_size=micro_batch_size,
            total_steps=1, **(dict(reward_model=tiny["rm"], dataset=tiny["jsonl"]) | options),
        )  # fmt: skip
        grad_norms.append(records[0]["grad_norm"])
        assert ("cispo_clip_ratio" in records[0]) == (options.get("loss_type") == "cispo")
        assert ("clip_ratio/region_mean" in records[0]) == (options.get("loss_type") not in ("cispo", "sapo"))
    assert grad_norms[0] > 0 and grad_norms[0] == pytest.approx(grad_norms[1], rel=1e-5)


def test_track_with_wandb_offline(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir, _ = run(tiny, tmp_path, track=True, total_steps=1)
    assert any(name.startswith("offline-run") for name in os.listdir(os.path.join(run_dir, "wandb")))


def test_resume_logs_what_one_run_logs(tiny, tmp_path):
    # 2 updates, then --resume to 4, log what 4 updates in one go do (timings and memory aside; lr constant): the
    # weights, AdamW, the RNG states and the prompt position come back, the reference is re-derived.
    whole, _ = run(tiny, tmp_path / "whole", total_steps=4, beta=0.1, num_iterations=2)
    run_dir, _ = run(tiny, tmp_path / "split", beta=0.1, num_iterations=2)
    assert grpo_llm.main(grpo_llm.parse_args(["--resume", run_dir, "--total-steps", "4"])) == run_dir
    assert [m["update"] for m in untimed_metrics(run_dir)] == [1, 2, 3, 4]
    assert untimed_metrics(run_dir) == untimed_metrics(whole)


def test_learning_raises_the_reward(tiny, tmp_path):
    # a fixed random reward model scores one token after each JSONL prompt; GRPO must find the tokens it
    # prefers: the mean score of the last 5 updates is well above that of the first 5 (seeded, ~1 s)
    _, records = run(
        tiny, tmp_path, reward_model=tiny["rm"], dataset=tiny["jsonl"], prompts_per_update=4, num_generations=8,
        micro_batch_size=32, max_new_tokens=2, total_steps=20, learning_rate=1e-2, sample_every=0,
    )  # fmt: skip
    rewards = [r["reward"] for r in records]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.05, rewards


def test_non_finite_loss_stops_and_keeps_the_last_good_weights(tiny, tmp_path, monkeypatch, capsys):
    real_loss, calls = grpo_llm.grpo_loss, []

    def loss_turning_nan(*args, **kwargs):
        calls.append(1)
        loss, stats = real_loss(*args, **kwargs)
        return (loss * float("nan") if len(calls) > 2 else loss), stats  # 2 micro-batches: update 2 turns NaN

    monkeypatch.setattr(grpo_llm, "grpo_loss", loss_turning_nan)
    with pytest.raises(SystemExit) as e:
        run(tiny, tmp_path, reward_model=tiny["rm"], dataset=tiny["jsonl"], learning_rate=1e-2)
    err = capsys.readouterr().err
    assert e.value.code == 1 and "stopped in update 2 (the gradient norm is nan" in err and "Traceback" not in err
    (run_dir,) = os.listdir(tmp_path / "runs")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / run_dir / "policy")
    assert all(torch.isfinite(p).all() for p in saved.parameters())
    assert saved_update(tmp_path / "runs" / run_dir) == 1


def test_ctrl_c_saves(tiny, tmp_path, monkeypatch):
    interrupt_generation(monkeypatch, 2)  # in update 2's generation
    with pytest.raises(SystemExit):
        run(tiny, tmp_path, total_steps=5)
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert [r["update"] for r in untimed_metrics(run_dir)] == [1]
    assert os.path.isfile(run_dir / "policy" / "config.json")


# ---------------------------------------------------------------------------------------------------------
# bad input: one line, no traceback
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_generations=1), "error: --num-generations must be >= 2 (got 1)"),
        (dict(num_generations=3), "error: --micro-batch-size must divide the completions per update (6 a process)"),
        (dict(micro_batch_size=3), "--micro-batch-size must divide the completions per update (8 a process)"),
        (dict(num_iterations=0), "error: --num-iterations must be >= 1 (got 0)"),
        (dict(epsilon=0.2, epsilon_high=0.1), "error: --epsilon-high must be >= --epsilon (got 0.1)"),
        (dict(epsilon_high=0.28, delta=1.2), "error: --delta must be > 1 + --epsilon-high (got 1.2)"),
        (dict(reward_fn=("arithmetic", "nope")), "error: --reward-fn nope: not one of ['arithmetic', 'format', "
         "'gsm8k'], nor a file.py:function or module:function that loads"),
        (dict(reward_weights=(1.0, 2.0)), "error: --reward-weights needs one per reward (1), not 2"),
        (dict(reward_fn=()), "error: --reward-fn needs at least one reward function"),
        (dict(off_policy_mask_threshold=0.5), "error: --off-policy-mask-threshold needs --num-iterations > 1 or "
         "--vllm"),
        (dict(temperature=0.0), "error: --temperature must be > 0"),
        (dict(top_entropy_quantile=0.0), "error: --top-entropy-quantile must be in (0, 1]"),
        (dict(sapo_temperature_neg=0.0), "error: --sapo-temperature-neg must be > 0 (got 0.0)"),
        (dict(model="/no/such/dir"), "error: --model /no/such/dir is no directory, nor reachable on the hub"),
        (dict(max_new_tokens=40), "error: --max-new-tokens 40 and a prompt (--max-prompt-length None) do not fit the "
         "model's context of 32 tokens"),
        (dict(max_prompt_length=30), "error: --max-new-tokens 4 and a prompt (--max-prompt-length 30) do not fit"),
        (dict(dataset="/no/such.jsonl"), "error: --dataset /no/such.jsonl could not be loaded (FileNotFoundError"),
        (dict(dataset="JSONL", prompt_column="question"), "row 1 has no --prompt-column question (columns: prompt"),
        (dict(reward_model="RM2"), "has num_labels=2: --reward-label (0 to 1) chooses the logit that is the score"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(tiny, tmp_path, options, message):
    paths = {"JSONL": tiny["jsonl"], "RM2": tiny["rm_two_labels"]}
    options = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in options.items()}
    with pytest.raises(SystemExit) as e:
        run(tiny, tmp_path, **options)
    assert str(e.value).startswith("error:") and "\n" not in str(e.value)
    assert message in str(e.value)


def test_unreachable_hub_id_names_the_default(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        SystemExit, match="no-such-org/no-such-model is no directory, nor reachable on the hub.*arith-sft"
    ):
        run(tiny, tmp_path, model="no-such-org/no-such-model")
    with pytest.raises(SystemExit) as refusal:  # the embedded reward model, not the policy
        run(tiny, tmp_path, reward_model="no-such-org/no-such-rm")
    assert str(refusal.value).endswith("; offline: assets/arith-rm")

"""--teacher, on-policy distillation in both LLM scripts: the student samples, the teacher's log-probs grade every token
it sampled. In ppo_llm.py the teacher takes the reference's place in the per-token KL penalty; in grpo_llm.py each
token's -coef (log pi - log pi_teacher) is its advantage, beside the group's."""

import os
import re

import pytest
import torch
from conftest import char_tokenizer, tiny_config, untimed_metrics
from test_stops import run
from transformers import AutoModelForCausalLM, GPT2LMHeadModel

import grpo_llm
import ppo_llm


def test_the_per_token_signal_by_hand():
    # 2 responses of 3 tokens; the student's log-probs minus the teacher's, the sampled reverse KL (k1):
    #   [-1.0 - -0.5, -0.5 - -0.5, -2.0 - -1.0] = [-0.5, 0, -1.0]
    #   [-0.2 - -0.4, -1.5 - -1.0, -0.7 - -2.0] = [0.2, -0.5, 1.3]
    student = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -1.5, -0.7]])
    teacher = torch.tensor([[-0.5, -0.5, -1.0], [-0.4, -1.0, -2.0]])
    # PPO: each token's reward -kl_coef * k1, at --kl-coef 0.1: [0.05, 0, 0.1] and [-0.02, 0.05, -0.13]
    rewards = -0.1 * ppo_llm.kl_penalty(student, teacher, "k1")
    assert torch.allclose(rewards, torch.tensor([[0.05, 0.0, 0.1], [-0.02, 0.05, -0.13]]))
    # GRPO: rewards 1 and 0 in a group of 2, --scale-rewards none: A = 1 - 0.5 = 0.5 and -0.5; each token's
    # advantage A - coef * k1 at coef 1: [0.5 + 0.5, 0.5 - 0, 0.5 + 1.0] and [-0.5 - 0.2, -0.5 + 0.5, -0.5 - 1.3]
    advantages, _ = grpo_llm.group_advantages(torch.tensor([1.0, 0.0]), 2, "none")
    per_token = grpo_llm.distillation_advantages(advantages, student, teacher, 1.0)
    assert torch.allclose(per_token, torch.tensor([[1.0, 0.5, 1.5], [-0.7, 0.0, -1.8]]))


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
def test_distilling_a_student_from_itself_gives_no_signal_and_no_change(script, tiny, tmp_path):
    # the teacher is the student: in fp32 on the CPU both are scored in the same micro-batches, so each token's reverse
    # KL is exactly 0; the task reward only measures (pure distillation), so no weight of the policy moves, even at a
    # large learning rate. Under bf16 autocast the two would be scored in different precisions and differ a little
    run_dir = run(script, tiny, tmp_path / "runs", teacher=tiny["policy"], learning_rate=1e-2, total_steps=2,
                  eval_every=2, eval_split=tiny["jsonl"], save_every=1)  # fmt: skip
    metrics = untimed_metrics(run_dir)
    assert [m["distill/reverse_kl"] for m in metrics[1:]] == [0.0, 0.0]
    assert metrics[0]["distill/teacher_accuracy"] == metrics[0]["eval/accuracy"]  # the same model, evaluated so
    trained = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "policy")).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny["policy"]).state_dict()
    assert all(torch.equal(trained[k], initial[k]) for k in initial)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Another tiny model with the policy's tokenizer (other random weights): a teacher that disagrees."""
    path, tok = tmp_path_factory.mktemp("other"), char_tokenizer([chr(c) for c in range(32, 127)])
    torch.manual_seed(1)
    GPT2LMHeadModel(tiny_config(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
def test_a_teacher_grades_and_the_reverse_kl_is_logged(script, tiny, other, tmp_path):
    # another model with the policy's tokenizer: a reverse KL above 0 to watch, with a task reward named beside it
    reward_fn = "arithmetic" if script is ppo_llm else ("arithmetic",)
    run_dir = run(script, tiny, tmp_path / "runs", teacher=other, reward_fn=reward_fn, total_steps=1)
    (metrics,) = untimed_metrics(run_dir)
    assert metrics["distill/reverse_kl"] > 0.01  # two random tiny models: close, never equal


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
def test_a_teacher_that_cannot_grade_the_policy_is_one_line_before_the_run_directory(script, tiny, tmp_path):
    short = tmp_path / "short"  # the policy's tokenizer and 8 positions: shorter than a prompt and its response
    tok = char_tokenizer([chr(c) for c in range(32, 127)])
    config = tiny_config(tok)
    config.n_positions = 8
    GPT2LMHeadModel(config).save_pretrained(short)
    tok.save_pretrained(short)
    for teacher, why in [
        (tiny["rm_other"], "its vocabulary is not --model's, whose ids it must score"),
        (str(short), "its context is shorter than --max-prompt-length + --max-new-tokens"),
        (str(tmp_path / "none"), "is no directory, nor reachable on the hub"),
    ]:
        with pytest.raises(SystemExit, match=f"error: --teacher {teacher}.*{re.escape(why)}"):
            run(script, tiny, tmp_path / "runs", teacher=teacher, max_prompt_length=20)
        assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "script, flags, why",
    [
        (ppo_llm, dict(kl_estimator="k3"), "--teacher is the KL penalty's model"),
        (ppo_llm, dict(kl_target=1.0), "without --kl-target or --ref-update-every"),
        (ppo_llm, dict(kl_coef=0.0), "its coefficient --kl-coef > 0"),
        (grpo_llm, dict(beta=0.1), "--teacher needs --beta 0"),
        (grpo_llm, dict(dynamic_sampling=True), "--dynamic-sampling with --teacher needs a --reward-fn"),
    ],
)
def test_flags_that_do_not_mean_distillation_are_refused(script, flags, why):
    with pytest.raises(SystemExit, match=f"^error: {why}" if why.startswith("--") else why):
        script.check_args(script.Args(teacher="t", **flags), 1)


def test_with_lora_the_teacher_is_a_model_of_its_own(tiny, other, tmp_path):
    # under LoRA update 1 samples from the base (B = 0): graded by the adapters-off base, as the KL's reference is, its
    # reverse KL would be 0; the teacher, a model of its own, gives it one above 0
    run_dir = run(ppo_llm, tiny, tmp_path / "runs", teacher=other, lora_r=4, learning_rate=1e-2, total_steps=1)
    assert untimed_metrics(run_dir)[0]["distill/reverse_kl"] > 0.01

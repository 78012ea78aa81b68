"""The scripts stand alone, so shared code is copied: the copies must stay identical, and agree on data."""

import importlib.util
import inspect
import os

import pytest
import torch

import grpo_llm
import ppo_llm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("make_arith_models", os.path.join(ROOT, "assets", "make_arith_models.py"))
make_arith_models = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_arith_models)

ARITHMETIC = ["arithmetic_problem", "arithmetic_eval_set", "arithmetic_train_problems", "arithmetic_reward"]
SHARED = ARITHMETIC + ["logprobs_from_logits", "entropy_from_logits", "masked_mean", "kl_penalty", "gsm8k_reward",
                       "load_prompts", "resolve", "from_pretrained", "add_pad_token", "disable_dropout",
                       "context_length_of", "generate", "truncate_after_eos", "hidden_states", "reward_model_scores",
                       "evaluate", "peak_memory_mb", "load_models"]  # fmt: skip


@pytest.mark.parametrize("name", SHARED)
def test_llm_scripts_share_identical_copies(name):
    assert inspect.getsource(getattr(ppo_llm, name)) == inspect.getsource(getattr(grpo_llm, name))


@pytest.mark.parametrize("name", ARITHMETIC)
def test_arithmetic_task_is_the_one_the_models_were_trained_on(name):
    assert inspect.getsource(getattr(ppo_llm, name)) == inspect.getsource(getattr(make_arith_models, name))
    for constant in ["ARITH_MAX_OPERAND", "ARITH_EVAL_SEED", "ARITH_EVAL_SIZE"]:
        assert getattr(ppo_llm, constant) == getattr(grpo_llm, constant) == getattr(make_arith_models, constant)


def test_numerics_agree_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(3, 5, 11, generator=g), torch.randint(0, 11, (3, 5), generator=g)
    a, b = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    assert torch.equal(ppo_llm.logprobs_from_logits(logits, labels), grpo_llm.logprobs_from_logits(logits, labels))
    assert torch.equal(ppo_llm.masked_mean(a, mask), grpo_llm.masked_mean(a, mask))
    assert torch.equal(ppo_llm.masked_mean(a, mask, axis=1), grpo_llm.masked_mean(a, mask, axis=1))
    for estimator in ["k1", "k2", "k3"]:
        assert torch.equal(ppo_llm.kl_penalty(a, b, estimator), grpo_llm.kl_penalty(a, b, estimator))
    # and the log-probs are a log-softmax
    assert torch.allclose(ppo_llm.logprobs_from_logits(logits, labels),
                          torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0], atol=1e-6)  # fmt: skip

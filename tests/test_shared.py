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
SHARED = ARITHMETIC + ["masked_mean", "kl_penalty", "gsm8k_reward", "load_prompts", "resolve", "from_pretrained",
                       "load_model", "add_pad_token", "fit_embeddings", "context_window_of", "eos_token_ids",
                       "sampling_config", "generate", "truncate_after_eos", "hidden_states", "logit_postprocessing",
                       "head_chunk", "lm_head_logprobs", "response_logprobs", "check_logits", "reward_model_scores",
                       "evaluate", "load_models", "setup", "RunLogger",
                       "build_optimizer", "start", "timing_metrics", "rollout", "check_finite", "wall_clock",
                       "eval_line", "eval_rows", "eval_only", "eta", "final_answer", "format_reward", "load_reward_fn",
                       "render_prompt", "read_dataset", "prompt_row", "check_hub", "end_of_turn_id", "tokenize_texts",
                       "rm_text", "PromptStream", "parse_args", "train_state", "save_checkpoint", "load_checkpoint",
                       "add_lora", "reference_model", "adapters_off",
                       "setup_distributed", "all_reduce", "global_mean", "global_mean_var",
                       "global_metrics", "TrainedModels", "ddp_forward", "Silent", "ChunkedHead"]  # fmt: skip


@pytest.mark.parametrize("name", SHARED)
def test_llm_scripts_share_identical_copies(name):
    assert inspect.getsource(getattr(ppo_llm, name)) == inspect.getsource(getattr(grpo_llm, name))


@pytest.mark.parametrize("name", ARITHMETIC)
def test_arithmetic_task_is_the_one_the_models_were_trained_on(name):
    assert inspect.getsource(getattr(ppo_llm, name)) == inspect.getsource(getattr(make_arith_models, name))
    for constant in ["ARITH_MAX_OPERAND", "ARITH_EVAL_SEED", "ARITH_EVAL_SIZE"]:
        assert getattr(ppo_llm, constant) == getattr(grpo_llm, constant) == getattr(make_arith_models, constant)
    assert list(ppo_llm.REWARD_FNS) == list(grpo_llm.REWARD_FNS)
    assert ppo_llm.NUMBER == grpo_llm.NUMBER


def test_numerics_agree_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    hidden, labels = torch.randn(3, 5, 8, generator=g), torch.randint(0, 11, (3, 5), generator=g)
    head = torch.nn.Linear(8, 11)
    a, b = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    for x, y in zip(ppo_llm.lm_head_logprobs(hidden, head, labels, 0.7, 1.2, 3.0, True),
                    grpo_llm.lm_head_logprobs(hidden, head, labels, 0.7, 1.2, 3.0, True)):  # fmt: skip
        assert torch.equal(x, y)
    assert torch.equal(ppo_llm.masked_mean(a, mask), grpo_llm.masked_mean(a, mask))
    assert torch.equal(ppo_llm.masked_mean(a, mask, axis=1), grpo_llm.masked_mean(a, mask, axis=1))
    for estimator in ["k1", "k2", "k3"]:
        assert torch.equal(ppo_llm.kl_penalty(a, b, estimator), grpo_llm.kl_penalty(a, b, estimator))

"""The scripts stand alone, so the code they share is copied: every top-level function, class and constant defined in
both is identical, but for the few that are each algorithm's own."""

import ast
import inspect

import pytest
import torch
from conftest import lm

import grpo_llm
import ppo_llm

OWN = {"Args", "main", "check_args", "training_forward", "accumulate_gradients"}  # each script's own


def definitions(module):
    """Each top-level function, class and assigned name of the module, with its source text."""
    source = inspect.getsource(module)
    out = {}
    for node in ast.parse(source).body:
        targets = getattr(node, "targets", []) + [getattr(node, "target", None)]  # x = ... and x |= ... (AugAssign)
        names = [node.name] if hasattr(node, "name") else [t.id for t in targets if hasattr(t, "id")]
        for name in names:  # a name built over several statements (x = ..., then x |= ...): all of them
            out[name] = out.get(name, "") + ast.get_source_segment(source, node)
    return out


PPO, GRPO = definitions(ppo_llm), definitions(grpo_llm)
SHARED = sorted(PPO.keys() & GRPO.keys() - OWN)


def test_the_shared_set_is_the_plumbing_and_the_common_numerics():
    numerics = {"masked_mean", "kl_penalty", "lm_head_logprobs", "rollout", "optimizer_step"}
    plumbing = {
        "load_models",
        "load_prompts",
        "save_checkpoint",
        "load_checkpoint",
        "guarded",
        "REWARD_FNS",
        "STOP",
    }
    assert numerics | plumbing <= set(SHARED)
    assert len(SHARED) >= 40


@pytest.mark.parametrize("name", SHARED)
def test_llm_scripts_share_identical_copies(name):
    assert PPO[name] == GRPO[name]


def test_numerics_agree_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    hidden, labels = torch.randn(3, 5, 8, generator=g), torch.randint(0, 11, (3, 5), generator=g)
    head = torch.nn.Linear(8, 11)
    a, b = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    model = lm(head, 1.2, 3.0)
    for x, y in zip(
        ppo_llm.lm_head_logprobs(hidden, model, labels, 0.7), grpo_llm.lm_head_logprobs(hidden, model, labels, 0.7)
    ):
        assert torch.equal(x, y)
    assert torch.equal(ppo_llm.masked_mean(a, mask), grpo_llm.masked_mean(a, mask))
    assert torch.equal(ppo_llm.masked_mean(a, mask, axis=1), grpo_llm.masked_mean(a, mask, axis=1))
    for estimator in ["k1", "k2", "k3"]:
        assert torch.equal(ppo_llm.kl_penalty(a, b, estimator), grpo_llm.kl_penalty(a, b, estimator))

"""Code blocks of the docs that a reader copies: each runs as written and does what its page says."""

import os
import re

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

import ppo_llm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def block(page, first_line):
    """The ```python block of docs/<page> that starts with `first_line`."""
    with open(os.path.join(ROOT, "docs", page)) as f:
        return re.search(rf"```python\n({re.escape(first_line)}\n.*?)```", f.read(), re.S).group(1)


@pytest.mark.parametrize("critic", ["separate", "head"])
def test_the_value_model_reload_block_runs_as_written_and_gives_the_runs_values(tiny, tmp_path, monkeypatch, critic):
    code = block("ppo_llm.md", "# reload the value model of the latest ppo_llm.py run")
    if critic == "head":  # the line's own comment says what --critic head changes
        code, n = re.subn(r"(critic_dir = ).*# with --critic head: (.*)", r"\1\2", code)
        assert n == 1
    # a run directory as ppo_llm.py saves one, the value head's bias not 0 (HF's score layers have none to carry it)
    policy = ppo_llm.load_model(AutoModelForCausalLM, tiny["policy"], "--model")
    trunk = ppo_llm.load_model(AutoModel, tiny["rm"], "--model") if critic == "separate" else None
    value_head = torch.nn.Linear(32, 1)
    torch.nn.init.constant_(value_head.bias, 0.5)
    run_dir = tmp_path / "runs" / "ppo_llm__1__1700000000000"
    models = dict(policy=policy, value_head=value_head)
    if trunk is not None:
        models["critic"] = trunk
    ppo_llm.save_policy(str(run_dir / "policy"), models, AutoTokenizer.from_pretrained(tiny["policy"]))
    monkeypatch.chdir(tmp_path)
    names = {}
    exec(code, names)  # as a reader runs it
    ids = names["input_ids"]
    r = dict(query_responses=ids, attention_mask=torch.ones_like(ids), responses=ids[:, 1:], prompt_width=1)
    with torch.no_grad():
        _, _, expected = ppo_llm.training_forward(
            policy, trunk, value_head, r, torch.arange(1), ppo_llm.Args(critic=critic)
        )
    assert ids.shape == (1, len("37+85=122"))
    torch.testing.assert_close(names["values"][:, :-1], expected)  # the states at positions 0 .. T-2 predict 1 .. T-1

"""LoRA through peft (--lora-r), both LLM scripts: only the adapters train, the adapter-free base is the reference
(exactly the initial policy), the first ratio is 1, and what is saved loads back with peft and plain transformers."""

import json
import os

import pytest
import torch
from conftest import saved_weights, untimed_metrics
from test_families import families  # noqa: F401 (a fixture)
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo_llm
import ppo_llm

peft = pytest.importorskip("peft")


def run(script, tiny, tmp_path, monkeypatch, **kwargs):
    """main() with --lora-r 4; returns (run_dir, metrics, the trained policy, its state before training)."""
    loaded = {}
    real_load_models = script.load_models

    def load_models(*a):
        out = real_load_models(*a)
        loaded["policy"], loaded["initial"] = out[1], {k: v.clone() for k, v in out[1].state_dict().items()}
        return out

    monkeypatch.setattr(script, "load_models", load_models)
    shape = dict(prompts_per_update=8, num_mini_batches=2, micro_batch_size=2) if script is ppo_llm else \
        dict(prompts_per_update=2, num_generations=4, micro_batch_size=4)  # fmt: skip
    settings = dict(model=tiny["policy"], output_dir=str(tmp_path), total_steps=1, max_new_tokens=3, eval_every=0,
                    sample_every=0, lora_r=4, learning_rate=1e-2) | shape  # fmt: skip
    run_dir = script.main(script.Args(**(settings | kwargs)))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return run_dir, [json.loads(line) for line in f], loaded["policy"], loaded["initial"]


def logits(model, ids):
    """The model's logits of ids, on the CPU; the ids go to the model's device (the GPU, where there is one)."""
    ids = ids.to(model.device)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.cpu()


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
def test_only_adapters_train_and_what_is_saved_loads_back(script, tiny, tmp_path, monkeypatch):
    kl = dict(critic="separate", kl_coef=0.05) if script is ppo_llm else dict(beta=0.1, num_iterations=2)
    # a reward model's scores: a tiny random policy earns no arithmetic reward, so nothing would move
    scored = dict(reward_model=tiny["rm"], dataset=tiny["jsonl"])
    run_dir, metrics, policy, initial = run(script, tiny, tmp_path, monkeypatch, save_merged=True, **kl, **scored)
    changed = {k for k, v in policy.state_dict().items() if not torch.equal(v, initial[k])}
    assert changed and all("lora_" in k for k in changed)  # the base is frozen; B moved away from 0
    assert all(p.dtype == torch.float32 for p in policy.parameters() if p.requires_grad)
    ids = torch.arange(3, 12)[None]
    base = AutoModelForCausalLM.from_pretrained(tiny["policy"])
    reloaded = peft.PeftModel.from_pretrained(base, os.path.join(run_dir, "policy")).to(policy.device)
    torch.testing.assert_close(logits(reloaded, ids), logits(policy, ids), rtol=0, atol=0)  # the same device's kernels
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "policy", "merged"))
    assert not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(logits(merged, ids), logits(policy, ids), rtol=1e-5, atol=1e-5)  # CPU against GPU
    # --model policy/ (the adapter, as --eval-only takes it): the base from adapter_config.json, the adapter on it
    adapter = script.load_model(AutoModelForCausalLM, os.path.join(run_dir, "policy"), "--model")
    torch.testing.assert_close(logits(adapter, ids), logits(policy, ids), rtol=1e-5, atol=1e-5)
    result = script.main(script.Args(eval_only=True, model=os.path.join(run_dir, "policy"), dataset=tiny["jsonl"],
                                     eval_split=tiny["jsonl"], eval_size=4, max_new_tokens=3))  # fmt: skip
    assert 0 <= result["eval/accuracy"] <= 1
    if script is ppo_llm:  # the separate critic has adapters of its own
        assert os.path.isfile(os.path.join(run_dir, "policy", "critic", "adapter_config.json"))


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
def test_reference_is_the_initial_policy_and_first_ratio_is_one(script, tiny, tmp_path, monkeypatch):
    # lr 0: the reference (the base under disable_adapter, no copy) gives the rollout's log-probs bit for bit
    kl = dict(critic="head", kl_coef=0.05) if script is ppo_llm else dict(beta=0.1, num_iterations=2)
    _, metrics, policy, _ = run(script, tiny, tmp_path, monkeypatch, learning_rate=0.0, **kl)
    m = metrics[-1]
    if script is ppo_llm:
        assert m["objective/kl"] == 0.0 and m["val/ratio"] == 1.0 and m["policy/approxkl_avg"] == 0.0
    else:
        assert m["kl"] == 0.0 and m["importance_ratio/mean"] == 1.0
    ids = torch.arange(3, 12)[None]
    with policy.disable_adapter():  # the scripts' reference under LoRA
        reference = logits(policy, ids)
    torch.testing.assert_close(reference, logits(policy, ids), rtol=0, atol=0)  # B = 0: LoRA adds exactly 0


def test_disable_adapter_is_the_base(tiny):
    # with B != 0 the adapters change the logits; under disable_adapter() (the reference) the base's come back
    base = ppo_llm.load_model(AutoModelForCausalLM, tiny["policy"], "--model")
    ids = torch.arange(3, 12)[None]
    expected = logits(base, ids)
    policy = ppo_llm.add_lora(base, ppo_llm.Args(lora_r=4))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.fill_(0.1)
    with policy.disable_adapter():
        torch.testing.assert_close(logits(policy, ids), expected, rtol=0, atol=0)
    assert not torch.allclose(logits(policy, ids), expected)


def test_bf16_base_with_autocast_and_checkpointing(families, tmp_path, monkeypatch):  # noqa: F811
    # Qwen2 saved in bf16: the base stays bf16 (no fp32 copy), the adapters fp32; the first ratio is still 1
    _, metrics, policy, _ = run(ppo_llm, {"policy": families["qwen2"]}, tmp_path, monkeypatch, learning_rate=0.0,
                                mixed_precision="bf16", gradient_checkpointing=True, critic="separate")  # fmt: skip
    assert {p.dtype for p in policy.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in policy.parameters() if p.requires_grad} == {torch.float32}
    assert metrics[-1]["val/ratio"] == 1.0 and metrics[-1]["objective/kl"] == 0.0
    _, _, policy, initial = run(ppo_llm, {"policy": families["qwen2"]}, tmp_path, monkeypatch,
                                mixed_precision="bf16", gradient_checkpointing=True, ent_coef=0.1)  # fmt: skip
    # the random model scores 0 everywhere, so only the entropy bonus has a gradient: it reaches the adapters
    assert any(not torch.equal(v, initial[k]) for k, v in policy.state_dict().items() if "lora_B" in k)


def test_an_fp16_checkpoint_never_trains_in_fp16(tiny, tmp_path, monkeypatch, capsys):
    # fp16 would train without loss scaling: a float16 base is read as fp32, or as bf16 under bf16 autocast, and no
    # tensor that autograd saves for the backward is float16
    path = str(tmp_path / "fp16")
    AutoModelForCausalLM.from_pretrained(tiny["policy"]).half().save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny["policy"]).save_pretrained(path)
    for precision, base in [("no", torch.float32), ("bf16", torch.bfloat16)]:
        saved = set()

        def pack(tensor):
            saved.add(tensor.dtype)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            _, _, policy, _ = run(ppo_llm, {"policy": path}, tmp_path, monkeypatch, mixed_precision=precision)
        assert {p.dtype for p in policy.parameters() if not p.requires_grad} == {base}
        assert torch.float16 not in saved and torch.float32 in saved
        assert f"--model {path} is float16, which would train without loss scaling: read as {str(base)[6:]}" in (
            capsys.readouterr().out
        )


@pytest.mark.parametrize(
    "script, kwargs, message",
    [
        (ppo_llm, dict(ref_update_every=1), "--ref-update-every cannot refresh a LoRA run's reference"),
        (grpo_llm, dict(lora_r=0, save_merged=True), "--save-merged needs --lora-r"),
        (ppo_llm, dict(lora_target_modules=("lm_head",)), "--lora-target-modules: not the LM head"),
        # GPT-2's linear layers: the Conv1D c_attn, c_proj (attention and MLP) and c_fc; the lm_head, refused, not named
        (grpo_llm, dict(lora_target_modules=("no_such_proj",)),
         "--lora-target-modules no_such_proj: Target modules {'no_such_proj'} not found in the base model (the model's "
         "linear layers: c_attn c_fc c_proj)"),
    ],
)  # fmt: skip
def test_bad_lora_flags_one_line(script, kwargs, message, tiny, tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as e:
        run(script, tiny, tmp_path, monkeypatch, **kwargs)
    assert str(e.value).startswith("error: ") and "\n" not in str(e.value)
    assert all(part in str(e.value) for part in ((message,) if isinstance(message, str) else message))


def test_lora_without_peft_names_the_install(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "peft", None)  # as if it were not installed
    with pytest.raises(SystemExit) as e:
        run(grpo_llm, tiny, tmp_path, monkeypatch)
    assert "pip install peft" in str(e.value) and "\n" not in str(e.value)


def test_resume_restores_the_adapters_and_adamw(tiny, tmp_path):
    # GRPO with LoRA: 2 updates, then --resume to 4, log what 4 updates in one go do (timings and memory aside):
    # the checkpoint carries the adapters and AdamW's state of the adapters, not the frozen base (from --model)
    opts = dict(model=tiny["policy"], lora_r=4, learning_rate=1e-2, beta=0.1, reward_model=tiny["rm"],
                dataset=tiny["jsonl"], prompts_per_update=2, num_generations=4, micro_batch_size=4, max_new_tokens=3,
                eval_every=0, sample_every=0)  # fmt: skip
    whole = grpo_llm.main(grpo_llm.Args(output_dir=str(tmp_path / "whole"), total_steps=4, **opts))
    split = grpo_llm.main(grpo_llm.Args(output_dir=str(tmp_path / "split"), total_steps=2, **opts))
    grpo_llm.main(grpo_llm.parse_args(["--resume", split, "--total-steps", "4"]))
    assert [m["update"] for m in untimed_metrics(split)] == [1, 2, 3, 4]
    assert untimed_metrics(split) == untimed_metrics(whole)
    assert untimed_metrics(whole)[-1]["kl"] > 0  # the adapters moved the policy
    saved = saved_weights(split, "policy")
    assert saved and all("lora_A" in k or "lora_B" in k for k in saved)

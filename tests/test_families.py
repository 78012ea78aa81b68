"""Faithful numerics on real model families: tiny GPT-2, Llama, Qwen2, Gemma2 (and Cohere, Granite for the logit
post-processing) built from their configs, some saved in bf16, some with a generation_config of their own.

CPU autocast stands in for CUDA's bf16 path: it runs the same autocast machinery, but its op lists differ from
CUDA's (e.g. CPU autocast keeps softmax and layer norm in the input dtype, CUDA casts some to fp32), and the
kernels and their rounding are the CPU's; what only a GPU can show is in benchmarks/, not here."""

import json
import os
import types
from contextlib import nullcontext

import pytest
import torch
from conftest import char_tokenizer
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GenerationConfig,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import grpo_llm
import ppo_llm

CHARS = [chr(c) for c in range(32, 127)]


@pytest.fixture(scope="session")
def families(tmp_path_factory, tiny):
    """Directories of tiny models of several families (random weights, seeded), all with the test's char tokenizer:
    llama: attention_dropout 0.5 in its config, a generation_config with repetition_penalty 5, top_k 3 and two EOS
    ids; qwen2: 30 more embedding rows than tokens and pad = EOS (so a [PAD] is added), saved in bf16;
    gemma2: final logits soft-capped at 1 (strong enough to matter on random weights), saved in bf16;
    cohere (logit_scale 0.5), granite (logits_scaling 4); llama_scaled: a Llama whose config carries a logit_scale
    its forward ignores."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("families")
    tok = char_tokenizer(CHARS)
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, vocab_size=len(tok))  # fmt: skip
    builds = {
        "llama": (LlamaForCausalLM, LlamaConfig(**small, **ids, attention_dropout=0.5), torch.float32),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**{**small, "vocab_size": len(tok) + 30}, **ids), torch.bfloat16),
        "gemma2": (
            Gemma2ForCausalLM,
            Gemma2Config(**small, **ids, head_dim=8, final_logit_softcapping=1.0),
            torch.bfloat16,
        ),  # fmt: skip
        "cohere": (CohereForCausalLM, CohereConfig(**small, **ids, logit_scale=0.5), torch.float32),
        "granite": (GraniteForCausalLM, GraniteConfig(**small, **ids, logits_scaling=4.0), torch.float32),
        "llama_scaled": (LlamaForCausalLM, LlamaConfig(**small, **ids, logit_scale=2.0), torch.float32),
    }
    paths = {"gpt2": tiny["policy"], "rm": tiny["rm"]}
    for name, (cls, config, dtype) in builds.items():
        paths[name] = str(root / name)
        cls(config).to(dtype).save_pretrained(paths[name])
        tok.save_pretrained(paths[name])
    GenerationConfig(
        repetition_penalty=5.0, top_k=3, do_sample=True, eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids(".")]
    ).save_pretrained(paths["llama"])
    # Qwen2.5-like tokenizer: pad is EOS, so the scripts add their own [PAD]
    qwen_tok = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="<eos>", pad_token="<eos>")
    qwen_tok.save_pretrained(paths["qwen2"])
    return paths


def load(path, **kwargs):
    args = ppo_llm.Args(model=path, max_new_tokens=4, **kwargs)
    return args, ppo_llm.load_models(args, torch.device("cpu"))


MATRIX = [("gpt2", "no"), ("llama", "no"), ("qwen2", "no"), ("gemma2", "no"), ("qwen2", "bf16"), ("gemma2", "bf16")]


@pytest.mark.parametrize("family, precision", MATRIX + [("cohere", "no"), ("granite", "no")])
def test_logprobs_are_the_models_own(families, family, precision):
    # At the sampled tokens, the scripts' log-probs equal log_softmax(model(...).logits / T) of the model's own forward.
    # Tolerance: 1e-5 in fp32; under bf16 autocast 0.05 nats (theirs runs the head's matmul in bf16, ours in fp32:
    # bf16 keeps 8 bits of mantissa, so logits of size ~1 differ by ~0.01).
    args, (tokenizer, policy, *_) = load(families[family], temperature=0.7)
    eos_ids = policy.generation_config.eos_token_id
    assert all(p.dtype == torch.float32 for p in policy.parameters())  # fp32 master weights, bf16 on disk or not
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    torch.manual_seed(0)
    enc = tokenizer(["1+2=", "33+4=", "5="], padding=True, return_tensors="pt")
    width = enc.input_ids.shape[1]
    with torch.no_grad(), autocast:
        responses = policy.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask)[:, width:]
        responses, mask, _ = ppo_llm.truncate_after_eos(responses, eos_ids, tokenizer.pad_token_id)
        qr = torch.cat([enc.input_ids, responses], 1)
        am = torch.cat([enc.attention_mask, mask.long()], 1)
        hidden = ppo_llm.hidden_states(policy, qr, am, width)
        ours, _ = ppo_llm.lm_head_logprobs(hidden, policy, responses, args.temperature, fp32=args.cast_lm_head_to_fp32)
        logits = policy(input_ids=qr, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0)).logits
        theirs = torch.log_softmax(logits[:, width - 1 : -1].float() / 0.7, -1).gather(-1, responses[..., None])[..., 0]
    tolerance = 0.05 if precision == "bf16" else 1e-5
    assert (ours - theirs).abs()[mask].max() < tolerance


def test_a_logit_change_the_scripts_do_not_reproduce_is_refused(families):
    # LlamaForCausalLM ignores a logit_scale in its config, which the scripts would apply: they must notice
    with pytest.raises(SystemExit, match="its forward changes the logits in a way this script does not reproduce"):
        load(families["llama_scaled"])


def test_sampling_ignores_the_checkpoints_generation_config(families):
    # the Llama checkpoint asks for repetition_penalty 5 and top_k 3: the scripts sample from softmax(logits / T)
    # alone, so every processed score equals the raw logit / T; its two EOS ids both end a response
    args, (tokenizer, policy, *_) = load(families["llama"], temperature=0.7)
    eos_ids = policy.generation_config.eos_token_id
    assert eos_ids == sorted([tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(".")])
    enc = tokenizer(["1+2=", "33+4="], padding=True, return_tensors="pt")
    out = policy.generate(**enc, output_scores=True, output_logits=True, return_dict_in_generate=True)
    for scores, logits in zip(out.scores, out.logits):
        torch.testing.assert_close(scores, logits / 0.7)
    for module in policy.modules():  # attention_dropout 0.5 in the config: zeroed before the model was built
        assert getattr(module, "attention_dropout", 0.0) == 0.0


def test_embeddings_grow_but_never_shrink(families):
    # 128 rows for 98 tokens and the added [PAD]: the spare rows stay (the policy samples them)
    _, (tokenizer, policy, *_) = load(families["qwen2"])
    assert tokenizer.pad_token == "[PAD]" and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert len(tokenizer) < 128 and policy.get_input_embeddings().num_embeddings == 128


def run(main, tmp_path, **kwargs):
    run_dir = main(type(kwargs.pop("args"))(output_dir=str(tmp_path), eval_every=0, sample_every=0, **kwargs))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return run_dir, [json.loads(line) for line in f]


@pytest.mark.parametrize("family, precision", MATRIX)
def test_one_update_of_each_script_with_exact_first_ratio_and_kl(families, tmp_path, family, precision):
    # PPO: one epoch of one minibatch, so every ratio is taken before the optimizer step: exactly 1, and the
    # reference (an fp32 copy scored in the same shapes) gives KL exactly 0. GRPO: beta > 0, KL exactly 0.
    # The tiny GPT-2 reward model scores (its vocabulary is the test tokenizer's: the scripts re-encode if not).
    common = dict(model=families[family], total_steps=1, micro_batch_size=4, max_new_tokens=4,
                  mixed_precision=precision, reward_model=families["rm"])  # fmt: skip
    run_dir, (m,) = run(ppo_llm.main, tmp_path / "ppo", args=ppo_llm.Args(), num_mini_batches=1, num_ppo_epochs=1,
                        prompts_per_update=8, learning_rate=1e-3, **common)  # fmt: skip
    assert m["val/ratio"] == 1.0 and m["policy/approxkl_avg"] == 0.0 and m["objective/kl"] == 0.0
    before = AutoModelForCausalLM.from_pretrained(families[family], dtype=torch.float32).state_dict()
    after = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "policy")).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the update ran
    grpo = dict(prompts_per_update=2, num_generations=4, beta=0.1)
    _, (m,) = run(grpo_llm.main, tmp_path / "grpo", args=grpo_llm.Args(), **grpo, **common)
    assert m["kl"] == 0.0 and m["importance_ratio/mean"] == 1.0 and m["grad_norm"] > 0


@pytest.mark.parametrize("critic", ["head", "separate"])
def test_accumulated_gradient_is_the_minibatch_gradient(tiny, critic):
    # Responses of 1, 1, 8 and 8 real tokens: micro-batches of 1, 2 and 4 must give the same gradient of policy,
    # critic and value head (policy, value and entropy terms), since each loss is a token mean over the minibatch.
    torch.manual_seed(0)
    policy = ppo_llm.load_model(AutoModelForCausalLM, tiny["policy"], "--model")
    critic_model = ppo_llm.load_model(AutoModel, tiny["policy"], "--model") if critic == "separate" else None
    value_head = torch.nn.Linear(32, 1)
    B, Q, R = 4, 3, 8
    qr = torch.randint(3, 90, (B, Q + R))
    mask = torch.zeros(B, R)
    mask[0, :1] = mask[1, :1] = mask[2:] = 1
    am = torch.cat([torch.ones(B, Q), mask], 1).long()
    rollout = dict(query_responses=qr, attention_mask=am, responses=qr[:, Q:], mask=mask, prompt_width=Q,
                   old_logprobs=-torch.rand(B, R), values=torch.randn(B, R), advantages=torch.randn(B, R),
                   returns=torch.randn(B, R))  # fmt: skip
    params = [p for m in [policy, critic_model, value_head] if m is not None for p in m.parameters()]
    grads = {}
    for micro_batch_size in [1, 2, 4]:
        args = types.SimpleNamespace(micro_batch_size=micro_batch_size, temperature=1.0, cast_lm_head_to_fp32=True,
                                     cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, ent_coef=0.01,
                                     critic=critic)  # fmt: skip
        micro_batches = torch.arange(B).split(micro_batch_size)
        ppo_llm.accumulate_gradients(policy, critic_model, value_head, rollout, micro_batches, args, nullcontext())
        grads[micro_batch_size] = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
    for micro_batch_size in [1, 2]:
        for a, b in zip(grads[micro_batch_size], grads[4]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_value_head_runs_in_fp32_under_autocast(tiny):
    # training_forward's values under bf16 autocast: the head's matmul in fp32 on the trunk's hidden states, not in
    # bf16 as autocast would run an nn.Linear (a random head, so that the values are not all 0)
    torch.manual_seed(0)
    policy = ppo_llm.load_model(AutoModelForCausalLM, tiny["policy"], "--model")
    value_head, B, Q, R = torch.nn.Linear(32, 1), 2, 3, 4
    qr = torch.randint(3, 90, (B, Q + R))
    r = dict(query_responses=qr, attention_mask=torch.ones_like(qr), responses=qr[:, Q:], prompt_width=Q)
    args = types.SimpleNamespace(temperature=1.0, cast_lm_head_to_fp32=True, ent_coef=0.0, critic="head")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.no_grad(), autocast:
        _, _, values = ppo_llm.training_forward(policy, None, value_head, r, torch.arange(B), args)
        hidden = ppo_llm.hidden_states(policy, qr, r["attention_mask"], Q)  # (B, R, H): what the head reads
        in_bf16 = value_head(hidden).squeeze(-1)  # the same head, left to autocast
    assert values.dtype == torch.float32 and values.shape == (B, R) and in_bf16.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(values, value_head(hidden.float()).squeeze(-1))


def test_gradient_checkpointing_reaches_the_separate_critic(tiny, tmp_path, monkeypatch):
    seen, real = [], ppo_llm.hidden_states

    def spy(model, *args):
        if torch.is_grad_enabled():
            seen.append((type(model).__name__, model.training, model.is_gradient_checkpointing))
        return real(model, *args)

    monkeypatch.setattr(ppo_llm, "hidden_states", spy)
    run(ppo_llm.main, tmp_path, args=ppo_llm.Args(), model=tiny["policy"], total_steps=1, prompts_per_update=4,
        micro_batch_size=2, max_new_tokens=3, critic="separate", gradient_checkpointing=True)  # fmt: skip
    assert ("GPT2Model", True, True) in seen and ("GPT2LMHeadModel", True, True) in seen


def test_auto_precision_is_bf16_only_on_a_gpu_that_runs_it_natively(monkeypatch):
    # a T4 or V100 emulates bf16 (slowly, without flash attention): --mixed-precision auto stays fp32 there; asked for
    # by name, bf16 runs anyway
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for native, expected in [(True, True), (False, False)]:
        monkeypatch.setattr(
            torch.cuda, "is_bf16_supported", lambda including_emulation=True: native or including_emulation
        )
        assert ppo_llm.uses_bf16(ppo_llm.Args()) is expected
        assert ppo_llm.uses_bf16(ppo_llm.Args(mixed_precision="bf16")) is True
        assert ppo_llm.uses_bf16(ppo_llm.Args(cuda=False)) is False


def test_gradient_checkpointing_is_non_reentrant(tiny):
    # named, not left to the installed transformers' default: reentrant checkpointing can leave a frozen base's LoRA
    # adapters without a gradient
    policy = ppo_llm.load_model(AutoModelForCausalLM, tiny["policy"], "--model")
    ppo_llm.prepare(ppo_llm.Args(gradient_checkpointing=True, learning_rate=1e-4), [policy])
    functions = [m._gradient_checkpointing_func for m in policy.modules() if hasattr(m, "_gradient_checkpointing_func")]
    assert functions and all(f.keywords == {"use_reentrant": False} for f in functions)

"""--vllm: the engine in the training process samples what the trainer trains on, its weights pushed before every
rollout. These tests run in the vLLM venv (README: pip install -r requirements-vllm.txt); without vLLM the ones that
need it are skipped, with one reason."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tarfile
import types

import pytest
import torch
from conftest import char_tokenizer, untimed_metrics
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config

import grpo_llm
import ppo_llm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed: its venv (README) runs these tests"
)
TOL = 1e-5  # fp32 on a CPU: vLLM's kernels against the trainer's forward


def in_subprocess(check, *args):
    """check(*args), a function of this file, in a process of its own: the engine initialises torch.distributed (one
    gloo rank) in its process, which a later test's models would then be sharded by."""
    code = f"import sys; sys.path[:0] = ['tests', '.']; import test_vllm; test_vllm.{check}(*{args!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def served_model(path, tie=True, n_head=2):
    """A tiny GPT-2 whose head size vLLM's CPU attention serves (64 / 2 = 32; 4 heads: 16, not served)."""
    torch.manual_seed(0)
    tok = char_tokenizer([chr(c) for c in range(32, 127)])
    config = GPT2Config(
        vocab_size=len(tok), n_positions=32, n_embd=64, n_layer=2, n_head=n_head, tie_word_embeddings=tie,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
    )  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(20)))
    return {
        "tied": served_model(root / "tied"),
        "untied": served_model(root / "untied", tie=False),
        "jsonl": str(prompts),
    }


def settings(script, served, tmp_path, **kwargs):
    ppo = script is ppo_llm
    shape = dict(prompts_per_update=8, num_mini_batches=2) if ppo else dict(prompts_per_update=2, num_generations=4)
    return script.Args(**dict(model=served["tied"], dataset=served["jsonl"], total_steps=3, micro_batch_size=4,
                              max_new_tokens=6, eval_every=0, sample_every=0, output_dir=str(tmp_path), vllm=True)
                       | shape | kwargs)  # fmt: skip


# row 0: four policy tokens, logprobs - vllm_logprobs = 0, 1, 5, -1; row 1: two policy tokens (0.5, 0.2), then a
# tool's token (mask 0: the trainer's -3 against the engine's 0, which no sum may read) and a pad
LOGPROBS = torch.tensor([[-0.5, -1.0, 0.0, -2.0], [-1.0, -1.0, -3.0, 0.0]])
VLLM_LOGPROBS = torch.tensor([[-0.5, -2.0, -5.0, -1.0], [-1.5, -1.2, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        # per token w = exp(diff): row 0 exp(0) = 1, exp(1) = 2.718282, exp(5) = 148.4, exp(-1) = 0.367879; row 1
        # exp(0.5) = 1.648721, exp(0.2) = 1.221403, and exp(0) = 1 where the mask is 0; truncate: min(w, C = 3)
        ("token_truncate", [[1.0, 2.718282, 3.0, 0.367879], [1.648721, 1.221403, 1.0, 1.0]]),
        ("token_mask", [[1.0, 2.718282, 0.0, 0.367879], [1.648721, 1.221403, 1.0, 1.0]]),  # 148.4 > 3: 0
        # per row w = exp(sum of the diffs over the mask): row 0 exp(0 + 1 + 5 - 1) = exp(5) = 148.4 (3, or 0); row 1
        # exp(0.5 + 0.2) = exp(0.7) = 2.013753 (< 3, kept by both), where the tool's -3 would give exp(-2.3) = 0.1
        ("sequence_truncate", [[3.0], [2.013753]]),
        ("sequence_mask", [[0.0], [2.013753]]),
    ],
)
def test_the_importance_weights_of_each_mode_by_hand(mode, expected):
    args = grpo_llm.Args(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=3.0)
    for script in [ppo_llm, grpo_llm]:
        weights = script.importance_weights(LOGPROBS, VLLM_LOGPROBS, MASK, args)
        torch.testing.assert_close(weights, torch.tensor(expected), atol=1e-6, rtol=0)
    for script in [ppo_llm, grpo_llm]:  # the vLLM learning results were measured with token_truncate, C = 3
        assert (script.Args().vllm_importance_sampling_mode, script.Args().vllm_importance_sampling_clip_max) == (
            "token_truncate",
            3.0,
        )


def fake_policy(config):
    """What start_vllm reads before it imports vLLM: a config, a device and a dtype."""
    return types.SimpleNamespace(config=config, device=torch.device("cpu"), dtype=torch.float32)


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
def test_a_kv_cache_that_holds_no_whole_sequence_is_refused_in_one_line_before_vllm_loads(script, monkeypatch):
    # one token's keys and values: 2 x layers x KV heads x head size x 4 bytes (fp32). Qwen2.5-0.5B's shape, 24 layers,
    # 2 KV heads of 64: 2 x 24 x 2 x 64 x 4 = 24,576 bytes, x 32,768 tokens = 805,306,368 = 0.75 GiB > 0.25 GiB.
    # GPT-2's config names no KV heads (its 2 attention heads are), head size 64 / 2 = 32: 2 x 24 x 2 x 32 x 4 = 12,288
    # bytes a token; 0.25 GiB = 268,435,456 bytes holds 268,435,456 / 12,288 = 21,845.3 tokens: 21,845, not 21,846
    monkeypatch.setitem(sys.modules, "vllm", None)  # past the check, the engine's import fails here: no engine
    qwen = Qwen2Config(num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, hidden_size=896)
    gpt2 = GPT2Config(n_layer=24, n_head=2, n_embd=64)
    args = script.Args(max_new_tokens=8, vllm_kv_cache_gb=0.25, cuda=False)
    why = "error: --vllm: {} tokens (the longest prompt, --max-new-tokens) need more KV cache than 0.25 GiB: lower "
    for config, prompt_length in [(qwen, 32760), (gpt2, 21838)]:
        with pytest.raises(SystemExit) as refusal:
            script.start_vllm(args, fake_policy(config), prompt_length)
        assert str(refusal.value) == why.format(prompt_length + 8) + "--max-prompt-length or raise --vllm-kv-cache-gb"
    with pytest.raises(ImportError):  # 21,837 + 8 = 21,845 tokens fit: on to vLLM
        script.start_vllm(args, fake_policy(gpt2), 21837)


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
def test_the_engine_is_sized_to_the_longest_prompt_loaded_and_refuses_before_the_run_directory(
    script, tiny, tmp_path, monkeypatch
):
    # the training prompts are "a+a=" for a = 0 ... 19, "19+19=" the longest: 6 tokens of the character tokenizer (no
    # BOS); the held-out split adds "123+456=", 8; --max-prompt-length 7 cuts that to 7
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: real("torch") if name == "vllm" else real(name, *a)
    )
    seen = []

    def start_vllm(args, policy, *prompt_length):
        seen.append(prompt_length)
        raise SystemExit("error: --vllm: refused by the test")

    monkeypatch.setattr(script, "start_vllm", start_vllm)
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(json.dumps({"prompt": "123+456=", "answer": "579"}) + "\n")
    shape = dict(num_mini_batches=2) if script is ppo_llm else dict(num_generations=4)
    flags = dict(model=tiny["policy"], dataset=tiny["jsonl"], prompts_per_update=8, vllm=True, **shape)
    for options, longest in [({}, 6), (dict(eval_split=str(held_out)), 8), (dict(eval_split=str(held_out)), 7)]:
        options |= dict(max_prompt_length=7) if longest == 7 else {}
        with pytest.raises(SystemExit, match="refused by the test"):
            script.main(script.Args(**flags, **options, output_dir=str(tmp_path / "runs")))
        assert seen[-1] == (longest,)
    assert not (tmp_path / "runs").exists()


class Engine:
    """vLLM's LLM as vllm_pushed uses it: the pushes (their tensors' names), sleeps and wake-ups, in order."""

    def __init__(self):
        self.calls, self.asleep, self.llm_engine = [], set(), self

    def is_sleeping(self):
        return bool(self.asleep)

    def collective_rpc(self, method, kwargs):
        self.calls.append(("push", len([name for name, _ in kwargs["weights_iterator"]])))

    def reset_prefix_cache(self):
        self.calls.append(("reset",))

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags):
        self.calls.append(("wake_up", *tags))
        self.asleep -= set(tags)


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
def test_the_weights_are_pushed_once_per_optimizer_step_and_a_gpu_engine_sleeps_as_trls(script, tiny, monkeypatch):
    # an evaluation of 4 batches pushes the weights once (not 4 times), an optimizer step makes them old; on a GPU the
    # engine sleeps at level 2 after each rollout (weights and KV cache freed) and wakes as TRL's colocate mode does:
    # the weights, the push into them, then the KV cache
    args = script.Args(model=tiny["policy"], cuda=False)
    policy = script.load_models(args, torch.device("cpu"))[1]
    params, optimizer = script.prepare(args, [policy])
    engine, tensors = Engine(), len(policy.state_dict())
    monkeypatch.setattr(script, "VLLM", [engine])
    monkeypatch.setattr(script, "PUSHED", [])
    for _ in range(4):
        with script.vllm_pushed(policy):
            pass
    assert engine.calls == [("push", tensors), ("reset",)]
    for p in params:
        p.grad = torch.zeros_like(p)
    script.optimizer_step(optimizer, params, 1.0)
    with script.vllm_pushed(policy):
        pass
    assert engine.calls == [("push", tensors), ("reset",)] * 2
    engine.calls.clear()
    monkeypatch.setattr(type(policy), "device", property(lambda self: torch.device("cuda")))
    for _ in range(2):
        with script.vllm_pushed(policy):
            assert not engine.is_sleeping()
    # the first holds the weights pushed above, no step since; its sleep frees them, and the second pushes them again
    push = [("push", tensors), ("reset",)]
    assert engine.calls == [("sleep", 2), ("wake_up", "weights"), *push, ("wake_up", "kv_cache"), ("sleep", 2)]


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
def test_refusals_before_anything_loads(script, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(SystemExit, match="^error: --vllm needs vLLM: its venv is in the README$"):
        script.check_args(script.Args(vllm=True), 1)

    def installed(name, *args):  # as if vLLM were installed, whether it is or not
        return real("torch") if name == "vllm" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", installed)
    with pytest.raises(SystemExit, match="^error: --vllm does not run --eval-only yet"):
        script.check_args(script.Args(vllm=True, eval_only=True), 1)


@pytest.mark.parametrize("num_iterations, scoring_passes", [(1, 0), (2, 4)])
def test_grpo_at_mu_1_under_vllm_runs_no_policy_forward_between_the_rollout_and_the_update(
    num_iterations, scoring_passes, tiny, tmp_path, monkeypatch
):
    # the engine faked (Engine), its samples generate()'s; a policy forward without a gradient is a scoring pass. At
    # mu = 1 there is none: the importance weights come from the training forward's log-probs, detached; at mu = 2 the
    # old log-probs need one, per micro-batch: 2 updates x 2 micro-batches of 4 = 4
    script, real, forwards = grpo_llm, importlib.util.find_spec, []
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: real("torch") if name == "vllm" else real(name, *a)
    )
    monkeypatch.setattr(script, "VLLM", [])
    monkeypatch.setattr(script, "start_vllm", lambda *args: script.VLLM.append(Engine()))
    generate_turn, policy_forward = script.generate_turn, script.policy_forward

    def sampled(policy, context, room, stop, args, sampling):  # generate()'s tokens, the engine's log-probs 0
        return generate_turn(policy, context, room, stop, script.Args(**vars(args) | {"vllm": False}), sampling)

    def counted(*args):
        forwards.append(torch.is_grad_enabled())
        return policy_forward(*args)

    monkeypatch.setattr(script, "generate_turn", sampled)
    monkeypatch.setattr(script, "policy_forward", counted)
    flags = dict(model=tiny["policy"], dataset=tiny["jsonl"], prompts_per_update=2, num_generations=4, total_steps=2)
    flags |= dict(micro_batch_size=4, max_new_tokens=4, eval_every=0, sample_every=0, output_dir=str(tmp_path))
    run_dir = script.main(script.Args(vllm=True, num_iterations=num_iterations, **flags))
    assert forwards.count(False) == scoring_passes and forwards.count(True) == 2 * 2 * num_iterations
    assert all("vllm/logprob_diff_max" in m for m in untimed_metrics(run_dir))


def gpt1_model(path):
    """A tiny GPT-1 (OpenAIGPTLMHeadModel, which transformers loads and vLLM 0.32 does not), head size 64 / 2 = 32."""
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel

    torch.manual_seed(0)
    tok = char_tokenizer([chr(c) for c in range(32, 127)])
    config = OpenAIGPTConfig(vocab_size=len(tok), n_positions=32, n_embd=64, n_layer=2, n_head=2,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    OpenAIGPTLMHeadModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@needs_vllm
@pytest.mark.parametrize("case", ["head size", "architecture"])
def test_a_model_the_engine_cannot_serve_is_one_line_and_no_run_directory(case, tmp_path):
    if case == "head size":
        model, why = served_model(tmp_path / "four_heads", n_head=4), "has head size 16, which"  # 64 / 4 = 16
    else:
        model, why = gpt1_model(tmp_path / "gpt1"), "vLLM cannot load --model"
    command = [sys.executable, "grpo_llm.py", "--vllm", "--model", model, "--output-dir", str(tmp_path / "runs")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last.startswith("error: --vllm:") and why in last, last
    assert "a GPU's does" in last if case == "head size" else "OpenAIGPTLMHeadModel" in last
    assert not (tmp_path / "runs").exists()


def engine_logprobs(script, policy, tokenizer, args, prompts, push=True, **sampling):
    """A rollout through the engine (pushed first or not) and the trainer's log-probs of its tokens."""
    if push:
        batch = script.rollout(policy, tokenizer, prompts, args, torch.autocast("cpu", enabled=False), **sampling)
    else:  # the engine as it is: a stale one after an optimizer step
        context = script.tokenize_texts(tokenizer, prompts, args.max_prompt_length)
        new, _, logprobs = script.generate_turn(policy, context, args.max_new_tokens, None, args, sampling)
        new, mask, ended = script.truncate_after_eos(new, [tokenizer.eos_token_id], 0)
        batch = script.padded_batch(context, new, mask, mask.sum(1), ended=ended, vllm_logprobs=logprobs * mask)
    with torch.no_grad():
        logprobs = script.policy_forward(policy, batch, torch.arange(len(prompts)), args)[1]
    return ((logprobs - batch["vllm_logprobs"]).abs() * batch["mask"]).max().item()


@needs_vllm
@pytest.mark.parametrize("head", ["tied", "untied"])
def test_the_engine_matches_the_trainer_after_each_push_and_a_stale_one_does_not(head, served, tmp_path):
    in_subprocess("engine_matches_the_trainer", head, served, str(tmp_path))


def engine_matches_the_trainer(head, served, tmp_path):
    script = grpo_llm
    args = settings(script, served, tmp_path, model=served[head], temperature=0.7, max_new_tokens=8)
    tokenizer, policy, _, _ = script.load_models(args, torch.device("cpu"))
    params, optimizer = script.prepare(args, [policy])
    script.start_vllm(args, policy, args.max_prompt_length)
    prompts = [f"{a}+{a}=" for a in range(8)]
    assert engine_logprobs(script, policy, tokenizer, args, prompts) < TOL  # at T = 0.7: detail 4's log-probs
    batch = script.tokenize_texts(tokenizer, prompts, None)
    for _ in range(3):  # an optimizer step on the prompts' own likelihood, large enough to move every log-prob
        loss = policy(**batch, labels=batch.input_ids.masked_fill(batch.attention_mask == 0, -100)).loss
        loss.backward()
        optimizer.param_groups[0]["lr"] = 3e-2
        script.optimizer_step(optimizer, params, 1.0)
        assert engine_logprobs(script, policy, tokenizer, args, prompts, push=False) > 0.1  # stale
        assert engine_logprobs(script, policy, tokenizer, args, prompts) < TOL  # pushed


@needs_vllm
def test_a_lora_run_pushes_the_merged_weights(served, tmp_path):
    pytest.importorskip("peft")
    in_subprocess("lora_pushes_merged_weights", served, str(tmp_path))


def lora_pushes_merged_weights(served, tmp_path):
    script = ppo_llm
    args = settings(script, served, tmp_path, model=served["untied"], lora_r=4, lora_alpha=8)
    tokenizer, policy, _, _ = script.load_models(args, torch.device("cpu"))
    script.prepare(args, [policy])
    script.start_vllm(args, policy, args.max_prompt_length)
    with torch.no_grad():  # B = 0 at the start: adapters that change the function
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    base = {k: v.clone() for k, v in policy.state_dict().items()}
    prompts = [f"{a}+{a}=" for a in range(8)]
    assert engine_logprobs(script, policy, tokenizer, args, prompts) < TOL
    assert all(torch.equal(v, policy.state_dict()[k]) for k, v in base.items())  # the adapters as they were


@needs_vllm
@pytest.mark.parametrize("script", ["ppo_llm", "grpo_llm"])
def test_runs_log_the_difference_and_a_stop_in_a_rollout_resumes_as_the_same_run(script, served, tmp_path):
    in_subprocess("run", script, served, str(tmp_path / "whole"))
    (whole,) = (tmp_path / "whole").iterdir()
    metrics = untimed_metrics(whole)
    assert [m["update"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["vllm/logprob_diff_max"] < TOL and m["vllm/logprob_diff_mean"] < TOL for m in metrics)
    stopped = in_subprocess("run", script, served, str(tmp_path / "split"), 6 * 2 + 2)
    (run_dir,) = (tmp_path / "split").iterdir()
    assert [m["update"] for m in untimed_metrics(run_dir)] == [1, 2]  # 6 tokens a rollout: the third one stopped
    assert "steps: 14" in stopped.stdout  # aborted at the next step: no step after the signal's
    in_subprocess("run", script, served, str(run_dir), None, True)
    assert untimed_metrics(run_dir) == metrics  # the same run: its seeds per update, the engine's too


def run(name, served, output_dir, stop_at=None, resume=False):
    """4 updates with --vllm --gradient-checkpointing (transformers < 5.20's call), or resumed; with stop_at, SIGTERM
    at the engine's stop_at-th step of the run, as a Ctrl-C during a rollout."""
    script, steps = {"ppo_llm": ppo_llm, "grpo_llm": grpo_llm}[name], []
    start = script.start_vllm

    def counted_steps(args, policy, prompt_length):
        start(args, policy, prompt_length)
        engine = script.VLLM[0].llm_engine
        real = engine.step

        def counted():
            steps.append(1)
            if len(steps) == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)
            return real()

        engine.step = counted

    script.start_vllm = counted_steps
    args = settings(script, served, output_dir, total_steps=4, gradient_checkpointing=True)
    if resume:
        args = script.parse_args(["--resume", output_dir])
    try:
        script.main(args)
    except SystemExit as stop:
        assert stop.code == 128 + signal.SIGTERM and stop_at is not None
    print(f"steps: {len(steps)}")


@needs_vllm
def test_a_stop_before_the_engines_first_step_gives_rows_of_no_tokens(served, tmp_path):
    in_subprocess("stopped_before_the_first_step", served, str(tmp_path))


def stopped_before_the_first_step(served, tmp_path):
    # SIGTERM came before the rollout: the engine is aborted before its first step, so each row has 0 tokens, and no
    # pad token has mask 1 (the length, and the mask's sum, not --max-new-tokens 6 a row)
    script = grpo_llm
    args = settings(script, served, tmp_path)
    tokenizer, policy, _, _ = script.load_models(args, torch.device("cpu"))
    script.prepare(args, [policy])
    script.start_vllm(args, policy, args.max_prompt_length)
    script.STOP.append(signal.SIGTERM)
    prompts, autocast = ["1+1=", "22+22=", "3+3="], torch.autocast("cpu", enabled=False)
    batch = script.rollout(policy, tokenizer, prompts, args, autocast, [script.signalled])
    assert batch["lengths"].tolist() == [0, 0, 0] and batch["mask"].sum().item() == 0
    assert not batch["ended"].any()


@needs_vllm
def test_a_tool_run_through_the_engine_has_the_turns_and_masks_of_generate(tmp_path):
    in_subprocess("tool_turns_match_generate", str(tmp_path))


def tool_turns_match_generate(tmp_path):
    # the embedded calculator policy with 5 heads (head size 32, served; the same weights): greedy, most of its
    # responses call the calculator, read its result (mask 0) and answer in a second turn; vLLM's must be generate()'s
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = os.path.join(tmp_path, "calc5")
    AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "assets/calc-sft"), n_head=5).save_pretrained(model)
    AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets/calc-sft")).save_pretrained(model)
    script = grpo_llm
    dataset = os.path.join(ROOT, "assets/calc/train.jsonl")
    args = script.Args(model=model, dataset=dataset, tools=("calculator",), vllm=True, max_new_tokens=80)
    tools, _ = script.load_environment(args)
    tokenizer, policy, _, _ = script.load_models(args, torch.device("cpu"), tools)
    script.prepare(args, [policy])
    script.start_vllm(args, policy, args.max_prompt_length)
    rows = script.load_prompts(args, tokenizer, tools=tools)
    prompts = [row["prompt"] for row in rows[::97][:6]]
    batches = []
    for vllm in [True, False]:
        options = script.Args(**(vars(args) | {"vllm": vllm}))
        autocast = torch.autocast("cpu", enabled=False)
        batches.append(script.rollout(policy, tokenizer, prompts, options, autocast, None, tools, do_sample=False))
    engine, generate = batches
    assert (generate["turns"] == 2).sum() >= 3 and (generate["mask"] == 0).any()  # tool turns, a result's tokens
    for key in ["responses", "mask", "attention_mask", "turns", "tool_calls", "tool_failures", "ended"]:
        assert torch.equal(engine[key], generate[key]), key
    with torch.no_grad():  # the engine's log-prob of each of the policy's tokens in both turns (greedy: of T = 1)
        logprobs = script.policy_forward(policy, engine, torch.arange(len(prompts)), args)[1]
    assert ((logprobs - engine["vllm_logprobs"]).abs() * engine["mask"]).max() < TOL
    assert (engine["vllm_logprobs"][engine["mask"] == 0] == 0).all()  # the results' tokens: the tool's, no log-prob
    # the same episodes in an environment (--environment): its calculator method, each call's turn rewarded 1
    batches = []
    for vllm in [True, False]:
        environments = [Tally() for _ in prompts]
        for environment in environments:
            environment.reset()
        options, tools = script.Args(**(vars(args) | {"vllm": vllm})), script.environment_tools(environments[0])
        autocast = torch.autocast("cpu", enabled=False)
        batch = script.rollout(
            policy, tokenizer, prompts, options, autocast, None, tools, environments, do_sample=False
        )
        batches.append(batch)
    engine, generate = batches
    for key in ["responses", "mask", "turns", "tool_calls", "turn_rewards"]:
        assert torch.equal(engine[key], generate[key]), key
    assert engine["turn_rewards"].sum() == engine["tool_calls"].sum() > 0  # a reward on each call's turn


class Tally:
    """An environment whose tool is the calculator: each call's turn earns 1 (its turn_rewards)."""

    def reset(self, **row):
        self.turn_rewards = []

    def calculator(self, expression: str) -> str:
        """Evaluates an arithmetic expression.

        Args:
            expression: the expression, as 37*85
        """
        self.turn_rewards.append(1.0)
        return grpo_llm.calculator(expression)


on_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="2 GPUs")


@needs_vllm
@pytest.mark.parametrize("cuda", [False, pytest.param(True, marks=on_gpus)])
def test_two_torchrun_ranks_each_generate_with_their_own_engine_stop_and_resume(cuda, served, tmp_path):
    # each rank builds its engine (external_launcher) in torchrun's world and pushes the weights gathered from its FSDP
    # shards; on the CPU in fp32, on GPUs with bf16 autocast on both sides. Each rank's second reward call sends it
    # SIGTERM: both stop in update 2, and the engine's exit, not the stop, destroys the world (once)
    reward = tmp_path / "stop.py"
    reward.write_text(
        "import os, signal\ncalls = []\n\n\ndef r(completions, **columns):\n    calls.append(1)\n"
        "    if len(calls) == 2:\n        os.kill(os.getpid(), signal.SIGTERM)\n    return [0.0] * len(completions)\n"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "grpo_llm.py", "--vllm",
               "--model", served["tied"], "--dataset", served["jsonl"], "--total-steps", "3", "--prompts-per-update",
               "4", "--num-generations", "2", "--micro-batch-size", "4", "--max-new-tokens", "6", "--eval-every", "0",
               "--vllm-gpu-memory-utilization", "0.2", "--reward-fn", f"{reward}:r", "--output-dir",
               str(tmp_path / "runs")]  # fmt: skip
    command.append("--cuda" if cuda else "--no-cuda")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode != 0 and "stopped in update 2 (SIGTERM" in done.stderr, done.stderr[-3000:]
    assert "Invalid process group" not in done.stderr, done.stderr[-3000:]  # vLLM destroying a destroyed world
    (run_dir,) = (tmp_path / "runs").iterdir()
    reward.write_text("def r(completions, **columns):\n    return [0.0] * len(completions)\n")  # no more stops
    resume = command[:6] + ["--resume", str(run_dir)]  # torchrun grpo_llm.py --resume
    done = subprocess.run(resume, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = untimed_metrics(run_dir)
    assert [m["update"] for m in metrics] == [1, 2, 3]
    assert all(m["vllm/logprob_diff_max"] < (0.5 if cuda else TOL) for m in metrics)


@needs_vllm
def test_gpu_py_vllm_part_measures_both_legs_the_push_and_the_difference(tmp_path):
    # benchmarks/gpu.py's last part at toy size on the CPU (--smoke), with this venv's python as the vLLM venv's
    flags = ["--smoke", "--parts", "vllm", "--budget", "vllm=600", "--vllm-python", sys.executable, str(tmp_path)]
    done = subprocess.run([sys.executable, "benchmarks/gpu.py", *flags], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["parts"]["vllm"]["state"] == "ok", summary["parts"]["vllm"]["tail"]
    with tarfile.open(tmp_path / "results.tar.gz") as tar:
        saved = json.load(tar.extractfile("results/vllm_cpu.json"))
    generate, engine = saved["rows"]
    assert (generate["vllm"], engine["vllm"]) == (False, True) and "vllm/logprob_diff_max" not in generate
    assert all(row["s/update"] > 0 and row["time/generation"] > 0 for row in saved["rows"])
    assert engine["time/push"] > 0 and engine["vllm/logprob_diff_max"] < TOL


@needs_vllm
def test_a_teacher_grades_the_trainers_log_probs_of_the_engines_tokens(served, tmp_path):
    # --teacher under --vllm: the engine samples; the student's side of the reverse KL is the trainer's log-prob of
    # each token, not the engine's, so a student distilled from itself has exactly 0 in fp32 on the CPU
    in_subprocess("distil_from_itself", served, str(tmp_path))
    (run_dir,) = (tmp_path / "runs").iterdir()
    metrics = untimed_metrics(run_dir)
    assert [m["distill/reverse_kl"] for m in metrics] == [0.0, 0.0]


def distil_from_itself(served, tmp_path):
    args = settings(grpo_llm, served, os.path.join(tmp_path, "runs"), teacher=served["tied"], total_steps=2)
    grpo_llm.main(args)

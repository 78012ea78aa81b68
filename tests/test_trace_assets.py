"""The second embedded task, running sums with a trace: its builder (assets/make_sums_models.py), its problem files
(assets/sums/) and its SFT policy (assets/sums-sft), and one short run of each RL script on them."""

import json
import math
import os
import random
import re
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import grpo_llm
import ppo_llm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "assets")
SFT_DIR, DATA_DIR = os.path.join(ASSETS, "sums-sft"), os.path.join(ASSETS, "sums")
TRAIN, TEST = os.path.join(DATA_DIR, "train.jsonl"), os.path.join(DATA_DIR, "test.jsonl")
sys.path.insert(0, ASSETS)
import make_sums_models as msm  # noqa: E402

TINY = dict(n_embd=32, n_layer=1, n_head=2, sft_steps=3, sft_batch_size=8, train_size=40, test_size=16, log_every=100)


def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def numbers_of(question):
    assert re.fullmatch(r"\d+(\+\d+)+=", question), question
    return [int(x) for x in question[:-1].split("+")]


class Scripted:
    """A stand-in for random.Random in trace(): random() returns the scripted draws (below step_noise: a mistake),
    choice() the scripted kinds of mistake."""

    def __init__(self, draws, kinds):
        self.draws, self.kinds = list(draws), list(kinds)

    def random(self):
        return self.draws.pop(0)

    def choice(self, options):
        kind = self.kinds.pop(0)
        assert kind in options
        return kind


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("sums")
    metrics = msm.main(msm.Args(out_dir=str(out), **TINY))
    return out, metrics


# ---- the builder ----
def test_tiny_build_writes_loadable_model_and_files(tiny_build):
    out, metrics = tiny_build
    reported = {"sft_greedy_accuracy", "sft_sampled_accuracy", "sft_sampled_eos_rate", "sft_sampled_mean_length_wrong"}
    assert reported <= set(metrics)  # the build reports what assets/README.md quotes
    assert len(read_rows(out / "sums" / "train.jsonl")) == 40 and len(read_rows(out / "sums" / "test.jsonl")) == 16
    policy = AutoModelForCausalLM.from_pretrained(out / "sums-sft")
    tok = AutoTokenizer.from_pretrained(out / "sums-sft")
    assert type(policy).__name__ == "GPT2LMHeadModel" and policy.config.n_embd == 32
    # the RL scripts read the completion budget from here; it covers the longest right trace
    assert policy.generation_config.max_new_tokens == 64 >= msm.LONGEST_RIGHT_TRACE
    assert (policy.generation_config.pad_token_id, policy.generation_config.eos_token_id) == (0, 1)
    # the arithmetic task's tokenizer, file for file
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / "sums-sft" / name).read_text() == open(os.path.join(ASSETS, "arith-sft", name)).read()
    batch = tok(["3+5=8 #### 8", "1+1="], return_tensors="pt", padding=True)
    assert policy(**batch).logits.shape == (2, 12, len(tok))  # (B, T, V): "3+5=8 #### 8" is 12 characters


def test_build_is_deterministic(tiny_build, tmp_path, capsys):
    out, metrics = tiny_build
    again = msm.main(msm.Args(out_dir=str(tmp_path), **TINY))
    printed = capsys.readouterr().out  # steps k/N and the time left
    assert "sft step 1/3 " in printed and "sft step 3/3 " in printed and "ETA 00:00:00" in printed
    first = load_file(out / "sums-sft" / "model.safetensors")
    second = load_file(tmp_path / "sums-sft" / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    for name in ("train.jsonl", "test.jsonl"):
        assert (out / "sums" / name).read_bytes() == (tmp_path / "sums" / name).read_bytes()
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in metrics.items() if k != "seconds"}


def test_build_refuses_to_overwrite_without_the_flag(tiny_build, tmp_path):
    out, _ = tiny_build
    for out_dir in (ASSETS, str(out)):  # the embedded asset, or any earlier build
        with pytest.raises(SystemExit, match=r"^error: .*sums exists: pass --overwrite to replace it"):
            msm.main(msm.Args(out_dir=out_dir, **TINY))
    (tmp_path / "sums-sft").mkdir()  # either folder is enough to refuse
    with pytest.raises(SystemExit, match=r"^error: .*sums-sft exists: pass --overwrite"):
        msm.main(msm.Args(out_dir=str(tmp_path), **TINY))


@pytest.mark.parametrize(
    "change, message",
    [({"step_noise": 1.0}, r"--step-noise must be in \[0, 1\)"), ({"eval_max_new_tokens": 54}, r"shorter than")],
)
def test_bad_settings_are_one_line(tmp_path, change, message):
    with pytest.raises(SystemExit, match=rf"^error: .*{message}"):
        msm.main(msm.Args(out_dir=str(tmp_path), **(TINY | change)))


# ---- the task ----
def test_trace_hand_cases():
    assert msm.question([12, 45, 7, 33]) == "12+45+7+33="
    # 12+45 = 57, 57+7 = 64, 64+33 = 97
    assert msm.trace([12, 45, 7, 33]) == "12+45=57 57+7=64 64+33=97 #### 97"
    assert msm.trace([3, 5]) == "3+5=8 #### 8"
    # the longest right trace: 7 nines; 54 characters and the EOS
    assert len(msm.trace([9] * 7)) + 1 == msm.LONGEST_RIGHT_TRACE
    # step 2 (adding the 7) is a mistake, a repeat: the 7 is added twice, 3+5+7+7+2 = 24, one step longer
    repeat = msm.trace([3, 5, 7, 2], 0.5, Scripted([0.9, 0.1, 0.9, 0.9], ["repeat"]))
    assert repeat == "3+5=8 8+7=15 15+7=22 22+2=24 #### 24"
    # step 2 is a skip: the 7 is never added, 3+5+2 = 10, one step shorter
    skip = msm.trace([3, 5, 7, 2], 0.5, Scripted([0.9, 0.1, 0.9], ["skip"]))
    assert skip == "3+5=8 8+2=10 #### 10"


def test_noisy_demonstrations_are_well_formed():
    rng, right, shorter, longer = random.Random(0), 0, 0, 0
    for _ in range(2000):
        numbers = msm.sums_problem(rng)
        assert msm.MIN_TERMS <= len(numbers) <= msm.MAX_TERMS and all(1 <= x <= msm.MAX_NUMBER for x in numbers)
        text = msm.demonstration(numbers, 0.2, rng, 64)
        assert len(text) + 1 <= 64
        steps, final = text.split("#### ")
        total = numbers[0]
        for step in steps.split():  # each step starts from the total so far, slips included
            a, b, s = (int(x) for x in re.fullmatch(r"(\d+)\+(\d+)=(\d+)", step).groups())
            assert a == total and b in numbers
            total = s
        assert int(final) == total
        if total == sum(numbers):
            right += 1
        else:
            shorter += len(text) < len(msm.trace(numbers))
            longer += len(text) > len(msm.trace(numbers))
    # wrong demonstrations both shorter and longer than the right trace: the length effects can show
    assert shorter > 100 and longer > 100 and 0.3 < right / 2000 < 0.7


def test_reward_agrees_with_the_scripts_gsm8k_reward():
    completions = ["3+5=8 #### 8", "3+5=8 #### 9", "3+5=8", "3+5=9 9+1=10 #### 8", "#### 8 #### 7", "#### 7\n#### 8"]
    completions += ["", "####"]
    # the first number after '####' on the last line that has one, else the last number: 8, 9, 8, 8, 8, 8, none, none
    expected = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    answers = ["3+5=8 #### 8"] * len(completions)
    assert msm.sums_reward(completions, answers) == expected
    assert grpo_llm.REWARD_FNS["gsm8k"](completions, answers) == expected
    assert ppo_llm.REWARD_FNS["gsm8k"](completions, answers) == expected


# ---- the committed files ----
def test_committed_problem_files():
    train, test = read_rows(TRAIN), read_rows(TEST)
    assert (len(train), len(test)) == (msm.Args.train_size, msm.Args.test_size) == (4000, 256)
    # what the builder writes with its defaults, row for row
    assert (train, test) == msm.problem_files(msm.Args())
    for rows in (train, test):
        assert all(set(r) == {"question", "answer"} for r in rows)
        assert len({r["question"] for r in rows}) == len(rows)
        for r in rows:
            numbers = numbers_of(r["question"])
            assert r["answer"] == msm.trace(numbers) and r["answer"].endswith(f"#### {sum(numbers)}")
        # the scripts' gsm8k reward accepts each answer as right, and the answer plus one as wrong
        answers = [r["answer"] for r in rows]
        assert grpo_llm.REWARD_FNS["gsm8k"](answers, answers) == [1.0] * len(rows)
        off = [f"#### {sum(numbers_of(r['question'])) + 1}" for r in rows]
        assert grpo_llm.REWARD_FNS["gsm8k"](off, answers) == [0.0] * len(rows)
    held_out = {r["question"] for r in test}
    assert not held_out & {r["question"] for r in train}
    # nor among the SFT demonstrations (the builder's stream of seed + 1)
    stream = msm.train_problems(msm.Args.seed + 1, held_out)
    assert not held_out & {msm.question(next(stream)) for _ in range(20_000)}


def test_committed_model_config():
    config = json.load(open(os.path.join(SFT_DIR, "config.json")))
    generation = json.load(open(os.path.join(SFT_DIR, "generation_config.json")))
    assert config["model_type"] == "gpt2" and config["resid_pdrop"] == config["attn_pdrop"] == 0.0
    # the longest prompt, 7 numbers and 6 signs and '=' (14 tokens), and the whole budget fit the context
    assert generation["max_new_tokens"] == 64 and config["n_positions"] >= 14 + 64
    assert (generation["pad_token_id"], generation["eos_token_id"]) == (0, 1)
    assert os.path.getsize(os.path.join(SFT_DIR, "model.safetensors")) <= 20 * 2**20


# ---- one short run of each RL script, the general path: local files, gsm8k reward ----
def metrics_of(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def check_run(records, eval_size):
    assert [r["update"] for r in records] == [0, 1, 2]
    for r in records:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, int | float)), r
        # eval_size distinct problems, each right or wrong: the accuracy is a multiple of 1 / eval_size
        accuracy = r["eval/accuracy"] * eval_size
        assert 0 <= accuracy <= eval_size and abs(accuracy - round(accuracy)) < 1e-9


# the user's command: no --max-new-tokens, the scripts take the checkpoint's generation_config max_new_tokens (64)
COMMON = dict(
    model=SFT_DIR, dataset=TRAIN, prompt_column="question", eval_split=TEST, total_steps=2, prompts_per_update=4,
    micro_batch_size=4, eval_every=1, eval_size=8, sample_every=0,
)  # fmt: skip


def test_ppo_runs_on_the_trace_task(tmp_path):
    args = ppo_llm.Args(**COMMON, reward_fn="gsm8k", num_mini_batches=1, output_dir=str(tmp_path))
    records = metrics_of(ppo_llm.main(args))
    check_run(records, 8)
    assert {"objective/scores", "loss/policy_avg", "loss/value_avg"} <= set(records[-1])
    assert records[-1]["episode"] == 8  # 2 updates of 4 prompts
    # a right trace is at least 13 tokens ('3+5=8 #### 8' and EOS): the budget is the checkpoint's 64, not 8
    assert 8 < records[-1]["val/mean_length"] <= 64


def test_grpo_runs_on_the_trace_task(tmp_path):
    args = grpo_llm.Args(**COMMON, reward_fn=("gsm8k",), num_generations=2, output_dir=str(tmp_path))
    records = metrics_of(grpo_llm.main(args))
    check_run(records, 8)
    assert {"reward", "entropy", "completions/mean_length", "clip_ratio/region_mean"} <= set(records[-1])
    # 4 prompts x 2 completions per update, 2 updates; lengths within the checkpoint's 64-token budget, not 8
    assert records[-1]["episode"] == 16 and 8 < records[-1]["completions/max_length"] <= 64

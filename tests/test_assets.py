"""The embedded default models (assets/arith-sft, assets/arith-rm) and the script that makes them."""

import importlib.util
import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "assets")
SFT_DIR, RM_DIR = os.path.join(ASSETS, "arith-sft"), os.path.join(ASSETS, "arith-rm")

_spec = importlib.util.spec_from_file_location("make_arith_models", os.path.join(ASSETS, "make_arith_models.py"))
mam = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mam)

TINY = dict(n_embd=32, n_layer=1, n_head=2, sft_steps=3, sft_batch_size=8, rm_steps=3, rm_batch_size=8, log_every=100)


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only real tokens, so left padding does not shift them."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith")
    metrics = mam.main(mam.Args(out_dir=str(out), **TINY))
    return out, metrics


def test_tiny_build_writes_loadable_models(tiny_build):
    out, metrics = tiny_build
    reported = {"sft_greedy_accuracy", "sft_sampled_accuracy", "sft_sampled_eos_rate", "rm_pairwise_accuracy"}
    assert reported <= set(metrics)  # the build reports what assets/README.md quotes
    tok = AutoTokenizer.from_pretrained(out / "arith-sft")
    policy = AutoModelForCausalLM.from_pretrained(out / "arith-sft")
    rm = AutoModelForSequenceClassification.from_pretrained(out / "arith-rm")
    # both dirs get the same tokenizer files, with no padding state left over from the evaluation
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / "arith-sft" / name).read_text() == (out / "arith-rm" / name).read_text()
        assert (out / "arith-sft" / name).read_text() == open(os.path.join(SFT_DIR, name)).read()
    assert type(policy).__name__ == "GPT2LMHeadModel" and type(rm).__name__ == "GPT2ForSequenceClassification"
    assert policy.config.n_embd == 32 and policy.config.n_layer == 1
    assert rm.config.num_labels == 1 and rm.config.pad_token_id == tok.pad_token_id
    assert policy.generation_config.pad_token_id == 0 and policy.generation_config.eos_token_id == 1
    batch = tok(["12+3=15", "1+1=2"], return_tensors="pt", padding=True)
    assert policy(**batch).logits.shape == (2, 7, len(tok))  # (B, T, V): "12+3=15" is 7 characters
    assert rm(**batch).logits.shape == (2, 1)


def test_build_is_deterministic(tiny_build, tmp_path, capsys):
    out, metrics = tiny_build
    again = mam.main(mam.Args(out_dir=str(tmp_path), **TINY))
    printed = capsys.readouterr().out  # steps k/N and the time left
    assert "sft step 1/3 " in printed and "rm step 3/3 " in printed and "ETA 00:00:00" in printed
    for name in ("arith-sft", "arith-rm"):
        first = load_file(out / name / "model.safetensors")
        second = load_file(tmp_path / name / "model.safetensors")
        assert first.keys() == second.keys()
        assert all(torch.equal(first[k], second[k]) for k in first), name
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in metrics.items() if k != "seconds"}


def test_build_refuses_to_overwrite_without_the_flag(tiny_build):
    out, _ = tiny_build
    for out_dir in (ASSETS, str(out)):  # the embedded default, or any earlier build
        with pytest.raises(SystemExit, match=r"^error: .*arith-sft exists: pass --overwrite to replace it"):
            mam.main(mam.Args(out_dir=out_dir, **TINY))


def test_committed_tokenizers_are_the_same_files():
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert open(os.path.join(SFT_DIR, name)).read() == open(os.path.join(RM_DIR, name)).read(), name


@pytest.mark.parametrize("path", [SFT_DIR, RM_DIR])
def test_tokenizer(path):
    tok = AutoTokenizer.from_pretrained(path)
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok.pad_token_id != tok.eos_token_id and tok.bos_token == "<eos>"
    assert len(tok) == 3 + 95  # specials + printable ASCII 32..126
    # one token per character, no BOS prepended: "1" is ASCII 49, id 3 + 49 - 32 = 20
    assert tok("12+3=")["input_ids"] == [20, 21, 14, 22, 32]
    for text in ("37+485=522", "a b  c", "0+0=0"):
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([20, 21, 1, 0, 0], skip_special_tokens=True) == "12"
    tok.padding_side = "left"
    assert tok(["1+1=", "10+10="], padding=True)["input_ids"][0][:2] == [0, 0]


def test_committed_configs_and_sizes():
    for path in (SFT_DIR, RM_DIR):
        config = json.load(open(os.path.join(path, "config.json")))
        assert config["model_type"] == "gpt2"
        assert config["resid_pdrop"] == config["embd_pdrop"] == config["attn_pdrop"] == 0.0
        assert (config["pad_token_id"], config["eos_token_id"], config["bos_token_id"]) == (0, 1, 1)
        weights = os.path.join(path, "model.safetensors")
        assert os.path.getsize(weights) <= 20 * 2**20
    generation = json.load(open(os.path.join(SFT_DIR, "generation_config.json")))
    assert (generation["pad_token_id"], generation["eos_token_id"]) == (0, 1)
    policy = AutoModelForCausalLM.from_pretrained(SFT_DIR)
    rm = AutoModelForSequenceClassification.from_pretrained(RM_DIR)
    assert 1e6 <= sum(p.numel() for p in policy.parameters()) <= 5e6
    assert rm.config.num_labels == 1 and rm.score.weight.shape == (1, rm.config.n_embd)


@torch.no_grad()
def test_committed_policy_greedy_is_right_and_left_padding_is_handled():
    tok = AutoTokenizer.from_pretrained(SFT_DIR, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(SFT_DIR)
    problems = mam.arithmetic_eval_set()[:64]
    batch = tok([p["prompt"] for p in problems], return_tensors="pt", padding=True)
    assert (batch["attention_mask"] == 0).any()  # prompts of different lengths, so some are left-padded
    out = policy.generate(**batch, do_sample=False, max_new_tokens=8)
    completions = tok.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert sum(mam.arithmetic_reward(completions, [p["answer"] for p in problems])) >= 0.9 * len(problems)
    # the same prompts one at a time, unpadded, give the same completions
    for p, completion in list(zip(problems, completions))[:8]:
        single = policy.generate(**tok(p["prompt"], return_tensors="pt"), do_sample=False, max_new_tokens=8)
        assert tok.decode(single[0, len(p["prompt"]) :], skip_special_tokens=True) == completion


@torch.no_grad()
def test_committed_rm_ranks_and_pools_at_eos():
    tok = AutoTokenizer.from_pretrained(RM_DIR)
    rm = AutoModelForSequenceClassification.from_pretrained(RM_DIR)
    texts = ["12+30=42<eos>", "12+30=52<eos>", "7+8=15<eos>", "7+8=5<eos>", "45+45=90<eos>", "45+45=900<eos>"]
    right = tok(texts, return_tensors="pt", padding=True)
    scores = rm(**right).logits[:, 0]
    assert (scores[0::2] > scores[1::2]).all()  # the correct answer scores higher in each pair
    # left padding with position ids from the mask gives the same scores: pooling finds the EOS either way
    tok.padding_side = "left"
    left = tok(texts, return_tensors="pt", padding=True)
    assert (left["input_ids"][:, -1] == tok.eos_token_id).all()
    left_scores = rm(**left, position_ids=position_ids_from(left["attention_mask"])).logits[:, 0]
    torch.testing.assert_close(left_scores, scores, atol=1e-4, rtol=1e-4)
    # and the score of an unpadded sequence is the one at its last token
    alone = rm(**tok(texts[0], return_tensors="pt")).logits[0, 0]
    torch.testing.assert_close(alone, scores[0], atol=1e-4, rtol=1e-4)


def test_eval_set_is_deterministic_and_disjoint_from_training():
    eval_set = mam.arithmetic_eval_set()
    assert eval_set == mam.arithmetic_eval_set()
    assert len(eval_set) == mam.ARITH_EVAL_SIZE == len({p["prompt"] for p in eval_set})
    held_out = {p["prompt"] for p in eval_set}
    stream = mam.arithmetic_train_problems(seed=1)
    train = [next(stream) for _ in range(20_000)]
    assert not held_out & {p["prompt"] for p in train}
    for p in eval_set[:20] + train[:20]:
        a, b = (int(x) for x in p["prompt"][:-1].split("+"))
        assert 0 <= a <= mam.ARITH_MAX_OPERAND and 0 <= b <= mam.ARITH_MAX_OPERAND
        assert p["answer"] == str(a + b)
    # the stream depends on its seed only
    assert [next(mam.arithmetic_train_problems(seed=1)) for _ in range(1)] == train[:1]
    other = mam.arithmetic_train_problems(seed=2)
    assert [next(other) for _ in range(20)] != train[:20]


def test_committed_problem_files_are_the_builders_and_split_every_problem(tiny_build):
    out, _ = tiny_build
    for name in ("train.jsonl", "test.jsonl"):
        with open(os.path.join(ASSETS, "arith", name)) as committed, open(os.path.join(out, "arith", name)) as built:
            assert committed.read() == built.read(), name
    train, test = mam.problem_files()
    assert test == mam.arithmetic_eval_set()
    # 100 x 100 problems a+b=, a and b in 0..99: the 256 held out, the other 9,744 to train on, each once
    assert len(train) == 100 * 100 - 256 == 9744
    prompts = {p["prompt"] for p in train}
    assert len(prompts) == 9744 and not prompts & {p["prompt"] for p in test}
    assert train[:2] == [{"prompt": "0+0=", "answer": "0"}, {"prompt": "0+1=", "answer": "1"}]
    assert train[-1] == {"prompt": "99+99=", "answer": "198"}  # 99+99 is not held out


def test_reward_hand_cases():
    completions = ["522", " 522\n", "52", "0522", "522 522", "", "-522"]
    assert mam.arithmetic_reward(completions, ["522"] * 7) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert mam.arithmetic_reward(["0"], ["0"]) == [1.0]


def test_wrong_answers_are_wrong_and_well_formed():
    rng = random.Random(0)
    for _ in range(500):
        p = mam.arithmetic_problem(rng)
        for wrong in (mam.near_miss(p["prompt"], p["answer"], rng), mam.random_wrong(p["answer"], rng)):
            assert wrong != p["answer"] and wrong.isdigit() and str(int(wrong)) == wrong
    # hand-checked: 58+67=125; the only carries leave the ones and tens columns, so a dropped carry is 115 or 25
    dropped = {mam.near_miss("58+67=", "125", random.Random(s)) for s in range(200)}
    assert {"115", "25"} <= dropped and "125" not in dropped

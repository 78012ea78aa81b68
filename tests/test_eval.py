"""Held-out evaluation in the papers' conventions: pass@k, maj@n, greedy, and the warning on cut-off responses."""

import json
import os
import re

import pytest

import grpo_llm
import ppo_llm


@pytest.mark.parametrize("module", [ppo_llm, grpo_llm])
def test_pass_at_k_by_hand(module):
    # 1 - C(n - c, k) / C(n, k): the chance that k of the n samples, drawn without replacement, hold a right one
    assert module.pass_at_k(4, 1, 2) == 1 - 3 / 6  # C(3, 2) = 3 of the C(4, 2) = 6 pairs miss the right one: 0.5
    assert module.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3, 2) = 3, C(5, 2) = 10: 0.7
    assert module.pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70)  # C(6, 4) = 15, C(8, 4) = 70: 0.7857
    assert module.pass_at_k(10, 3, 1) == pytest.approx(0.3)  # k = 1: c / n
    assert module.pass_at_k(4, 3, 2) == 1.0  # C(1, 2) = 0: every pair holds a right one
    assert module.pass_at_k(8, 0, 8) == 0.0 and module.pass_at_k(8, 8, 1) == 1.0


def test_majority_vote_ties_go_to_the_earliest_and_no_answer_does_not_vote():
    vote = ppo_llm.majority_vote
    assert vote([3.0, 4.0, 4.0, None, 3.0]) == 3.0  # 3 and 4 twice each: 3 came first
    assert vote([4.0, None, None, None, 3.0, 3.0]) == 3.0  # three without an answer do not outvote two
    assert vote([None, 5.0]) == 5.0 and vote([None, None]) is None and vote([]) is None


def test_eval_only_greedy_gives_the_embedded_policys_quoted_accuracy(tmp_path, capsys):
    # assets/README.md quotes the SFT policy at 96.1% greedy on its 256 held-out problems; greedy samples agree
    args = ppo_llm.Args(eval_only=True, eval_temperature=0.0, eval_num_generations=2, output_dir=str(tmp_path / "r"))
    result = ppo_llm.main(args)
    assert result["eval/accuracy"] == pytest.approx(0.961, abs=result["eval/accuracy_stderr"])
    assert result["eval/pass@1"] == result["eval/pass@2"] == result["eval/maj@2"] == result["eval/accuracy"]
    out = capsys.readouterr().out
    assert "256 held-out prompts, 2 samples each, greedy:" in out and "two evaluations of one policy differ" not in out
    assert "greedy: the 2 samples of a prompt are one, so pass@k and maj@2 are pass@1" in out  # no noise to bound
    assert not os.path.exists(tmp_path / "r")


def test_pass_at_k_grows_with_k_and_maj_at_n_is_logged(tmp_path, capsys):
    args = grpo_llm.Args(eval_only=True, eval_num_generations=8, eval_size=32, output_dir=str(tmp_path))
    result = grpo_llm.main(args)
    passes = [result[f"eval/pass@{k}"] for k in (1, 2, 4, 8)]
    assert passes == sorted(passes) and passes[0] == pytest.approx(result["eval/accuracy"]) and passes[0] < passes[-1]
    assert 0 <= result["eval/maj@8"] <= 1 and "eval/pass@3" not in result
    # pass@1 is the mean over a prompt's 8 samples: 32 prompts x 8 samples, a whole number of them right
    assert result["eval/accuracy"] * 256 == pytest.approx(round(result["eval/accuracy"] * 256))
    out = capsys.readouterr().out
    assert "32 held-out prompts, 8 samples each, temperature 1:" in out and "  maj@8  " in out
    assert "(pass@1; two evaluations of one policy differ by < " in out and "greedy: " not in out


def test_right_is_a_positive_reward_and_one_sample_keeps_the_keys(tmp_path, capsys, monkeypatch):
    # a graded reward (0.5 for every completion): each sample is right, the accuracy 1; the mean reward, 0.5, beside
    # it, and one line, once, that says what right means when the scores are not all 0 or 1
    monkeypatch.setattr(ppo_llm, "TRUNCATED", [])  # this run's notes
    (tmp_path / "half.py").write_text("def half(completions, **kw):\n    return [0.5] * len(completions)\n")
    args = ppo_llm.Args(eval_only=True, eval_size=16, reward_fn=f"{tmp_path / 'half.py'}:half")
    result = ppo_llm.main(args)
    assert (
        result["eval/accuracy"] == 1.0 and result["eval/accuracy_stderr"] == 0.0 and result["eval/mean_reward"] == 0.5
    )
    keys = {"eval/accuracy", "eval/accuracy_stderr", "eval/mean_reward", "eval/clipped_ratio", "eval/mean_length_right"}
    assert set(result) == keys
    note = "note: held-out scores are not all 0 or 1: eval/accuracy counts a response right when it scores > 0"
    assert capsys.readouterr().out.count(note) == 1
    ppo_llm.warn_truncated(0.6, args, "")  # the note kept apart from the cut-off shares, which max() compares
    assert capsys.readouterr().out.startswith("warning: 60% of this update's responses hit --max-new-tokens")
    # 2 samples: pass@k, but no maj@2: a reward function of one's own has no answer that final_answer reads
    result = ppo_llm.main(ppo_llm.Args(**vars(args) | dict(eval_num_generations=2)))
    assert result["eval/pass@2"] == 1.0 and not any(key.startswith("eval/maj@") for key in result)


def test_the_warning_on_cut_off_responses_once_and_again_as_it_grows(capsys, monkeypatch):
    monkeypatch.setattr(ppo_llm, "TRUNCATED", [])  # this run's
    args = ppo_llm.Args(max_new_tokens=8)
    for share in [0.4, 0.6, 0.6, 0.5, 0.75, 0.7]:
        ppo_llm.warn_truncated(share, args, ", less --missing-eos-penalty if set")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("%")[0] for line in lines] == ["warning: 60", "warning: 75"]
    assert "hit --max-new-tokens 8, scored on their cut text, less --missing-eos-penalty if set" in lines[0]


@pytest.mark.parametrize("module, prompts", [(ppo_llm, 16), (grpo_llm, 2)])
def test_a_too_short_max_new_tokens_is_named_and_the_share_logged(module, prompts, tmp_path, capsys):
    # the embedded answers are 1 to 3 digits and an EOS: 2 tokens cut most of them off, 8 none; each run warns anew
    for i, max_new_tokens in enumerate([2, 8, 2]):
        output_dir = tmp_path / str(i)
        common = dict(total_steps=1, eval_every=0, save_every=0, prompts_per_update=prompts, micro_batch_size=8)
        module.main(module.Args(max_new_tokens=max_new_tokens, output_dir=str(output_dir), **common))
        (run_dir,) = output_dir.iterdir()
        share = json.loads((run_dir / "metrics.jsonl").read_text())["completions/clipped_ratio"]
        assert share >= 0.5 if max_new_tokens == 2 else share == 0.0
        warned = f"% of this update's responses hit --max-new-tokens {max_new_tokens}, scored on their cut text"
        assert (warned in capsys.readouterr().out) == (max_new_tokens == 2)


def test_the_standard_error_is_over_n_minus_1(tmp_path):
    # a reward right on every other sample of a batch: 4 prompts, 1 sample each, one batch of 4: right 0, 1, 0, 1;
    # mean 0.5, sample variance (4 x 0.25) / (4 - 1) = 1/3, standard error sqrt(1/3) / sqrt(4) = 0.2887 (over n: 0.25)
    (tmp_path / "alt.py").write_text(
        "def alt(completions, **kw):\n    return [i % 2 for i in range(len(completions))]\n"
    )
    args = ppo_llm.Args(eval_only=True, eval_size=4, prompts_per_update=4, reward_fn=f"{tmp_path / 'alt.py'}:alt")
    result = ppo_llm.main(args)
    assert result["eval/accuracy"] == 0.5 and result["eval/accuracy_stderr"] == pytest.approx((1 / 3) ** 0.5 / 2)


@pytest.mark.parametrize("module", [ppo_llm, grpo_llm])
def test_evaluation_cut_off_at_max_new_tokens_says_so(module, capsys):
    # --max-new-tokens 2: the embedded answers are 1 to 3 digits and an EOS, most cut off; the share in the metrics
    # and the table, and the line
    result = module.main(module.Args(eval_only=True, eval_size=16, max_new_tokens=2))
    out = capsys.readouterr().out
    assert (
        result["eval/clipped_ratio"] >= 0.5
        and f"  clipped_ratio               {result['eval/clipped_ratio']:.3f}" in out
    )
    assert f"warning: {result['eval/clipped_ratio']:.0%} of the held-out responses were cut off, scored as wrong" in out


def test_an_evaluation_asked_for_that_cannot_happen_says_so(tmp_path, capsys):
    # --eval-every with no split found beside the dataset, or with no reward function to score it (a reward model's
    # run): one line at the start naming --eval-split or the reward function, and no evaluation
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained("assets/arith-sft")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    args = ppo_llm.Args(dataset=str(tmp_path / "prompts.jsonl"))
    assert ppo_llm.eval_rows(args, tok, [lambda *a: [1.0]]) is None
    assert capsys.readouterr().out == (
        "note: no held-out evaluation (--eval-every 10): no --eval-split given or found beside --dataset\n"
    )
    assert ppo_llm.eval_rows(ppo_llm.Args(), tok, []) is None  # test.jsonl is beside, but nothing scores
    assert capsys.readouterr().out == "note: no held-out evaluation (--eval-every 10): no reward function to score it\n"
    assert ppo_llm.eval_rows(ppo_llm.Args(eval_every=0), tok, []) is None and capsys.readouterr().out == ""


def test_evaluation_needs_the_answer_column_as_training_does_and_names_its_split(tmp_path):
    # a reward function of one's own reads `target`: the split found beside train.jsonl, with no answer column, is
    # evaluated; with the built-in arithmetic, which reads it, the error names the split as what it is
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained("assets/arith-sft")
    for split in ["train", "test"]:
        rows = [{"prompt": f"{a}+{a}=", "target": str(2 * a)} for a in range(4)]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    own = ppo_llm.Args(dataset=str(tmp_path / "train.jsonl"), reward_fn="mine.py:f")
    assert len(ppo_llm.eval_rows(own, tok, [lambda *a: [1.0]])) == 4
    beside = f"--eval-split {tmp_path / 'test.jsonl'}, found beside {tmp_path / 'train.jsonl'},"
    with pytest.raises(SystemExit, match=f"^error: {beside}: row 1 has no --answer-column answer, which the reward"):
        ppo_llm.eval_rows(ppo_llm.Args(dataset=str(tmp_path / "train.jsonl")), tok, [lambda *a: [1.0]])


def test_a_reward_function_is_checked_as_it_loads(tmp_path):
    # it is called with completions=, transcripts=, prompts= and each column (environments= with --environment): one
    # that takes fewer and no **kwargs is refused in one line, before any model loads; one number instead of a list too
    (tmp_path / "fns.py").write_text(
        "def exact(completions, answer):\n    return [1.0] * len(completions)\n\n\n"
        "def full(completions, transcripts, prompts, answer):\n    return [1.0] * len(completions)\n\n\n"
        "def one(completions, **kwargs):\n    return 0.5\n"
    )
    spec = f"{tmp_path / 'fns.py'}"
    why = "got an unexpected keyword argument 'transcripts': it is called with completions=, transcripts=, prompts="
    with pytest.raises(SystemExit, match=f"^error: --reward-fn {spec}:exact: {re.escape(why)}.*give it .*kwargs$"):
        ppo_llm.load_reward_fn(f"{spec}:exact", 600)
    assert ppo_llm.load_reward_fn(f"{spec}:full", 600)(["1"], [{"columns": {"prompts": "p", "answer": "1"}}], ["1"])
    with pytest.raises(SystemExit, match="environments="):  # with an environment it is called with environments= too
        ppo_llm.load_reward_fn(f"{spec}:full", 600, environment=True)
    with pytest.raises(SystemExit, match=f"^error: --reward-fn {spec}:one returned 0.5, not a list of a number per"):
        ppo_llm.load_reward_fn(f"{spec}:one", 600)(["1"], [{"columns": {"prompts": "p"}}], ["1"])

"""The third embedded task, multiplication with a calculator tool: its builder (assets/make_calc_models.py), its problem
files (assets/calc/) and its SFT policy (assets/calc-sft), its tokenizer and its chat and response templates."""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "assets")
SFT_DIR, DATA_DIR = os.path.join(ASSETS, "calc-sft"), os.path.join(ASSETS, "calc")
sys.path.insert(0, ASSETS)
import make_calc_models as mcm  # noqa: E402

TINY = dict(n_embd=32, n_layer=1, n_head=2, sft_steps=3, sft_batch_size=8, log_every=100, eval_max_new_tokens=24)

PROMPT = "calculator:37*85\nA:"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "37*85"}}</tool_call>'
TOOL = "\nR:3145\nA:"
RESPONSE = CALL + "<eos>" + TOOL + "3145<eos>"
CALL_MESSAGE = {"name": "calculator", "arguments": {"expression": "37*85"}}


def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(SFT_DIR)


def messages(tool_use):
    """37*85 answered with the calculator, or directly."""
    conversation = [{"role": "user", "content": "37*85"}]
    if tool_use:
        conversation.append({"role": "assistant", "content": "", "tool_calls": [{"function": CALL_MESSAGE}]})
        conversation.append({"role": "tool", "name": "calculator", "content": "3145"})
    return conversation + [{"role": "assistant", "content": "3145"}]


# ---- the committed files ----
def test_committed_problem_files():
    train, test = read_rows(os.path.join(DATA_DIR, "train.jsonl")), read_rows(os.path.join(DATA_DIR, "test.jsonl"))
    # 90 x 90 operand pairs 10..99, 256 of them held out
    assert (len(train), len(test)) == (90 * 90 - 256, 256)
    assert test[0] == {"prompt": "25*50", "answer": "1250"}  # the first draw of seed 2026
    assert train[:2] == [{"prompt": "10*10", "answer": "100"}, {"prompt": "10*11", "answer": "110"}]
    assert train[-1] == {"prompt": "99*99", "answer": "9801"}
    pairs = []
    for row in train + test:
        assert set(row) == {"prompt", "answer"}
        a, b = (int(x) for x in row["prompt"].split("*"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["answer"] == str(a * b)
        pairs.append((a, b))
    assert len(set(pairs)) == 90 * 90  # every pair once: train and test are disjoint and cover them all
    assert pairs[: len(train)] == sorted(pairs[: len(train)])  # train: a, then b, ascending
    assert (train, test) == mcm.problem_files()  # what the builder writes, row for row


def test_committed_model_config(tok):
    policy = AutoModelForCausalLM.from_pretrained(SFT_DIR)
    assert type(policy).__name__ == "GPT2LMHeadModel"
    config = json.load(open(os.path.join(SFT_DIR, "config.json")))
    generation = json.load(open(os.path.join(SFT_DIR, "generation_config.json")))
    assert config["n_positions"] == 128 and config["vocab_size"] == 101 == len(tok)
    assert (config["n_layer"], config["n_embd"], config["n_head"]) == (4, 160, 4)
    assert config["resid_pdrop"] == config["embd_pdrop"] == config["attn_pdrop"] == 0.0
    assert generation["max_new_tokens"] == 96
    assert (generation["pad_token_id"], generation["eos_token_id"], generation["bos_token_id"]) == (0, 1, 1)
    assert os.path.getsize(os.path.join(SFT_DIR, "model.safetensors")) <= 20 * 2**20


# ---- the tokenizer and its templates ----
def test_tokenizer_ids(tok):
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, tok.bos_token) == (0, 1, 2, "<eos>")
    # "\n" is 98, the tool-call tags 99 and 100; "R" is ASCII 82, id 3 + 82 - 32 = 53; ":" 58 -> 29; "3" 51 -> 22
    assert tok.convert_tokens_to_ids(["\n", "<tool_call>", "</tool_call>"]) == [98, 99, 100]
    assert tok(TOOL, add_special_tokens=False)["input_ids"] == [98, 53, 29, 22, 20, 23, 24, 98, 36, 29]


def test_tokenizer_round_trips_the_tool_using_response(tok):
    ids = tok(PROMPT + RESPONSE, add_special_tokens=False)["input_ids"]
    # prompt: 10 + 1 + 5 + 1 + 2 = 19 characters; the call: tag, 60 characters of JSON, tag, EOS = 63 tokens;
    # the tool message and the next turn's start '\nR:3145\nA:' 10; the answer and its EOS 5: 19 + 63 + 10 + 5 = 97
    assert len(ids) == 97 and ids[18] == 29 and mcm.PROMPT_TOKENS == 19
    assert ids[19] == 99 and ids[80:82] == [100, 1] and ids[-5:] == [22, 20, 23, 24, 1]
    assert ids.count(99) == ids.count(100) == 1 and ids.count(98) == 3 and ids.count(1) == 2
    assert tok.decode(ids) == PROMPT + RESPONSE
    # the tags are not special: skipping special tokens drops the EOS, keeps them
    assert tok.decode(ids[19:82], skip_special_tokens=True) == CALL


def test_chat_template_renders_the_task(tok):
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "37*85"}], tools=[mcm.calculator], tokenize=False, add_generation_prompt=True
    )
    assert prompt == PROMPT
    assert tok.apply_chat_template(messages(True), tools=[mcm.calculator], tokenize=False) == PROMPT + RESPONSE
    assert tok.apply_chat_template(messages(False), tools=[mcm.calculator], tokenize=False) == PROMPT + "3145<eos>"
    # the tool message with the next turn's generation prompt
    before = tok.apply_chat_template(messages(True)[:2], tools=[mcm.calculator], tokenize=False)
    after = tok.apply_chat_template(
        messages(True)[:3], tools=[mcm.calculator], tokenize=False, add_generation_prompt=True
    )
    assert before == PROMPT + CALL + "<eos>" and after == before + TOOL


def test_response_template_parses_the_call(tok):
    calls = [{"type": "function", "function": CALL_MESSAGE}]
    assert tok.parse_response(CALL, prefix=PROMPT) == {"role": "assistant", "tool_calls": calls}  # its defaults' role
    assert tok.parse_response("3145", prefix=PROMPT + CALL + "<eos>" + TOOL) == {"role": "assistant", "content": "3145"}


def test_demonstration_loss_mask_is_the_assistants_tokens(tok):
    for row_call, trained in [(True, CALL + "<eos>3145<eos>"), (False, "3145<eos>")]:
        ids, mask = mcm.demonstration(tok, {"prompt": "37*85", "answer": "3145"}, call=row_call)
        assert tok.decode([i for i, m in zip(ids, mask) if m]) == trained
        assert tok.decode([i for i, m in zip(ids, mask) if not m]) == PROMPT + TOOL * row_call
    assert tok.decode(mcm.tool_message_ids(tok, "3145")) == TOOL


def test_calculator():
    # 37 * 85 = 2960 + 185 = 3145; (2 + 3) * -4 = -20; 7 // 2 = 3; 2 ** 10 = 1024
    assert [mcm.calculator(e) for e in ("37*85", "(2+3)*-4", "7//2", "2**10")] == ["3145", "-20", "3", "1024"]
    for bad in ("abc", "1/0", "9**999", "__import__('os')", "37*"):
        assert mcm.calculator(bad).startswith("error: ")


def test_read_turn(tok):
    context = tok(PROMPT, add_special_tokens=False)["input_ids"]
    turn = tok(CALL + "<eos>", add_special_tokens=False)["input_ids"]
    assert mcm.read_turn(tok, context, turn, True) == {"tried": True, "expression": "37*85", "content": ""}
    # cut off before its EOS, or its JSON broken, or another tool: not a call that runs
    assert mcm.read_turn(tok, context, turn[:-1], False)["expression"] is None
    for text in ('<tool_call>{"name": "calc', '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'):
        broken = tok(text + "<eos>", add_special_tokens=False)["input_ids"]
        assert mcm.read_turn(tok, context, broken, True) == {"tried": True, "expression": None, "content": ""}
    answer = tok("3145<eos>", add_special_tokens=False)["input_ids"]
    assert mcm.read_turn(tok, context, answer, True) == {"tried": False, "expression": None, "content": "3145"}


@torch.no_grad()
def test_committed_policy_writes_the_call_and_copies_the_result(tok):
    """Once the policy has opened a call, greedy decoding writes it well-formed; after the result, copies it."""
    policy = AutoModelForCausalLM.from_pretrained(SFT_DIR)
    rows = read_rows(os.path.join(DATA_DIR, "test.jsonl"))[:16]
    prompts = [mcm.render(tok, [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True) for r in rows]
    batch = tok.pad({"input_ids": [p + [99] for p in prompts]}, return_tensors="pt", padding_side="left")
    out = policy.generate(**batch, do_sample=False, max_new_tokens=70)
    calls = tok.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    expected = ['{"name": "calculator", "arguments": {"expression": "' + r["prompt"] + '"}}</tool_call>' for r in rows]
    assert sum(c == e for c, e in zip(calls, expected)) >= 15
    # each demonstration up to the tool message's '\nA:', before the answer and its EOS
    contexts = [mcm.demonstration(tok, r, call=True)[0][: -len(r["answer"]) - 1] for r in rows]
    batch = tok.pad({"input_ids": contexts}, return_tensors="pt", padding_side="left")
    out = policy.generate(**batch, do_sample=False, max_new_tokens=8)
    answers = tok.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert sum(a == r["answer"] for a, r in zip(answers, rows)) >= 15


# ---- the builder ----
def test_build_refuses_to_overwrite_without_the_flag(tmp_path):
    os.makedirs(tmp_path / "calc")
    for out_dir in (ASSETS, str(tmp_path)):  # the embedded one, or any earlier build
        with pytest.raises(SystemExit, match=r"^error: .*calc exists: pass --overwrite to replace it, or another"):
            mcm.main(mcm.Args(out_dir=out_dir, **TINY))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(call_share=1.5), "--call-share must be in"),
        (dict(short_result_share=-0.1), "--short-result-share must be in"),
        (dict(eval_max_new_tokens=110), "do not fit --n-positions 128"),  # 19 + 110 > 128
    ],
)
def test_bad_settings_are_one_line(tmp_path, change, message):
    with pytest.raises(SystemExit, match=rf"^error: .*{message}"):
        mcm.main(mcm.Args(out_dir=str(tmp_path), **(TINY | change)))


def test_tiny_build_is_deterministic_and_loadable(tmp_path, capsys):
    first = mcm.main(mcm.Args(out_dir=str(tmp_path / "a"), **TINY))
    second = mcm.main(mcm.Args(out_dir=str(tmp_path / "b"), **TINY))
    printed = capsys.readouterr().out
    assert "sft step 1/3 " in printed and "ETA 00:00:00" in printed
    weights = [load_file(tmp_path / out / "calc-sft" / "model.safetensors") for out in ("a", "b")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert {k: v for k, v in first.items() if k != "seconds"} == {k: v for k, v in second.items() if k != "seconds"}
    # the build reports what assets/README.md quotes
    for key in ("accuracy", "call_rate", "well_formed_call_rate", "accuracy_calling", "accuracy_direct"):
        assert f"sft_greedy_{key}" in first and f"sft_sampled_{key}" in first
    # the same tokenizer files as the committed ones, with no padding state left over from the evaluation
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "a" / "calc-sft" / name).read_text() == open(os.path.join(SFT_DIR, name)).read(), name
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "calc-sft")
    assert policy.config.n_positions == 128 and policy.generation_config.max_new_tokens == 24
    assert read_rows(tmp_path / "a" / "calc" / "test.jsonl") == read_rows(os.path.join(DATA_DIR, "test.jsonl"))


def test_a_parsed_turn_is_an_assistant_message_as_trl_reads_it():
    # TRL's tool loop appends the parsed turn to the conversation and reads its "role": the response template's
    # defaults give it, as every TRL template's do (without them, TRL fails at the first call: KeyError 'role')
    tok = AutoTokenizer.from_pretrained(SFT_DIR)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call><eos>'
    parsed = tok.parse_response(call, prefix="calculator:6*7\nA:")
    assert parsed["role"] == "assistant" and parsed["tool_calls"][0]["function"]["arguments"] == {"expression": "6*7"}

"""Tool use: the built-in calculator, GAE over a mask with holes, the chat template's tool messages and response
templates (our own templates in Qwen2.5's, Qwen3's and Llama 3's forms, and a compact one), and multi-turn runs of both
scripts on a tiny model whose turns a patched generate() writes."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
import transformers
from conftest import char_tokenizer, saved_update, tiny_config, untimed_metrics
from tokenizers import AddedToken
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel

import grpo_llm
import ppo_llm

COMPACT = (  # the embedded calc task's form: tools named in one line, a call and its result on the turn's line
    "{%- if tools %}{{ tools | map(attribute='function.name') | join(',') + ':' }}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{ message.content }}"
    "{%- elif message.role == 'assistant' %}{{ '\\nA:' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}{{ '<tool_call>' + call.function | tojson + '</tool_call>' }}"
    "{%- endfor %}{{ '<eos>' }}"
    "{%- elif message.role == 'tool' %}{{ '\\nR:' + message.content }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '\\nA:' }}{% endif %}"
)
QWEN25 = (  # Qwen2.5's form: ChatML turns, the tools' JSON schemas in a system turn, results in a user turn
    "{%- if tools %}<|im_start|>system\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{ '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}{{ '<|im_start|>assistant\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}{{ '<tool_call>\n' + call.function | tojson + '\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen3's: an empty think block in the last assistant turn only, so a turn renders otherwise once a tool message follows
QWEN3 = QWEN25.replace(
    "'<|im_start|>assistant\n' + (message.content or '')",
    "'<|im_start|>assistant\n' + ('<think>\n\n</think>\n\n' if loop.last else '') + (message.content or '')",
)
LLAMA3 = (  # Llama 3.1's form: the call is a bare JSON object with "parameters", the result an ipython turn
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "<|eot_id|>{% endif %}"
    "{%- for message in messages %}<|start_header_id|>{{ message.role }}<|end_header_id|>{{ message.content }}"
    "<|eot_id|>{% endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"
)
NO_TOOLS = "{% for message in messages %}{{ message.content }}{% endfor %}"  # a template that ignores tools=
NO_HEADER = QWEN25.replace("{{ '<|im_start|>assistant\n' }}", "")  # no generation prompt: no turn's start to parse at


def tool_tokenizer(template, specials=()):
    """The tests' character tokenizer with a newline, <tool_call> / </tool_call> as single (not special) tokens, a
    chat template, and the template's turn markers as special tokens."""
    tok = char_tokenizer([chr(c) for c in range(32, 127)] + ["\n"])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ["<tool_call>", "</tool_call>"]])
    tok.add_special_tokens({"additional_special_tokens": list(specials)})
    tok.chat_template = template
    return tok


CALLS = {  # a response template's <tool_call> JSON field, as the embedded calc-sft's tokenizer carries it
    "open": "<tool_call>",
    "close": "</tool_call>",
    "content": "json",
    "repeats": True,
    "transform": {"type": "function", "function": "{content}"},
}


def compact_tokenizer():
    tok = tool_tokenizer(COMPACT)
    tok.response_template = {"start_anchor": "\nA:", "fields": {"content": {}, "tool_calls": CALLS}}
    return tok


def right_padded_batch(tok, inputs, ids, masks, ended, cut_on_call, **counts):
    """padded_batch of responses given as each one's ids and mask values, right-padded as run_episodes pads them."""
    responses = torch.nn.utils.rnn.pad_sequence([torch.tensor(x) for x in ids], True, tok.pad_token_id)
    mask, lengths = (
        torch.nn.utils.rnn.pad_sequence([torch.tensor(x) for x in masks], True),
        torch.tensor(list(map(len, ids))),
    )
    outcomes = dict(ended=torch.tensor(ended), cut_on_call=torch.tensor(cut_on_call))
    return ppo_llm.padded_batch(inputs, responses, mask, lengths, **outcomes, **counts)


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


# ---- the calculator


@pytest.mark.parametrize(
    "expression, result",
    [("37*85", "3145"), ("7/2", "3.5"), (" -(2**3) + 1", "-7"), ("17 // 5 % 2", "1"), ("(1 + 2) * 3.5", "10.5")],
)
def test_calculator_evaluates_arithmetic(expression, result):
    assert ppo_llm.calculator(expression) == result  # 37 * 85 = 2960 + 185; -(8) + 1; 17 // 5 = 3, 3 % 2 = 1


@pytest.mark.parametrize(
    "expression, error",
    [
        ("9**9**9", "exponent"),  # 9**387420489: refused before it is computed, not a hang
        ("(10**101) * 2", "too large"),  # an operand past 1e100
        ("1e308 * 10 - 1", "too large"),  # inf, then an operand
        ("__import__('os').getcwd()", "not arithmetic"),  # never eval()
        ("x + 1", "not arithmetic"),
        ("True + 1", "not arithmetic"),  # a bool is no number here
        ("(-8)**0.5", "not a real number"),  # Python's complex (1.7e-16+2.83j)
        ("1e100 / 1e-300", "not a real number"),  # inf: both operands within the bound
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, error):
    started = time.perf_counter()
    with pytest.raises(ValueError, match=error):
        ppo_llm.calculator(expression)
    assert time.perf_counter() - started < 5  # not a hang (a bound far above the microseconds it takes)


# ---- GAE over a mask with holes


def test_gae_skips_a_tool_result_and_bootstraps_from_the_next_policy_token():
    # positions 0 1 2 3 4: the policy's tokens at 0, 3, 4 (a tool's result at 1, 2); gamma 0.5, lam 0.5
    rewards = torch.tensor([[1.0, 9.0, 9.0, 0.0, 2.0]])  # the tool tokens' 9s are never read
    values = torch.tensor([[0.5, 7.0, 7.0, 1.0, 3.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0]])
    advantages, returns = ppo_llm.compute_gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # t=4: delta = 2 + 0.5 * 0 - 3 = -1, A = -1
    # t=3: delta = 0 + 0.5 * 3 - 1 = 0.5, A = 0.5 + 0.25 * -1 = 0.25
    # t=0: next policy token is 3: delta = 1 + 0.5 * 1 - 0.5 = 1, A = 1 + 0.25 * 0.25 = 1.0625
    torch.testing.assert_close(advantages, torch.tensor([[1.0625, 0.0, 0.0, 0.25, -1.0]]))
    torch.testing.assert_close(returns, torch.tensor([[1.5625, 0.0, 0.0, 1.25, 2.0]]))  # A + V where mask is 1


def test_gae_without_holes_is_the_classic_recursion_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    mask = (torch.arange(7)[None] < torch.tensor([[7], [5], [1], [3]])).float()  # responses of 7, 5, 1, 3 tokens
    r, v = rewards * mask, values * mask  # the recursion as the script had it before tools
    next_values = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], 1)
    deltas, advantages, last = r + 0.9 * next_values - v, torch.zeros_like(r), torch.zeros(4)
    for t in reversed(range(7)):
        last = deltas[:, t] + 0.9 * 0.8 * last
        advantages[:, t] = last
    got_advantages, got_returns = ppo_llm.compute_gae(rewards, values, mask, 0.9, 0.8)
    assert torch.equal(got_advantages, advantages * mask) and torch.equal(got_returns, (advantages + v) * mask)


# ---- parsing calls, running tools, rendering results


def test_a_tool_message_is_rendered_as_the_chat_template_adds_it():
    tok = compact_tokenizer()
    assert tok.decode(ppo_llm.tool_result_ids(tok, [{"role": "tool", "name": "f", "content": "42"}], [1])) == (
        "\nR:42\nA:"  # after the turn's <eos>: the result, then the next assistant turn's header
    )
    qwen = tool_tokenizer(QWEN25, ["<|im_start|>", "<|im_end|>"])
    im_end = qwen.convert_tokens_to_ids("<|im_end|>")
    ids = ppo_llm.tool_result_ids(qwen, [{"role": "tool", "name": "f", "content": "42"}], [im_end])
    # Qwen2.5's '\n' after <|im_end|> comes first: the policy stopped at <|im_end|> and never sampled it
    assert (
        qwen.decode(ids)
        == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_calls_are_parsed_by_the_response_template_after_their_context():
    tok = compact_tokenizer()
    prompt = tok("calculator:6*7\nA:").input_ids
    turn = tok(CALL).input_ids + [tok.eos_token_id]
    tools = {"calculator": ppo_llm.calculator}
    (call,) = ppo_llm.parse_turn(tok, prompt + turn, len(turn), tools)["tool_calls"]
    assert call["function"] == {"name": "calculator", "arguments": {"expression": "6*7"}}
    assert ppo_llm.parse_turn(tok, prompt + tok("42").input_ids, 2, tools)["tool_calls"] == []  # an answer
    broken = tok('<tool_call>{"name": "calculator", "arguments": {</tool_call>').input_ids
    assert ppo_llm.parse_turn(tok, prompt + broken, len(broken), tools)["tool_calls"] == ["the call is not valid JSON"]


def test_every_kind_of_bad_call_is_an_error_result_and_counted():
    def number() -> int:
        """Returns a number, not a string: str()'d, as TRL does."""
        return 3

    def broken(x: str) -> str:
        """Raises.

        Args:
            x: anything
        """
        raise RuntimeError("the tool broke")

    tok = compact_tokenizer()
    tools = {"calculator": ppo_llm.calculator, "slow": slow, "number": number, "broken": broken}
    calls = [
        {"function": {"name": "calculator", "arguments": {"expression": "6*7"}}},  # the one that works
        "the call is not valid JSON",  # tool_calls_in's failed call: its reason
        {"function": {"name": "search", "arguments": {}}},  # no such tool
        {"function": {"name": "calculator", "arguments": "6*7"}},  # arguments not an object
        {"function": {"name": "calculator", "arguments": {"expr": "6*7"}}},  # a wrong argument: TypeError
        {"function": {"name": "broken", "arguments": {"x": ""}}},
        {"function": {"name": "number", "arguments": {}}},
        {"function": {"name": "slow", "arguments": {"seconds": 30}}},  # past --tool-timeout
        {"function": {"name": "calculator", "arguments": {"expression": "9**9**9"}}},
    ]
    started = time.perf_counter()
    ids, failed, _ = ppo_llm.run_tools(tok, tools, calls, 0.5, [tok.eos_token_id], 1000)
    assert time.perf_counter() - started < 10  # the 30 s sleep was cut at 0.5 s
    assert failed == 7
    text = tok.decode(ids)
    assert text.startswith("\nR:42\nR:{'error': 'ValueError: the call is not valid JSON'}\nR:")
    for why in ["no tool 'search'", "not a JSON object", "TypeError", "the tool broke", "\nR:3\nR:"]:
        assert why in text
    assert "TimedOut: tool slow ran past 0.5 s" in text and "exponent" in text and text.endswith("\nA:")


def test_tools_are_the_builtin_one_and_your_functions(tmp_path):
    path = tmp_path / "mytools.py"
    weather = 'def weather(city: str) -> str:\n    """The weather.\n\n    Args:\n        city: where\n    """\n'
    path.write_text(weather + '    return "sun"\n\n\ndef undocumented(x):\n    return x\n')
    tools, _ = ppo_llm.load_environment(ppo_llm.Args(tools=("calculator", f"{path}:weather")))
    assert list(tools) == ["calculator", "weather"] and tools["weather"]("Oslo") == "sun"
    tok = compact_tokenizer()
    with pytest.raises(SystemExit, match="error: --tools: .*: a tool is a function with type hints and an Args: doc"):
        undocumented, _ = ppo_llm.load_environment(ppo_llm.Args(tools=(f"{path}:undocumented",)))
        ppo_llm.setup_tool_parsing(tok, undocumented, [tok.eos_token_id], "m")
    with pytest.raises(SystemExit, match=r"error: --tools search: not one of \['calculator'\]"):
        ppo_llm.load_environment(ppo_llm.Args(tools=("search",)))


@pytest.mark.parametrize(
    "template, specials, eos, error",
    [
        (None, (), "<eos>", "does not render tools: give a --model that does"),
        (NO_TOOLS, (), "<eos>", "does not render tools"),
        (
            LLAMA3,
            ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
            "<|eot_id|>",
            "writes calls in a format not read here",
        ),
        (QWEN3, ("<|im_start|>", "<|im_end|>"), "<|im_end|>", "renders a turn otherwise once a tool message follows"),
        (NO_HEADER, ("<|im_start|>", "<|im_end|>"), "<|im_end|>", "adds no assistant header to anchor calls at"),
    ],
)
def test_a_chat_template_that_cannot_carry_tools_is_refused_in_one_line(template, specials, eos, error):
    tok = tool_tokenizer(template, specials)
    tools = {"calculator": ppo_llm.calculator}
    with pytest.raises(SystemExit, match=error):
        ppo_llm.setup_tool_parsing(tok, tools, tok.convert_tokens_to_ids([eos]), "m")


def test_a_tool_call_template_gets_hermes_response_template_anchored_at_the_assistant_header():
    tok = tool_tokenizer(QWEN25, ["<|im_start|>", "<|im_end|>"])
    tools = {"calculator": ppo_llm.calculator}
    ppo_llm.setup_tool_parsing(tok, tools, tok.convert_tokens_to_ids(["<|im_end|>"]), "m")
    assert tok.response_template["start_anchor"] == "<|im_start|>assistant\n"
    prompt = tok.apply_chat_template([{"role": "user", "content": "6*7"}], tokenize=False, add_generation_prompt=True)
    turn = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call><|im_end|>'
    ids, turn_ids = tok(prompt).input_ids, tok(turn).input_ids
    (call,) = ppo_llm.parse_turn(tok, ids + turn_ids, len(turn_ids), tools)["tool_calls"]
    assert call["function"]["arguments"] == {"expression": "6*7"}


def test_the_reward_reads_the_last_turn_and_a_response_ending_on_a_tool_result_scores_0():
    tok = compact_tokenizer()
    eos = tok.eos_token_id
    call, result, answer = tok(CALL).input_ids + [eos], tok("\nR:42\nA:").input_ids, tok("42").input_ids + [eos]
    responses = [call + result + answer, call + result, tok("42").input_ids + [eos]]  # the 2nd: cut off after it
    masks = [[1.0] * len(call) + [0.0] * len(result) + [1.0] * len(answer), [1.0] * len(call) + [0.0] * len(result)]
    masks.append([1.0] * 3)
    inputs = tok(["6*7", "6*7", "6*7"], return_tensors="pt")
    tool_turn = [{"role": "assistant", "content": "", "tool_calls": []}, {"role": "tool", "name": "f", "content": "42"}]
    messages = [tool_turn + [{"role": "assistant", "content": "42"}], tool_turn, []]  # as run_episodes records them
    batch = right_padded_batch(tok, inputs, responses, masks, [True, False, True], [False, False, False])
    batch["messages"] = messages
    completions, transcripts, _ = ppo_llm.decode_responses(tok, batch)
    assert completions == ["42", "", "42"]  # the tool's 42 is never the policy's answer
    assert transcripts[0] == CALL + "[tool: 42]42" and transcripts[1] == CALL + "[tool: 42]"  # the result's text
    rows = [{"answer": "42"}] * 3
    assert ppo_llm.load_reward_fn("arithmetic", 600)(completions, rows, transcripts) == [1.0, 0.0, 1.0]
    assert batch["attention_mask"][1, 3:].sum() == len(call + result) and batch["mask"][1].sum() == len(call)


# ---- multi-turn runs: a tiny policy whose turns a patched generate() writes

SCRIPT = {  # prompt -> its turns, each after the tool results so far; the answers are the products
    "6*7": [CALL, "42"],  # a call, then the answer it read: right
    "5*5": ["24"],  # a direct answer: wrong
    "2*3": ['<tool_call>{"name": "calculator", "arguments": {</tool_call>', "6"],  # malformed: a failed call, then 6
    "9*9": [CALL.replace("6*7", "9*9"), CALL.replace("6*7", "9*9")],  # a 2nd call, past --max-tool-calls 1: cut off
}


@pytest.fixture(scope="module")
def calc(tmp_path_factory):
    """A tiny random GPT-2 with the compact tool template, and the 4 scripted problems as train and test files."""
    root = tmp_path_factory.mktemp("calc")
    tok = compact_tokenizer()
    torch.manual_seed(0)
    config = tiny_config(tok)
    config.n_positions = 180  # the prompts' 17 tokens and --max-new-tokens 160 fit, no more
    GPT2LMHeadModel(config).save_pretrained(root / "policy")
    tok.save_pretrained(root / "policy")
    rows = "".join(json.dumps({"prompt": p, "answer": str(eval(p))}) + "\n" for p in SCRIPT)
    (root / "train.jsonl").write_text(rows)
    (root / "test.jsonl").write_text(rows)
    return {"policy": str(root / "policy"), "train": str(root / "train.jsonl")}


def scripted(monkeypatch, sample=False, script=SCRIPT):
    """Every generate() afterwards writes each row's next turn of `script` (then EOS), read from its context; with
    sample, after the real generate() has run (its FSDP gathers and synced_gpus' all-reduces, if any, with it)."""
    real = transformers.GenerationMixin.generate

    def generate(self, input_ids=None, attention_mask=None, max_new_tokens=None, **kwargs):
        if sample:
            real(self, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, **kwargs)
        tok = AutoTokenizer.from_pretrained(os.environ["SCRIPTED_TOKENIZER"])
        turns = []
        for ids in input_ids.tolist():
            context = tok.decode(ids, skip_special_tokens=True)
            problem, written = context.split(":")[1].split("\n")[0], context.rsplit("\nA:", 1)[1]  # the turn so far
            turn = tok(script[problem][context.count("\nR:")][len(written) :]).input_ids + [tok.eos_token_id]
            turns.append(turn[:max_new_tokens])
        width = max(len(turn) for turn in turns)
        new = torch.tensor([turn + [tok.pad_token_id] * (width - len(turn)) for turn in turns])
        return torch.cat([input_ids, new.to(input_ids.device)], 1)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", generate)


def tool_run(script, calc, tmp_path, monkeypatch, **kwargs):
    """main() on the scripted problems, each turn after the real generate() has run on the same context and room:
    the model's positions would overflow if a turn's room were not the longest response's."""
    monkeypatch.setenv("SCRIPTED_TOKENIZER", calc["policy"])
    scripted(monkeypatch, sample=True)
    defaults = dict(
        model=calc["policy"], dataset=calc["train"], tools=("calculator",), max_tool_calls=1, total_steps=2,
        prompts_per_update=4, micro_batch_size=2, max_new_tokens=160, eval_every=2, sample_every=1,
        num_samples=4, learning_rate=0.0, output_dir=str(tmp_path),
    )  # fmt: skip
    return script.main(script.Args(**(defaults | kwargs)))


def test_ppo_with_tools_trains_on_the_policys_tokens_and_its_first_ratio_is_exactly_one(calc, tmp_path, monkeypatch):
    seen, real = [], ppo_llm.compute_gae
    monkeypatch.setattr(ppo_llm, "compute_gae", lambda r, v, m, *a: seen.append((r, m)) or real(r, v, m, *a))
    run_dir = tool_run(ppo_llm, calc, tmp_path, monkeypatch, num_mini_batches=2, kl_coef=0.1)
    for rewards, mask in seen:  # lr 0, so KL 0: a right answer's 1 alone, on its last policy token, after a hole
        rows = [i for i in range(len(mask)) if mask[i].sum() < mask[i].nonzero().max() + 1 and rewards[i].any()]
        assert len(rows) == 2  # 6*7's and 2*3's: a hole (the tool's result), then their right answer
        for i in rows:
            assert rewards[i].nonzero().item() == mask[i].nonzero().max().item() and rewards[i].sum() == 1.0
    metrics = untimed_metrics(run_dir)
    for m in metrics[1:]:
        # lr 0: the training forward reproduces the rollout's log-probs over the tool's tokens too
        assert m["val/ratio"] == 1.0 and m["policy/approxkl_avg"] == 0.0 and m["objective/kl"] == 0.0
        # calls: 6*7's, 2*3's malformed one, 9*9's first (its second is past --max-tool-calls, never run): 3 of 4
        # responses' calls, 1 failed; turns 2 + 1 + 2 + 2; 6*7 and 2*3 right; 9*9 cut off, so 3 ended in EOS
        assert m["tools/call_frequency"] == 0.75 and m["tools/failure_frequency"] == pytest.approx(1 / 3)
        assert m["tools/mean_turns"] == 1.75 and m["objective/accuracy"] == 0.5 and m["val/num_eos_tokens"] == 3
    for m in metrics[0], metrics[2]:  # evaluation runs the same loop
        assert m["eval/accuracy"] == 0.5 and m["eval/tools/call_frequency"] == 0.75
    samples = [json.loads(line) for line in open(os.path.join(run_dir, "samples.jsonl"))]
    (six,) = [s for s in samples if s["update"] == 1 and s["prompt"].startswith("calculator:6*7")]
    assert six["completion"] == CALL + "[tool: 42]42"  # the tool's result (its content) marked as the tool's


def test_grpo_with_tools_passes_the_whole_responses_to_reward_functions(calc, tmp_path, monkeypatch):
    path = tmp_path / "mine.py"
    path.write_text(
        'def used_tool(completions, transcripts, **columns):\n    return [float("[tool:" in t) for t in transcripts]\n'
    )
    reward_fns = ("arithmetic", f"{path}:used_tool")
    run_dir = tool_run(grpo_llm, calc, tmp_path, monkeypatch, num_generations=2, num_iterations=2, reward_fn=reward_fns)
    for m in untimed_metrics(run_dir)[1:]:
        assert m["importance_ratio/mean"] == 1.0  # the old log-probs recomputed: exactly the current ones at lr 0
        assert m["tools/call_frequency"] == 0.75 and m["tools/cut_off_ratio"] == 0.25  # 9*9 cut off on its call
        assert m["completions/clipped_ratio"] == 0.0  # TRL's: every response ends in an EOS, 9*9's on its call
        # 6*7 and 2*3 right; a tool's result in 6*7's, 2*3's (an error) and 9*9's (its first call's)
        assert m["rewards/arithmetic/mean"] == 0.5 and m["rewards/used_tool/mean"] == 0.75


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
@pytest.mark.parametrize("spare", [0, -1])
def test_a_result_that_fills_or_overflows_the_room_cuts_the_response_off(calc, tmp_path, monkeypatch, script, spare):
    # --max-new-tokens: 6*7's call and its result (\nR:42\nA:) fit exactly (spare 0: appended, then no room for an
    # answer, so the response ends on the tool's result), or do not (-1: not appended, it ends after the call); either
    # way it is cut off (not ended), with no answer of its own: reward 0
    tok = AutoTokenizer.from_pretrained(calc["policy"])
    call, result = len(tok(CALL).input_ids) + 1, len(tok("\nR:42\nA:").input_ids)
    kwargs = dict(max_new_tokens=call + result + spare, dataset=calc["train"], eval_every=0, total_steps=1)
    if script is grpo_llm:
        kwargs |= dict(num_generations=2)
    run_dir = tool_run(script, calc, tmp_path, monkeypatch, **kwargs)
    samples = [json.loads(line) for line in open(os.path.join(run_dir, "samples.jsonl"))]
    (six,) = [s for s in samples if s["prompt"].startswith("calculator:6*7")]
    assert six["completion"] == CALL + ("[tool: 42]" if spare == 0 else "")
    assert six.get("score", six.get("reward")) == 0.0


WRAPPER = """import os, runpy, sys
import pytest
sys.path[:0] = [{tests!r}, {root!r}]
import test_tools
test_tools.scripted(pytest.MonkeyPatch(), sample=True)
script = sys.argv.pop(1)
sys.argv[0] = script
runpy.run_path(os.path.join({root!r}, script), run_name="__main__")
"""


@pytest.mark.e2e
def test_two_ranks_taking_different_numbers_of_turns_finish_and_resume(calc, tmp_path, monkeypatch):
    # one prompt a rank an update, 4 prompts a pass: 5*5 (one turn) sits on one rank while the other takes two, in
    # each pass; no collective inside the tool loop (the policy gathered once, generate() neither FSDP's registered
    # method nor synced_gpus), so neither waits for the other. One process resumes the run
    tests = os.path.dirname(os.path.abspath(__file__))
    wrapper = tmp_path / "scripted.py"
    wrapper.write_text(WRAPPER.format(tests=tests, root=os.path.dirname(tests)))
    flags = ["--model", calc["policy"], "--dataset", calc["train"], "--tools", "calculator", "--max-tool-calls", "1"]
    flags += ["--prompts-per-update", "2", "--num-mini-batches", "1", "--max-new-tokens", "160", "--eval-every", "2"]
    torchrun = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node", "2"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "SCRIPTED_TOKENIZER": calc["policy"]}
    done = subprocess.run([*torchrun, str(wrapper), "ppo_llm.py", *flags, "--total-steps", "2", "--output-dir",
                           str(tmp_path / "runs")], env=env, timeout=300, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    monkeypatch.setenv("SCRIPTED_TOKENIZER", calc["policy"])
    scripted(monkeypatch)
    assert ppo_llm.main(ppo_llm.parse_args(["--resume", str(run_dir), "--total-steps", "3"])) == str(run_dir)
    metrics = untimed_metrics(run_dir)
    assert [m["update"] for m in metrics] == [0, 1, 2, 3]
    for m in metrics[1:]:  # 4 prompts over 2 updates: each pass has every call and turn of the script
        assert m["tools/call_frequency"] in (0.5, 1.0) and "eval/accuracy" in metrics[2]
    assert sum(m["tools/mean_turns"] for m in metrics[1:3]) == 1.75 * 2  # the pass: 2 + 1 + 2 + 2 turns over 4


def test_a_stop_during_a_tool_call_is_no_failure():
    # SIGTERM while a tool sleeps: the call ends at once, as a stop (STOP records it), not as the tool's failure
    tok = compact_tokenizer()
    call = {"function": {"name": "slow", "arguments": {"seconds": 30}}}
    timer = threading.Timer(0.5, os.kill, [os.getpid(), signal.SIGTERM])
    started = time.perf_counter()
    timer.start()
    try:
        ids, failed, _ = ppo_llm.run_tools(tok, {"slow": slow}, [call, call], 60, [tok.eos_token_id], 1000)
        assert ppo_llm.STOP == [signal.SIGTERM]
    finally:
        timer.cancel()
        ppo_llm.STOP.clear()
    # no result reaches the policy (None: the response is cut off there), and the second call never runs
    assert failed == 0 and ids is None and time.perf_counter() - started < 10


def test_a_turn_longer_than_its_room_goes_on_in_the_next_generate(calc, monkeypatch):
    # after the first turn 6*7's response is shorter than 2*3's (a call and its result, against a malformed call and
    # the longer error): the second turn's room is the longest's, 2 tokens, so 6*7's answer, 42 and its EOS, takes two
    # generate() calls; the turn is parsed whole, and no row runs past the model's 180 positions
    monkeypatch.setenv("SCRIPTED_TOKENIZER", calc["policy"])
    scripted(monkeypatch, sample=True)
    calls, real = [], transformers.GenerationMixin.generate
    monkeypatch.setattr(transformers.GenerationMixin, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    tok = AutoTokenizer.from_pretrained(calc["policy"], padding_side="left")
    tools = {"calculator": ppo_llm.calculator}
    first = [tok(SCRIPT[p][0]).input_ids + [tok.eos_token_id] for p in ["6*7", "2*3"]]
    parsed = [ppo_llm.parse_turn(tok, ids, len(ids), tools)["tool_calls"] for ids in first]
    results = [ppo_llm.run_tools(tok, tools, c, 1, [1], 10_000)[0] for c in parsed]
    longest = max(len(ids) + len(result) for ids, result in zip(first, results))  # 2*3's
    policy = AutoModelForCausalLM.from_pretrained(calc["policy"])
    policy.generation_config.update(do_sample=True, eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    args = ppo_llm.Args(max_new_tokens=longest + 2, max_tool_calls=1, tool_timeout=10.0)
    prompts = [f"calculator:{p}\nA:" for p in ["6*7", "2*3"]]
    batch = ppo_llm.rollout(policy, tok, prompts, args, contextlib.nullcontext(), None, tools)
    completions, _, _ = ppo_llm.decode_responses(tok, batch)
    assert completions == ["42", "6"] and batch["ended"].tolist() == [True, True] and len(calls) == 3
    assert batch["tool_calls"].tolist() == [1, 1] and batch["tool_failures"].tolist() == [0, 1]


# ---- a call cut off, the reward model's text, the metrics' meanings


def call_batch(tok, prompts, responses, ended, cut_on_call):
    """padded_batch of compact-template responses, each a list of (text, the policy's or not) parts ("<eos>" at a
    part's end: the EOS id), with rollout's counts (a call and a turn each)."""
    ids, masks = [[] for _ in responses], [[] for _ in responses]
    for i, parts in enumerate(responses):
        for text, own in parts:
            part = tok(text.removesuffix("<eos>")).input_ids
            if text.endswith("<eos>"):
                part.append(tok.eos_token_id)
            ids[i], masks[i] = ids[i] + part, masks[i] + [float(own)] * len(part)
    inputs = tok(prompts, padding=True, return_tensors="pt")
    return right_padded_batch(
        tok, inputs, ids, masks, ended, cut_on_call, tool_calls=torch.ones(len(prompts), dtype=torch.long)
    )


def test_a_response_cut_off_on_its_call_has_no_answer_and_abstains_from_the_vote():
    # two samples cut off on their call of 1*3145 (past --max-tool-calls, or its result would not fit) and one that
    # answers 7: the call's last operand, 3145, is no answer of theirs. Scored "" (gsm8k's reward: 0, not 1), they
    # abstain, and maj@3 is 7 (it was 3145, two votes to one)
    tok = compact_tokenizer()
    cut = [(CALL.replace("6*7", "1*3145") + "<eos>", True)]
    batch = call_batch(tok, ["q"] * 3, [cut, cut, [("7<eos>", True)]], [False, False, True], [True, True, False])
    completions, transcripts, _ = ppo_llm.decode_responses(tok, batch)
    assert completions == ["", "", "7"] and "1*3145" in transcripts[0]
    rows = [{"answer": "#### 3145"}] * 3
    assert ppo_llm.load_reward_fn("gsm8k", 600)(completions, rows, transcripts) == [0.0, 0.0, 0.0]
    assert ppo_llm.majority_vote([ppo_llm.final_answer(c) for c in completions]) == 7.0


def test_a_reward_model_reads_the_whole_conversation_whatever_its_tokenizer(calc, monkeypatch):
    # a tool run and a direct answer with the same last turn, 42, from the rollout itself: one with its own tokenizer
    # reads TRL's messages through its chat template, the assistant's with its call parsed (content "", the call in
    # tool_calls), then the tool's with its result alone, 42 (not the template's wrapper, \nR:42\nA:), then the
    # answer; one with the policy's reads the ids, which hold them all
    monkeypatch.setenv("SCRIPTED_TOKENIZER", calc["policy"])
    monkeypatch.setitem(SCRIPT, "7*6", ["42"])
    scripted(monkeypatch)
    tok, rm_tok = AutoTokenizer.from_pretrained(calc["policy"], padding_side="left"), tool_tokenizer(QWEN25)
    policy = AutoModelForCausalLM.from_pretrained(calc["policy"])
    policy.generation_config.update(eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    args = ppo_llm.Args(max_new_tokens=160, max_tool_calls=1)
    prompts = ["calculator:6*7\nA:", "calculator:7*6\nA:"]
    batch = ppo_llm.rollout(
        policy, tok, prompts, args, contextlib.nullcontext(), None, {"calculator": ppo_llm.calculator}
    )
    completions, _, conversations = ppo_llm.decode_responses(tok, batch)
    assert completions == ["42", "42"]
    row = {"prompt": "6*7", "messages": None}
    tool_text, direct_text = [ppo_llm.rm_text(rm_tok, row, turns) for turns in conversations]
    assert direct_text == "<|im_start|>user\n6*7<|im_end|>\n<|im_start|>assistant\n42<|im_end|>\n"
    call = '{"name": "calculator", "arguments": {"expression": "6*7"}}'
    assert tool_text == (
        f"<|im_start|>user\n6*7<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{call}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n42<|im_end|>\n"
    )
    assert ppo_llm.rm_text(char_tokenizer(["x"]), row, conversations[0]) == "6*7" + call + "4242"  # no template
    real = batch["attention_mask"][:, batch["prompt_width"] :].sum(1)  # the policy's ids: the tool's tokens too
    assert real.tolist() == [len(tok(CALL).input_ids) + 1 + 8 + 3, 3]


def test_the_metrics_under_trls_names_mean_trls():
    # one batch: a call (60 tokens and EOS: 61), its result "\nR:42\nA:" (8) and the answer 42<eos> (3); and a call cut
    # off on it (61). TRL's completions/*_length count the policy's tokens: 61 + 3 = 64 and 61, mean 62.5; ours,
    # tools/mean_length, every token: (72 + 61) / 2 = 66.5. TRL's clipped_ratio counts no EOS at the end: 0 (the cut
    # off call ends in its EOS; TRL counts it terminated); tools/cut_off_ratio: 1 of 2
    tok = compact_tokenizer()
    tool_run = [(CALL + "<eos>", True), ("\nR:42\nA:", False), ("42<eos>", True)]
    batch = call_batch(tok, ["6*7", "6*7"], [tool_run, [(CALL + "<eos>", True)]], [True, False], [False, True])
    assert batch["lengths"].tolist() == [72, 61] and batch["mask"].sum(1).tolist() == [64.0, 61.0]
    batch |= {"rewards": torch.zeros(2), "scores": torch.zeros(2, 1), "zero_std": torch.ones(2, dtype=torch.bool)}
    args = grpo_llm.Args(num_generations=2, prompts_per_update=1, tools=("calculator",))
    optimizer, clock = types.SimpleNamespace(param_groups=[{"lr": 0.0}]), types.SimpleNamespace()
    clock.metrics = lambda update, tokens: ({"perf/tokens": tokens}, "")
    m, _ = grpo_llm.grpo_metrics(1, args, batch, ["arithmetic"], [], [], [], optimizer, clock)
    assert (m["completions/mean_length"], m["completions/min_length"], m["completions/max_length"]) == (62.5, 61, 64)
    assert m["completions/clipped_ratio"] == 0.0 and m["tools/cut_off_ratio"] == 0.5
    assert m["tools/mean_length"] == 66.5 and m["perf/tokens"] == 133 and m["tools/mean_turns"] == 1.0


# ---- hostile results, stops and cut-off responses in evaluation

REFUSING = COMPACT.replace(  # a template that raises on one result, as a template's own checks can
    "{%- elif message.role == 'tool' %}",
    "{%- elif message.role == 'tool' %}"
    "{% if message.content == 'REFUSED' %}{{ raise_exception('refused') }}{% endif %}",
)


def test_a_result_not_utf8_or_refused_by_the_template_or_too_long_for_the_room(monkeypatch):
    # a subprocess's bytes that are not UTF-8 (os.fsdecode: lone surrogates) are rendered with ? for them; a result the
    # template refuses is a failed call the policy reads; a 5 M-character result for a room of 10 tokens is no result
    # (None: the response is cut off), never tokenised
    def latin1() -> str:
        """Bytes that are not UTF-8, as os.fsdecode decodes them."""
        return os.fsdecode(b"caf\xe9")

    def refused() -> str:
        """A result the template refuses."""
        return "REFUSED"

    def huge() -> str:
        """Five million characters."""
        return "9" * 5_000_000

    tok = tool_tokenizer(REFUSING)
    tools = {"calculator": ppo_llm.calculator, "latin1": latin1, "refused": refused, "huge": huge}
    calls = [{"function": {"name": name, "arguments": {}}} for name in ["latin1", "refused"]]
    calls.append({"function": {"name": "calculator", "arguments": {"expression": "6*7"}}})
    ids, failed, _ = ppo_llm.run_tools(tok, tools, calls, 10, [tok.eos_token_id], 1000)
    assert failed == 1 and tok.decode(ids) == "\nR:caf?\nR:{'error': 'TemplateError: refused'}\nR:42\nA:"
    rendered, real = [], ppo_llm.tool_result_ids
    monkeypatch.setattr(
        ppo_llm, "tool_result_ids", lambda tok, messages, eos: rendered.append(1) or real(tok, messages, eos)
    )
    huge_call = {"function": {"name": "huge", "arguments": {}}}
    assert ppo_llm.run_tools(tok, tools, [huge_call], 10, [tok.eos_token_id], 10)[:2] == (None, 0) and rendered == []
    # 5 M > 10 tokens x 11 characters (<tool_call>, the longest token); one that fits in 99 tokens is kept
    assert ppo_llm.run_tools(tok, tools, calls[2:], 10, [tok.eos_token_id], 99)[0] == tok("\nR:42\nA:").input_ids


NOT_UTF8 = '''import os


def calculator(expression: str) -> str:
    """The calculator, its result after a byte that is not UTF-8 (as a subprocess's output, os.fsdecode'd); 9*9's
    result is one that the chat template refuses.

    Args:
        expression: the expression
    """
    if expression == "9*9":
        return "REFUSED"
    return os.fsdecode(b"\\xff") + str(eval(expression))
'''


@pytest.mark.parametrize("processes", [1, 2])
def test_a_run_whose_tool_returns_bytes_that_are_not_utf8_goes_on(calc, tmp_path, processes):
    # the scripted problems with a calculator whose results start with a lone surrogate, and a chat template that
    # refuses 9*9's result: the run finishes, in one process and under torchrun; the policy read ? in place of the
    # surrogate, and the refused result is a failed call (2*3's malformed call and 9*9's of the 3 calls)
    tests = os.path.dirname(os.path.abspath(__file__))
    (tmp_path / "mytools.py").write_text(NOT_UTF8)
    tok = AutoTokenizer.from_pretrained(calc["policy"])
    tok.chat_template = REFUSING
    tok.save_pretrained(tmp_path / "policy")
    AutoModelForCausalLM.from_pretrained(calc["policy"]).save_pretrained(tmp_path / "policy")
    calc = calc | {"policy": str(tmp_path / "policy")}
    wrapper = tmp_path / "scripted.py"
    wrapper.write_text(WRAPPER.format(tests=tests, root=os.path.dirname(tests)))
    flags = ["--model", calc["policy"], "--dataset", calc["train"], "--tools", f"{tmp_path / 'mytools.py'}:calculator"]
    flags += [
        "--max-tool-calls",
        "1",
        "--prompts-per-update",
        "4",
        "--num-mini-batches",
        "1",
        "--max-new-tokens",
        "160",
    ]
    flags += ["--eval-every", "0", "--sample-every", "1", "--num-samples", "4", "--total-steps", "1"]
    launch = [sys.executable]
    if processes == 2:
        launch = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node", "2"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "SCRIPTED_TOKENIZER": calc["policy"]}
    done = subprocess.run([*launch, str(wrapper), "ppo_llm.py", *flags, "--output-dir", str(tmp_path / "runs")],
                          env=env, timeout=300, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    samples = [json.loads(line) for line in open(run_dir / "samples.jsonl")]
    completions = "".join(s["completion"] for s in samples)  # under torchrun rank 0's prompts alone
    if processes == 1:
        assert CALL + "[tool: ?42]42" in completions and "{'error': 'TemplateError: refused'}" in completions
    (metrics,) = untimed_metrics(run_dir)
    assert metrics["tools/failure_frequency"] == pytest.approx(2 / 3)


SIGNALLING = '''import os, signal

calls = []


def calculator(expression: str) -> str:
    """The calculator; its {call}-th call on rank 0 is sent {signal}.

    Args:
        expression: the expression
    """
    calls.append(1)
    if len(calls) == {call} and os.environ.get("RANK", "0") == "0":
        os.kill(os.getpid(), signal.{signal})  # a Ctrl-C or a scheduler's SIGTERM while the tool runs
    return str(eval(expression))
'''


@pytest.mark.parametrize("call, update", [(1, 0), (7, 1)])
def test_a_stop_in_evaluation_ends_it_after_the_batch_and_logs_no_evaluation(calc, tmp_path, monkeypatch, capsys,
                                                                             call, update):  # fmt: skip
    # SIGTERM in a tool call of the first evaluation (call 1), or of update 1's (calls 1-4: update 0's two batches
    # of 4 samples, each with 6*7's and 9*9's calls; 5-6: update 1's rollout; 7: update 1's evaluation): the
    # evaluation ends after its first batch, and none of it is logged; update 1's row is logged without eval/*
    (tmp_path / "mytools.py").write_text(SIGNALLING.format(call=call, signal="SIGTERM"))
    rollouts, real = [], ppo_llm.rollout
    monkeypatch.setattr(ppo_llm, "rollout", lambda *a, **k: rollouts.append(a[2]) or real(*a, **k))
    tool = f"{tmp_path / 'mytools.py'}:calculator"
    with pytest.raises(SystemExit) as stop:
        tool_run(ppo_llm, calc, tmp_path / "runs", monkeypatch, tools=(tool,), eval_every=1, eval_num_generations=2,
                 total_steps=3, num_mini_batches=1)  # fmt: skip
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert stop.value.code == 128 + signal.SIGTERM
    assert f"stopped in update {update + 1 if update else 0} (SIGTERM)" in capsys.readouterr().err
    # update 0: its evaluation's first batch; update 1: update 0's 2 batches, update 1's rollout, its evaluation's first
    # batch, and update 2's rollout, ended at its first token by the stop
    assert len(rollouts) == [1, 5][update]
    assert saved_update(run_dir) == update
    metrics = untimed_metrics(run_dir) if update else []  # update 0: not even a metrics.jsonl
    assert not (run_dir / "metrics.jsonl").exists() or [m["update"] for m in metrics] == list(range(update + 1))
    assert not any(key.startswith("eval/") for m in metrics[1:] for key in m)  # update 1's row, not its evaluation
    if update:
        monkeypatch.setattr(ppo_llm, "rollout", real)
        (tmp_path / "mytools.py").write_text(SIGNALLING.format(call=0, signal="SIGTERM"))  # no signal this time
        ppo_llm.main(ppo_llm.parse_args(["--resume", str(run_dir)]))
        metrics = untimed_metrics(run_dir)
        assert [m["update"] for m in metrics] == [0, 1, 2, 3] and "eval/accuracy" not in metrics[1]
        assert all("eval/accuracy" in m for m in metrics[2:])  # update 1 is never evaluated after the resume


@pytest.mark.parametrize("processes", [1, 2])
def test_a_stop_in_eval_only_ends_at_once_with_one_line_and_128_plus_the_signal(calc, tmp_path, processes):
    # SIGINT (Ctrl-C) in rank 0's first tool call of --eval-only, 4 prompts x 2 samples in batches of 4 (2 a rank):
    # every rank ends after its first batch with 130, rank 0 printing one line and no table (rank 1 had no signal)
    tests = os.path.dirname(os.path.abspath(__file__))
    (tmp_path / "mytools.py").write_text(SIGNALLING.format(call=1, signal="SIGINT"))
    wrapper = tmp_path / "scripted.py"
    wrapper.write_text(WRAPPER.format(tests=tests, root=os.path.dirname(tests)))
    flags = ["--model", calc["policy"], "--dataset", calc["train"], "--tools", f"{tmp_path / 'mytools.py'}:calculator"]
    flags += ["--eval-only", "--eval-num-generations", "2", "--prompts-per-update", "4", "--num-mini-batches", "1"]
    flags += ["--max-new-tokens", "160"]
    launch = [sys.executable]
    if processes == 2:
        launch = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node", "2"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "SCRIPTED_TOKENIZER": calc["policy"]}
    done = subprocess.run([*launch, str(wrapper), "ppo_llm.py", *flags], env=env, timeout=300, capture_output=True,
                          text=True)  # fmt: skip
    out = done.stdout + done.stderr
    assert "held-out" not in out and out.count("stopped (SIGINT) during the evaluation: no accuracy to print") == 1, out
    if processes == 1:
        assert done.returncode == 128 + signal.SIGINT
    else:  # torchrun's report: each rank's exit code
        assert done.returncode != 0 and out.count("exitcode  : 130") == 2, out[-3000:]


def test_evaluation_gives_the_share_cut_off_and_the_share_cut_off_at_a_call(calc, tmp_path, monkeypatch, capsys):
    # --max-tool-calls 0: every call cuts its response off, 6*7's, 2*3's malformed one and 9*9's; 5*5 answers: 3 of
    # 4 cut off, all at a call, and the line on cut-off responses; --max-tool-calls 1: only 9*9's second call. Each
    # ends in an EOS (its call's), so none counts in clipped_ratio (TRL's: no EOS at the end), as in training's
    result = tool_run(ppo_llm, calc, tmp_path, monkeypatch, eval_only=True, max_tool_calls=0)
    assert result["eval/clipped_ratio"] == 0.0 and result["eval/tools/cut_off_ratio"] == 0.75
    assert result["eval/tools/call_frequency"] == 0.0  # none ran
    out = capsys.readouterr().out
    assert "warning: 75% of the held-out responses were cut off" in out and "  clipped_ratio  " in out
    result = tool_run(ppo_llm, calc, tmp_path, monkeypatch, eval_only=True)
    assert result["eval/clipped_ratio"] == 0.0 and result["eval/tools/cut_off_ratio"] == 0.25
    assert "warning" not in capsys.readouterr().out

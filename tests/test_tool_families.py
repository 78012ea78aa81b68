"""Tool use on the model families TRL ships chat templates of (trl/chat_templates/*.jinja, TRL 1.16): each tool-capable
template is either right through the scripts' path or refused in one line. A family's tokenizer here is the tests'
character tokenizer with the template, its special tokens (added as a checkpoint's tokenizer lists them, special but
not named) and its checkpoint's end ids; a scripted policy writes the turns, as the template renders them."""

import glob
import os
import re
import sys
import types

import pytest
import torch
import trl  # noqa: I001  requirements-dev.txt pins the release whose templates these tests read: missing, they fail
from conftest import char_tokenizer, tiny_config
from tokenizers import AddedToken, Regex, pre_tokenizers
from transformers import AutoTokenizer, GenerationConfig, GPT2LMHeadModel

import ppo_llm

TEMPLATES = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
NAMES = sorted(os.path.basename(p)[:-6] for p in glob.glob(f"{TEMPLATES}/*.jinja") if "_training" not in p)
REFUSED = ["deepseekv3", "diffusion_gemma", "muse_glimmer"]  # no response template of TRL's: no format to parse
RIGHT = [  # the 25 whose format TRL's add_response_schema knows (the two vision ones too)
    *["gemma4", "gemma4_v2", "gemma4_v3", "gemma4_v4", "gemma4_v5", "glm4moe", "gptoss", "lfm2_2_5", "lfm2_2_5_v2"],
    *["lfm2_2_5_vl", "lfm2_v2", "llama3_1", "llama3_2", "nemotron_3_5_lightning", "nemotron_3_nano"],
    *["nemotron_3_super", "nemotron_3_ultra", "qwen2_5", "qwen3", "qwen3_5_nothink", "qwen3_5_think", "qwen3_6"],
    *["qwen3_8", "qwen3_instruct_2507", "qwen3_vl"],
]
ENDS = {  # the end ids of each family's checkpoint (generation_config.json); ChatML's <|im_end|> otherwise
    "glm4moe": ["<|user|>", "<|observation|>"],  # a call's turn ends in <|observation|>, which the model writes
    "gptoss": ["<|return|>", "<|call|>"],  # a call ends the turn: <|call|>
    "llama3_1": ["<|eot_id|>", "<|eom_id|>"],
    "llama3_2": ["<|eot_id|>"],
    "gemma4": ["<turn|>", "<|tool_response>"],  # a call's turn hands over at <|tool_response>
    "diffusion_gemma": ["<turn|>", "<|tool_response>"],
    "deepseekv3": ["<｜end▁of▁sentence｜>"],
    "muse_glimmer": ["<|eot|>", "<|eom|>"],
}
SPECIAL = re.compile(r"<\|[^<>\s]*?\|>|<\|[\w\"]+>|<\w+\|>|<｜[^｜]+｜>|\[gMASK\]|<sop>")  # <|x|>, <|x>, <x|>, <｜x｜>


def add(a: int, b: int) -> str:
    """Adds two integers.

    Args:
        a: the first
        b: the second
    """
    return str(a + b)


TOOLS = {"add": add}


def family(name):
    """(tokenizer, end ids) of a family: its template, the characters of every TRL template, its special tokens."""
    text = open(f"{TEMPLATES}/{name}.jinja").read()
    chars = set("".join(open(p).read() for p in glob.glob(f"{TEMPLATES}/*.jinja"))) | {chr(c) for c in range(32, 127)}
    tok = char_tokenizer(sorted(chars | {"\n"}))
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # "\n\n": 2 ids
    ends = next((ids for prefix, ids in ENDS.items() if name.startswith(prefix)), ["<|im_end|>"])
    tok.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in sorted(set(SPECIAL.findall(text)) | set(ends))]
    )
    tok.chat_template, tok.padding_side, tok.name_or_path = text, "left", name
    eos_ids = ppo_llm.end_of_response_ids(tok, GenerationConfig(eos_token_id=tok.convert_tokens_to_ids(ends)))
    assert eos_ids == sorted([tok.eos_token_id, *tok.convert_tokens_to_ids(ends)])  # the family's, no turn marker
    return tok, eos_ids


def render(tok, messages, **kwargs):
    return tok.apply_chat_template(messages, tools=list(TOOLS.values()), return_dict=False, **kwargs)


def turn_after(tok, eos_ids, messages, reply, then=None):
    """(the prompt, the ids the model writes for reply after messages, the rest) as the template renders the
    conversation on to `then`: the turn from where it leaves the generation prompt to its first end id (GLM-4-MoE's is
    the next message's). Without then, reply last (Qwen3.5 drops the think blocks of turns before a user's), or if that
    ends in none, a user's after it (GLM-4-MoE)."""
    header = render(tok, messages, add_generation_prompt=True)
    for rest in [[then]] if then else [[], [USER]]:
        ids = render(tok, messages + [reply] + rest, add_generation_prompt=bool(rest))
        start = next(j for j, (a, b) in enumerate(zip(header + [None], ids)) if a != b)
        end = next((j + 1 for j in range(start, len(ids)) if ids[j] in eos_ids), None)
        if end:
            return header, ids[start:end], ids[end:]


USER = {"role": "user", "content": "What is 7+5?"}
CALL = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add",
        "arguments": {"a": 7, "b": 5}}}]}  # fmt: skip
RESULT = {"role": "tool", "name": "add", "content": "12"}


def test_every_tool_capable_template_of_trl_is_listed_right_or_refused():
    capable = []
    for name in NAMES:
        tok, _ = family(name)
        if name != "llama3":  # its template needs a BOS token; it renders no tools either way
            capable += [name] if trl.chat_template_utils.supports_tool_calling(tok) else []
    assert sorted(capable) == sorted(RIGHT + REFUSED)


@pytest.mark.parametrize("name", RIGHT)
def test_a_family_round_trips_typed_calls_and_runs_two_turns(name):
    tok, eos_ids = family(name)
    ppo_llm.setup_tool_parsing(tok, TOOLS, eos_ids, name)
    # Qwen3's own template is not prefix-preserving: TRL's training template renders everything for the run
    assert (tok.chat_template == trl.chat_template_utils.qwen3_training_chat_template) == (name == "qwen3")
    assert tok.one_call_a_turn == name.startswith(("llama3", "gptoss"))
    prompt, call, rest = turn_after(tok, eos_ids, [USER], CALL, RESULT)
    (parsed,) = ppo_llm.parse_turn(tok, prompt + call, len(call), TOOLS)["tool_calls"]
    assert parsed["function"] == {"name": "add", "arguments": {"a": 7, "b": 5}}  # ints, as the tool's hints say
    result, failed, _ = ppo_llm.run_tools(tok, TOOLS, [parsed], 5.0, eos_ids, 10_000)
    # the result's ids: the template's tool message and next assistant header, right after the model's end id
    assert failed == 0 and result == rest
    _, answer, _ = turn_after(tok, eos_ids, [USER, CALL, RESULT], {"role": "assistant", "content": "The sum is 12."})
    turns = iter([call, answer])

    def generate(input_ids, max_new_tokens, **kwargs):  # the policy: the call, then the answer, as rendered
        return torch.cat([input_ids, torch.tensor([next(turns)])], 1)

    policy = types.SimpleNamespace(device=torch.device("cpu"), generate=generate, modules=lambda: [])
    policy.eval, policy.generation_config = lambda: policy, GenerationConfig(eos_token_id=eos_ids)
    args = ppo_llm.Args(max_new_tokens=len(call + result + answer), max_prompt_length=None, max_tool_calls=1)
    batch = ppo_llm.rollout(policy, tok, [tok.decode(prompt)], args, torch.autocast("cpu", enabled=False), None, TOOLS)
    assert batch["responses"][0].tolist() == call + result + answer and batch["ended"].item()
    assert batch["mask"][0].tolist() == [1.0] * len(call) + [0.0] * len(result) + [1.0] * len(answer)
    assert (batch["tool_calls"].item(), batch["tool_failures"].item(), batch["turns"].item()) == (1, 0, 2)
    completions, transcripts, conversations = ppo_llm.decode_responses(tok, batch)
    assert "The sum is 12." in completions[0] and "[tool: " in transcripts[0] and len(conversations[0]) == 3


@pytest.mark.parametrize("name", REFUSED)
def test_a_family_without_a_known_format_is_refused_in_one_line(name):
    tok, eos_ids = family(name)
    with pytest.raises(SystemExit, match="(does not render tools|format not read here: install TRL)") as e:
        ppo_llm.setup_tool_parsing(tok, TOOLS, eos_ids, name)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "name", ["qwen3", "qwen3_5_think", "glm4moe", "nemotron_3_nano", "gptoss", "llama3_1", "gemma4"]
)
def test_without_trl_the_families_that_need_its_formats_are_refused_in_one_line(name, monkeypatch):
    # the <tool_call> JSON derivation would read Qwen3.5's XML calls as malformed JSON, every call failing: the round
    # trip refuses it; Qwen3's template is not prefix-preserving, and only TRL has its training one
    monkeypatch.setitem(sys.modules, "trl", None)
    tok, eos_ids = family(name)
    with pytest.raises(SystemExit, match="install TRL") as e:
        ppo_llm.setup_tool_parsing(tok, TOOLS, eos_ids, name)
    assert "\n" not in str(e.value)
    tok, eos_ids = family("qwen2_5")  # <tool_call> JSON: read without TRL
    ppo_llm.setup_tool_parsing(tok, TOOLS, eos_ids, "qwen2_5")


def test_xml_arguments_reach_the_tool_typed():
    # Qwen3.5 writes <parameter=a>\n7\n</parameter>: parsed without the tools' schemas, 7 and 5 are strings and add
    # returns "75" with no failure counted; with them (parse_response(tools=...)), 7 + 5 = 12
    tok, eos_ids = family("qwen3_5_think")
    ppo_llm.setup_tool_parsing(tok, TOOLS, eos_ids, "qwen3_5_think")
    prompt, call, _ = turn_after(tok, eos_ids, [USER], CALL, RESULT)
    untyped = tok.parse_response(tok.decode(call), prefix=tok.decode(prompt))["tool_calls"]
    assert untyped[0]["function"]["arguments"] == {"a": "7", "b": "5"}
    (typed,) = ppo_llm.parse_turn(tok, prompt + call, len(call), TOOLS)["tool_calls"]
    assert add(**typed["function"]["arguments"]) == "12" and add(**untyped[0]["function"]["arguments"]) == "75"


@pytest.mark.parametrize("name, field", [("gptoss", "thinking"), ("qwen3_5_think", "reasoning_content")])
def test_reasoning_before_a_call_ends_at_the_call_and_parses(name, field):
    tok, eos_ids = family(name)
    ppo_llm.setup_tool_parsing(tok, TOOLS, eos_ids, name)
    prompt, call, _ = turn_after(tok, eos_ids, [USER], CALL | {field: "I should add 7 and 5."}, RESULT)
    assert "I should add 7 and 5." in tok.decode(call) and call[-1] in eos_ids  # one turn: reasoning, then the call
    (parsed,) = ppo_llm.parse_turn(tok, prompt + call, len(call), TOOLS)["tool_calls"]
    assert parsed["function"] == {"name": "add", "arguments": {"a": 7, "b": 5}}


def test_two_calls_in_a_turn_of_a_one_call_family_are_a_failed_call():
    # Llama 3.1 renders one call a turn (its template raises on two). TRL's parser reads two in a turn as one malformed
    # call; a tokenizer's own response template (first, before TRL's) that reads "; " between calls gets a failed call
    tok, eos_ids = family("llama3_1")
    calls = {"open_pattern": r'\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*', "repeats": True, "content": "json"}
    calls["close_pattern"] = r"\}(?:; (?=\{)|<\|eot_id\|>)"  # the call's own "}", before "; {" or the turn's end
    calls["transform"] = {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}
    start = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    tok.response_template = {"start_anchor": start, "fields": {"tool_calls": calls, "content": {}}}
    ppo_llm.setup_tool_parsing(tok, TOOLS, eos_ids, "llama3_1")
    assert tok.one_call_a_turn
    prompt = render(tok, [USER], add_generation_prompt=True)
    two = tok('{"name": "add", "parameters": {"a": 7, "b": 5}}; {"name": "add", "parameters": {"a": 1, "b": 2}}')
    turn = two.input_ids + [tok.convert_tokens_to_ids("<|eot_id|>")]
    calls = ppo_llm.parse_turn(tok, prompt + turn, len(turn), TOOLS)["tool_calls"]
    assert calls == ["this model calls one tool a turn"]
    result, failed, _ = ppo_llm.run_tools(tok, TOOLS, calls, 5.0, eos_ids, 10_000)
    assert failed == 1 and "ValueError: this model calls one tool a turn" in tok.decode(result)


def test_qwen3_runs_with_trls_training_template_and_saves_its_own(tmp_path):
    # the run renders prompts, tool messages and evaluation with TRL's prefix-preserving training template (it
    # replaces the tokenizer's, in memory); the saved policy/ keeps the family's own
    tok, eos_ids = family("qwen3")
    own = tok.chat_template
    ppo_llm.setup_tool_parsing(tok, TOOLS, eos_ids, "qwen3")
    assert tok.chat_template == trl.chat_template_utils.qwen3_training_chat_template != own
    ppo_llm.save_policy(str(tmp_path), {"policy": GPT2LMHeadModel(tiny_config(tok))}, tok)
    assert AutoTokenizer.from_pretrained(tmp_path).chat_template == own
    assert tok.chat_template == trl.chat_template_utils.qwen3_training_chat_template  # the run's, still


def test_a_family_whose_turn_ends_in_no_end_id_is_refused(monkeypatch):
    # GLM-4-MoE's call turn ends in <|observation|>: a checkpoint that does not list it among its end ids would write
    # past its call, tool results of its own, until --max-new-tokens; the round trip finds no end and refuses
    monkeypatch.setitem(ENDS, "glm4moe", ["<|user|>"])
    tok, eos_ids = family("glm4moe")
    with pytest.raises(SystemExit, match="a turn that calls probe.n=7., to its first end id, did not parse back"):
        ppo_llm.setup_tool_parsing(tok, TOOLS, eos_ids, "glm4moe")

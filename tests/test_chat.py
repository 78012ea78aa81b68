"""Both LLM scripts: conversational prompts through the chat template, reward functions from a file, the GSM8K and
format rewards, reward models with their own tokenizer, prompt files of every format, and their one-line errors."""

import glob
import inspect
import json
import math
import os
import re
import socket
from dataclasses import asdict, fields

import huggingface_hub
import pytest
import torch
import transformers
from conftest import saved_update, tiny_config
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, GPT2LMHeadModel, PreTrainedTokenizerFast

import grpo_llm
import ppo_llm

SCRIPTS = [ppo_llm, grpo_llm]
ROLES = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_tokenizer(specials=ROLES, template=TEMPLATE):
    """A character tokenizer like Llama's: it adds <s> to plain text, and its chat template writes <s> too; every
    turn ends with <|end|>, which is neither its EOS nor in any generation_config."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", "<s>", *specials, *map(chr, range(32, 127))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                  bos_token="<s>", additional_special_tokens=list(specials))  # fmt: skip
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def chat(tmp_path_factory, tiny):
    """A tiny chat policy that always says <|end|> first (its last layer norm outputs <|end|>'s embedding, scaled),
    conversational and other prompt files, and a reward-function file."""
    root = tmp_path_factory.mktemp("chat")
    torch.manual_seed(0)
    tok = chat_tokenizer()
    policy = GPT2LMHeadModel(tiny_config(tok))
    with torch.no_grad():
        policy.transformer.ln_f.weight.zero_()
        policy.transformer.ln_f.bias.copy_(1e4 * policy.transformer.wte.weight[tok.convert_tokens_to_ids("<|end|>")])
    policy.save_pretrained(root / "policy")
    tok.save_pretrained(root / "policy")
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "answer": str(2 * a), "w": a / 8} for a in range(8)]
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rewards.py").write_text(
        "def weight(completions, prompts, answer, w, **kwargs):\n"
        "    assert isinstance(prompts[0], list) and isinstance(answer[0], str) and len(w) == len(completions)\n"
        "    return w\n"
        "def wrong_length(completions, **kwargs):\n"
        "    return [1.0]\n"
    )
    (root / "long.jsonl").write_text("".join(json.dumps({"prompt": "1" * 60 + f"+{a}="}) + "\n" for a in range(4)))
    return tiny | {"tiny_policy": tiny["policy"], "policy": str(root / "policy"), "jsonl": str(root / "chat.jsonl"),
                   "rewards": str(root / "rewards.py"), "long": str(root / "long.jsonl"), "root": root,
                   "tokenizer": tok}  # fmt: skip


def run(script, tmp_path, **kwargs):
    """main() for one update of 8 sequences on a tiny policy; returns (run_dir, metrics records, samples)."""
    settings = dict(output_dir=str(tmp_path), prompts_per_update=8, micro_batch_size=4, max_new_tokens=4,
                    total_steps=1, eval_every=0, sample_every=1)  # fmt: skip
    if script is grpo_llm:
        settings |= dict(prompts_per_update=2, num_generations=4)
        if isinstance(kwargs.get("reward_fn"), str):
            kwargs["reward_fn"] = (kwargs["reward_fn"],)  # GRPO takes several
    else:
        settings |= dict(num_mini_batches=2)
    run_dir = script.main(script.Args(**(settings | kwargs)))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f, open(os.path.join(run_dir, "samples.jsonl")) as g:
        return run_dir, [json.loads(line) for line in f], [json.loads(line) for line in g]


# ---- rewards ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, number, strict",
    [
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", 72.0, 72.0),  # GSM8K's own format
        ("so 3 + 4 = 7, and the total is \\boxed{1,234}. Check: 5", 1234.0, 1234.0),  # boxed wins over the last number
        ("The answer is $18.", 18.0, 18.0),  # '$' and the full stop are not part of it
        ("Final answer: -3.50 degrees", -3.5, -3.5),
        ("I think it is 5, no, 6", 6.0, None),  # the last number, which strict (the format reward) does not accept
        ("#### 7\nwait, #### 8", 8.0, 8.0),  # the last stated one
        ("\\boxed{x}, so 12", 12.0, None),  # a box without a number states nothing
        ("no number at all", None, None),
        ("It costs -$5, or $-5 #### $-5", -5.0, -5.0),  # a sign before or after the '$'
        ("3+5=8 8++1=9 #### ++1", 1.0, 1.0),  # two signs: the number starts at the second one (float('++1') fails)
        ("#### +-2", -2.0, -2.0),
    ],
)
def test_final_answer(text, number, strict):
    assert ppo_llm.final_answer(text) == number and ppo_llm.final_answer(text, strict=True) == strict


def test_gsm8k_and_format_rewards():
    gold = "Natalia sold 48/2 = 24 clips in May.\n#### 1234"
    completions = ["So the total is 1,234.", "1234 or maybe 43", "The answer is 1234.0", "\\boxed{1233}", "none"]
    gsm8k, format_reward = ppo_llm.REWARD_FNS["gsm8k"], ppo_llm.REWARD_FNS["format"]
    assert gsm8k(completions, [gold] * 5) == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert format_reward(completions, [gold] * 5) == [0.0, 0.0, 1.0, 1.0, 0.0]
    assert gsm8k(["it is 2"], ["2"]) == [1.0]  # a bare reference answer (a CSV column, say)
    assert gsm8k(["no number"], ["none either"]) == [0.0]  # two missing answers are not the same answer
    # --reward-fn NAME reads each row's answer
    rows = [{"answer": gold}, {"answer": "2"}]
    completions = ["#### 1,234", "2.0"]  # without tools, each is its whole response (transcript) too
    assert ppo_llm.load_reward_fn("gsm8k", 600)(completions, rows, completions) == [1.0, 1.0]


# ---- the chat template -----------------------------------------------------------------------------------------


def test_load_prompts_renders_the_template_and_tokenize_texts(chat, tmp_path):
    tok = AutoTokenizer.from_pretrained(chat["policy"], padding_side="left", truncation_side="left")
    messages = [{"role": "user", "content": "2+3="}]
    (tmp_path / "conv.jsonl").write_text(json.dumps({"prompt": messages, "answer": 5}) + "\n")
    (tmp_path / "plain.jsonl").write_text(json.dumps({"prompt": "2+3=", "answer": "5"}) + "\n")
    conv, plain = str(tmp_path / "conv.jsonl"), str(tmp_path / "plain.jsonl")

    def row(dataset, **kwargs):
        (only,) = ppo_llm.load_prompts(ppo_llm.Args(model=chat["policy"], dataset=dataset, **kwargs), tok)
        return only

    got = row(conv, system_prompt="Add.")
    text = "<s><|system|>Add.<|end|><|user|>2+3=<|end|><|assistant|>"
    assert got["prompt"] == text and got["answer"] == "5"  # the answer as text
    assert got["messages"] == [{"role": "system", "content": "Add."}] + messages
    assert got["columns"] == {"prompts": messages, "answer": "5"}  # what a reward function from a file receives
    ids = ppo_llm.tokenize_texts(tok, [text], None).input_ids[0].tolist()
    assert ids == tok.apply_chat_template(got["messages"], add_generation_prompt=True)["input_ids"]
    assert ids.count(3) == 1  # one BOS (id 3): the template's, none added on top
    assert tok("2+3=").input_ids[0] == 3  # a plain string keeps the BOS its tokenizer adds
    assert (row(plain)["prompt"], row(plain)["messages"]) == ("2+3=", None)
    assert row(plain, chat_template=True)["prompt"] == "<s><|user|>2+3=<|end|><|assistant|>"
    assert ppo_llm.tokenize_texts(tok, ["2+3="], None).input_ids[0].tolist() == tok("2+3=").input_ids
    # too long: the start goes, the assistant header stays (as in TRL)
    cut = ppo_llm.tokenize_texts(tok, [text], 5).input_ids[0].tolist()
    assert tok.convert_ids_to_tokens(cut) == ["+", "3", "=", "<|end|>", "<|assistant|>"]


def test_end_of_turn_token_ends_a_response(chat):
    # ids: <pad> 0, <eos> 1, <unk> 2, <s> 3, <|system|> 4, <|user|> 5, <|assistant|> 6, <|end|> 7. The template's text
    # writes <|assistant|> and <|end|> literally (the role headers come from '<|' + role + '|>'), so the response
    # ends at the EOS 1 (the tokenizer's and the generation_config's), at 6 or at 7: [1, 6, 7]
    tokenizer, policy, *_ = ppo_llm.load_models(ppo_llm.Args(model=chat["policy"]), torch.device("cpu"))
    eos_ids = policy.generation_config.eos_token_id  # generate() stops there, and truncate_after_eos
    assert eos_ids == [1, 6, 7] and tokenizer.convert_tokens_to_ids("<|end|>") == 7
    assert tokenizer.pad_token_id == 0  # <pad> ends nothing: kept
    # no chat template: the EOS alone
    _, policy, *_ = ppo_llm.load_models(ppo_llm.Args(model=chat["tiny_policy"]), torch.device("cpu"))
    assert policy.generation_config.eos_token_id == [1]


@pytest.mark.parametrize(
    "specials, template, ends",
    [
        (["<|im_start|>", "<|im_end|>"], "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content']"
         " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
         "{% endif %}", [1, 4, 5]),  # ChatML, as Qwen2.5's template writes it: <|im_start|> 4, <|im_end|> 5
        (["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "{{ bos_token }}{% for m in messages %}"
         "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}",
         [1, 4, 5, 6]),  # Llama 3: the headers 4 and 5, <|eot_id|> 6
        (["<start_of_turn>", "<end_of_turn>"], "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if "
         "m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}", [1, 4, 5]),
        ([], "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", [1]),  # no special token
        ([], "{{ raise_exception('only user turns') if messages[-1]['role'] == 'assistant' }}", [1]),  # refuses
        # the BOS, unk and pad tokens written in the text end nothing
        (["<|end|>"], "<s>{% for m in messages %}{{ m['content'] }}<|end|><unk><pad>{% endfor %}", [1, 4]),
    ],
)  # fmt: skip
def test_end_of_turn_of_family_templates(specials, template, ends, tmp_path):
    # a response ends at the tokenizer's EOS (1, also the generation_config's) and at every special token that the
    # chat template's text writes (the ids after <pad> 0, <eos> 1, <unk> 2, <s> 3: the specials in their order)
    tok = chat_tokenizer(specials, template)
    GPT2LMHeadModel(tiny_config(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    _, policy, *_ = ppo_llm.load_models(ppo_llm.Args(model=str(tmp_path)), torch.device("cpu"))
    assert policy.generation_config.eos_token_id == ends


@pytest.mark.parametrize("script", SCRIPTS, ids=["ppo", "grpo"])
def test_conversational_prompts_run_through_the_template(script, chat, tmp_path, monkeypatch):
    # the prompt ids the policy generates from are the template's rendering with one BOS; it says <|end|> at once,
    # which ends every response (1 token, not 4); samples.jsonl shows the rendered prompt
    queries, real_generate, adamw, real_adamw = [], transformers.GenerationMixin.generate, [], torch.optim.AdamW

    def generate(self, *args, input_ids=None, attention_mask=None, **kwargs):
        queries.append(input_ids[0][attention_mask[0].bool()])  # the first prompt's real ids
        return real_generate(self, *args, input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", generate)
    monkeypatch.setattr(torch.optim, "AdamW", lambda *a, **kw: adamw.append(kw) or real_adamw(*a, **kw))
    _, metrics, samples = run(script, tmp_path, model=chat["policy"], dataset=chat["jsonl"], system_prompt="Add.",
                              reward_fn=chat["rewards"] + ":weight", weight_decay=0.1)  # fmt: skip
    tok = chat["tokenizer"]
    rendered = {tuple(tok.apply_chat_template([{"role": "system", "content": "Add."}, {"role": "user",
                "content": f"{a}+{a}="}], add_generation_prompt=True)["input_ids"]) for a in range(8)}  # fmt: skip
    assert tuple(queries[0].tolist()) in rendered and queries[0].tolist().count(tok.bos_token_id) == 1
    lengths = metrics[0]["val/mean_length" if script is ppo_llm else "completions/mean_length"]
    assert lengths == 1.0
    assert samples[0]["prompt"].startswith("<s><|system|>Add.<|end|><|user|>") and samples[0]["completion"] == ""
    # the reward function from the file returned column w: a / 8 for prompt a + a
    a = int(samples[0]["prompt"].split("<|user|>")[1].split("+")[0])
    assert samples[0]["score" if script is ppo_llm else "reward"] == a / 8
    assert "rewards/weight/mean" in metrics[0] or script is ppo_llm
    assert adamw[0]["weight_decay"] == 0.1  # --weight-decay reaches the optimizer (default 0: Args().weight_decay)


def test_reward_fn_as_module_with_weights(chat, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(chat["root"]))
    _, metrics, _ = run(grpo_llm, tmp_path, model=chat["policy"], dataset=chat["jsonl"], chat_template=True,
                        reward_fn=("format", "rewards:weight"), reward_weights=(1.0, 2.0))  # fmt: skip
    m = metrics[0]
    assert m["rewards/format/mean"] == 0.0 and m["reward"] == pytest.approx(2 * m["rewards/weight/mean"])


def test_reward_model_reads_the_whole_response(chat):
    # a prompt of 64 tokens and a reward model of 32 positions: the text loses its start, never the response
    args = ppo_llm.Args(model=chat["policy"], reward_model=chat["rm_other"], micro_batch_size=4)
    _, _, reward_model, rm_tokenizer = ppo_llm.load_models(args, torch.device("cpu"))
    rows = [{"prompt": "1" * 60 + "+1=", "messages": None}]
    r = {"query_responses": None, "attention_mask": None}  # the policy's ids: unused, the text is encoded again
    assert rm_tokenizer is not None  # a tokenizer of its own: it does not read the policy's ids
    got = ppo_llm.reward_model_scores(
        reward_model, rm_tokenizer, r, rows, [[{"role": "assistant", "content": "61"}]], args
    )
    ids = rm_tokenizer(("1" * 60 + "+1=61")[-32:], return_tensors="pt").input_ids
    assert got.item() == pytest.approx(reward_model(input_ids=ids).logits[0, 0].item(), abs=1e-6)


@pytest.mark.parametrize("script", SCRIPTS, ids=["ppo", "grpo"])
def test_long_prompts_with_another_tokenizers_reward_model(script, chat, tmp_path):
    _, metrics, _ = run(
        script, tmp_path, model=chat["tiny_policy"], dataset=chat["long"], reward_model=chat["rm_other"]
    )
    assert all(math.isfinite(v) for v in metrics[0].values())


def test_a_policy_without_a_pad_token_beside_a_reward_model_of_another_tokenizer(tiny, tmp_path):
    # pad = EOS (as Llama's and Qwen2.5's base models) and no spare embedding row: the [PAD] the script adds must get a
    # row in the policy, whose ids the policy reads, also when the reward model reads its own tokenizer
    tok = AutoTokenizer.from_pretrained(tiny["policy"])
    tok.pad_token = tok.eos_token
    GPT2LMHeadModel(tiny_config(tok)).save_pretrained(tmp_path / "policy")
    tok.save_pretrained(tmp_path / "policy")
    args = ppo_llm.Args(model=str(tmp_path / "policy"), reward_model=tiny["rm_other"])
    tokenizer, policy, _, rm_tokenizer = ppo_llm.load_models(args, torch.device("cpu"))
    assert rm_tokenizer is not None and tokenizer.pad_token == "[PAD]" and tokenizer.pad_token_id == len(tok)
    assert policy.get_input_embeddings().num_embeddings == len(tok) + 1


def test_reward_model_with_its_own_chat_template():
    tok = chat_tokenizer()
    row = {"prompt": "<s><|user|>2+3=<|end|><|assistant|>", "messages": [{"role": "user", "content": "2+3="}]}
    assert (
        ppo_llm.rm_text(tok, row, [{"role": "assistant", "content": "5"}])
        == "<s><|user|>2+3=<|end|><|assistant|>5<|end|>"
    )
    tok.chat_template = None  # a reward model without a template reads the prompt as the policy saw it
    assert ppo_llm.rm_text(tok, row, [{"role": "assistant", "content": "5"}]) == row["prompt"] + "5"


# ---- data ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_prompt_files_of_every_format(fmt, tiny, tmp_path):
    import pandas as pd

    path = str(tmp_path / f"p.{fmt}")
    frame = pd.DataFrame({"prompt": ["1+1=", "2+2="], "answer": [2, 4]})  # numbers: a CSV reads them as such
    if fmt in ("jsonl", "json"):
        frame.to_json(path, orient="records", lines=fmt == "jsonl")
    else:
        getattr(frame, f"to_{fmt}")(path, index=False)
    tok = AutoTokenizer.from_pretrained(tiny["policy"])
    rows = ppo_llm.load_prompts(ppo_llm.Args(dataset=path), tok)
    got = sorted((r["prompt"], r["answer"]) for r in rows)
    assert got == [("1+1=", "2"), ("2+2=", "4")]  # answers compared as text


BAD_FILES = {
    "empty.jsonl": "",
    "notjson.jsonl": '{"prompt": "1+1=", "answer": "2"}\n\nnot json\n',
    "noprompt.jsonl": '{"prompt": "1+1=", "answer": "2"}\n{"answer": "4"}\n',
    "noanswer.csv": "prompt,answer\n1+1=,2\n2+2=,\n",
    "badmessages.jsonl": '{"prompt": [{"content": "hi"}], "answer": "2"}\n',
    "broken.json": '[{"prompt": "1+1="',
    "emptyprompt.jsonl": '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "", "answer": "0"}\n',
}


@pytest.mark.parametrize("script", SCRIPTS, ids=["ppo", "grpo"])
@pytest.mark.parametrize(
    "options, message",
    [
        # datasets' own error, its first line (an error without text: "no rows")
        (dict(dataset="empty.jsonl"), ("empty.jsonl could not be loaded (", "no rows)")),
        (dict(dataset="notjson.jsonl"), ("notjson.jsonl could not be loaded (", "JSON parse error")),
        (dict(dataset="noprompt.jsonl"), "noprompt.jsonl: row 2 has no --prompt-column prompt (columns: answer)"),
        (dict(dataset="noanswer.csv"), "noanswer.csv: row 2 has no --answer-column answer, which the reward"),
        (dict(dataset="badmessages.jsonl"), "row 1: the prompt is neither a string nor a list of {role, content}"),
        (dict(dataset="broken.json"), "broken.json could not be loaded ("),
        (dict(dataset="nowhere.jsonl"), "nowhere.jsonl could not be loaded (FileNotFoundError"),
        (dict(dataset="emptyprompt.jsonl"), "emptyprompt.jsonl: row 2 has no --prompt-column prompt (columns: answer)"),
        (dict(chat_template=True), "its tokenizer has no chat template, which conversational prompts, --chat-template "
         "and --system-prompt need"),
        (dict(reward_model="RM2", reward_label=2), "has num_labels=2: --reward-label (0 to 1) chooses the logit that "
         "is the score (got 2)"),
        (dict(reward_fn="nowhere.py:f"), "--reward-fn nowhere.py:f: not one of ['arithmetic', 'format', 'gsm8k'], "
         "nor a file.py:function or module:function that loads (FileNotFoundError"),
        (dict(reward_fn="REWARDS:nope"), ":nope: not one of"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(script, options, message, chat, tmp_path):
    for name, text in BAD_FILES.items():
        (tmp_path / name).write_text(text)
    if "dataset" in options:
        options["dataset"] = str(tmp_path / options["dataset"])
    if "reward_fn" in options:
        options["reward_fn"] = options["reward_fn"].replace("REWARDS", chat["rewards"])
    if "reward_model" in options:
        options["reward_model"] = chat["rm_two_labels"]
    with pytest.raises(SystemExit) as e:
        run(script, tmp_path, model=chat["tiny_policy"], **options)
    assert str(e.value).startswith("error:") and "\n" not in str(e.value)
    assert all(part in str(e.value) for part in ((message,) if isinstance(message, str) else message))
    assert "offline" not in str(e.value)  # none of these is a network error


@pytest.mark.parametrize("script", SCRIPTS, ids=["ppo", "grpo"])
def test_reward_fn_of_the_wrong_length_stops_the_run_and_saves(script, chat, tmp_path, capsys):
    # 1 number for 8 completions: our check, in update 1; the run saves its state (update 0), says in one line what was
    # wrong and how to resume, with no traceback, and exits with 1
    with pytest.raises(SystemExit) as e:
        run(script, tmp_path, model=chat["tiny_policy"], reward_fn=chat["rewards"] + ":wrong_length")
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert f"(error: --reward-fn {chat['rewards']}:wrong_length returned 1 numbers for 8 completions)" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    (run_dir,) = glob.glob(str(tmp_path / "*"))
    assert f"the state after update 0 is in {run_dir}/checkpoint" in err and f"--resume {run_dir} goes on" in err
    assert saved_update(run_dir) == 0


def test_hub_id_offline_fails_at_once_in_one_line(tmp_path, monkeypatch):
    # HF_HUB_OFFLINE=1 and an empty cache: gpt2 cannot load, and no connection is even tried (huggingface_hub's
    # retries never start); the one line names the flag and the offline default
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read when huggingface_hub was imported
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    connections, connect = [], socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", lambda s, *a: connections.append(a) or connect(s, *a))
    with pytest.raises(SystemExit) as e:
        ppo_llm.main(ppo_llm.Args(model="gpt2", output_dir=str(tmp_path / "runs")))
    message = str(e.value)
    assert message.startswith("error: --model gpt2 is no directory, nor reachable on the hub") and "\n" not in message
    assert "with HF_HUB_OFFLINE=1, the cache alone" in message and message.endswith("offline: assets/arith-sft")
    assert connections == [] and not os.path.exists(tmp_path / "runs")  # no network, no run directory


# ---- flags -----------------------------------------------------------------------------------------------------


def help_entries(text):
    """tyro's --help as {flag: its whole entry on one line}. An entry starts at '--flag' indented by 1 or 2 (inside a
    box on a terminal, or not) and goes on over the indented lines after it: its choices (wrapped, as indented as the
    flag), its help and '(default: ...)' (wrapped, indented further)."""
    entries, flag = {}, None
    for line in text.splitlines():
        line = line.strip("│")
        start = re.match(r" {1,2}(--[a-z][\w-]*)", line)
        flag = start.group(1) if start else flag if re.match(r" ", line) else None
        if flag:
            entries[flag] = entries.get(flag, "") + " " + line
    return {flag: " ".join(entry.split()) for flag, entry in entries.items()}


def shown(default):
    """A default as tyro's help writes it: a tuple's items separated by spaces."""
    return " ".join(map(str, default)) if isinstance(default, tuple) else str(default)


def inline_comments(script):
    """{field: the comment after it in the source of Args}, which tyro makes its help."""
    return dict(re.findall(r"^    (\w+): .*?  # (.*)$", inspect.getsource(script.Args), flags=re.M))


@pytest.mark.parametrize("script", SCRIPTS, ids=["ppo", "grpo"])
def test_help_lists_every_flag_with_its_help_and_default(script, capsys):
    with pytest.raises(SystemExit) as e:
        script.parse_args(["--help"])
    assert e.value.code == 0
    entries, comments = help_entries(capsys.readouterr().out), inline_comments(script)
    for field in fields(script.Args):
        entry = entries["--" + field.name.replace("_", "-")]  # kebab-case
        assert " ".join(comments[field.name].split()) in entry, (field.name, entry)
        # tyro's own (default: ...) ends the entry
        assert entry.endswith(f"(default: {shown(field.default)})"), (field.name, entry)
    assert entries["--cuda"].startswith("--cuda, --no-cuda ")  # booleans come as --x / --no-x
    assert set(entries) == {"--" + f.name.replace("_", "-") for f in fields(script.Args)}  # and no other


@pytest.mark.parametrize("script", SCRIPTS, ids=["ppo", "grpo"])
def test_help_states_each_default_once(script, capsys):
    with pytest.raises(SystemExit):
        script.parse_args(["--help"])
    twice = {flag: e for flag, e in help_entries(capsys.readouterr().out).items() if e.count("(default:") > 1}
    assert not twice


@pytest.mark.parametrize("script", SCRIPTS, ids=["ppo", "grpo"])
def test_flags_parse_and_removed_ones_are_refused(script, capsys):
    args = script.parse_args(["--seed", "3", "--lora-target-modules", "q", "v", "--eval-every", "0"])
    assert (args.seed, args.lora_target_modules, args.eval_every) == (3, ("q", "v"), 0)
    assert asdict(args) == asdict(script.Args(seed=3, lora_target_modules=("q", "v"), eval_every=0))
    assert asdict(script.parse_args([])) == asdict(script.Args())
    for flag in ["--top-k", "--top-p", "--lora-dropout"]:  # removed: sampling is softmax(logits / T), no dropout
        with pytest.raises(SystemExit) as e:
            script.parse_args([flag, "3"])
        assert e.value.code == 2 and f"Unrecognized options: {flag}" in capsys.readouterr().err  # tyro's own error


def test_score_norm_flag(tiny, tmp_path, monkeypatch):
    # auto: whiten a reward model's scores, not a reward function's; a given value is kept
    assert ppo_llm.parse_args(["--score-norm", "off"]).score_norm == "off"
    assert ppo_llm.parse_args([]).score_norm == "auto" and ppo_llm.Args().weight_decay == 0.0
    whitened = []
    monkeypatch.setattr(
        ppo_llm, "normalize_scores", lambda scores, ended, whiten, *_: whitened.append(whiten) or scores
    )
    for reward_model, norm in [(tiny["rm"], "auto"), (None, "auto"), (tiny["rm"], "off"), (None, "on")]:
        run(ppo_llm, tmp_path / str(len(whitened)), model=tiny["policy"], reward_model=reward_model, score_norm=norm)
    assert whitened == [True, False, False, True]

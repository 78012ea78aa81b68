"""Both LLM scripts: conversational prompts through the chat template, reward functions from a file, the GSM8K and
format rewards, reward models with their own tokenizer, prompt files of every format, and their one-line errors."""

import json
import math
import os
import re
from dataclasses import asdict

import pytest
import torch
from conftest import tiny_config
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
    ],
)
def test_final_answer(text, number, strict):
    assert ppo_llm.final_answer(text) == number and ppo_llm.final_answer(text, strict=True) == strict


def test_gsm8k_and_format_rewards():
    gold = "Natalia sold 48/2 = 24 clips in May.\n#### 1234"
    completions = ["So the total is 1,234.", "1234 or maybe 43", "The answer is 1234.0", "\\boxed{1233}", "none"]
    assert ppo_llm.gsm8k_reward(completions, [gold] * 5) == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert ppo_llm.format_reward(completions, [gold] * 5) == [0.0, 0.0, 1.0, 1.0, 0.0]
    assert ppo_llm.gsm8k_reward(["it is 2"], ["2"]) == [1.0]  # a bare reference answer (a CSV column, say)


# ---- the chat template -----------------------------------------------------------------------------------------


def test_render_prompt_and_tokenize_texts(chat):
    tok = AutoTokenizer.from_pretrained(chat["policy"], padding_side="left", truncation_side="left")
    messages = [{"role": "user", "content": "2+3="}]
    text, rendered = ppo_llm.render_prompt(tok, messages, False, "Add.", "row 1")
    assert text == "<s><|system|>Add.<|end|><|user|>2+3=<|end|><|assistant|>"
    assert rendered == [{"role": "system", "content": "Add."}] + messages
    ids = ppo_llm.tokenize_texts(tok, [text], None).input_ids[0].tolist()
    assert ids == tok.apply_chat_template(rendered, add_generation_prompt=True)["input_ids"] and ids.count(3) == 1
    assert tok("2+3=").input_ids[0] == 3  # a plain string keeps the BOS its tokenizer adds
    assert ppo_llm.render_prompt(tok, "2+3=", False, None, "row 1") == ("2+3=", None)
    assert ppo_llm.render_prompt(tok, "2+3=", True, None, "row 1")[0] == "<s><|user|>2+3=<|end|><|assistant|>"
    assert ppo_llm.tokenize_texts(tok, ["2+3="], None).input_ids[0].tolist() == tok("2+3=").input_ids
    # too long: the start goes, the assistant header stays (as in TRL)
    cut = ppo_llm.tokenize_texts(tok, [text], 5).input_ids[0].tolist()
    assert tok.convert_ids_to_tokens(cut) == ["+", "3", "=", "<|end|>", "<|assistant|>"]


def test_end_of_turn_token_ends_a_response(chat):
    tok = chat["tokenizer"]
    end = tok.convert_tokens_to_ids("<|end|>")
    assert ppo_llm.end_of_turn_id(tok) == end
    assert ppo_llm.eos_token_ids(tok, ppo_llm.GenerationConfig(eos_token_id=1)) == [1, end]
    assert ppo_llm.end_of_turn_id(AutoTokenizer.from_pretrained(chat["rm_other"])) is None  # no template


@pytest.mark.parametrize(
    "specials, template, end",
    [
        (["<|im_start|>", "<|im_end|>"], "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content']"
         " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
         "{% endif %}", "<|im_end|>"),  # ChatML, as Qwen2.5's template writes it
        (["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "{{ bos_token }}{% for m in messages %}"
         "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}",
         "<|eot_id|>"),  # Llama 3
        (["<start_of_turn>", "<end_of_turn>"], "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if "
         "m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}", "<end_of_turn>"),
        ([], "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", None),  # no special token
        ([], "{{ raise_exception('only user turns') if messages[-1]['role'] == 'assistant' }}", None),  # refuses
    ],
)  # fmt: skip
def test_end_of_turn_of_family_templates(specials, template, end):
    tok = chat_tokenizer(specials, template)  # "\n" is not in its vocabulary: <unk>, special, must not count
    assert ppo_llm.end_of_turn_id(tok) == (None if end is None else tok.convert_tokens_to_ids(end))


@pytest.mark.parametrize("script", SCRIPTS, ids=["ppo", "grpo"])
def test_conversational_prompts_run_through_the_template(script, chat, tmp_path, monkeypatch):
    # the prompt ids the policy generates from are the template's rendering with one BOS; it says <|end|> at once,
    # which ends every response (1 token, not 4); samples.jsonl shows the rendered prompt
    queries, real_generate, adamw, real_adamw = [], script.generate, [], torch.optim.AdamW
    monkeypatch.setattr(script, "generate", lambda p, q, m: queries.append(q[0][m[0].bool()]) or real_generate(p, q, m))
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
    _, _, reward_model, rm_tokenizer, _, _ = ppo_llm.load_models(
        ppo_llm.Args(model=chat["policy"], reward_model=chat["rm_other"]), torch.device("cpu")
    )
    rows = [{"prompt": "1" * 60 + "+1=", "messages": None}]
    got = ppo_llm.reward_model_scores(reward_model, rm_tokenizer, None, None, rows, ["61"], 0, 4)
    ids = rm_tokenizer(("1" * 60 + "+1=61")[-32:], return_tensors="pt").input_ids
    assert got.item() == pytest.approx(reward_model(input_ids=ids).logits[0, 0].item(), abs=1e-6)


@pytest.mark.parametrize("script", SCRIPTS, ids=["ppo", "grpo"])
def test_long_prompts_with_another_tokenizers_reward_model(script, chat, tmp_path):
    _, metrics, _ = run(
        script, tmp_path, model=chat["tiny_policy"], dataset=chat["long"], reward_model=chat["rm_other"]
    )
    assert all(math.isfinite(v) for v in metrics[0].values())


def test_reward_model_with_its_own_chat_template():
    tok = chat_tokenizer()
    row = {"prompt": "<s><|user|>2+3=<|end|><|assistant|>", "messages": [{"role": "user", "content": "2+3="}]}
    assert ppo_llm.rm_text(tok, row, "5") == "<s><|user|>2+3=<|end|><|assistant|>5<|end|>"
    tok.chat_template = None  # a reward model without a template reads the prompt as the policy saw it
    assert ppo_llm.rm_text(tok, row, "5") == row["prompt"] + "5"


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
    got = sorted((r["prompt"], r["answer"]) for r in [next(rows), next(rows)])
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
        (dict(dataset="empty.jsonl"), "empty.jsonl: empty file"),
        (dict(dataset="notjson.jsonl"), "notjson.jsonl: line 3 is not JSON"),
        (dict(dataset="noprompt.jsonl"), "noprompt.jsonl: row 2 has no --prompt-column prompt (columns: answer)"),
        (dict(dataset="noanswer.csv"), "noanswer.csv: row 2 has no --answer-column answer, which the reward"),
        (dict(dataset="badmessages.jsonl"), "row 1: the prompt is neither a string nor a list of {role, content}"),
        (dict(dataset="broken.json"), "broken.json could not be loaded ("),
        (dict(dataset="emptyprompt.jsonl"), "prompt '' encodes to no tokens with --model's tokenizer (a wrong one?)"),
        (dict(chat_template=True), "has no chat template, which --chat-template and --system-prompt need"),
        (dict(reward_model="RM2", reward_label=2), "--reward-label 2 is not a logit of --reward-model"),
        (dict(reward_fn="nowhere.py:f"), "--reward-fn nowhere.py:f: not one of ['arithmetic', 'format', 'gsm8k'], "
         "nor a path/to/file.py:function or module:function (FileNotFoundError"),
        (dict(reward_fn="REWARDS:nope"), ":nope: not one of"),
        (dict(reward_fn="REWARDS:wrong_length"), "must return a list of 8 numbers, one per completion (got [1.0])"),
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
    assert str(e.value).startswith("error:") and "\n" not in str(e.value) and message in str(e.value)
    assert "offline" not in str(e.value)  # none of these is a network error


def test_unreachable_hub_fails_fast(tmp_path, monkeypatch):
    # the hub does not answer (a closed port): one probe switches to offline mode, so gpt2 fails in seconds
    monkeypatch.setattr(ppo_llm.hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(ppo_llm.hub_constants, "ENDPOINT", "http://127.0.0.1:9")
    ppo_llm.check_hub.cache_clear()
    probes, urlopen = [], ppo_llm.urllib.request.urlopen
    monkeypatch.setattr(ppo_llm.urllib.request, "urlopen", lambda *a, **k: probes.append(k) or urlopen(*a, **k))
    with pytest.raises(SystemExit, match="gpt2 is not a local directory.*HF_HUB_OFFLINE=1 skips the network"):
        ppo_llm.from_pretrained(AutoTokenizer, "gpt2", "--model")
    # one probe of at most 5 s, then offline: huggingface_hub's retries (~50 s) never start
    assert probes == [{"timeout": 5}] and ppo_llm.hub_constants.HF_HUB_OFFLINE
    ppo_llm.check_hub.cache_clear()


# ---- flags -----------------------------------------------------------------------------------------------------


def test_help_and_flags(capsys):
    for script in SCRIPTS:
        with pytest.raises(SystemExit):
            script.parse_args(["--help"])
        text = capsys.readouterr().out
        assert "(default:" in text and not re.search(r"\(default:[^)]*\)[\s│]*\(default:", text)
        # one section per group of Args, in the order of the source, each flag in its own group's section
        groups = ["experiment", "models", "generation", "algorithm", "logging"]
        at = [text.index(f"{group} options") for group in groups] + [len(text)]
        for i, flag in enumerate(["--seed", "--dataset", "--temperature", "--learning-rate", "--eval-every"]):
            assert at[i] < re.search(rf"\n\W*{flag} ", text).start() < at[i + 1]
        assert at == sorted(at) and "--experiment." not in text
        args = script.parse_args(["--seed", "3", "--lora-target-modules", "q", "v", "--eval-every", "0"])
        assert (args.seed, args.lora_target_modules, args.eval_every) == (3, ("q", "v"), 0)
        assert asdict(args) == asdict(script.Args(seed=3, lora_target_modules=("q", "v"), eval_every=0))
    assert ppo_llm.parse_args(["--score-norm", "off"]).score_norm == "off"
    assert ppo_llm.parse_args([]).score_norm == "auto" and ppo_llm.Args().weight_decay == 0.0
    args = ppo_llm.Args(reward_model="x")
    ppo_llm.check_args(args)
    assert args.score_norm == "on"

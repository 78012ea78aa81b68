"""Tiny models the tests build themselves: a character tokenizer, a GPT-2 policy and reward models."""

import glob
import json
import os

import pytest
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, PreTrainedTokenizerFast


def pytest_addoption(parser):
    parser.addoption("--e2e", action="store_true", help="also the slowest end-to-end tests (marked e2e), as .ci/run")


def pytest_collection_modifyitems(config, items):
    """Without --e2e, the tests marked e2e (torchrun launches of two processes, gpu.py's smoke run: about two fifths
    of the suite's time) are skipped, each with its reason, and the summary says how many; .ci/run passes --e2e."""
    if not config.getoption("--e2e"):
        skip = pytest.mark.skip(reason="end-to-end and slow: python -m pytest -q --e2e runs it, as .ci/run does")
        for item in items:
            if "e2e" in item.keywords:
                item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, config):
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "--e2e runs it" in str(r.longrepr)]
    if skipped:
        terminalreporter.write_line(f"{len(skipped)} end-to-end tests skipped: --e2e runs them too, as .ci/run does")


@pytest.fixture(autouse=True)
def no_stop_yet():
    """A stop recorded by an earlier test's run (STOP is the script's, kept past its end) would skip every tool call."""
    import grpo_llm
    import ppo_llm

    ppo_llm.STOP.clear()
    grpo_llm.STOP.clear()


def char_tokenizer(chars, pad="<pad>", eos="<eos>"):
    """A character-level tokenizer that AutoTokenizer loads: specials first, then one id per character."""
    vocab = {tok: i for i, tok in enumerate([pad, eos, "<unk>", *chars])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, eos_token=eos, unk_token="<unk>")


def tiny_config(tokenizer, **kwargs):
    return GPT2Config(
        vocab_size=len(tokenizer), n_positions=32, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Directories of a tiny policy, a reward model with the same tokenizer, one with another tokenizer,
    and a JSONL prompt file. Weights are random (seeded)."""
    import torch

    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    tok = char_tokenizer([chr(c) for c in range(32, 127)])
    paths = {name: root / name for name in ["policy", "rm", "rm_other", "rm_two_labels"]}
    GPT2LMHeadModel(tiny_config(tok)).save_pretrained(paths["policy"])
    tok.save_pretrained(paths["policy"])
    GPT2ForSequenceClassification(tiny_config(tok, num_labels=1)).save_pretrained(paths["rm"])
    tok.save_pretrained(paths["rm"])
    GPT2ForSequenceClassification(tiny_config(tok, num_labels=2)).save_pretrained(paths["rm_two_labels"])
    tok.save_pretrained(paths["rm_two_labels"])
    # Another tokenizer: the digits and signs only, in another order, so its ids differ from the policy's.
    other = char_tokenizer(list("9876543210+-= "), pad="[P]", eos="[E]")
    GPT2ForSequenceClassification(tiny_config(other, num_labels=1)).save_pretrained(paths["rm_other"])
    other.save_pretrained(paths["rm_other"])
    paths["jsonl"] = root / "prompts.jsonl"
    paths["jsonl"].write_text(
        "".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(20))
    )
    return {k: str(v) for k, v in paths.items()}


def untimed_metrics(run_dir):
    """A run's metrics.jsonl records without time/* and perf/*, which differ between two runs of the same updates."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))} for line in f]


def ends_at(monkeypatch, positions):
    """Every generate() afterwards: response i ends in EOS at positions[i] (None: no EOS), other EOS made text."""
    real = transformers.GenerationMixin.generate

    def patched(self, input_ids=None, **kwargs):
        out = real(self, input_ids=input_ids, **kwargs).clone()
        responses = out[:, input_ids.shape[1] :]  # a view: edited in place
        responses[responses == self.config.eos_token_id] = 3  # a character, not an end
        for i, position in enumerate(positions[: len(responses)]):
            if position is not None:
                responses[i, position] = self.config.eos_token_id
        return out

    monkeypatch.setattr(transformers.GenerationMixin, "generate", patched)


def interrupt_generation(monkeypatch, call, error=KeyboardInterrupt):
    """generate() raises `error` at its `call`-th call (from 1), as a Ctrl-C or a crash at that moment would."""
    real, calls = transformers.GenerationMixin.generate, []

    def patched(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise error("interrupted by the test")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", patched)


def saved_update(run_dir):
    """The update whose state a run directory's checkpoint holds (its state.json)."""
    with open(os.path.join(run_dir, "checkpoint", "state.json")) as f:
        return json.load(f)["update"]


def saved_weights(run_dir, name):
    """The weights of models[name] in a run directory's checkpoint, read whole in one process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(run_dir, "checkpoint", "whole.pt")
    dcp_to_torch_save(os.path.join(run_dir, "checkpoint"), path)
    weights = torch.load(path)["models"]
    os.remove(path)
    return {k.removeprefix(f"{name}."): v for k, v in weights.items() if k.startswith(f"{name}.")}


def lm(head, logit_scale=None, softcap=None):
    """A causal LM as lm_head_logprobs reads one: its output embedding `head`, its config's logit scale and softcap."""
    import types

    config = types.SimpleNamespace(logit_scale=logit_scale, final_logit_softcapping=softcap)
    return types.SimpleNamespace(config=config, get_output_embeddings=lambda: head)


def contents(directory):
    """Every file under a directory, read: {path: bytes}, to compare a directory before and after."""
    paths = glob.glob(os.path.join(directory, "**"), recursive=True)
    return {path: open(path, "rb").read() for path in paths if os.path.isfile(path)}

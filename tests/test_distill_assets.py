"""The embedded models of on-policy distillation (assets/arith-teacher, assets/arith-student) and their builder."""

import importlib.util
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "assets")
SFT_DIR = os.path.join(ASSETS, "arith-sft")
TEACHER_DIR, STUDENT_DIR = os.path.join(ASSETS, "arith-teacher"), os.path.join(ASSETS, "arith-student")

_spec = importlib.util.spec_from_file_location("make_distill_models", os.path.join(ASSETS, "make_distill_models.py"))
mdm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mdm)


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_teacher_and_student_share_arith_sft_vocabulary():
    # the teacher scores the student's ids in its own softmax: the same token for the same id, not only as many ids
    vocab = AutoTokenizer.from_pretrained(SFT_DIR).get_vocab()
    assert AutoTokenizer.from_pretrained(TEACHER_DIR).get_vocab() == vocab
    assert AutoTokenizer.from_pretrained(STUDENT_DIR).get_vocab() == vocab
    # and the tokenizer files are the arithmetic builder's, byte for byte, with no padding state left in them
    for path in (TEACHER_DIR, STUDENT_DIR):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            assert open(os.path.join(path, name)).read() == open(os.path.join(SFT_DIR, name)).read(), (path, name)


def test_teacher_has_arith_sft_config_and_student_is_smaller():
    sft = json.load(open(os.path.join(SFT_DIR, "config.json")))
    teacher = json.load(open(os.path.join(TEACHER_DIR, "config.json")))
    # PPO trained arith-sft's weights: the architecture is the same (the saving transformers may differ)
    assert {k: v for k, v in teacher.items() if k != "transformers_version"} == {
        k: v for k, v in sft.items() if k != "transformers_version"
    }
    student = json.load(open(os.path.join(STUDENT_DIR, "config.json")))
    assert student["n_layer"] < sft["n_layer"] and student["n_embd"] < sft["n_embd"]
    assert student["n_embd"] // student["n_head"] == 32  # a head size vLLM's CPU attention serves
    assert student["resid_pdrop"] == student["embd_pdrop"] == student["attn_pdrop"] == 0.0
    assert student["n_positions"] == sft["n_positions"] and student["vocab_size"] == sft["vocab_size"]
    for path in (TEACHER_DIR, STUDENT_DIR):
        assert os.path.getsize(os.path.join(path, "model.safetensors")) <= 20 * 2**20
        assert not os.path.exists(os.path.join(path, "critic"))  # the policy only, not PPO's critic


@torch.no_grad()
def test_both_load_and_answer_with_eos():
    tok = AutoTokenizer.from_pretrained(SFT_DIR, padding_side="left")
    teacher = AutoModelForCausalLM.from_pretrained(TEACHER_DIR)
    student = AutoModelForCausalLM.from_pretrained(STUDENT_DIR)
    assert type(teacher).__name__ == type(student).__name__ == "GPT2LMHeadModel"
    # a block of width d is 12 d^2 + 13 d (attention 4 d^2 + 4 d, MLP 8 d^2 + 5 d, two layer norms 4 d), plus the
    # embeddings (98 + 64) d and the final norm 2 d, the LM head tied: 4 x 309,280 + 25,920 + 320 = 1,263,360 at
    # d = 160 (arith-sft), 2 x 198,272 + 20,736 + 256 = 417,536 at d = 128 (3.0x fewer)
    assert parameters(teacher) == parameters(AutoModelForCausalLM.from_pretrained(SFT_DIR)) == 1_263_360
    assert parameters(student) == 417_536
    problems = mdm.mam.arithmetic_eval_set()[:32]
    batch = tok([p["prompt"] for p in problems], return_tensors="pt", padding=True)
    for model in (teacher, student):
        assert model.generation_config.pad_token_id == tok.pad_token_id
        out = model.generate(**batch, do_sample=False, max_new_tokens=8)
        responses = out[:, batch["input_ids"].shape[1] :]
        assert (responses == tok.eos_token_id).any(dim=1).all()  # every greedy answer ends
        completions = tok.batch_decode(responses, skip_special_tokens=True)
        right = mdm.mam.arithmetic_reward(completions, [p["answer"] for p in problems])
        assert sum(right) >= 0.8 * len(problems)


def test_builder_refuses_to_overwrite_without_the_flag():
    with pytest.raises(SystemExit, match=r"^error: .*arith-teacher exists: pass --overwrite to replace it"):
        mdm.main(mdm.Args(out_dir=ASSETS))

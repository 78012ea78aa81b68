"""PPO for language models (RLHF), in one file.

Stage 3 of RLHF (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences"; Ouyang et al. 2022, InstructGPT):
a policy generates responses to prompts, a reward model or a reward function scores them, and PPO (Schulman et al.
2017) raises the score while a per-token KL penalty keeps the policy close to the frozen reference (the SFT model it
started from). `main()` reads in the order of the algorithm: rollout -> log-probs of policy and reference, values,
scores -> per-token rewards -> GAE -> epochs of clipped minibatch updates -> log -> save.

    python ppo_llm.py                                  # embedded arithmetic SFT model, offline, CPU
    python ppo_llm.py --reward-model assets/arith-rm   # the same, scored by the learned reward model
    python ppo_llm.py --model gpt2 --total-steps 200   # a hub model (a GPU is advisable)

Implementation details (cited as "detail N" in the comments):
1. Tokens are actions and a response is an episode; the state is the prompt plus the tokens so far.
2. Responses are cut after the first EOS; later tokens become pad, masked out of every loss and statistic, so the policy
   is not trained on text it would never show.
3. The score is added to the reward of the last real response token and every token gets -beta * KL to the reference:
   the KL penalty is dense where the score is sparse (Ziegler et al.).
4. Log-probs divide the logits by the sampling temperature, or the ratio and KL start away from 1 and 0.
5. Old log-probs and values are recomputed after generation with the training forward's function, dtype and micro-batch
   shapes, so the first ratio of every update is exactly 1.
6. Dropout is 0 in the config before the model is built (Llama-style attention reads attention_dropout in train mode)
   and in every nn.Dropout: the ratio and the KL measure policy change and nothing else.
7. Prompts are left-padded; position ids come from the attention mask, so a padded prompt sees an unpadded one's.
8. Values: a zero-initialised scalar head in fp32 (bf16 would round them by ~0.4%) on a separate critic initialised from
   the reward model (same tokenizer) or the policy: 90% on the embedded task in fewer samples than --critic head (on the
   policy's trunk, cheaper per update; benchmarks/).
9. The LM head runs on response positions only, in chunks of at most 2^24 logits recomputed in backward, not kept:
   memory does not grow with length x vocabulary. One fp32 log-sum-exp gives log-probs and entropy.
10. GAE (gamma=1, lam=0.95) over response tokens, returns = advantages + values; the advantages are whitened over the
    batch's real tokens, the rewards optionally (masked, Bessel-corrected).
11. Clipped surrogate and clipped value loss, each a mean over real tokens; optional entropy bonus.
12. Epochs of shuffled minibatches, accumulated over micro-batches, with global grad-norm clipping, AdamW, optional
    linear lr decay and approx-KL early stop. A micro-batch's token mean is weighted by its share of the minibatch's
    real tokens (not sequences: lengths differ), so the gradient does not depend on --micro-batch-size.
13. beta fixed, or adapted towards a target KL (Ziegler et al.'s proportional controller).
14. Optional missing-EOS penalty and score clipping; scores whitened per batch by default with a reward model, whose
    scale is arbitrary (unnormalised, beta * KL was too weak to stop reward hacking).
15. A non-finite gradient stops the run before the optimizer step and saves the last good weights; Ctrl-C saves too.
16. A response ends at any EOS id, the tokenizer's and the generation_config's (chat models declare several), in
    generation, truncation, the missing-EOS penalty, evaluation and the logs.
17. Embeddings are resized to the tokenizer only to grow: checkpoints carry spare rows the model can sample.
18. The family's logit post-processing (Gemma's final_logit_softcapping, Cohere's logit_scale, Granite's logits_scaling)
    runs in each head chunk, before the temperature; a model whose logits this does not reproduce is refused.
19. Dtypes: trained weights are fp32 whatever the checkpoint's (bf16 AdamW updates of lr 1e-5 mostly round away),
    compute is bf16 autocast on CUDA; the reference, an fp32 copy scored by the same function in the same shapes, starts
    at KL exactly 0. The frozen reward model and a LoRA base keep their checkpoint dtype (a 7B base in fp32: 28 GB).
20. Sampling is softmax(logits / temperature), nothing else: the checkpoint's generation_config (repetition_penalty,
    top_k, min_p, ...), which transformers would apply silently, is replaced; --top-k / --top-p are refused: the ratio
    and KL need the log-probs of the distribution sampled (a truncated reference gives -inf outside its support).
21. Prompts are what the model was trained on (TRL's rule: the data decides): a conversation goes through the chat
    template with the assistant header (--chat-template / --system-prompt for plain strings); no second BOS; a long
    prompt loses its start, never the header; the end-of-turn token ends a response (detail 16).
22. --resume RUN_DIR goes on from RUN_DIR/checkpoint.pt, the whole state of the run (weights, AdamW, beta, every rank's
    RNG states, prompts drawn, wandb id): 2 updates and a resume to 4 log what 4 do. A stop inside an update saves the
    state after the last finished one with the weights of the moment: the resume redoes that update. Written to a
    temporary file and renamed: a crash while saving leaves the last one whole. Flags given win.
23. LoRA (--lora-r, through peft, as TRL): only adapters train, W x + (alpha / r) B A x on the trunk's linear layers. B
    starts at 0, so the base with its adapters off is the initial policy exactly: the reference, at no memory cost, with
    a first KL of 0. Adapter dropout is refused (detail 6).
24. Under torchrun (DDP) each rank rolls out its share of the prompts; the update is the one-process update on the union
    batch (minibatch k: the union of the ranks' k-th): every batch statistic is over all ranks, so they stop and skip
    together. Gradients are averaged once per minibatch; only rank 0 logs and saves.
"""

import contextlib
import copy
import functools
import importlib.util
import itertools
import json
import numbers
import os
import random
import re
import resource
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, fields, make_dataclass
from typing import Literal

import huggingface_hub.constants as hub_constants
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import transformers
import tyro
from torch.utils.tensorboard import SummaryWriter
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
)


@dataclass
class Experiment:
    """seeds, device, tracking, saving and resuming"""

    exp_name: str = "ppo_llm"
    """name of the experiment: the run directory and the wandb run start with it"""
    seed: int = 1
    """seed of python, numpy, torch and the prompt order"""
    cuda: bool = True
    """use CUDA when it is available"""
    mixed_precision: Literal["auto", "bf16", "no"] = "auto"
    """bf16 autocast over fp32 weights (detail 19); auto: on CUDA, not on CPU"""
    track: bool = False
    """log to Weights & Biases (WANDB_MODE=offline works)"""
    wandb_project_name: str = "rlhf-reference"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team)"""
    output_dir: str = "runs"
    """parent of the run directory, which gets metrics.jsonl, samples.jsonl and the saved policy"""
    save_every: int = 0
    """also save every N updates (0: only at the end)"""
    resume: str | None = None
    """continue the run in this run directory from its checkpoint.pt (detail 22); flags given override the saved ones"""


@dataclass
class Models:
    """policy, reward model or function, prompts, LoRA"""

    model: str = "assets/arith-sft"
    """policy and reference: a local directory or a hub id; assets/arith-sft is the embedded arithmetic SFT model"""
    reward_model: str | None = None
    """sequence-classification reward model (hub id or directory); without it --reward-fn scores"""
    reward_label: int | None = None
    """which logit of the reward model is the score, when it has several (lvwerra/distilbert-imdb: 1)"""
    reward_fn: str = "arithmetic"
    """reward function: arithmetic (exact answer), gsm8k (final answer vs '#### N'), format (an explicit final
    answer), or your own, path/to/file.py:function or module:function (README: "Your own reward function")"""
    dataset: str = "arithmetic"
    """prompts: `arithmetic` (built in, offline), a local .jsonl, .json, .csv or .parquet file, or a hub dataset"""
    dataset_config: str | None = None
    """hub dataset configuration (gsm8k: main)"""
    dataset_split: str = "train"
    """hub dataset split"""
    prompt_column: str = "prompt"
    """column of the prompts: strings, or lists of {"role", "content"} messages (gsm8k: question, imdb: text)"""
    answer_column: str = "answer"
    """column that holds the reference answer the reward function checks (compared as text)"""
    chat_template: bool = False
    """also put plain-string prompts through the chat template, as one user message (instruct models want it)"""
    system_prompt: str | None = None
    """a system message before each conversation (implies --chat-template for plain-string prompts)"""
    critic: Literal["head", "separate"] = "separate"
    """value function: a head on the policy's trunk, or a separate network (detail 8)"""
    gradient_checkpointing: bool = False
    """trade compute for memory in the policy and critic"""
    lora_r: int = 0
    """LoRA rank (0: off; detail 23); LoRA usually wants ~10x the --learning-rate of full fine-tuning"""
    lora_alpha: int = 32
    """LoRA scale numerator: the adapters add (alpha / r) B A x"""
    lora_dropout: float = 0.0
    """must stay 0: dropout on the adapters would move the first ratio away from 1 (detail 6)"""
    lora_target_modules: tuple[str, ...] | None = None
    """module names to adapt; None: every linear layer of the trunk, not the LM head (peft's all-linear)"""
    save_merged: bool = False
    """with --lora-r, also save the base with the adapters merged in, to policy/merged (transformers loads it)"""


@dataclass
class Generation:
    """sampling the responses"""

    max_new_tokens: int = 8
    """longest response (8 fits the arithmetic task; text tasks want 48 or more)"""
    max_prompt_length: int | None = None
    """longer prompts lose their start, as in TRL (unset: the model's context minus --max-new-tokens)"""
    temperature: float = 1.0
    """sampling temperature; log-probs use the same one (detail 4)"""
    top_k: int = 0
    """must stay 0: truncated sampling is refused for training (detail 20)"""
    top_p: float = 1.0
    """must stay 1.0: truncated sampling is refused for training (detail 20)"""
    cast_lm_head_to_fp32: bool = True
    """the LM head's matmul in fp32 under autocast (TRL's name); the log-sum-exp is fp32 either way"""


@dataclass
class Algorithm:
    """the PPO update, rewards and KL"""

    total_steps: int = 300
    """number of PPO updates (one rollout batch and its epochs each)"""
    prompts_per_update: int = 128
    """prompts per rollout batch, one response each (TRL: batch_size)"""
    num_mini_batches: int = 2
    """minibatches (optimizer steps) per epoch"""
    micro_batch_size: int = 64
    """sequences per forward pass: gradient accumulation in training, chunking in no-grad passes"""
    num_ppo_epochs: int = 2
    """passes over each rollout batch"""
    learning_rate: float | None = None
    """AdamW learning rate (unset: 1e-4 below 50M parameters, 1e-5 above; printed at start)"""
    weight_decay: float = 0.0
    """AdamW weight decay (0, as TRL and the N+ details; torch's own default is 0.01)"""
    anneal_lr: bool = False
    """decay the learning rate linearly to 0"""
    gamma: float = 1.0
    """discount over response tokens"""
    lam: float = 0.95
    """GAE lambda"""
    cliprange: float = 0.2
    """PPO clip range of the policy ratio"""
    cliprange_value: float = 0.2
    """clip range of the value update"""
    vf_coef: float = 0.1
    """value-loss weight"""
    ent_coef: float = 0.0
    """entropy-bonus weight"""
    max_grad_norm: float = 1.0
    """global gradient-norm clip"""
    target_kl: float | None = None
    """stop an update's epochs once an epoch's mean approx-KL, 1/2 (log rho)^2 (policy/approxkl_avg), passes this"""
    kl_coef: float = 0.05
    """beta of the per-token KL penalty (its start value with --kl-target)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """per-token KL estimator in the reward"""
    kl_target: float | None = None
    """adapt beta towards this KL per sequence (Ziegler et al.); off when unset"""
    kl_horizon: int = 10000
    """horizon (in samples) of the adaptive KL controller"""
    ref_update_every: int = 0
    """copy the policy into the reference every N updates (0: never)"""
    whiten_rewards: bool = False
    """whiten the per-token rewards (scale only) before GAE"""
    missing_eos_penalty: float | None = None
    """subtract this from the score of a response that never emits EOS"""
    score_norm: Literal["auto", "on", "off"] = "auto"
    """whiten the scores of each batch (mean 0, std 1); auto: on with --reward-model, off with --reward-fn"""
    score_clip: float | None = None
    """clip the scores to [-c, c] (after --score-norm)"""


@dataclass
class Logging:
    """evaluation and samples"""

    eval_every: int = 10
    """held-out accuracy on the arithmetic task (or --eval-split) every N updates (0: off)"""
    eval_split: str | None = None
    """split of --dataset (gsm8k: test), or a prompt file, evaluated with the reward function every --eval-every"""
    eval_size: int = 256
    """distinct prompts drawn from --eval-split (the arithmetic task has its own 256 held-out problems)"""
    eval_only: bool = False
    """print the accuracy of --model (runs/<run>/policy) on the eval set (--eval-split or --dataset-split), exit"""
    sample_every: int = 10
    """print and store a few decoded samples every N updates (0: off)"""
    num_samples: int = 3
    """samples shown each time"""


@dataclass
class Args(Logging, Algorithm, Generation, Models, Experiment):
    """PPO for language models (RLHF): a policy samples responses, a reward model or function scores them, PPO
    raises the score under a per-token KL penalty to the reference.

    python ppo_llm.py                                         # the embedded arithmetic task: CPU, a few minutes

    python ppo_llm.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset prompts.jsonl --reward-fn my_rewards.py:score
    """


# ALGO LOGIC: the numerics, small pure functions on tensors (checked by tests/ against hand-computed values)


def masked_mean(values, mask, axis=None):
    """sum(values * mask) / sum(mask), over `axis` or over everything."""
    return (values * mask).sum(axis) / mask.sum(axis)


def masked_whiten(values, mask, shift_mean=True):
    """(x - mean) / sqrt(var + 1e-8) over the masked entries, var Bessel-corrected (global_mean_var); with
    shift_mean=False the mean is added back: only the scale changes (TRL's convention)."""
    mean, var = global_mean_var(values, mask)  # over every rank's entries under torchrun (detail 24)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def kl_penalty(logprobs, ref_logprobs, estimator):
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's r = logp - ref_logp (Schulman 2020):
    k1 = r (unbiased, can be < 0); k2 = r^2 / 2 (biased, low variance); k3 = exp(-r) - 1 + r (unbiased, >= 0)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return torch.expm1(-log_ratio) + log_ratio


def compute_gae(rewards, values, mask, gamma, lam):
    """GAE over the response tokens, (B, T) -> (advantages, returns) (detail 10):
    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1},  returns = A + V.
    Rewards and values count as 0 where mask is 0 and past the last position (the episode ends at the last real
    token); advantages and returns are 0 where mask is 0."""
    rewards, values = rewards * mask, values * mask
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    deltas = rewards + gamma * next_values - values
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        last = deltas[:, t] + gamma * lam * last
        advantages[:, t] = last
    return advantages * mask, (advantages + values) * mask


def policy_loss(logprobs, old_logprobs, advantages, mask, clip_range):
    """PPO's clipped surrogate: masked mean of max(-A * rho, -A * clip(rho, 1 - eps, 1 + eps)),
    rho = exp(logprobs - old_logprobs). Returns (loss, stats): clipfrac, approxkl = mean (log rho)^2 / 2, mean rho."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    losses = -advantages * ratio
    clipped_losses = -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = masked_mean(torch.max(losses, clipped_losses), mask)
    with torch.no_grad():
        stats = {
            "policy/clipfrac_avg": masked_mean((clipped_losses > losses).float(), mask),
            "policy/approxkl_avg": 0.5 * masked_mean(log_ratio**2, mask),
            "val/ratio": masked_mean(ratio, mask),
        }
    return loss, stats


def value_loss(values, old_values, returns, mask, clip_range):
    """1/2 * masked mean of max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2). Returns (loss, stats)."""
    clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
    losses, clipped_losses = (values - returns) ** 2, (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(losses, clipped_losses), mask)
    with torch.no_grad():
        stats = {"val/clipfrac_avg": masked_mean((clipped_losses > losses).float(), mask)}
    return loss, stats


def normalize_scores(scores, whiten, clip):
    """Detail 14: the scores (B,) as the rewards get them: whitened over the batch (every rank's) when `whiten`, then
    clipped to [-clip, clip] unless clip is None. The logs show them before."""
    scores = masked_whiten(scores, torch.ones_like(scores)) if whiten else scores
    return scores if clip is None else scores.clamp(-clip, clip)


def adaptive_kl_coef(kl_coef, kl, target, horizon, n_steps):
    """Ziegler et al.'s proportional controller (detail 13), the beta after n_steps more sequences of mean KL kl:
    beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon)."""
    proportional_error = min(max(kl / target - 1, -0.2), 0.2)
    return kl_coef * (1 + proportional_error * n_steps / horizon)


# TASKS: prompts and reward functions (the arithmetic block is identical in grpo_llm.py and assets/)

ARITH_MAX_OPERAND = 99
ARITH_EVAL_SEED = 2024
ARITH_EVAL_SIZE = 256


def arithmetic_problem(rng: random.Random) -> dict:
    """One addition problem `a+b=` and its answer, a and b uniform in [0, ARITH_MAX_OPERAND]."""
    a, b = rng.randint(0, ARITH_MAX_OPERAND), rng.randint(0, ARITH_MAX_OPERAND)
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def arithmetic_eval_set() -> list[dict]:
    """The fixed held-out set: the first ARITH_EVAL_SIZE distinct problems drawn with ARITH_EVAL_SEED."""
    rng, seen, problems = random.Random(ARITH_EVAL_SEED), set(), []
    while len(problems) < ARITH_EVAL_SIZE:
        p = arithmetic_problem(rng)
        if p["prompt"] not in seen:
            seen.add(p["prompt"])
            problems.append(p)
    return problems


def arithmetic_train_problems(seed: int):
    """An endless stream of training problems; none of them is in the held-out set."""
    held_out = {p["prompt"] for p in arithmetic_eval_set()}
    rng = random.Random(seed)
    while True:
        p = arithmetic_problem(rng)
        if p["prompt"] not in held_out:
            yield p


def arithmetic_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 for exactly the right answer (surrounding whitespace ignored), else 0.0."""
    return [float(c.strip() == a) for c, a in zip(completions, answers)]


NUMBER = r"[-+]?\$?\s?[-+]?\d(?:[\d,]*\d)?(?:\.\d+)?"  # -12, $1,234, 3.5, -$5


def final_answer(text, strict=False):
    """The last number stated after '####' (GSM8K's format), in \\boxed{} or after 'answer is' / 'answer:'; else,
    unless strict, the text's last number; None if none. Commas and '$' are ignored, and 42.0 is 42."""
    for marker in [r"####([^\n]*)", r"\\boxed\{([^{}]*)\}", r"answer(?:\s+is|:)([^\n]*)"]:
        stated = [m for m in re.findall(marker, text, flags=re.IGNORECASE) if re.search(NUMBER, m)]
        if stated:
            return float(re.sub(r"[$,\s]", "", re.search(NUMBER, stated[-1]).group()))
    found = [] if strict else re.findall(NUMBER, text)
    return float(re.sub(r"[$,\s]", "", found[-1])) if found else None


def gsm8k_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the completion's final answer (final_answer) equals the reference's ('#### N' in GSM8K)."""
    return [
        float(final_answer(c) is not None and final_answer(c) == final_answer(a)) for c, a in zip(completions, answers)
    ]


def format_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the completion states a final answer in so many words ('####', \\boxed{}, 'the answer is'),
    right or wrong: a second reward that teaches the format the first one reads."""
    return [float(final_answer(c, strict=True) is not None) for c in completions]


REWARD_FNS = {"arithmetic": arithmetic_reward, "gsm8k": gsm8k_reward, "format": format_reward}


@functools.cache
def load_reward_fn(spec):
    """--reward-fn as f(completions, rows) -> a float per completion. A name in REWARD_FNS gets (completions, answers);
    `path/to/file.py:function` or `module:function` is called by keyword, as TRL calls one: fn(completions=[str],
    prompts=[strings or message lists], **every other column of the dataset by name, a list each; answers as text)."""
    if spec in REWARD_FNS:
        return lambda completions, rows: REWARD_FNS[spec](completions, [row["answer"] for row in rows])
    source, _, name = spec.rpartition(":")
    try:
        if source.endswith(".py"):
            module_spec = importlib.util.spec_from_file_location(os.path.basename(source)[:-3], source)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(source)
        fn = getattr(module, name)
    except (OSError, ImportError, ValueError, AttributeError) as e:
        why = f" ({type(e).__name__}: {e})" if source else ""
        raise SystemExit(f"error: --reward-fn {spec}: not one of {sorted(REWARD_FNS)}, nor a path/to/file.py:function "
                         f"or module:function{why}") from None  # fmt: skip

    def user_fn(completions, rows):
        scores = fn(completions=completions, **{k: [row["columns"][k] for row in rows] for k in rows[0]["columns"]})
        ok = isinstance(scores, list | tuple) and all(isinstance(x, numbers.Real) for x in scores)
        if not ok or len(scores) != len(completions):
            raise SystemExit(f"error: --reward-fn {spec} must return a list of {len(completions)} numbers, one per "
                             f"completion (got {str(scores)[:60]})")  # fmt: skip
        return [float(x) for x in scores]

    return user_fn


def render_prompt(tokenizer, prompt, chat_template, system_prompt, where):
    """Detail 21: (the text the policy sees, its conversation or None). A list of {"role", "content"} messages goes
    through the chat template; a plain string too, as one user message, under --chat-template or --system-prompt."""
    if isinstance(prompt, str) and not chat_template and system_prompt is None:
        return prompt, None
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and m.get("role") and m.get("content") is not None for m in messages):  # fmt: skip
        raise SystemExit(f"error: {where}: the prompt is neither a string nor a list of {{role, content}} messages")
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    if tokenizer.chat_template is None:
        need = "--chat-template and --system-prompt need" if isinstance(prompt, str) else "conversational prompts need"
        raise SystemExit(f"error: --model {tokenizer.name_or_path}: its tokenizer has no chat template, which {need}")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), messages


def read_dataset(args):
    """--dataset's rows (dicts), by datasets.load_dataset: a local .jsonl, .json, .csv or .parquet file, or a hub id."""
    import datasets  # only this path needs it, and it is slow to import

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # failures are reported below, in one line
    ext = os.path.splitext(args.dataset)[1]
    fmt = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(ext)
    if fmt is None:
        check_hub()
        datasets.config.HF_HUB_OFFLINE |= hub_constants.HF_HUB_OFFLINE  # datasets keeps its own copy of the switch
    elif not os.path.isfile(args.dataset) or os.path.getsize(args.dataset) == 0:
        why = "empty file" if os.path.isfile(args.dataset) else "no such file"
        raise SystemExit(f"error: --dataset {args.dataset}: {why}")
    elif args.dataset_split != "train":  # datasets names a file's one split "train"
        raise SystemExit(
            f"error: --dataset {args.dataset} is one file, with no split {args.dataset_split!r} "
            "(--dataset-split, --eval-split); evaluation prompts can be a file: --eval-split FILE"
        )
    try:
        if fmt is None:
            return list(datasets.load_dataset(args.dataset, args.dataset_config, split=args.dataset_split))
        return list(datasets.load_dataset(fmt, data_files=args.dataset, split="train"))
    except Exception as e:
        if isinstance(e, ConnectionError):
            raise SystemExit(f"error: --dataset {args.dataset} could not be fetched from the hub ({type(e).__name__}); "
                             "a local .jsonl, .json, .csv or .parquet file works offline, and HF_HUB_OFFLINE=1 skips "
                             "the network") from None  # fmt: skip
        if args.dataset.endswith(".jsonl"):
            with open(args.dataset) as f:
                for i, line in enumerate(f, 1):
                    try:
                        json.loads(line) if line.strip() else None
                    except json.JSONDecodeError:
                        raise SystemExit(f"error: --dataset {args.dataset}: line {i} is not JSON") from None
        cause = e.__cause__ or e  # datasets wraps the reader's own error
        raise SystemExit(f"error: --dataset {args.dataset} could not be loaded ({type(cause).__name__}: "
                         f"{(str(cause).strip() or 'no rows').splitlines()[0]})") from None  # fmt: skip


def prompt_row(row, where, tokenizer, args):
    """A dataset row as {"prompt": the text the policy sees, "answer": the reference as text or None, "messages": the
    conversation (None for a plain prompt), "columns": what a user's reward function gets besides the completions}."""
    if row.get(args.prompt_column) is None:
        raise SystemExit(f"error: --dataset {args.dataset}: {where} has no --prompt-column {args.prompt_column} "
                         f"(columns: {', '.join(k for k, v in row.items() if v is not None)})")  # fmt: skip
    answer = row.get(args.answer_column)
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)  # a CSV column with a gap is read as floats: 2.0 must still read "2"
    answer = None if answer is None else str(answer)
    text, messages = render_prompt(tokenizer, row[args.prompt_column], args.chat_template, args.system_prompt,
                                   f"--dataset {args.dataset}, {where}")  # fmt: skip
    columns = {"prompts": row[args.prompt_column]} | {k: v for k, v in row.items() if k != args.prompt_column}
    if args.answer_column in row:
        columns[args.answer_column] = answer
    return {"prompt": text, "answer": answer, "messages": messages, "columns": columns}


def load_prompts(args, tokenizer):
    """Endless iterator of --dataset's prompt_row()s, reshuffled every pass. Answers are all there or all absent,
    and there when a built-in reward function reads them (arithmetic, gsm8k; without --reward-model)."""
    if args.dataset == "arithmetic":
        return (prompt_row(p, "a problem", tokenizer, args) for p in arithmetic_train_problems(args.seed))
    rows = [prompt_row(row, f"row {i}", tokenizer, args) for i, row in enumerate(read_dataset(args), 1)]
    names = [args.reward_fn] if isinstance(args.reward_fn, str) else args.reward_fn
    needed = args.reward_model is None and {"arithmetic", "gsm8k"} & set(names)
    missing = [i for i, row in enumerate(rows, 1) if row["answer"] is None]
    if missing and (needed or len(missing) < len(rows)):
        raise SystemExit(f"error: --dataset {args.dataset}: row {missing[0]} has no --answer-column "
                         f"{args.answer_column}, which the reward function needs")  # fmt: skip

    def cycle(rng=random.Random(args.seed)):
        while True:
            rng.shuffle(rows)
            yield from rows

    return cycle()


class PromptStream:
    """load_prompts' rows for this rank (rows rank, rank + world, ...: detail 24), counted (detail 22): a resumed run
    re-creates the seeded stream and skips the `cursor` rows it has drawn."""

    def __init__(self, rows, rank, world, cursor):
        self.rows, self.cursor = itertools.islice(rows, rank + world * cursor, None, world), cursor

    def __next__(self):
        self.cursor += 1
        return next(self.rows)


# MODELS: loading, generation, the forward pass and its head, scores

LM_HEAD_CHUNK = 2**24  # logits per chunk of lm_head_logprobs (64 MiB in fp32), whatever the vocabulary


def resolve(path):
    """A repo-relative asset path (assets/...) also works from another working directory."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), path)
    return here if not os.path.exists(path) and os.path.exists(here) else path


@functools.cache
def check_hub():
    """Ask the hub once, for 5 s at most; when it does not answer, go offline (as HF_HUB_OFFLINE=1 does), so that a
    hub id loads from the local cache or fails at once, not after ~50 s of retries."""
    if hub_constants.HF_HUB_OFFLINE:
        return
    try:
        urllib.request.urlopen(urllib.request.Request(hub_constants.ENDPOINT, method="HEAD"), timeout=5)
    except urllib.error.HTTPError:
        pass  # it answered
    except OSError:
        hub_constants.HF_HUB_OFFLINE = True
        print(f"note: {hub_constants.ENDPOINT} does not answer: hub ids load from the local cache only")


def from_pretrained(cls, name, flag, **kwargs):
    """cls.from_pretrained(name) with a one-line error for a missing directory or an unreachable hub."""
    if not os.path.isdir(name):
        check_hub()
    try:
        return cls.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        where = "could not be loaded" if os.path.isdir(name) else "is not a local directory, nor reachable on the hub"
        raise SystemExit(f"error: {flag} {name} {where} ({type(e).__name__}). A local directory (save_pretrained) "
                         "works offline, HF_HUB_OFFLINE=1 skips the network; the embedded default: omit --model "
                         "(assets/arith-sft), --reward-model assets/arith-rm") from None  # fmt: skip


def load_model(cls, name, flag, dtype=torch.float32):
    """Every dropout zeroed, in the config and in nn.Dropout modules (detail 6); fp32 unless dtype says (detail 19)."""
    config = from_pretrained(AutoConfig, name, flag)
    for key, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    model = from_pretrained(cls, name, flag, config=config, dtype=dtype)
    for module in model.modules():  # for models that hard-code one
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def add_lora(model, args):
    """Detail 23: peft's LoRA on a frozen base, B = 0 at start; fp32 adapters (peft's default) on a base kept as is."""
    try:
        import peft  # optional: only LoRA runs need it
    except ImportError:
        raise SystemExit("error: --lora-r needs peft, which is not installed: pip install peft") from None
    config = peft.LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        target_modules=list(args.lora_target_modules or []) or "all-linear",  # all-linear leaves out the LM head
        task_type="CAUSAL_LM" if model.get_output_embeddings() is not None else None,
    )  # fmt: skip
    model = peft.get_peft_model(model, config)
    if hasattr(model.get_output_embeddings(), "lora_A"):
        raise SystemExit("error: --lora-target-modules: not the LM head, whose log-probs come from its weight alone "
                         "(detail 9): its adapters would never train")  # fmt: skip
    return model


def reference_model(policy):
    """The frozen reference: an fp32 copy of the policy (detail 19), or with LoRA the policy itself (detail 23)."""
    return policy if hasattr(policy, "disable_adapter") else copy.deepcopy(policy).requires_grad_(False)


def adapters_off(model):
    """A context in which a LoRA model is its frozen base, the reference (peft's disable_adapter); else nothing."""
    return model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()


def add_pad_token(tokenizer, eos_ids=()):
    """Give a tokenizer its own pad token unless it has one that ends no response (detail 16; Qwen2.5's pad is one of
    its EOS ids): a reward model reads the last non-pad token, and a padded end would look like an end."""
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id in {tokenizer.eos_token_id, *eos_ids}:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
        print(f"note: the tokenizer had no pad token distinct from EOS; added [PAD] (id {tokenizer.pad_token_id})")


def fit_embeddings(model, tokenizer):
    """Grow the embeddings to the tokenizer, never shrink them (detail 17; Qwen2: 151,936 rows for ~151.6k tokens)."""
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id


def context_window_of(config):
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def end_of_turn_id(tokenizer):
    """The special token that the tokenizer's chat template closes an assistant turn with (Qwen's <|im_end|>,
    Llama-3's <|eot_id|>, Gemma's <end_of_turn>), found by rendering one; None without a template or such a token."""
    if tokenizer.chat_template is None:
        return None
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Ok"}]
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False)
    except Exception:  # a template may refuse this conversation (one that needs a system turn, say)
        return None
    ids = tokenizer(text[text.rindex("Ok") + 2 :], add_special_tokens=False).input_ids
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    special -= {tokenizer.unk_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id}  # text unknown, or no end
    return ids[0] if ids and ids[0] in special else None


def eos_token_ids(tokenizer, generation_config):
    """Every id that ends a response (detail 16): the tokenizer's EOS, the generation_config's (Qwen2.5-Instruct: its
    <|im_end|> and <|endoftext|>), the chat template's end of turn (detail 21: a base model's config has only EOS)."""
    ids = generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return sorted({tokenizer.eos_token_id, *ids} | ({end_of_turn_id(tokenizer)} - {None}))


def sampling_config(max_new_tokens, temperature, pad_token_id, eos_ids):
    """What generate() samples with, and the saved policy carries (detail 20): softmax(logits / temperature). It
    replaces the checkpoint's generation_config, whose fields would fill any left unset here."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
        pad_token_id=pad_token_id, eos_token_id=eos_ids,
    )  # fmt: skip


@torch.no_grad()
def generate(policy, queries, query_mask):
    """Responses (B, R) to left-padded prompts (B, Q), sampled with sampling_config (position ids from the mask)."""
    return policy.generate(input_ids=queries, attention_mask=query_mask)[:, queries.shape[1] :]


def truncate_after_eos(responses, eos_ids, pad_token_id):
    """Detail 2: keep the tokens up to and including the first EOS (any of eos_ids). Returns (responses, mask)."""
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device))
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0  # an EOS strictly before this position
    return responses.masked_fill(after_eos, pad_token_id), ~after_eos


def hidden_states(model, query_responses, attention_mask, prompt_width):
    """The trunk's last hidden states (B, R, H) at the positions that predict the response: the state at t predicts
    token t + 1, so query_responses[:, prompt_width:] comes from prompt_width - 1 ... -2 (the off-by-one shift)."""
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # detail 7
    # a peft model's .base_model is its LoRA wrapper, whose forward ends in the LM head: take the trunk under it
    trunk = model.get_base_model().base_model if hasattr(model, "get_base_model") else model.base_model
    out = trunk(input_ids=query_responses, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state[:, prompt_width - 1 : -1]


def logit_postprocessing(config):
    """(scale, softcap) of the family's logits (detail 18): logits * scale (Cohere's logit_scale, Granite's
    1 / logits_scaling), then softcap * tanh(logits / softcap) (Gemma 2 and 3's final_logit_softcapping)."""
    scale = (getattr(config, "logit_scale", None) or 1.0) / (getattr(config, "logits_scaling", None) or 1.0)
    return scale, getattr(config, "final_logit_softcapping", None)


def head_chunk(hidden, weight, bias, temperature, scale, softcap):
    """One chunk's post-processed logits z = softcap(scale * a) / temperature, a = h W^T + b: (N, H) -> (N, V),
    fp32, the matmul in the dtype that its inputs were cast to. In place after the matmul: every new (N, V) tensor
    is another pass over memory (and, on a CPU, fresh pages from the kernel)."""
    z = F.linear(hidden, weight, bias).float()  # the log-sum-exp arithmetic is always fp32
    if softcap:
        return z.mul_(scale / softcap).tanh_().mul_(softcap / temperature)
    return z.mul_(scale / temperature) if scale != temperature else z


class ChunkedHead(torch.autograd.Function):
    """lm_head_logprobs' autograd. Forward keeps no logits, only each token's logsumexp (and entropy); backward
    recomputes the logits chunk by chunk and adds each chunk's gradient in place to one weight (and bias)
    gradient, where autograd through the chunks would make and sum a (V, H) weight gradient per chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, scale, softcap, with_entropy, dtype):
        w, b, n = weight.to(dtype), None if bias is None else bias.to(dtype), max(1, LM_HEAD_CHUNK // len(weight))
        logsumexp = hidden.new_empty(len(hidden), dtype=torch.float32)
        logprobs, entropy = torch.empty_like(logsumexp), torch.empty_like(logsumexp) if with_entropy else None
        with torch.autocast(hidden.device.type, enabled=False):  # the matmul runs in `dtype`
            for i in range(0, len(hidden), n):
                s = slice(i, i + n)
                logp = head_chunk(hidden[s].to(dtype), w, b, temperature, scale, softcap)
                logsumexp[s] = torch.logsumexp(logp, dim=-1)
                logp -= logsumexp[s, None]  # log softmax, in place
                logprobs[s] = logp.gather(-1, labels[s, None])[:, 0]
                if with_entropy:  # H = -sum_v p_v log p_v
                    entropy[s] = logp.exp().mul_(logp).sum(-1).neg_()
                del logp  # before the next chunk's logits exist
        ctx.save_for_backward(hidden, weight, bias, labels, logsumexp, entropy)
        ctx.settings = temperature, scale, softcap, dtype, n
        ctx.set_materialize_grads(False)  # an output that the loss does not use gets None: its terms are skipped
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        """With g = d loss / d log p_y and g_H = d loss / d H: d log p_y / d z_j = δ_jy - p_j and
        d H / d z_j = -p_j (log p_j + H), so d loss / d z_j = g δ_jy - p_j (g + g_H (log p_j + H))."""
        hidden, weight, bias, labels, logsumexp, entropy = ctx.saved_tensors
        temperature, scale, softcap, dtype, n = ctx.settings
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = grad_bias = None  # stay None for a frozen head (LoRA); summed in fp32 whatever their dtype
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, len(hidden), n):
                s, h = slice(i, i + n), hidden[i : i + n].to(dtype)
                logp = head_chunk(h, w, b, temperature, scale, softcap)
                # d softcap tanh(x / softcap) / d x = 1 - tanh^2 = 1 - (temperature z / softcap)^2
                d_softcap = (logp * (temperature / softcap)).square_().neg_().add_(1) if softcap else None
                logp -= logsumexp[s, None]
                grad = logp.exp()  # p, then d loss / d z = g δ_jy - p_j c_j, c_j = g + g_H (log p_j + H)
                c = 0.0 if grad_logprobs is None else grad_logprobs[s, None]
                if grad_entropy is not None:
                    c = logp.add_(entropy[s, None]).mul_(grad_entropy[s, None]).add_(c)  # in place of logp
                grad.mul_(c).neg_()
                if grad_logprobs is not None:
                    grad[torch.arange(len(h)), labels[s]] += grad_logprobs[s]
                del logp
                if softcap:
                    grad *= d_softcap
                if scale != temperature:
                    grad *= scale / temperature  # d loss / d a
                if grad_hidden is not None:  # d a / d h = W
                    grad_hidden[s] = grad.to(dtype) @ w
                if ctx.needs_input_grad[1]:  # d a / d W = h, summed over the chunks in place
                    grad_weight = grad.T @ h.float() if i == 0 else grad_weight.addmm_(grad.T, h.float())
                if ctx.needs_input_grad[2]:
                    grad_bias = grad.sum(0) if i == 0 else grad_bias.add_(grad.sum(0))
                del grad
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def lm_head_logprobs(hidden, head, labels, temperature, scale=1.0, softcap=None, with_entropy=False, fp32=True):
    """Log-probs of labels (B, T) and, optionally, entropies (B, T) of the next-token distributions, from the last
    hidden states (B, T, H) and the output embedding `head`, in chunks of tokens (details 4, 9, 18).

    logits = softcap(scale * head(h)) / temperature;  log p = logits - logsumexp(logits);  H = -sum_v p_v log p_v.
    Two or three tensors the size of one chunk (at most LM_HEAD_CHUNK logits) exist at once."""
    (B, T), device = labels.shape, hidden.device.type
    if fp32:  # the matmul in fp32 even under autocast (--cast-lm-head-to-fp32)
        dtype = torch.float32
    else:  # where F.linear would run it: in autocast's dtype, or else the weight's
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    logprobs, entropy = ChunkedHead.apply(
        hidden.reshape(B * T, -1), head.weight, head.bias, labels.reshape(B * T), temperature, scale, softcap,
        with_entropy, dtype,
    )  # fmt: skip
    return logprobs.view(B, T), entropy.view(B, T) if with_entropy else None


def response_logprobs(model, hidden, responses, args, with_entropy=False):
    """lm_head_logprobs with the model's own output embedding and logit post-processing, at --temperature."""
    scale, softcap = logit_postprocessing(model.config)
    return lm_head_logprobs(
        hidden, model.get_output_embeddings(), responses, args.temperature, scale, softcap, with_entropy,
        args.cast_lm_head_to_fp32,
    )  # fmt: skip


@torch.no_grad()
def check_logits(model, flag, name):
    """Detail 18: the model's own log-softmax and lm_head_logprobs' must agree on a few tokens."""
    ids = torch.arange(1, 9, device=model.device)[None] % model.get_output_embeddings().weight.shape[0]
    mask = torch.ones_like(ids)
    expected = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), dim=-1)
    expected = expected.gather(-1, ids[:, 1:, None])[..., 0]
    scale, softcap = logit_postprocessing(model.config)
    # the head's matmul in the model's own dtype, as its forward does (a LoRA base may be bf16, detail 23)
    got, _ = lm_head_logprobs(hidden_states(model, ids, mask, 1), model.get_output_embeddings(), ids[:, 1:], 1.0,
                              scale, softcap, fp32=False)  # fmt: skip
    error = (got - expected).abs().max().item()
    if error > 1e-3:
        raise SystemExit(f"error: {flag} {name}: its forward changes the logits in a way this script does not "
                         f"reproduce (log-probs {error:.3g} apart); supported: logit_scale, logits_scaling, "
                         "final_logit_softcapping")  # fmt: skip


def tokenize_texts(tokenizer, texts, max_length):
    """Padded ids of texts, cut to max_length on the tokenizer's truncation side (left keeps a prompt's header, detail
    21); no special tokens for texts that start with the BOS, as chat templates write them (Llama-3 would see two)."""
    special = not (tokenizer.bos_token and all(t.startswith(tokenizer.bos_token) for t in texts))
    return tokenizer(texts, padding=True, truncation=max_length is not None, max_length=max_length,
                     add_special_tokens=special, return_tensors="pt")  # fmt: skip


def rm_text(rm_tokenizer, row, completion):
    """What a reward model with its own tokenizer reads: the conversation and completion through its own chat template
    when it has one (detail 21: it scores what it was trained on), else the prompt as the policy saw it + completion."""
    if rm_tokenizer.chat_template is None:
        return row["prompt"] + completion
    messages = row["messages"] or [{"role": "user", "content": row["prompt"]}]
    return rm_tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": completion}], tokenize=False)


@torch.no_grad()
def reward_model_scores(reward_model, rm_tokenizer, query_responses, attention_mask, rows, completions, label, chunk):
    """Score of each sequence (B,), read at its last real token. rm_tokenizer None: the ids are scored as they are;
    otherwise the reward model reads rm_text, cut on the left to its context (the prompt's start goes first)."""
    if rm_tokenizer is None:
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
        inputs = dict(input_ids=query_responses, attention_mask=attention_mask, position_ids=position_ids)
    else:
        context = min(rm_tokenizer.model_max_length, context_window_of(reward_model.config) or 2**31)
        texts = [rm_text(rm_tokenizer, row, c) for row, c in zip(rows, completions)]
        inputs = {k: v.to(reward_model.device) for k, v in tokenize_texts(rm_tokenizer, texts, context).items()}
    n = len(completions)
    logits = [reward_model(**{k: v[i : i + chunk] for k, v in inputs.items()}).logits for i in range(0, n, chunk)]
    return torch.cat(logits)[:, label].float()


def load_models(args, device):
    """(tokenizer, policy, reward_model, rm_tokenizer, max_prompt_length, eos_ids): the policy on the CPU (details 18
    to 20, 23), the frozen reward model on `device` in its checkpoint dtype; each failure a one-line error."""
    args.model = resolve(args.model)
    tokenizer = from_pretrained(AutoTokenizer, args.model, "--model", padding_side="left", truncation_side="left")
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"error: --model {args.model}: the tokenizer has no EOS token, so no response could end")
    policy = load_model(AutoModelForCausalLM, args.model, "--model", "auto" if args.lora_r else torch.float32)
    check_logits(policy, "--model", args.model)
    context = context_window_of(policy.config)
    if context is not None and args.max_new_tokens >= context:
        raise SystemExit(f"error: --max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model's "
                         f"context of {context} tokens")  # fmt: skip
    max_prompt_length = args.max_prompt_length or (context - args.max_new_tokens if context else None)
    if context is not None and max_prompt_length + args.max_new_tokens > context:
        raise SystemExit(f"error: --max-prompt-length {max_prompt_length} + --max-new-tokens {args.max_new_tokens} "
                         f"exceeds the model's context of {context} tokens")  # fmt: skip
    reward_model = rm_tokenizer = None
    if args.reward_model is not None:
        args.reward_model = resolve(args.reward_model)
        reward_model = load_model(AutoModelForSequenceClassification, args.reward_model, "--reward-model", "auto")
        num_labels = reward_model.config.num_labels
        if num_labels != 1 and args.reward_label is None:
            raise SystemExit(f"error: --reward-model {args.reward_model} has num_labels={num_labels}; "
                             "a reward model gives one score: pass --reward-label to choose the logit")  # fmt: skip
        if args.reward_label is not None and not 0 <= args.reward_label < num_labels:
            raise SystemExit(f"error: --reward-label {args.reward_label} is not a logit of --reward-model "
                             f"{args.reward_model} (num_labels={num_labels}: 0 to {num_labels - 1})")  # fmt: skip
        rm_tokenizer = from_pretrained(AutoTokenizer, args.reward_model, "--reward-model", truncation_side="left")
        if rm_tokenizer.get_vocab() == tokenizer.get_vocab():
            rm_tokenizer = None  # same tokens: score the ids directly, no decode / re-encode
        else:
            add_pad_token(rm_tokenizer)
            fit_embeddings(reward_model, rm_tokenizer)
        reward_model.to(device).eval().requires_grad_(False)
    eos_ids = eos_token_ids(tokenizer, policy.generation_config)
    add_pad_token(tokenizer, eos_ids)
    for model in [policy] + ([reward_model] if reward_model is not None and rm_tokenizer is None else []):
        fit_embeddings(model, tokenizer)
    policy.generation_config = sampling_config(args.max_new_tokens, args.temperature, tokenizer.pad_token_id, eos_ids)
    if args.lora_r:
        policy = add_lora(policy, args)
    return tokenizer, policy, reward_model, rm_tokenizer, max_prompt_length, eos_ids


# PLUMBING: set-up, the run directory, the rollout, timing (identical in grpo_llm.py)


def setup(args):
    """Seeds, device and autocast (detail 19). Returns (device, autocast, a line saying which)."""
    transformers.utils.logging.disable_progress_bar()
    transformers.set_seed(args.seed)  # python's random, numpy, torch
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    bf16 = args.mixed_precision == "bf16" or (args.mixed_precision == "auto" and device.type == "cuda")
    precision = "fp32 weights, bf16 autocast" if bf16 else "fp32 weights and compute"
    print(f"device: {device}, {precision}")
    return device, torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16), precision


class RunLogger:
    """runs/<exp-name>__<seed>__<ms>/ (or --resume's): args.json (and the device and precision), metrics.jsonl (a line
    per update) and TensorBoard's events, samples.jsonl, the saved policy, checkpoint.pt; wandb with --track."""

    def __init__(self, args, device, precision, wandb_id=None):
        name = f"{args.exp_name}__{args.seed}__{int(time.time() * 1000)}"  # ms: runs started together stay apart
        self.run_dir = args.resume or os.path.join(args.output_dir, name)  # a resumed run appends to its own
        os.makedirs(self.run_dir, exist_ok=True)
        config = asdict(args) | {"device": str(device), "precision": precision}
        with open(os.path.join(self.run_dir, "args.json"), "w") as f:
            json.dump(config, f, indent=1)
        # line-buffered: each line is on disk as soon as it is written (tail -f)
        self.metrics = open(os.path.join(self.run_dir, "metrics.jsonl"), "a", buffering=1)
        self.samples = open(os.path.join(self.run_dir, "samples.jsonl"), "a", buffering=1)
        self.tensorboard = SummaryWriter(self.run_dir)
        self.wandb = None
        if args.track:
            import wandb

            self.wandb = wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=config,
                                    name=os.path.basename(os.path.normpath(self.run_dir)), dir=self.run_dir,
                                    save_code=True, id=wandb_id, resume="allow" if wandb_id else None)  # fmt: skip

    def log(self, metrics):
        self.metrics.write(json.dumps(metrics) + "\n")
        for key in metrics.keys() - {"update"}:  # the same names as metrics.jsonl (`tensorboard --logdir runs`)
            self.tensorboard.add_scalar(key, metrics[key], metrics["update"])
        self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=metrics["update"])

    def log_samples(self, samples):
        for sample in samples:
            self.samples.write(json.dumps(sample) + "\n")
            values = "  ".join(f"{k} {v:.2f}" for k, v in sample.items() if isinstance(v, float))
            print(f"  {sample['prompt']!r} -> {sample['completion']!r}  {values}")

    def close(self):
        for f in [self.metrics, self.samples, self.tensorboard]:
            f.close()
        if self.wandb is not None:
            self.wandb.finish()


@torch.no_grad()
def rollout(policy, tokenizer, prompts, max_prompt_length, eos_ids, autocast):
    """Step 1: the prompts left-padded (detail 7) and cut on the left, a sampled response each, cut after its first EOS
    (detail 2). Returns {query_responses, attention_mask (B, Q + R), responses, mask (B, R) float, prompt_width Q}."""
    enc = tokenize_texts(tokenizer, prompts, max_prompt_length)
    empty = [prompt for prompt, n in zip(prompts, enc.attention_mask.sum(1).tolist()) if n == 0]
    if empty:  # generate() would fail deep inside
        raise SystemExit(f"error: prompt {empty[0]!r} encodes to no tokens with --model's tokenizer (a wrong one?)")
    enc = enc.to(policy.device)
    policy.eval()
    with autocast:
        responses = generate(policy, enc.input_ids, enc.attention_mask)
    responses, mask = truncate_after_eos(responses, eos_ids, tokenizer.pad_token_id)
    return dict(
        query_responses=torch.cat([enc.input_ids, responses], 1), prompt_width=enc.input_ids.shape[1],
        attention_mask=torch.cat([enc.attention_mask, mask.long()], 1), responses=responses, mask=mask.float(),
    )  # fmt: skip


def evaluate(policy, tokenizer, problems, reward_fn, eos_ids, max_prompt_length, chunk, autocast):
    """Held-out accuracy: mean reward-function score over `problems`, sampling as in training, and its standard error
    std / sqrt(n) (sqrt(p (1 - p) / n) for a 0/1 reward): evaluations of one policy differ by chance by ~1.4x that."""
    correct = []
    for i in range(0, len(problems), chunk):
        batch = problems[i : i + chunk]
        r = rollout(policy, tokenizer, [p["prompt"] for p in batch], max_prompt_length, eos_ids, autocast)
        completions = tokenizer.batch_decode(r["responses"], skip_special_tokens=True)
        correct += reward_fn(completions, batch)
    stderr = torch.tensor(correct, dtype=torch.float64).std(correction=0).item() / len(correct) ** 0.5
    return {"eval/accuracy": sum(correct) / len(correct), "eval/accuracy_stderr": stderr}


def eval_line(metrics):
    return f"held-out accuracy {metrics['eval/accuracy']:.3f} ± {metrics['eval/accuracy_stderr']:.3f}"


def eval_rows(args, tokenizer):
    """What evaluate() scores: the arithmetic task's held-out set, or up to --eval-size distinct prompts of --dataset's
    --eval-split or of the --eval-split file (--eval-only: default --dataset-split); None when there is neither. The
    same prompts whatever --seed, so that runs of different seeds compare."""
    if args.dataset == "arithmetic":
        if args.eval_split is not None:
            raise SystemExit(f"error: --eval-split {args.eval_split} goes with --dataset: the arithmetic task has its "
                             "own held-out set")  # fmt: skip
        return [prompt_row(p, "a problem", tokenizer, args) for p in arithmetic_eval_set()]
    split = args.eval_split or (args.dataset_split if args.eval_only else None)
    if split is None:
        return None
    source = {"dataset": split} if os.path.isfile(split) else {"dataset_split": split}
    prompts = load_prompts(Args(**asdict(args) | source | {"seed": 0}), tokenizer)
    rows = list({row["prompt"]: row for row in (next(prompts) for _ in range(args.eval_size))}.values())
    if rows[0]["answer"] is None:  # the reward function checks answers, even beside a reward model
        raise SystemExit(f"error: evaluation needs --answer-column {args.answer_column} in --dataset {args.dataset}")
    return rows


def eval_only(args, policy, tokenizer, reward_fn, eos_ids, max_prompt_length, autocast):
    """--eval-only, no run directory. Evaluations of a policy differ by < 1.96 sqrt(2) = 2.8 stderr 95% of the time."""
    problems = eval_rows(args, tokenizer)
    result = evaluate(
        policy, tokenizer, problems, reward_fn, eos_ids, max_prompt_length, args.micro_batch_size, autocast
    )
    print(f"{eval_line(result)} (n={len(problems)}; two evaluations differing by up to "
          f"{2.8 * result['eval/accuracy_stderr']:.3f} are noise)")  # fmt: skip
    return result


def eta(start_time, first, done, total):
    """'(seconds so far, ETA hh:mm:ss)': the time left at this run's pace since update `first` (0, or the resumed)."""
    elapsed = time.time() - start_time
    return f"({elapsed:.0f}s, ETA {time.strftime('%H:%M:%S', time.gmtime(elapsed * (total - done) / (done - first)))})"


def check_finite(grad_norm, update, save):
    """Detail 15: stop before the optimizer step, so that save() writes the last good weights."""
    if not torch.isfinite(grad_norm):
        raise SystemExit(f"error: the loss became non-finite at update {update}; the last good weights are in {save()} "
                         "(try a lower --learning-rate)")  # fmt: skip


def wall_clock(device):
    """time.perf_counter() once the GPU's queued work is done, so that each step is timed by its own work."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def parse_args(argv=None):
    """The flags of Args, one --help section per group (tyro shows a dataclass field as a section; the prefix of its
    flags is omitted). With --resume RUN_DIR the run's args.json gives the defaults, so that only the flags on the
    command line change (detail 22: a larger --total-steps, say, which the --anneal-lr schedule then follows)."""
    groups = Args.__mro__[-2:0:-1]  # Experiment, Models, ..., in the order of the source
    named_groups = [(group.__name__.lower(), group) for group in groups]
    Sections = make_dataclass("Sections", named_groups, namespace={"__doc__": Args.__doc__})

    def cli(defaults):  # an Args, split into its groups for tyro
        split = Sections(*[group(**{f.name: getattr(defaults, f.name) for f in fields(group)}) for group in groups])
        sections = tyro.cli(Sections, args=argv, default=split, config=(tyro.conf.OmitArgPrefixes,))
        return Args(**{k: v for section in asdict(sections).values() for k, v in section.items()})

    args = cli(Args())
    if args.resume is None:
        return args
    path = os.path.join(args.resume, "args.json")
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(args.resume, "checkpoint.pt")):
        raise SystemExit(f"error: --resume {args.resume}: no args.json and checkpoint.pt there (a run writes them)")
    with open(path) as f:
        saved = {k: tuple(v) if isinstance(v, list) else v for k, v in json.load(f).items() if hasattr(Args, k)}
    return cli(Args(**saved | {"resume": args.resume}))


def train_state(update, prompts, **state):
    """What a resume restores besides the weights and AdamW, taken between updates (detail 22): the update, the prompts
    drawn, python's, numpy's, torch's and CUDA's RNG states (a list, one per rank), and `state` (PPO's beta)."""
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}  # fmt: skip
    states = [rng]
    if dist.is_initialized():  # every rank's: each goes on with its own on resuming (detail 24)
        states = [None] * dist.get_world_size()
        dist.all_gather_object(states, rng)
    return dict(update=update, prompt_cursor=prompts.cursor, rng=states, **state)


def save_checkpoint(logger, models, optimizer, state):
    """Detail 22: checkpoint.pt gets `state` (train_state's), the weights of `models` (None skipped), AdamW's state and
    the wandb id."""
    weights = {name: model.state_dict() for name, model in models.items() if model is not None}
    wandb_id = getattr(logger.wandb, "id", None)
    state = state | dict(weights=weights, optimizer=optimizer.state_dict(), wandb_id=wandb_id)
    path = os.path.join(logger.run_dir, "checkpoint.pt")
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename
    os.replace(path + ".tmp", path)  # atomic


def load_checkpoint(run_dir):
    """The dict save_checkpoint wrote in run_dir; {} for a new run (run_dir None)."""
    path = run_dir and os.path.join(run_dir, "checkpoint.pt")
    return torch.load(path, map_location="cpu", weights_only=False) if path else {}  # (not only tensors)


def build_optimizer(args, device, trained, frozen, world):
    """The models onto the device, activation checkpointing (HF's works in train mode only: step 5), defaults for the
    policy's size. Returns (trainable parameters, with LoRA the adapters; AdamW; DDP of the trained models or None)."""
    trained = [model.to(device) for model in trained if model is not None]
    for model in frozen:
        if model is not None:
            model.to(device)
    for model in trained if args.gradient_checkpointing else []:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable()
    n_params = sum(p.numel() for p in trained[0].parameters())
    if device.type == "cpu" and n_params < 50e6:
        torch.set_num_threads(1)  # measured faster for small models on 2 shared cores
    if args.learning_rate is None:
        args.learning_rate = 1e-4 if n_params < 50e6 else 1e-5
        print(f"learning rate {args.learning_rate:g}: the default for {n_params / 1e6:.1f}M parameters")
    params = [p for m in trained for p in m.parameters() if p.requires_grad]
    # fused: one kernel over all parameters (~0.05 s a step at 124M on a CPU, ~0.6 s as torch's default loop)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, eps=1e-5, weight_decay=args.weight_decay, fused=True)
    return params, optimizer, nn.parallel.DistributedDataParallel(TrainedModels(trained)) if world > 1 else None


def start(args, checkpoint, models, optimizer, logger, evaluate_policy, rank, world):
    """The update to start after: the checkpoint's, with its weights, AdamW and RNG states back last before the loop
    so that sampling goes on where the saved run stopped (detail 22); or 0 after evaluating the initial policy."""
    if checkpoint:
        for name, weights in checkpoint["weights"].items():
            if models.get(name) is not None:
                models[name].load_state_dict(weights)
        print(f"resuming after update {checkpoint['update']} of the saved run")
        optimizer.load_state_dict(checkpoint["optimizer"])
        optimizer.param_groups[0]["lr"] = args.learning_rate  # a flag given on resuming wins
        rng = checkpoint["rng"][rank if len(checkpoint["rng"]) == world else 0]  # this rank's, if it ran
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    elif evaluate_policy:
        evaluation = evaluate_policy()
        logger.log({"update": 0, "episode": 0} | evaluation)
        print(f"update 0: {eval_line(evaluation)}")
    update = checkpoint.get("update", 0)
    if world > 1 and len(checkpoint.get("rng", [])) != world:  # a new run (or world size): each rank its own samples
        torch.manual_seed(args.seed + rank + world * update)
    return update


def timing_metrics(t, start_time, n_tokens, device):
    """time/* and perf/* of one update, from its wall-clock marks t = (t0, t1, t2, t3); ru_maxrss is in KiB."""
    return {"time/generation": t[1] - t[0], "time/scoring": t[2] - t[1], "time/update": t[3] - t[2],
            "time/elapsed": time.time() - start_time, "perf/tokens_per_sec": n_tokens / (t[3] - t[0]),
            "perf/peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10}  # fmt: skip


# DISTRIBUTED: torchrun's data parallelism (detail 24), identical in grpo_llm.py; without torchrun each is a no-op


def setup_distributed(args):
    """(rank, world size) after joining torchrun's process group (NCCL on GPUs, gloo on CPU); (0, 1) without."""
    if int(os.environ.get("WORLD_SIZE", 1)) == 1:
        return 0, 1
    if args.cuda and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.cuda and torch.cuda.is_available() else "gloo")
    if dist.get_rank():  # only rank 0 prints
        sys.stdout = open(os.devnull, "w")
    return dist.get_rank(), dist.get_world_size()


def all_reduce(x, op="sum"):
    """The tensor x summed over the ranks (or their "min", "max"); x itself in one process."""
    if not dist.is_initialized():
        return x
    y = x.detach().to("cuda" if dist.get_backend() == "nccl" else "cpu", copy=True)
    dist.all_reduce(y, getattr(dist.ReduceOp, op.upper()))
    return y.to(x.device)


def global_mean(values):
    """Mean of the scalar tensors in every rank's list, pooled (not a mean of means), NaNs (0 / 0 token means) out."""
    x = torch.stack(values).double()
    total, count = all_reduce(torch.stack([x.nansum(), (~x.isnan()).sum().double()])).tolist()
    return total / count


def global_mean_var(values, mask):
    """Mean and variance of the entries where mask is 1, over every rank's: n = sum(m), mean = sum(x * m) / n,
    var = sum((x - mean)^2 * m) / (n - 1) (Bessel), each sum over the ranks."""
    n = all_reduce(mask.sum())
    mean = all_reduce((values * mask).sum()) / n
    return mean, all_reduce(((values - mean) ** 2 * mask).sum()) / (n - 1)


def global_metrics(metrics, ops):
    """The metrics over every rank's sequences: each rank has as many, so their mean is the mean of the ranks' means
    (a value equal on every rank stays as it is); the keys of ops are reduced by "sum", "min" or "max" instead."""
    if not dist.is_initialized():
        return metrics
    reduced = {
        k: all_reduce(torch.tensor(float(v), dtype=torch.float64), ops.get(k, "sum")).item() for k, v in metrics.items()
    }
    return {k: type(v)(reduced[k] if k in ops else reduced[k] / dist.get_world_size()) for k, v in metrics.items()}


class TrainedModels(nn.ModuleList):
    """The trained models as one module for DistributedDataParallel: forward(fn, *inputs) is fn(*inputs)."""

    def forward(self, fn, *inputs):
        return fn(*inputs)


def ddp_forward(ddp, sync, fn, *inputs):
    """fn(*inputs); under torchrun through DDP(TrainedModels), whose backward averages the gradients over the ranks
    only where sync (the last micro-batch; the others accumulate locally). No-grad passes run the bare models."""
    if ddp is None:
        return fn(*inputs)
    with contextlib.nullcontext() if sync else ddp.no_sync():
        return ddp(fn, *inputs)


class Silent:
    """The logger of ranks other than 0: every call does nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


# PPO: arguments, the value model, scores, the minibatch update, saving


def check_args(args):
    """Every bad combination of flags, as one line each, before anything is loaded."""
    if args.lora_dropout:  # detail 23
        raise SystemExit(f"error: --lora-dropout must be 0, or the first ratio is not 1 (got {args.lora_dropout})")
    if args.save_merged and not args.lora_r:
        raise SystemExit("error: --save-merged needs --lora-r: without LoRA the saved policy is already a full model")
    world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's processes, each with its share (detail 24)
    if args.prompts_per_update % world:
        raise SystemExit(f"error: {world} processes must divide --prompts-per-update (got {args.prompts_per_update})")
    B = args.prompts_per_update // world
    if world > 1 and args.micro_batch_size > B // args.num_mini_batches > 0:  # the default 64 must not refuse 8 GPUs
        args.micro_batch_size = B // args.num_mini_batches
        print(f"--micro-batch-size {args.micro_batch_size}: each of the {world} processes' minibatch")
    if B % args.num_mini_batches or B // args.num_mini_batches % args.micro_batch_size:
        raise SystemExit(f"error: --num-mini-batches must divide --prompts-per-update, and --micro-batch-size the "
                         f"minibatch (got {B}{' per process' if world > 1 else ''}, {args.num_mini_batches} and "
                         f"{args.micro_batch_size})")  # fmt: skip
    if args.temperature <= 0:
        raise SystemExit(f"error: --temperature must be > 0: log-probs divide by it (got {args.temperature})")
    if args.top_k or args.top_p < 1.0:
        raise SystemExit(f"error: --top-k {args.top_k} / --top-p {args.top_p} would sample from a truncated "
                         "distribution whose log-probs the update never sees (detail 20); train with --temperature "
                         "alone")  # fmt: skip
    load_reward_fn(args.reward_fn)  # a bad name or file fails here, before anything is loaded
    if args.lora_r and args.ref_update_every:
        raise SystemExit("error: --ref-update-every cannot refresh a LoRA run's reference: the adapter-free base")
    if args.score_norm == "auto":
        args.score_norm = "on" if args.reward_model is not None else "off"  # detail 14
        print(f"score normalisation {args.score_norm}: the default with a reward "
              f"{'model' if args.reward_model else 'function'}")  # fmt: skip
    if args.score_norm == "on" and args.prompts_per_update < 2:
        raise SystemExit("error: --score-norm on whitens each batch's scores: it needs --prompts-per-update >= 2")
    if args.kl_target and not args.kl_coef:
        raise SystemExit("error: --kl-target scales --kl-coef up or down by a factor: start it above 0 (got 0)")


def build_value_model(args, policy, tokenizer, reward_model, rm_tokenizer):
    """Detail 8: (critic, value_head). The critic is None with --critic head (the head sits on the policy's trunk),
    else a trunk initialised from the reward model when it reads the policy's tokens, else from the policy."""
    critic = None
    if args.critic == "separate":
        source = args.reward_model if reward_model is not None and rm_tokenizer is None else args.model
        critic = load_model(AutoModel, source, "--critic source", "auto" if args.lora_r else torch.float32)
        fit_embeddings(critic, tokenizer)
        critic = add_lora(critic, args) if args.lora_r else critic  # adapters of its own; the head trains in full
        print(f"critic: a separate network initialised from {source}")
    value_head = nn.Linear((critic or policy).config.hidden_size, 1)
    nn.init.zeros_(value_head.weight)
    nn.init.zeros_(value_head.bias)
    return critic, value_head


def values_of(value_head, hidden):
    """Values (B, R) of the value head, in fp32 outside autocast (detail 8)."""
    with torch.autocast(hidden.device.type, enabled=False):
        return value_head(hidden.float()).squeeze(-1)


@torch.no_grad()
def score(r, completions, rows, reward_model, rm_tokenizer, args):
    """Step 2's scores (B,), one per response: the reward model's, or the reward function's against the answers."""
    if reward_model is None:
        return torch.tensor(load_reward_fn(args.reward_fn)(completions, rows))
    return reward_model_scores(reward_model, rm_tokenizer, r["query_responses"], r["attention_mask"], rows,
                               completions, args.reward_label or 0, args.micro_batch_size)  # fmt: skip


def training_forward(policy, critic, value_head, r, mc, args):
    """The training forward of micro-batch mc: log-probs and entropies (B, R) of the responses, values (B, R)."""
    qr, am = r["query_responses"][mc], r["attention_mask"][mc]
    hidden = hidden_states(policy, qr, am, r["prompt_width"])
    logprobs, entropy = response_logprobs(policy, hidden, r["responses"][mc], args, with_entropy=True)
    if critic is not None:
        hidden = hidden_states(critic, qr, am, r["prompt_width"])
    return logprobs, entropy, values_of(value_head, hidden)


def accumulate_gradients(policy, critic, value_head, r, mb_inds, args, autocast, ddp=None):
    """Forward and backward one minibatch, micro-batch by micro-batch (detail 12); returns each micro-batch's stats.
    Under torchrun n_tokens is the union minibatch's real tokens per rank, as DDP averages the ranks' gradients."""
    stats, n_tokens = [], global_mean([r["mask"][mb_inds].sum()])
    micro_batches = mb_inds.split(args.micro_batch_size)
    for mc in micro_batches:
        mask = r["mask"][mc]
        with autocast:  # under DDP the last micro-batch's backward averages the gradients over the ranks
            logprobs, entropy, values = ddp_forward(
                ddp, mc is micro_batches[-1], training_forward, policy, critic, value_head, r, mc, args
            )
        pg_loss, pg_stats = policy_loss(logprobs, r["old_logprobs"][mc], r["advantages"][mc], mask, args.cliprange)
        vf_loss, vf_stats = value_loss(values, r["values"][mc], r["returns"][mc], mask, args.cliprange_value)
        entropy = masked_mean(entropy, mask)
        loss = pg_loss + args.vf_coef * vf_loss
        if args.ent_coef:  # only then does backward go through the entropy
            loss = loss - args.ent_coef * entropy
        (loss * mask.sum() / n_tokens).backward()  # weighted by its share of the minibatch's real tokens (detail 12)
        stats.append(pg_stats | vf_stats | {"loss/policy_avg": pg_loss.detach(), "loss/value_avg": vf_loss.detach(),
                                            "policy/entropy_avg": entropy.detach()})  # fmt: skip
    return stats


def save(path, policy, tokenizer, value_head, critic, merged=False):
    """save_pretrained of the policy and its tokenizer (with LoRA the adapter, which peft loads on the base; with
    merged=True also the merged model in path/merged), and of the value model: path/critic (the trunk, an adapter with
    LoRA; tokenizer; value_head.pt), or path itself with --critic head. The value model reloads as
        critic = AutoModel.from_pretrained(critic_dir)  # --critic head: AutoModel.from_pretrained(path)
        value_head = torch.nn.Linear(critic.config.hidden_size, 1)  # with its bias: HF's score layers have none
        value_head.load_state_dict(torch.load(os.path.join(critic_dir, "value_head.pt")))
        values = value_head(critic(input_ids).last_hidden_state).squeeze(-1)  # (B, T): V of each prefix"""
    policy.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if merged:  # W + (alpha / r) B A, in a copy (one more base in memory, while saving): training keeps its adapters
        copy.deepcopy(policy).merge_and_unload().save_pretrained(os.path.join(path, "merged"))
        tokenizer.save_pretrained(os.path.join(path, "merged"))
    value_dir = path if critic is None else os.path.join(path, "critic")
    if critic is not None:
        critic.save_pretrained(value_dir)
        tokenizer.save_pretrained(value_dir)
    torch.save(value_head.state_dict(), os.path.join(value_dir, "value_head.pt"))
    return path


def main(args: Args | None = None):
    args = parse_args() if args is None else args
    # TRY NOT TO MODIFY: set-up
    rank, world = setup_distributed(args)  # detail 24
    check_args(args)
    device, autocast, precision = setup(args)
    tokenizer, policy, reward_model, rm_tokenizer, max_prompt_length, eos_ids = load_models(args, device)
    if args.eval_only:  # no training, no run directory
        reward_fn = load_reward_fn(args.reward_fn)
        return eval_only(args, policy.to(device), tokenizer, reward_fn, eos_ids, max_prompt_length, autocast)
    critic, value_head = build_value_model(args, policy, tokenizer, reward_model, rm_tokenizer)
    ref_policy = reference_model(policy) if args.kl_coef or args.kl_target else None  # details 19, 23
    params, optimizer, ddp = build_optimizer(args, device, [policy, critic, value_head], [ref_policy], world)
    checkpoint = load_checkpoint(args.resume)  # detail 22; {} for a new run
    kl_coef = checkpoint.get("kl_coef", args.kl_coef) if args.kl_target else args.kl_coef
    prompts = PromptStream(load_prompts(args, tokenizer), rank, world, checkpoint.get("prompt_cursor", 0))
    eval_problems = eval_rows(args, tokenizer) if args.eval_every and rank == 0 else None
    logger = RunLogger(args, device, precision, checkpoint.get("wandb_id")) if rank == 0 else Silent()
    # what --resume restores (detail 22); the reference is re-derived from --model unless --ref-update-every moves it
    models = dict(policy=policy, critic=critic, value_head=value_head,
                  ref_policy=ref_policy if args.ref_update_every else None)  # fmt: skip
    B = args.prompts_per_update // world  # this rank's share (detail 24)
    evaluate_policy = eval_problems and functools.partial(
        evaluate, policy, tokenizer, eval_problems, load_reward_fn(args.reward_fn), eos_ids, max_prompt_length, B,
        autocast,
    )  # fmt: skip

    def save_all():
        if rank:  # only rank 0 writes (detail 24)
            return "rank 0's run directory"
        save_checkpoint(logger, models, optimizer, state)
        return save(os.path.join(logger.run_dir, "policy"), policy, tokenizer, value_head, critic, args.save_merged)

    first_update = update = start(args, checkpoint, models, optimizer, logger, evaluate_policy, rank, world)
    state = train_state(update, prompts, kl_coef=kl_coef)  # what a resume restores (detail 22)
    start_time = time.time()
    try:
        for update in range(update + 1, args.total_steps + 1):
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = args.learning_rate * (1 - (update - 1) / args.total_steps)
            # ALGO LOGIC: 1. rollout -- one response per prompt
            t0 = wall_clock(device)
            rows = [next(prompts) for _ in range(B)]
            r = rollout(policy, tokenizer, [row["prompt"] for row in rows], max_prompt_length, eos_ids, autocast)
            responses, mask = r["responses"], r["mask"]  # (B, R)
            t1 = wall_clock(device)

            # 2. old and reference log-probs and the values, in the training's micro-batch shapes (detail 5); scores
            old_logprobs, ref_logprobs, values = [], [], []
            with torch.no_grad(), autocast:
                for mc in torch.arange(B, device=device).split(args.micro_batch_size):
                    qr, am, Q = r["query_responses"][mc], r["attention_mask"][mc], r["prompt_width"]
                    hidden = hidden_states(policy, qr, am, Q)
                    old_logprobs.append(response_logprobs(policy, hidden, responses[mc], args)[0])
                    values.append(values_of(value_head, hidden if critic is None else hidden_states(critic, qr, am, Q)))
                    if ref_policy is not None:
                        with adapters_off(ref_policy):  # LoRA: the base is the reference (detail 23)
                            hidden = hidden_states(ref_policy, qr, am, Q)
                        ref_logprobs.append(response_logprobs(ref_policy, hidden, responses[mc], args)[0])
            old_logprobs, values = torch.cat(old_logprobs), torch.cat(values)
            ref_logprobs = torch.cat(ref_logprobs) if ref_policy is not None else old_logprobs
            completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
            scores = score(r, completions, rows, reward_model, rm_tokenizer, args).to(device)
            contains_eos = torch.isin(responses, torch.tensor(eos_ids, device=device)).any(1)
            if args.missing_eos_penalty is not None:
                scores = scores - args.missing_eos_penalty * (~contains_eos).float()
            t2 = wall_clock(device)

            # 3. per-token rewards: -beta * KL everywhere, plus the score at the last real token (detail 3)
            kl = kl_penalty(old_logprobs, ref_logprobs, args.kl_estimator) * mask
            non_score_reward = -kl_coef * kl
            rewards = non_score_reward.clone()
            normalized = normalize_scores(scores, args.score_norm == "on", args.score_clip)  # detail 14
            rewards[torch.arange(B, device=device), mask.long().sum(1) - 1] += normalized
            if args.whiten_rewards:
                rewards = masked_whiten(rewards, mask, shift_mean=False) * mask

            # 4. advantages: GAE over response tokens, whitened over the batch (detail 10)
            advantages, returns = compute_gae(rewards, values, mask, args.gamma, args.lam)
            advantages = masked_whiten(advantages, mask)

            # 5. PPO update: epochs of shuffled minibatches, micro-batches accumulate gradients (details 11, 12)
            r |= dict(old_logprobs=old_logprobs, values=values, advantages=advantages, returns=returns)
            for model in [policy, critic]:
                if model is not None:
                    model.train()
            stats = []
            for _ in range(args.num_ppo_epochs):
                epoch_stats = []
                for mb_inds in torch.randperm(B, device=device).split(B // args.num_mini_batches):
                    epoch_stats += accumulate_gradients(policy, critic, value_head, r, mb_inds, args, autocast, ddp)
                    check_finite(nn.utils.clip_grad_norm_(params, args.max_grad_norm), update, save_all)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                stats += epoch_stats
                approxkl = global_mean([s["policy/approxkl_avg"] for s in epoch_stats])  # all ranks stop together
                if args.target_kl is not None and approxkl > args.target_kl:
                    break
            t3 = wall_clock(device)

            # 6. KL controller and reference refresh
            mean_kl = global_mean([kl.sum(1).mean()])  # over every rank's batch (detail 24)
            if args.kl_target:
                kl_coef = adaptive_kl_coef(kl_coef, mean_kl, args.kl_target, args.kl_horizon, args.prompts_per_update)
            if args.ref_update_every and update % args.ref_update_every == 0 and ref_policy is not None:
                ref_policy.load_state_dict(policy.state_dict())

            # TRY NOT TO MODIFY: log (TRL's metric names), evaluate, show samples, save
            n_tokens = mask.sum().item()
            metrics = {"update": update, "episode": update * args.prompts_per_update, "objective/kl": mean_kl,
                       "objective/kl_coef": kl_coef, "objective/entropy": (-old_logprobs * mask).sum(1).mean().item(),
                       "objective/non_score_reward": non_score_reward.sum(1).mean().item(),
                       "objective/scores": scores.mean().item(),
                       "val/num_eos_tokens": int(contains_eos.sum().item()), "val/mean_length": n_tokens / B,
                       "lr": optimizer.param_groups[0]["lr"]}  # fmt: skip
            metrics |= timing_metrics((t0, t1, t2, t3), start_time, n_tokens, device)
            # the stats of policy_loss (policy/*, val/ratio), value_loss (val/clipfrac_avg), the losses and entropy
            metrics |= {k: torch.stack([s[k] for s in stats]).mean().item() for k in stats[0]}
            metrics["objective/rlhf_reward"] = metrics["objective/scores"] + metrics["objective/non_score_reward"]
            if rows[0]["answer"] is not None:  # the reward function's verdict, beside a reward model too
                metrics["objective/accuracy"] = sum(load_reward_fn(args.reward_fn)(completions, rows)) / B
            metrics = global_metrics(metrics, {"val/num_eos_tokens": "sum", "perf/tokens_per_sec": "sum",
                                               "perf/peak_memory_mb": "max"})  # fmt: skip
            if eval_problems and (update % args.eval_every == 0 or update == args.total_steps):
                metrics |= evaluate_policy()
            logger.log(metrics)
            state = train_state(update, prompts, kl_coef=kl_coef)  # update done: a stop from here on resumes after it
            print(
                f"update {update}/{args.total_steps}: score {metrics['objective/scores']:.3f}  kl {mean_kl:.3f}  "
                f"approxkl {metrics['policy/approxkl_avg']:.4f}  clipfrac {metrics['policy/clipfrac_avg']:.3f}  "
                + (f"{eval_line(metrics)}  " if "eval/accuracy" in metrics else "")
                + f"{t3 - t0:.2f}s  {eta(start_time, first_update, update, args.total_steps)}"
            )
            if args.sample_every and update % args.sample_every == 0:
                shown = range(min(args.num_samples, B))
                logger.log_samples([{"update": update, "prompt": rows[j]["prompt"], "completion": completions[j],
                                     "score": scores[j].item()} for j in shown])  # fmt: skip
            if args.save_every and update % args.save_every == 0:
                save_all()
    except KeyboardInterrupt:
        print(f"interrupted at update {update}: saving")
    print(f"saved the policy to {save_all()}")
    logger.close()
    if dist.is_initialized():
        dist.barrier()  # the other ranks wait while rank 0 saves: one that tears gloo down first can abort at exit
        dist.destroy_process_group()
    return logger.run_dir


if __name__ == "__main__":
    main()

"""PPO for language models (RLHF), in one file.

Stage 3 of RLHF (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences"; Ouyang et al. 2022,
InstructGPT): a policy generates responses to prompts, a reward model or a reward function scores them,
and PPO (Schulman et al. 2017) raises the score while a per-token KL penalty keeps the policy close to
the frozen reference (the SFT model it started from). `main()` reads in the order of the algorithm:
rollout -> log-probs of policy and reference, values, scores -> per-token rewards -> GAE -> epochs of
clipped minibatch updates -> log -> save.

    python ppo_llm.py                                  # embedded arithmetic SFT model, offline, CPU
    python ppo_llm.py --reward-model assets/arith-rm   # the same, scored by the learned reward model
    python ppo_llm.py --model gpt2 --total-steps 200   # a hub model (a GPU is advisable)

Implementation details (cited as "detail N" in the comments):
1. Tokens are actions and a response is an episode; the state is the prompt plus the tokens so far.
2. Responses are cut after the first EOS; later tokens become pad and are masked out of every loss and
   statistic, so the policy is not trained on text it would never show.
3. The sequence score is added to the reward of the last real response token, and every token gets
   -beta*KL to the reference: the KL penalty is dense where the score is sparse (Ziegler et al.).
4. Log-probs divide the logits by the sampling temperature, or the ratio and KL start away from 1 and 0.
5. Old log-probs and values are recomputed after generation with the same function, dtype and
   micro-batch shape as the training forward, so the first ratio of every update is exactly 1.
6. Dropout is off in every model: the ratio and the KL then measure policy change and nothing else.
7. Prompts are left-padded for batched generation; position ids come from the attention mask, so a
   padded prompt sees the positions an unpadded one would.
8. The value function is a zero-initialised scalar head on a separate critic initialised from the reward
   model (same tokenizer) or the policy (default: fewer samples to 90% on the embedded task than the
   head on the policy's own trunk, --critic head, which is cheaper per update; benchmarks/).
9. The logits are computed only at response positions, and log-probs as gather - logsumexp: no
   (B, T, V) log-softmax copy. No-grad forwards run in micro-batches.
10. GAE (gamma=1, lam=0.95) over response tokens; returns = advantages + values; the advantages are
    whitened over the batch's real tokens, the rewards optionally (masked, Bessel-corrected).
11. Clipped surrogate and clipped value loss, each a mean over real tokens; optional entropy bonus.
12. Several epochs of shuffled minibatches with gradient accumulation over micro-batches, global
    grad-norm clipping, AdamW, optional linear learning-rate decay and early stop on approx-KL.
13. beta fixed, or adapted towards a target KL (Ziegler et al.'s proportional controller).
14. Optional penalty for responses without EOS and score clipping; scores whitened per batch by default
    with a reward model, whose scale is arbitrary (unnormalised, beta*KL was too weak to stop reward hacking).
15. A non-finite gradient stops the run before the optimizer step and saves the last good weights;
    Ctrl-C saves before exiting.
"""

import copy
import json
import os
import random
import re
import resource
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import transformers
import tyro
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
)


@dataclass
class Args:
    # Experiment
    exp_name: str = "ppo_llm"
    """name of the experiment: the run directory and the wandb run start with it"""
    seed: int = 1
    """seed of python, numpy, torch and the prompt order"""
    cuda: bool = True
    """use CUDA (bf16 autocast) when it is available"""
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

    # Model and data
    model: str = "assets/arith-sft"
    """policy and reference: a hub id or a local directory (default: the embedded arithmetic SFT model)"""
    reward_model: str | None = None
    """sequence-classification reward model (hub id or directory); without it --reward-fn scores"""
    reward_label: int | None = None
    """which logit of the reward model is the score, when it has several (lvwerra/distilbert-imdb: 1)"""
    reward_fn: Literal["arithmetic", "gsm8k"] = "arithmetic"
    """reward function: exact answer (arithmetic) or last number vs '#### N' (gsm8k)"""
    dataset: str = "arithmetic"
    """prompts: `arithmetic` (built in, offline), a local .jsonl file, or a hub dataset name"""
    dataset_config: str | None = None
    """hub dataset configuration (gsm8k: main)"""
    dataset_split: str = "train"
    """hub dataset split"""
    prompt_column: str = "prompt"
    """field of a dataset row that holds the prompt (gsm8k: question, imdb: text)"""
    answer_column: str = "answer"
    """field that holds the reference answer the reward function checks"""
    critic: Literal["head", "separate"] = "separate"
    """value function: a head on the policy's trunk, or a separate network (detail 8)"""
    gradient_checkpointing: bool = False
    """trade compute for memory in the policy and critic"""

    # Generation
    max_new_tokens: int = 8
    """longest response (8 fits the arithmetic task; text tasks want 48 or more)"""
    max_prompt_length: int | None = None
    """prompts are cut to their first N tokens (default: the model's context minus --max-new-tokens)"""
    temperature: float = 1.0
    """sampling temperature; log-probs use the same one (detail 4)"""
    top_k: int = 0
    """sample from the k most likely tokens only (0: off)"""
    top_p: float = 1.0
    """nucleus sampling mass (1.0: off)"""

    # Algorithm
    total_steps: int = 300
    """number of PPO updates (one rollout batch and its epochs each)"""
    batch_size: int = 128
    """prompts (and responses) per rollout batch"""
    num_mini_batches: int = 2
    """minibatches (optimizer steps) per epoch"""
    micro_batch_size: int = 64
    """sequences per forward pass: gradient accumulation in training, chunking in no-grad passes"""
    num_ppo_epochs: int = 2
    """passes over each rollout batch"""
    learning_rate: float | None = None
    """AdamW learning rate (default: 1e-4 below 50M parameters, 1e-5 above; printed at start)"""
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
    """stop an update's epochs early once their mean approx-KL passes this"""
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
    score_norm: bool | None = None
    """whiten the scores of each batch (mean 0, std 1); default: on with --reward-model, off with --reward-fn"""
    score_clip: float | None = None
    """clip the scores to [-c, c] (after --score-norm)"""

    # Logging
    eval_every: int = 10
    """held-out accuracy on the arithmetic task every N updates (0: off)"""
    sample_every: int = 10
    """print and store a few decoded samples every N updates (0: off)"""
    num_samples: int = 3
    """samples shown each time"""


# ALGO LOGIC: the numerics, small pure functions on tensors (checked by tests/ against hand-computed values)


def logprobs_from_logits(logits, labels):
    """log softmax(logits)[label] = logit[label] - logsumexp(logits), without a (B, T, V) log-softmax copy.

    logits (B, T, V), labels (B, T) -> (B, T)."""
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits):
    """H = logsumexp(l) - sum softmax(l) * l, per position: (B, T, V) -> (B, T)."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def masked_mean(values, mask, axis=None):
    """sum(values * mask) / sum(mask), over `axis` or over everything."""
    if axis is None:
        return (values * mask).sum() / mask.sum()
    return (values * mask).sum(axis) / mask.sum(axis)


def masked_whiten(values, mask, shift_mean=True):
    """(x - mean) / sqrt(var + 1e-8) over the masked entries, var = sum (x - mean)^2 / (n - 1) (Bessel).

    With shift_mean=False the mean is added back: only the scale changes (TRL's convention)."""
    mean = masked_mean(values, mask)
    n = mask.sum()
    var = masked_mean((values - mean) ** 2, mask) * n / (n - 1)
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
    """Generalised advantage estimation over the response tokens, (B, T) -> (advantages, returns).

    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1},  returns = A + V.
    Rewards and values count as 0 where mask is 0 and past the last position (the episode ends at the
    last real token); advantages and returns are 0 where mask is 0."""
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
    rho = exp(logprobs - old_logprobs). Returns (loss, clipfrac, approxkl = mean (log rho)^2 / 2, mean rho)."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    losses = -advantages * ratio
    clipped_losses = -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = masked_mean(torch.max(losses, clipped_losses), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped_losses > losses).float(), mask)
        approxkl = 0.5 * masked_mean(log_ratio**2, mask)
        ratio_mean = masked_mean(ratio, mask)
    return loss, clipfrac, approxkl, ratio_mean


def value_loss(values, old_values, returns, mask, clip_range):
    """1/2 * masked mean of max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2). Returns (loss, clipfrac)."""
    clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
    losses, clipped_losses = (values - returns) ** 2, (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(losses, clipped_losses), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped_losses > losses).float(), mask)
    return loss, clipfrac


class AdaptiveKLController:
    """Ziegler et al.'s beta controller: beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon)."""

    def __init__(self, init_kl_coef, target, horizon):
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl, n_steps):
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


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


def gsm8k_reward(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the completion's last number equals the number after '####' in the answer (GSM8K's format)."""

    def last_number(text):
        numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
        return float(numbers[-1].replace(",", "")) if numbers else None

    return [
        float(last_number(c) is not None and last_number(c) == last_number(a.split("####")[-1]))
        for c, a in zip(completions, answers)
    ]


REWARD_FNS = {"arithmetic": arithmetic_reward, "gsm8k": gsm8k_reward}


def load_prompts(args):
    """Endless iterator of {"prompt", "answer"} rows from --dataset, reshuffled every pass."""
    if args.dataset == "arithmetic":
        return arithmetic_train_problems(args.seed)
    if args.dataset.endswith(".jsonl"):
        if not os.path.isfile(args.dataset):
            raise SystemExit(f"error: --dataset {args.dataset}: no such file")
        with open(args.dataset) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        import datasets  # only this path needs it, and it is slow to import

        try:
            rows = list(datasets.load_dataset(args.dataset, args.dataset_config, split=args.dataset_split))
        except Exception as e:
            raise SystemExit(
                f"error: --dataset {args.dataset} could not be loaded ({type(e).__name__}); offline, use "
                "the built-in `arithmetic` task or a local .jsonl file"
            ) from None
    if not rows or args.prompt_column not in rows[0]:
        raise SystemExit(f"error: --prompt-column {args.prompt_column} is not a field of --dataset {args.dataset}")
    rows = [{"prompt": r[args.prompt_column], "answer": r.get(args.answer_column)} for r in rows]

    def cycle(rng=random.Random(args.seed)):
        while True:
            rng.shuffle(rows)
            yield from rows

    return cycle()


# MODELS: loading, generation, forward passes, scores


def resolve(path):
    """A repo-relative asset path (assets/...) also works from another working directory."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), path)
    return here if not os.path.exists(path) and os.path.exists(here) else path


def from_pretrained(cls, name, flag, **kwargs):
    """cls.from_pretrained(name) with a one-line error for a missing directory or an unreachable hub."""
    try:
        return cls.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        where = "could not be loaded" if os.path.isdir(name) else "is not a local directory, nor reachable on the hub"
        raise SystemExit(
            f"error: {flag} {name} {where} ({type(e).__name__}). Offline, use the embedded default "
            "(omit --model: assets/arith-sft; --reward-model assets/arith-rm)"
        ) from None


def add_pad_token(tokenizer, models):
    """Give a tokenizer without a pad token its own one (never EOS: a padded EOS would look like an end)."""
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
        print(f"note: the tokenizer had no pad token distinct from EOS; added [PAD] (id {tokenizer.pad_token_id})")
        for model in models:
            model.resize_token_embeddings(len(tokenizer))
    for model in models:
        model.config.pad_token_id = tokenizer.pad_token_id


def disable_dropout(model):
    """Detail 6: dropout would make the ratio and the KL differ from 1 and 0 at unchanged weights."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def context_length_of(config):
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


@torch.no_grad()
def generate(policy, queries, query_mask, generation_config):
    """Sample responses (B, R) for left-padded prompts (B, Q); generate() derives position ids from the mask."""
    output = policy.generate(input_ids=queries, attention_mask=query_mask, generation_config=generation_config)
    return output[:, queries.shape[1] :]


def truncate_after_eos(responses, eos_token_id, pad_token_id):
    """Detail 2: keep the tokens up to and including the first EOS. Returns (responses, mask), (B, R)."""
    is_eos = responses == eos_token_id
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0  # an EOS strictly before this position
    return responses.masked_fill(after_eos, pad_token_id), ~after_eos


def hidden_states(model, query_responses, attention_mask, context_length):
    """Last hidden states (B, R, H) at the positions that predict the response tokens (context_length - 1 ...)."""
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # detail 7
    out = model.base_model(
        input_ids=query_responses, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    return out.last_hidden_state[:, context_length - 1 : -1]


def forward(policy, value_model, value_head, query_responses, attention_mask, context_length, temperature):
    """One pass over prompt + response: response log-probs (B, R), logits (B, R, V) and values (B, R).

    value_model None: the value head sits on the policy's own trunk; with value_head None too, no values."""
    hidden = hidden_states(policy, query_responses, attention_mask, context_length)
    logits = policy.get_output_embeddings()(hidden).float() / temperature  # details 4 and 9
    logprobs = logprobs_from_logits(logits, query_responses[:, context_length:])
    if value_head is None:
        return logprobs, logits, None
    if value_model is not None:
        hidden = hidden_states(value_model, query_responses, attention_mask, context_length)
    return logprobs, logits, value_head(hidden).squeeze(-1).float()


@torch.no_grad()
def reward_model_scores(reward_model, rm_tokenizer, tokenizer, query_responses, attention_mask, label, chunk):
    """Score of each sequence (B,), read by the reward model at its last real token (pad follows it).

    rm_tokenizer None: same vocabulary, the ids are used as they are; otherwise decode and re-encode."""
    if rm_tokenizer is None:
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
        inputs = dict(input_ids=query_responses, attention_mask=attention_mask, position_ids=position_ids)
    else:
        texts = tokenizer.batch_decode(query_responses, skip_special_tokens=True)
        inputs = rm_tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        inputs = {k: v.to(query_responses.device) for k, v in inputs.items()}
    n = query_responses.shape[0]
    logits = [reward_model(**{k: v[i : i + chunk] for k, v in inputs.items()}).logits for i in range(0, n, chunk)]
    return torch.cat(logits)[:, label].float()


@torch.no_grad()
def evaluate(policy, tokenizer, problems, generation_config, reward_fn, chunk):
    """Held-out accuracy: mean reward-function score over `problems`, sampling as in training."""
    correct = []
    for i in range(0, len(problems), chunk):
        batch = problems[i : i + chunk]
        enc = tokenizer([p["prompt"] for p in batch], padding=True, return_tensors="pt").to(policy.device)
        responses = generate(policy, enc.input_ids, enc.attention_mask, generation_config)
        responses, _ = truncate_after_eos(responses, tokenizer.eos_token_id, tokenizer.pad_token_id)
        completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
        correct += reward_fn(completions, [p["answer"] for p in batch])
    return sum(correct) / len(correct)


def peak_memory_mb(device):
    """Peak memory of this process: CUDA allocations on a GPU, the resident set (ru_maxrss, KiB) on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def save(path, policy, tokenizer, value_head, critic):
    """save_pretrained for the policy (transformers loads it back), the value head and critic beside it."""
    policy.save_pretrained(path)
    tokenizer.save_pretrained(path)
    torch.save(value_head.state_dict(), os.path.join(path, "value_head.pt"))
    if critic is not None:
        critic.save_pretrained(os.path.join(path, "critic"))


def load_models(args, device):
    """--model's tokenizer and policy and --reward-model's model, each failure a one-line error.

    Returns (tokenizer, policy, reward_model, rm_tokenizer, max_prompt_length): rm_tokenizer is None when
    the reward model reads the policy's own tokens (the ids are then scored as they are); the policy stays
    on the CPU, the reward model goes to `device`, frozen."""
    args.model = resolve(args.model)
    tokenizer = from_pretrained(AutoTokenizer, args.model, "--model", padding_side="left")
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"error: --model {args.model}: the tokenizer has no EOS token, so no response could end")
    policy = from_pretrained(AutoModelForCausalLM, args.model, "--model")
    context = context_length_of(policy.config)
    if context is not None and args.max_new_tokens >= context:
        raise SystemExit(
            f"error: --max-new-tokens {args.max_new_tokens} leaves no room for a prompt in the model's "
            f"context of {context} tokens"
        )
    max_prompt_length = args.max_prompt_length or (context - args.max_new_tokens if context else None)
    if context is not None and max_prompt_length + args.max_new_tokens > context:
        raise SystemExit(
            f"error: --max-prompt-length {max_prompt_length} + --max-new-tokens {args.max_new_tokens} "
            f"exceeds the model's context of {context} tokens"
        )
    reward_model = rm_tokenizer = None
    if args.reward_model is not None:
        args.reward_model = resolve(args.reward_model)
        reward_model = from_pretrained(AutoModelForSequenceClassification, args.reward_model, "--reward-model")
        if reward_model.config.num_labels != 1 and args.reward_label is None:
            raise SystemExit(
                f"error: --reward-model {args.reward_model} has num_labels={reward_model.config.num_labels}; "
                "a reward model gives one score: pass --reward-label to choose the logit"
            )
        rm_tokenizer = from_pretrained(AutoTokenizer, args.reward_model, "--reward-model")
        if rm_tokenizer.get_vocab() == tokenizer.get_vocab():
            rm_tokenizer = None  # same tokens: score the ids directly, no decode / re-encode
        else:
            add_pad_token(rm_tokenizer, [reward_model])
        reward_model.to(device).eval().requires_grad_(False)
        disable_dropout(reward_model)
    add_pad_token(tokenizer, [policy] + ([reward_model] if reward_model is not None and rm_tokenizer is None else []))
    return tokenizer, policy, reward_model, rm_tokenizer, max_prompt_length


def main(args: Args | None = None):
    args = tyro.cli(Args) if args is None else args
    # TRY NOT TO MODIFY: checks, seeding, device, models
    if args.batch_size % args.num_mini_batches:
        raise SystemExit(
            f"error: --num-mini-batches must divide --batch-size (got {args.num_mini_batches} and {args.batch_size})"
        )
    mini_batch_size = args.batch_size // args.num_mini_batches
    if mini_batch_size % args.micro_batch_size:
        raise SystemExit(
            f"error: --micro-batch-size must divide the minibatch --batch-size / --num-mini-batches "
            f"(got {args.micro_batch_size} and {mini_batch_size})"
        )
    if args.temperature <= 0:
        raise SystemExit(f"error: --temperature must be > 0: log-probs divide by it (got {args.temperature})")
    if args.reward_model is None and args.reward_fn not in REWARD_FNS:
        raise SystemExit(f"error: --reward-fn must be one of {sorted(REWARD_FNS)} (got {args.reward_fn})")
    transformers.utils.logging.disable_progress_bar()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    tokenizer, policy, reward_model, rm_tokenizer, max_prompt_length = load_models(args, device)
    if args.score_norm is None:
        # Detail 14: a learned reward model's offset and scale are arbitrary (the Bradley-Terry loss sees only
        # differences), and at its raw scale beta*KL is no brake: the policy chases the model's errors.
        args.score_norm = args.reward_model is not None
        print(f"score normalisation {'on' if args.score_norm else 'off'}: the default with a reward "
              f"{'model' if args.score_norm else 'function'} (--score-norm True/False overrides)")  # fmt: skip

    # Detail 8: the critic starts from the reward model when it reads the same tokens, else from the policy.
    critic = None
    if args.critic == "separate":
        source = args.reward_model if reward_model is not None and rm_tokenizer is None else args.model
        critic = from_pretrained(AutoModel, source, "--critic source")
        critic.resize_token_embeddings(len(tokenizer))
        print(f"critic: a separate network initialised from {source}")
    value_head = nn.Linear(policy.config.hidden_size if critic is None else critic.config.hidden_size, 1)
    nn.init.zeros_(value_head.weight)
    nn.init.zeros_(value_head.bias)
    # Reference: a frozen copy of the initial policy (not needed at all when there is no KL penalty).
    ref_policy = copy.deepcopy(policy).eval().requires_grad_(False) if args.kl_coef or args.kl_target else None
    for model in [policy, critic, ref_policy]:
        if model is not None:
            model.to(device)
            disable_dropout(model)
            model.config.use_cache = True
    value_head.to(device)
    if args.gradient_checkpointing:
        for model in [policy, critic]:
            if model is not None:
                model.gradient_checkpointing_enable()

    n_params = sum(p.numel() for p in policy.parameters())
    if device.type == "cpu" and n_params < 50e6:
        torch.set_num_threads(1)  # measured on 2 shared cores: small models run faster on one thread
    if args.learning_rate is None:
        args.learning_rate = 1e-4 if n_params < 50e6 else 1e-5
        print(
            f"learning rate {args.learning_rate:g}: the default for {n_params / 1e6:.1f}M parameters "
            "(1e-4 below 50M, 1e-5 above; --learning-rate overrides)"
        )
    params = [p for m in [policy, critic, value_head] if m is not None for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, eps=1e-5)
    kl_ctl = AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon) if args.kl_target else None
    kl_coef = args.kl_coef
    generation_config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, do_sample=True, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    reward_fn = REWARD_FNS[args.reward_fn]
    prompts = load_prompts(args)
    eval_problems = arithmetic_eval_set() if args.dataset == "arithmetic" and args.eval_every else None

    run_name = f"{args.exp_name}__{args.seed}__{int(time.time() * 1000)}"  # ms: runs started together stay apart
    run_dir = os.path.join(args.output_dir, run_name)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "args.json"), "w") as f:
        json.dump(asdict(args), f, indent=1)
    metrics_file = open(os.path.join(run_dir, "metrics.jsonl"), "a")
    samples_file = open(os.path.join(run_dir, "samples.jsonl"), "a")
    if args.track:
        import wandb

        wandb.init(
            project=args.wandb_project_name, entity=args.wandb_entity, name=run_name, config=vars(args), dir=run_dir
        )

    def log(metrics):
        metrics_file.write(json.dumps(metrics) + "\n")
        metrics_file.flush()
        if args.track:
            wandb.log(metrics, step=metrics["update"])

    def timer():
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    if eval_problems:
        with autocast:
            accuracy = evaluate(policy, tokenizer, eval_problems, generation_config, reward_fn, args.batch_size)
        log({"update": 0, "episode": 0, "eval/accuracy": accuracy})
        print(f"update 0: held-out accuracy {accuracy:.3f}")

    update, start_time = 0, time.time()
    try:
        for update in range(1, args.total_steps + 1):
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = args.learning_rate * (1 - (update - 1) / args.total_steps)
            # ALGO LOGIC: 1. rollout -- sample one response per prompt
            t0 = timer()
            batch = [next(prompts) for _ in range(args.batch_size)]
            enc = tokenizer(
                [row["prompt"] for row in batch], padding=True, truncation=max_prompt_length is not None,
                max_length=max_prompt_length, return_tensors="pt",
            ).to(device)  # fmt: skip
            queries, context_length = enc.input_ids, enc.input_ids.shape[1]
            policy.eval()
            with autocast:
                responses = generate(policy, queries, enc.attention_mask, generation_config)
            responses, response_mask = truncate_after_eos(responses, tokenizer.eos_token_id, tokenizer.pad_token_id)
            query_responses = torch.cat([queries, responses], dim=1)
            attention_mask = torch.cat([enc.attention_mask, response_mask.long()], dim=1)
            mask = response_mask.float()  # (B, R)
            t1 = timer()

            # 2. log-probs of policy and reference, values and scores; chunks of the training shape (detail 5)
            logprobs, ref_logprobs, values = [], [], []
            with torch.no_grad(), autocast:
                for i in range(0, args.batch_size, args.micro_batch_size):
                    chunk = slice(i, i + args.micro_batch_size)
                    qr, am = query_responses[chunk], attention_mask[chunk]
                    lp, _, v = forward(policy, critic, value_head, qr, am, context_length, args.temperature)
                    logprobs.append(lp)
                    values.append(v)
                    if ref_policy is not None:
                        ref_logprobs.append(
                            forward(ref_policy, None, None, qr, am, context_length, args.temperature)[0]
                        )
                logprobs, values = torch.cat(logprobs), torch.cat(values)
                ref_logprobs = torch.cat(ref_logprobs) if ref_policy is not None else logprobs
                completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
                answers = [row["answer"] for row in batch]
                accuracy = None
                if answers[0] is not None:
                    accuracy = torch.tensor(reward_fn(completions, answers), device=device)
                if reward_model is not None:
                    scores = reward_model_scores(
                        reward_model, rm_tokenizer, tokenizer, query_responses, attention_mask,
                        args.reward_label or 0, args.micro_batch_size,
                    )  # fmt: skip
                elif accuracy is not None:
                    scores = accuracy.clone()
                else:
                    raise SystemExit(f"error: --reward-fn needs answers: --answer-column {args.answer_column} is empty")
            contains_eos = (responses == tokenizer.eos_token_id).any(1)
            if args.missing_eos_penalty is not None:
                scores = scores - args.missing_eos_penalty * (~contains_eos).float()
            raw_scores = scores  # what the logs show: before normalisation and clipping
            if args.score_norm:
                scores = (scores - scores.mean()) / (scores.std() + 1e-8)
            if args.score_clip is not None:
                scores = scores.clamp(-args.score_clip, args.score_clip)
            t2 = timer()

            # 3. per-token rewards: -beta * KL everywhere, plus the score at the last real token (detail 3)
            kl = kl_penalty(logprobs, ref_logprobs, args.kl_estimator) * mask
            non_score_reward = -kl_coef * kl
            rewards = non_score_reward.clone()
            last_index = response_mask.long().sum(1) - 1
            rewards[torch.arange(args.batch_size, device=device), last_index] += scores
            if args.whiten_rewards:
                rewards = masked_whiten(rewards, mask, shift_mean=False) * mask

            # 4. advantages: GAE over response tokens, whitened over the batch (detail 10)
            advantages, returns = compute_gae(rewards, values, mask, args.gamma, args.lam)
            advantages = masked_whiten(advantages, mask)

            # 5. PPO update: epochs of shuffled minibatches, micro-batches accumulate gradients (details 11, 12)
            policy.train()
            stats = {k: [] for k in ["approxkl", "clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "ratio"]}
            for _ in range(args.num_ppo_epochs):
                epoch_approxkl = []
                for mb_inds in torch.randperm(args.batch_size, device=device).split(mini_batch_size):
                    for mc_inds in mb_inds.split(args.micro_batch_size):
                        mc_mask = mask[mc_inds]
                        with autocast:
                            new_logprobs, logits, new_values = forward(
                                policy, critic, value_head, query_responses[mc_inds], attention_mask[mc_inds],
                                context_length, args.temperature,
                            )  # fmt: skip
                        pg_loss, clipfrac, approxkl, ratio = policy_loss(
                            new_logprobs, logprobs[mc_inds], advantages[mc_inds], mc_mask, args.cliprange
                        )
                        vf_loss, vf_clipfrac = value_loss(
                            new_values, values[mc_inds], returns[mc_inds], mc_mask, args.cliprange_value
                        )
                        with torch.set_grad_enabled(args.ent_coef > 0):
                            entropy = masked_mean(entropy_from_logits(logits), mc_mask)
                        loss = pg_loss + args.vf_coef * vf_loss - args.ent_coef * entropy
                        (loss * len(mc_inds) / len(mb_inds)).backward()
                        for key, value in zip(
                            stats, [approxkl, clipfrac, pg_loss, vf_loss, vf_clipfrac, entropy, ratio]
                        ):
                            stats[key].append(value.detach())
                        epoch_approxkl.append(approxkl)
                    grad_norm = nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                    if not torch.isfinite(grad_norm):  # detail 15: the weights are still the last good ones
                        save(os.path.join(run_dir, "policy"), policy, tokenizer, value_head, critic)
                        raise SystemExit(
                            f"error: the loss became non-finite at update {update}; the last good weights are "
                            f"in {run_dir}/policy (try a lower --learning-rate)"
                        )
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if args.target_kl is not None and torch.stack(epoch_approxkl).mean() > args.target_kl:
                    break
            t3 = timer()

            # 6. KL controller and reference refresh
            mean_kl = kl.sum(1).mean().item()
            if kl_ctl is not None:
                kl_ctl.update(mean_kl, args.batch_size)
                kl_coef = kl_ctl.value
            if args.ref_update_every and update % args.ref_update_every == 0 and ref_policy is not None:
                ref_policy.load_state_dict(policy.state_dict())

            # TRY NOT TO MODIFY: log (TRL's metric names), evaluate, show samples, save
            mean = {k: torch.stack(v).mean().item() for k, v in stats.items()}
            mean_non_score_reward = non_score_reward.sum(1).mean().item()
            n_tokens = int(mask.sum().item())
            metrics = {
                "update": update,
                "episode": update * args.batch_size,
                "objective/kl": mean_kl,
                "objective/kl_coef": kl_coef,
                "objective/entropy": (-logprobs * mask).sum(1).mean().item(),
                "objective/non_score_reward": mean_non_score_reward,
                "objective/rlhf_reward": raw_scores.mean().item() + mean_non_score_reward,
                "objective/scores": raw_scores.mean().item(),
                "policy/approxkl_avg": mean["approxkl"],
                "policy/clipfrac_avg": mean["clipfrac"],
                "policy/entropy_avg": mean["entropy"],
                "loss/policy_avg": mean["pg_loss"],
                "loss/value_avg": mean["vf_loss"],
                "val/clipfrac_avg": mean["vf_clipfrac"],
                "val/ratio": mean["ratio"],
                "val/num_eos_tokens": int(contains_eos.sum().item()),
                "val/mean_length": n_tokens / args.batch_size,
                "lr": optimizer.param_groups[0]["lr"],
                "time/generation": t1 - t0,
                "time/scoring": t2 - t1,
                "time/update": t3 - t2,
                "time/elapsed": time.time() - start_time,
                "perf/tokens_per_sec": n_tokens / (t3 - t0),
                "perf/peak_memory_mb": peak_memory_mb(device),
            }
            if accuracy is not None:
                metrics["objective/accuracy"] = accuracy.mean().item()
            if eval_problems and (update % args.eval_every == 0 or update == args.total_steps):
                policy.eval()
                with autocast:
                    metrics["eval/accuracy"] = evaluate(
                        policy, tokenizer, eval_problems, generation_config, reward_fn, args.batch_size
                    )
            log(metrics)
            print(
                f"update {update}: score {metrics['objective/scores']:.3f}  kl {mean_kl:.3f}  "
                f"approxkl {mean['approxkl']:.4f}  clipfrac {mean['clipfrac']:.3f}  "
                + (f"held-out accuracy {metrics['eval/accuracy']:.3f}  " if "eval/accuracy" in metrics else "")
                + f"{t3 - t0:.2f}s  ({time.time() - start_time:.0f}s total)"
            )
            if args.sample_every and update % args.sample_every == 0:
                for j in range(min(args.num_samples, args.batch_size)):
                    sample = {"update": update, "prompt": batch[j]["prompt"], "completion": completions[j]}
                    sample["score"] = raw_scores[j].item()
                    samples_file.write(json.dumps(sample) + "\n")
                    print(f"  {sample['prompt']!r} -> {sample['completion']!r}  score {sample['score']:.2f}")
                samples_file.flush()
            if args.save_every and update % args.save_every == 0:
                save(os.path.join(run_dir, "policy"), policy, tokenizer, value_head, critic)
    except KeyboardInterrupt:
        print(f"interrupted at update {update}: saving")
    save(os.path.join(run_dir, "policy"), policy, tokenizer, value_head, critic)
    print(f"saved the policy to {run_dir}/policy")
    metrics_file.close()
    samples_file.close()
    if args.track:
        wandb.finish()
    return run_dir


if __name__ == "__main__":
    main()

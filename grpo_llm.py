"""GRPO for language models, and its current variants (Dr. GRPO, DAPO, GSPO, RLOO, CISPO, SAPO, ...), in one file.

Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath) is PPO without the critic: every prompt
gets a group of G sampled completions, each completion's advantage is its reward relative to the group's,
and a KL term to the frozen reference sits in the loss instead of in the reward. `main()` reads in the
order of the algorithm: rollout (G completions per prompt) -> rewards -> group advantages -> old and
reference log-probs -> num-iterations clipped updates -> log -> save.

    python grpo_llm.py                                  # embedded arithmetic SFT model, offline, CPU
    python grpo_llm.py --reward-model assets/arith-rm   # the same, scored by the learned reward model
    python grpo_llm.py --model gpt2 --total-steps 200   # a hub model (a GPU is advisable)

Implementation details (cited as "detail N" in the comments):
1. --batch-size counts completions (as TRL does): prompts per update = batch size / --num-generations, and
   a prompt's G completions are contiguous, so a group is a row of rewards.view(-1, G).
2. Completions are cut after the first EOS; later tokens become pad and are masked out of every loss and
   statistic, so the policy is not trained on text it would never show.
3. Advantage = reward - group mean, divided by the group's std + 1e-4 (Bessel), the batch's, or nothing;
   one advantage per completion, broadcast to its tokens. No value model, no GAE.
4. Log-probs divide the logits by the sampling temperature, or the ratio and KL start away from 1 and 0.
5. A group whose rewards are all equal gets advantage exactly 0: nothing to prefer, and no 0 / 0.
6. Dropout is off in every model, set to 0 in the config before the model is built (Llama-style attention
   reads config.attention_dropout in train mode) and in every nn.Dropout: the ratio and the KL then measure
   policy change and nothing else.
7. Prompts are left-padded for batched generation; position ids come from the attention mask, so a
   padded prompt sees the positions an unpadded one would.
8. With --num-iterations 1 the old log-probs are the current ones detached (ratio exactly 1, one gradient
   step per batch); with more, they are recomputed after generation in the training's micro-batch shapes.
9. The LM head runs on completion positions only, in chunks of tokens (lm_head_logprobs): at most 2^24 logits
   exist at once, and under autograd each chunk is recomputed in backward instead of kept, so memory does
   not grow with completion length x vocabulary. Log-probs and entropy come from one fp32 log-sum-exp.
10. Clipped surrogate per token with asymmetric bounds [1 - epsilon, 1 + epsilon_high]: a higher upper
    bound lets unlikely tokens with a positive advantage grow (DAPO's clip-higher, against entropy collapse).
11. Loss aggregation by --loss-type: per-completion token mean then mean (grpo), one token mean over the
    batch (dapo), or the token sum over completions x --max-new-tokens (dr_grpo).
12. KL to the frozen reference is a loss term beta * k3 (unbiased, >= 0), not a reward penalty, so it
    stays out of the advantages; beta = 0 loads no reference at all (TRL's default since Dr. GRPO).
13. Several reward functions are summed with --reward-weights (TRL); a reward model scores alone.
14. Micro-batches weight their loss so that the accumulated gradient is the whole batch's: by completions
    for grpo, sapo and dr_grpo, by their share of the loss tokens for dapo and cispo (the normalisers are global).
15. A non-finite gradient stops the run before the optimizer step and saves the last good weights;
    Ctrl-C saves before exiting.
16. A completion ends at any EOS id: the tokenizer's and the checkpoint's generation_config's (chat models
    declare several), in generation, truncation, --mask-truncated-completions, evaluation and the logs.
17. Embeddings are resized to the tokenizer only to grow: checkpoints carry spare rows the model can sample.
18. The family's logit post-processing (Gemma's final_logit_softcapping, Cohere's logit_scale, Granite's
    logits_scaling) is applied inside each head chunk, before the temperature; at start the script checks
    its log-probs against the model's own forward and refuses a model whose logits it does not reproduce.
19. Dtypes: the policy trains in fp32 (master weights, whatever the checkpoint dtype: bf16 AdamW updates
    of lr 1e-5 mostly round away); compute runs under bf16 autocast on CUDA (--mixed-precision). The
    reference is an fp32 copy of the policy, scored by the same function in the same shapes, so the first
    KL is exactly 0; the frozen reward model keeps its checkpoint dtype.
20. Sampling is softmax(logits / temperature) and nothing else: the checkpoint's generation_config
    (repetition_penalty, top_k, min_p, ...) is replaced, since transformers would apply it silently, and
    --top-k / --top-p are refused: the ratio and the KL need the log-probs of the distribution sampled,
    and a truncated one would also give the reference -inf log-probs for tokens outside its own support.
    The saved policy carries this generation config.
21. --loss-type cispo (MiniMax-M1, 2025): REINFORCE weighted by the capped, detached ratio: no token's gradient
    is clipped away. The cap is 1 + --epsilon-high (TRL reads its epsilon_high as the cap: TRL's 5 = our 4).
22. --loss-type sapo (Gao et al. 2025): a sigmoid gate instead of the hard clip: gradient A at rho = 1, fading
    smoothly off-policy, faster for A <= 0 (--sapo-temperature-neg > -pos).
23. --delta (INTELLECT-2, 2025): two-sided clipping, the unclipped ratio capped at delta: with A < 0, a token
    whose probability rose far since sampling gets a bounded push down.
24. --top-entropy-quantile q (Wang et al. 2025, "Beyond the 80/20 rule"): only tokens whose entropy is in the
    top q carry the policy gradient (the normaliser counts all); q of the whole batch, from the rollout policy
    (an extra no-grad forward at mu = 1), not of each micro-batch from the current one as in TRL.
25. --off-policy-mask-threshold t (DeepSeek-V3.2, 2025): completions with A < 0 whose mean k1 KL(old || policy)
    exceeds t leave the policy-gradient term. At mu = 1 the rollout policy is the current one: a no-op.
26. --use-bias-correction-kl (DeepSeek-V3.2; on, as TRL): the KL term is rho k3. Tokens come from pi_old, so
    E_old[rho k3] = E_pi[k3] = KL(pi || ref), with gradient E_pi[(k3 + 1 - ref/pi) grad log pi] = grad KL(pi || ref)
    even at mu = 1 (rho = 1, grad rho != 0): the KL the objective names and `kl` reports. k3 alone: gradient
    E_pi[(1 - ref/pi) grad log pi] = -E_ref[grad log pi] = grad KL(ref || pi), the other direction (the GRPO paper's).
27. --ent-coef c: entropy bonus -c H (detail 9's entropy, with gradient), a token mean over the batch's loss tokens.

The variants, as differences from GRPO (loss-type grpo, scale-rewards group, epsilon-high = epsilon):
- Dr. GRPO (Liu et al. 2025): --loss-type dr_grpo --scale-rewards none. Dividing by each completion's
  length favours long wrong answers and short right ones, dividing by the group std favours too easy and
  too hard prompts; both biases go: the sum is divided by a constant (completions x --max-new-tokens).
- DAPO (Yu et al. 2025): --loss-type dapo --epsilon-high 0.28 --dynamic-sampling --overlong-buffer N.
  Token-level loss (every token weighs the same, however long its completion); clip-higher; groups with
  equal rewards leave the loss (dynamic sampling, here without resampling); soft overlong punishment:
  -penalty * (L - (max_new_tokens - N)) / N for the last N lengths. --mask-truncated-completions drops
  completions that never emitted EOS from the loss (DAPO's overlong filtering).
- GSPO (Zheng et al. 2025): --importance-sampling-level sequence (with clip ranges like 3e-4 / 4e-4). One
  ratio per completion, exp(mean over its tokens of logp - old_logp), clipped as a whole and broadcast.
- RLOO (Ahmadian et al. 2024): --leave-one-out --scale-rewards none. Baseline = the mean of the other
  G - 1 rewards of the group, so a completion's own reward does not bias its baseline.
"""

import copy
import json
import os
import random
import re
import resource
import time
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
import tyro
from torch.utils.checkpoint import checkpoint
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GenerationConfig,
)


@dataclass
class Args:
    # Experiment
    exp_name: str = "grpo_llm"
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

    # Model and data
    model: str = "assets/arith-sft"
    """policy and reference: a hub id or a local directory (default: the embedded arithmetic SFT model)"""
    reward_model: str | None = None
    """sequence-classification reward model (hub id or directory); it replaces --reward-fn as the reward"""
    reward_label: int | None = None
    """which logit of the reward model is the score, when it has several (lvwerra/distilbert-imdb: 1)"""
    reward_fn: tuple[Literal["arithmetic", "gsm8k"], ...] = ("arithmetic",)
    """reward functions, summed with --reward-weights: exact answer (arithmetic), last number vs '#### N' (gsm8k)"""
    reward_weights: tuple[float, ...] | None = None
    """weight of each reward function (default: 1 each)"""
    dataset: str = "arithmetic"
    """prompts: `arithmetic` (built in, offline), a local .jsonl file, or a hub dataset name"""
    dataset_config: str | None = None
    """hub dataset configuration (gsm8k: main)"""
    dataset_split: str = "train"
    """hub dataset split"""
    prompt_column: str = "prompt"
    """field of a dataset row that holds the prompt (gsm8k: question, imdb: text)"""
    answer_column: str = "answer"
    """field that holds the reference answer the reward functions check"""
    gradient_checkpointing: bool = False
    """trade compute for memory in the policy"""

    # Generation
    max_new_tokens: int = 8
    """longest completion (8 fits the arithmetic task; text tasks want 48 or more)"""
    max_prompt_length: int | None = None
    """prompts are cut to their first N tokens (default: the model's context minus --max-new-tokens)"""
    temperature: float = 1.0
    """sampling temperature; log-probs use the same one (detail 4)"""
    top_k: int = 0
    """must stay 0: truncated sampling is refused for training (detail 20)"""
    top_p: float = 1.0
    """must stay 1.0: truncated sampling is refused for training (detail 20)"""
    cast_lm_head_to_fp32: bool = True
    """the LM head's matmul in fp32 under autocast (TRL's name); the log-sum-exp is fp32 either way"""

    # Algorithm
    total_steps: int = 500
    """number of GRPO updates (one generation batch and its --num-iterations each)"""
    batch_size: int = 64
    """completions per update = prompts x --num-generations (detail 1)"""
    num_generations: int = 8
    """G, completions per prompt: the group whose rewards are the baseline"""
    micro_batch_size: int = 64
    """sequences per forward pass: gradient accumulation in training, chunking in no-grad passes"""
    num_iterations: int = 1
    """mu, optimizer steps on each generation batch (old log-probs recomputed when > 1, detail 8)"""
    learning_rate: float | None = None
    """AdamW learning rate (default: 1e-4 below 50M parameters, 1e-5 above; printed at start)"""
    anneal_lr: bool = False
    """decay the learning rate linearly to 0"""
    max_grad_norm: float = 1.0
    """global gradient-norm clip"""
    beta: float = 0.0
    """weight of the k3 KL-to-reference loss term (0: no reference model is loaded)"""
    epsilon: float = 0.2
    """lower clip range of the ratio: 1 - epsilon"""
    epsilon_high: float | None = None
    """upper clip range of the ratio: 1 + epsilon_high (default: epsilon; DAPO: 0.28; cispo's cap, detail 21)"""
    delta: float | None = None
    """two-sided clipping: the unclipped ratio capped at delta > 1 + epsilon_high (INTELLECT-2: 4; detail 23)"""
    loss_type: Literal["grpo", "dapo", "dr_grpo", "cispo", "sapo"] = "grpo"
    """per-token loss and its normaliser (details 11, 21, 22): see grpo_loss"""
    sapo_temperature_pos: float = 1.0
    """sapo's gate temperature for positive advantages"""
    sapo_temperature_neg: float = 1.05
    """sapo's gate temperature for the other advantages"""
    top_entropy_quantile: float = 1.0
    """only the tokens in this top quantile of entropy carry the policy gradient (0.2 in the paper; detail 24)"""
    off_policy_mask_threshold: float | None = None
    """drop completions with A < 0 whose KL to the sampling policy exceeds it from the loss (detail 25)"""
    use_bias_correction_kl: bool = True
    """multiply k3 by the importance ratio: the gradient of KL(policy || ref) itself (detail 26)"""
    ent_coef: float = 0.0
    """entropy-bonus weight (token mean over the loss tokens, detail 27)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide the advantages by the group's std, the batch's std, or nothing (Dr. GRPO)"""
    leave_one_out: bool = False
    """RLOO's baseline: the mean of the other G - 1 rewards of the group instead of the group mean"""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """one importance ratio per token (GRPO) or per completion (GSPO)"""
    dynamic_sampling: bool = False
    """drop groups whose rewards are all equal from the loss (DAPO's dynamic sampling, without resampling)"""
    mask_truncated_completions: bool = False
    """drop completions that never emitted EOS from the loss"""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment over the last N lengths up to --max-new-tokens (0: off)"""
    overlong_penalty: float = 1.0
    """reward lost by a completion that reaches --max-new-tokens, with --overlong-buffer"""

    # Logging
    eval_every: int = 10
    """held-out accuracy on the arithmetic task every N updates (0: off)"""
    sample_every: int = 10
    """print and store a few decoded samples every N updates (0: off)"""
    num_samples: int = 3
    """samples shown each time"""


# ALGO LOGIC: the numerics, small pure functions on tensors (checked by tests/ against hand-computed values)


def masked_mean(values, mask, axis=None):
    """sum(values * mask) / sum(mask), over `axis` or over everything."""
    if axis is None:
        return (values * mask).sum() / mask.sum()
    return (values * mask).sum(axis) / mask.sum(axis)


def kl_penalty(logprobs, ref_logprobs, estimator):
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's r = logp - ref_logp (Schulman 2020):
    k1 = r (unbiased, can be < 0); k2 = r^2 / 2 (biased, low variance); k3 = exp(-r) - 1 + r (unbiased, >= 0)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return torch.expm1(-log_ratio) + log_ratio


def group_advantages(rewards, group_size, scale, leave_one_out=False):
    """Advantage of each completion relative to its group (detail 3): rewards (B,) -> (B,), G contiguous each.

    A_i = r_i - mean(group), or r_i - mean of the other G - 1 (leave_one_out, RLOO); then divided by
    std(group) + 1e-4 (scale "group"), std(batch) + 1e-4 ("batch") or nothing ("none"), std Bessel-corrected.
    A group of equal rewards gets exactly 0 (detail 5)."""
    grouped = rewards.view(-1, group_size)  # (P, G)
    if leave_one_out:
        baseline = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
    else:
        baseline = grouped.mean(1, keepdim=True)
    advantages = grouped - baseline
    if scale == "group":
        advantages = advantages / (grouped.std(1, keepdim=True) + 1e-4)
    elif scale == "batch":
        advantages = advantages / (rewards.std() + 1e-4)
    equal = grouped.max(1, keepdim=True).values == grouped.min(1, keepdim=True).values
    return advantages.masked_fill(equal, 0.0).view(-1)


def high_entropy_mask(entropy, mask, quantile):
    """1 on the real tokens whose entropy is in the top `quantile` of all real tokens' (detail 24), else 0."""
    threshold = torch.quantile(entropy[mask.bool()].float(), 1 - quantile)
    return (entropy >= threshold).float() * mask


def grpo_loss(
    logprobs, old_logprobs, ref_logprobs, advantages, mask, epsilon, epsilon_high, beta, loss_type,
    max_completion_length, importance_sampling_level="token", delta=None, sapo_temperatures=(1.0, 1.05),
    entropy_mask=1.0, off_policy_mask_threshold=None, use_bias_correction_kl=False,
):  # fmt: skip
    """Per-token policy loss by loss_type, plus beta * k3, aggregated by loss_type. Returns (loss, stats).

    rho = exp(logprobs - old_logprobs) (token) or exp(mean over the completion of logprobs - old_logprobs)
    broadcast to its tokens (sequence, GSPO); per token, with A the advantage and sg() stop-gradient:
      grpo, dapo, dr_grpo: -min(min(rho, delta) A, clip(rho, 1 - epsilon, 1 + epsilon_high) A)    (details 10, 23)
      cispo: -sg(min(rho, 1 + epsilon_high)) A logprobs;  sapo: -sigmoid(tau (rho - 1)) 4 / tau A   (details 21, 22)
    times entropy_mask and the off-policy mask (details 24, 25), plus beta k3 (times rho, detail 26), k3 = exp(ref
    - logp) - (ref - logp) - 1; the masked token sum / (each completion's length x completions) (grpo, sapo), /
    real tokens (dapo, cispo) or / (completions x max_completion_length) (dr_grpo). logprobs (B, T), advantages
    (B,) or (B, T); ref_logprobs may be None when beta is 0."""
    log_ratio = logprobs - old_logprobs  # (B, T)
    if importance_sampling_level == "sequence":
        log_ratio = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # (B, 1)
    ratio = torch.exp(log_ratio)
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
    clipped_ratio, capped_ratio = ratio.clamp(1 - epsilon, 1 + epsilon_high), ratio.clamp(max=delta or torch.inf)
    tau = torch.where(advantages > 0, *sapo_temperatures)
    per_token_loss = {
        "cispo": lambda: -ratio.clamp(max=1 + epsilon_high).detach() * advantages * logprobs,
        "sapo": lambda: -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages,
    }.get(loss_type, lambda: -torch.min(capped_ratio * advantages, clipped_ratio * advantages))()
    per_token_loss = per_token_loss * entropy_mask
    if off_policy_mask_threshold is not None:  # mean k1 KL(old || current) per completion, over real tokens
        off_policy_kl = masked_mean(old_logprobs - logprobs.detach(), mask, axis=1)[:, None]  # (B, 1)
        per_token_loss = per_token_loss * ~((advantages < 0) & (off_policy_kl > off_policy_mask_threshold))
    correction = ratio if use_bias_correction_kl else 1  # detail 26: rho k3 has the gradient of KL(pi || ref)
    kl = kl_penalty(logprobs, ref_logprobs, "k3") * correction if ref_logprobs is not None else None
    if beta:
        per_token_loss = per_token_loss + beta * kl
    lengths, rows = mask.sum(1).clamp(min=1), logprobs.shape[0]
    normaliser = {"grpo": lengths * rows, "sapo": lengths * rows, "dr_grpo": rows * max_completion_length}
    loss = ((per_token_loss * mask).sum(1) / normaliser.get(loss_type, mask.sum().clamp(min=1))).sum()
    with torch.no_grad():
        low = (ratio < 1 - epsilon) & (advantages < 0)  # clipped where the min picks the clipped term
        high = (ratio > 1 + epsilon_high) & (advantages > 0)
        stats = {
            "clip_ratio/low_mean": masked_mean(low.float(), mask),
            "clip_ratio/high_mean": masked_mean(high.float(), mask),
            "clip_ratio/region_mean": masked_mean((low | high).float(), mask),
            "importance_ratio/mean": masked_mean(ratio.expand_as(mask), mask),
        }
        if loss_type == "cispo":
            stats["cispo_clip_ratio"] = stats["clip_ratio/high_mean"]  # TRL's name: rho above the cap, A > 0
        if kl is not None:
            stats["kl"] = masked_mean(kl, mask)
    return loss, stats


# TASKS: prompts and reward functions (the arithmetic block is identical in ppo_llm.py and assets/)

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


# MODELS: loading, generation, the forward pass and its head, scores

LM_HEAD_CHUNK = 2**24  # logits that exist at once in lm_head_logprobs (64 MiB in fp32), whatever the vocabulary


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


def load_model(cls, name, flag, dtype=torch.float32):
    """A model with every dropout probability zeroed before it is built (detail 6), in fp32 by default (detail 19).

    Llama-style attention copies config.attention_dropout at construction and applies it in train mode, so
    zeroing nn.Dropout modules afterwards is not enough; those are zeroed too, for models that hard-code one."""
    config = from_pretrained(AutoConfig, name, flag)
    for key, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    model = from_pretrained(cls, name, flag, config=config, dtype=dtype)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def add_pad_token(tokenizer):
    """Give a tokenizer without a pad token its own one (never EOS: a padded EOS would look like an end)."""
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
        print(f"note: the tokenizer had no pad token distinct from EOS; added [PAD] (id {tokenizer.pad_token_id})")


def fit_embeddings(model, tokenizer):
    """Grow the embeddings to the tokenizer, never shrink them (detail 17): checkpoints carry spare rows
    (Qwen2: 151,936 for ~151.6k tokens) that the model can still sample, and a shrunk table cannot embed them."""
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id


def context_window_of(config):
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def eos_token_ids(tokenizer, generation_config):
    """Every id that ends a response (detail 16): the tokenizer's EOS and the checkpoint's generation_config's
    (chat models declare several: Qwen2.5-Instruct ends a turn with <|im_end|>, a document with <|endoftext|>)."""
    ids = generation_config.eos_token_id
    return sorted({tokenizer.eos_token_id, *([] if ids is None else [ids] if isinstance(ids, int) else ids)})


def sampling_config(max_new_tokens, temperature, pad_token_id, eos_ids):
    """What generate() samples with (detail 20): softmax(logits / temperature), nothing else. It replaces the
    checkpoint's generation_config, whose other fields (repetition_penalty, top_k, min_p, ...) would otherwise
    fill every field left unset here and change the distribution that the log-probs never see."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
        pad_token_id=pad_token_id, eos_token_id=eos_ids,
    )  # fmt: skip


@torch.no_grad()
def generate(policy, queries, query_mask):
    """Sample responses (B, R) for left-padded prompts (B, Q) with policy.generation_config (sampling_config);
    generate() derives position ids from the mask."""
    output = policy.generate(input_ids=queries, attention_mask=query_mask)
    return output[:, queries.shape[1] :]


def truncate_after_eos(responses, eos_ids, pad_token_id):
    """Detail 2: keep the tokens up to and including the first EOS (any of eos_ids). Returns (responses, mask)."""
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device))
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0  # an EOS strictly before this position
    return responses.masked_fill(after_eos, pad_token_id), ~after_eos


def hidden_states(model, query_responses, attention_mask, prompt_width):
    """The trunk's last hidden states (B, R, H) at the positions that predict the response tokens.

    The state at position t predicts token t + 1, so the response query_responses[:, prompt_width:] is predicted
    by positions prompt_width - 1 ... -2: this slice is the off-by-one shift between logits and tokens."""
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # detail 7
    out = model.base_model(
        input_ids=query_responses, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    return out.last_hidden_state[:, prompt_width - 1 : -1]


def logit_postprocessing(config):
    """What the family's forward does to the output embedding's logits (detail 18), as (scale, softcap):
    logits * scale (Cohere's logit_scale, Granite's 1 / logits_scaling), then softcap * tanh(logits / softcap)
    (Gemma 2 and 3's final_logit_softcapping)."""
    scale = (getattr(config, "logit_scale", None) or 1.0) / (getattr(config, "logits_scaling", None) or 1.0)
    return scale, getattr(config, "final_logit_softcapping", None)


def head_chunk(hidden, weight, bias, labels, temperature, scale, softcap, with_entropy, fp32):
    """lm_head_logprobs on one chunk of tokens: hidden (N, H), labels (N,) -> log-probs (N,), entropy (N,) or None."""
    if fp32:  # the matmul in fp32 even under autocast (--cast-lm-head-to-fp32)
        with torch.autocast(hidden.device.type, enabled=False):
            logits = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    else:
        logits = F.linear(hidden, weight, bias)
    logits = logits.float() * scale  # the log-sum-exp arithmetic is always fp32
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    logsumexp = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, labels[:, None])[:, 0] - logsumexp
    entropy = logsumexp - (torch.softmax(logits, dim=-1) * logits).sum(-1) if with_entropy else None
    return logprobs, entropy


def lm_head_logprobs(hidden, head, labels, temperature, scale=1.0, softcap=None, with_entropy=False, fp32=True):
    """Log-probs of labels (B, T) and, optionally, entropies (B, T) of the next-token distributions, from the last
    hidden states (B, T, H) and the output embedding `head`, in chunks of tokens (details 4, 9, 18).

    logits = softcap(scale * head(h)) / temperature;  log p(y) = logits[y] - logsumexp(logits);
    H = logsumexp(logits) - sum_v softmax(logits)_v * logits_v.
    At most LM_HEAD_CHUNK logits exist at once: under autograd each chunk is recomputed in backward
    (torch.utils.checkpoint) instead of kept, so memory does not grow with tokens x vocabulary."""
    (B, T), V = labels.shape, head.weight.shape[0]
    hidden, labels, n = hidden.reshape(B * T, -1), labels.reshape(B * T), max(1, LM_HEAD_CHUNK // V)
    logprobs, entropy = [], []
    for i in range(0, B * T, n):
        inputs = (hidden[i : i + n], head.weight, head.bias, labels[i : i + n], temperature, scale, softcap)
        if torch.is_grad_enabled():
            lp, h = checkpoint(head_chunk, *inputs, with_entropy, fp32, use_reentrant=False, preserve_rng_state=False)
        else:
            lp, h = head_chunk(*inputs, with_entropy, fp32)
        logprobs.append(lp)
        entropy.append(h)
    return torch.cat(logprobs).view(B, T), torch.cat(entropy).view(B, T) if with_entropy else None


def response_logprobs(model, hidden, responses, args, with_entropy=False):
    """lm_head_logprobs with the model's own output embedding and logit post-processing, at --temperature."""
    scale, softcap = logit_postprocessing(model.config)
    return lm_head_logprobs(
        hidden, model.get_output_embeddings(), responses, args.temperature, scale, softcap, with_entropy,
        args.cast_lm_head_to_fp32,
    )  # fmt: skip


@torch.no_grad()
def check_logits(model, flag, name):
    """Refuse a model whose forward does something to its logits that lm_head_logprobs does not reproduce
    (detail 18): its own log-softmax and ours, on a few tokens, must agree."""
    ids = torch.arange(1, 9, device=model.device)[None] % model.get_output_embeddings().weight.shape[0]
    mask = torch.ones_like(ids)
    expected = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), dim=-1)
    expected = expected.gather(-1, ids[:, 1:, None])[..., 0]
    scale, softcap = logit_postprocessing(model.config)
    got, _ = lm_head_logprobs(hidden_states(model, ids, mask, 1), model.get_output_embeddings(), ids[:, 1:], 1.0,
                              scale, softcap)  # fmt: skip
    error = (got - expected).abs().max().item()
    if error > 1e-3:
        raise SystemExit(
            f"error: {flag} {name}: its forward changes the logits in a way this script does not reproduce (log-probs "
            f"{error:.3g} apart); supported: logit_scale, logits_scaling, final_logit_softcapping"
        )


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
def evaluate(policy, tokenizer, problems, reward_fn, eos_ids, chunk):
    """Held-out accuracy: mean reward-function score over `problems`, sampling as in training."""
    correct = []
    for i in range(0, len(problems), chunk):
        batch = problems[i : i + chunk]
        enc = tokenizer([p["prompt"] for p in batch], padding=True, return_tensors="pt").to(policy.device)
        responses = generate(policy, enc.input_ids, enc.attention_mask)
        responses, _ = truncate_after_eos(responses, eos_ids, tokenizer.pad_token_id)
        completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
        correct += reward_fn(completions, [p["answer"] for p in batch])
    return sum(correct) / len(correct)


def peak_memory_mb(device):
    """Peak memory of this process: CUDA allocations on a GPU, the resident set (ru_maxrss, KiB) on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def load_models(args, device):
    """--model's tokenizer and policy and --reward-model's model, each failure a one-line error.

    Returns (tokenizer, policy, reward_model, rm_tokenizer, max_prompt_length, eos_ids). The policy is fp32
    (detail 19), checked against its own logits (detail 18), samples with sampling_config (detail 20) and
    stays on the CPU; rm_tokenizer is None when the reward model reads the policy's own tokens (the ids are
    then scored as they are); the reward model keeps its checkpoint dtype, frozen, on `device`."""
    args.model = resolve(args.model)
    tokenizer = from_pretrained(AutoTokenizer, args.model, "--model", padding_side="left")
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"error: --model {args.model}: the tokenizer has no EOS token, so no response could end")
    policy = load_model(AutoModelForCausalLM, args.model, "--model")
    check_logits(policy, "--model", args.model)
    context = context_window_of(policy.config)
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
        reward_model = load_model(AutoModelForSequenceClassification, args.reward_model, "--reward-model", "auto")
        if reward_model.config.num_labels != 1 and args.reward_label is None:
            raise SystemExit(
                f"error: --reward-model {args.reward_model} has num_labels={reward_model.config.num_labels}; "
                "a reward model gives one score: pass --reward-label to choose the logit"
            )
        rm_tokenizer = from_pretrained(AutoTokenizer, args.reward_model, "--reward-model")
        if rm_tokenizer.get_vocab() == tokenizer.get_vocab():
            rm_tokenizer = None  # same tokens: score the ids directly, no decode / re-encode
        else:
            add_pad_token(rm_tokenizer)
            fit_embeddings(reward_model, rm_tokenizer)
        reward_model.to(device).eval().requires_grad_(False)
    eos_ids = eos_token_ids(tokenizer, policy.generation_config)
    add_pad_token(tokenizer)
    for model in [policy] + ([reward_model] if reward_model is not None and rm_tokenizer is None else []):
        fit_embeddings(model, tokenizer)
    policy.generation_config = sampling_config(args.max_new_tokens, args.temperature, tokenizer.pad_token_id, eos_ids)
    return tokenizer, policy, reward_model, rm_tokenizer, max_prompt_length, eos_ids


def main(args: Args | None = None):
    args = tyro.cli(Args) if args is None else args
    # TRY NOT TO MODIFY: checks, seeding, device, models
    G = args.num_generations
    if G < 2:
        raise SystemExit(f"error: --num-generations must be at least 2: the group is the baseline (got {G})")
    if args.batch_size % G:
        raise SystemExit(f"error: --num-generations must divide --batch-size (got {G} and {args.batch_size})")
    if args.batch_size % args.micro_batch_size:
        raise SystemExit(
            f"error: --micro-batch-size must divide --batch-size (got {args.micro_batch_size} and {args.batch_size})"
        )
    if args.num_iterations < 1:
        raise SystemExit(f"error: --num-iterations must be at least 1 (got {args.num_iterations})")
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    if epsilon_high < args.epsilon:
        raise SystemExit(f"error: --epsilon-high must be >= --epsilon (got {epsilon_high} and {args.epsilon})")
    if not 0 < args.top_entropy_quantile <= 1 or min(args.sapo_temperature_pos, args.sapo_temperature_neg) <= 0:
        raise SystemExit("error: --top-entropy-quantile must be in (0, 1] and the --sapo-temperature-* > 0")
    if args.temperature <= 0:
        raise SystemExit(f"error: --temperature must be > 0: log-probs divide by it (got {args.temperature})")
    if args.top_k or args.top_p < 1.0:
        raise SystemExit(
            f"error: --top-k {args.top_k} / --top-p {args.top_p} would sample from a truncated distribution whose "
            "log-probs the update never sees (detail 20); train with --temperature alone"
        )
    unknown = [name for name in args.reward_fn if name not in REWARD_FNS]
    if unknown or not args.reward_fn:
        raise SystemExit(f"error: --reward-fn must be among {sorted(REWARD_FNS)} (got {' '.join(args.reward_fn)})")
    reward_names = [os.path.basename(args.reward_model)] if args.reward_model else list(args.reward_fn)
    reward_weights = torch.tensor(args.reward_weights or [1.0] * len(reward_names))
    if len(reward_weights) != len(reward_names):
        raise SystemExit(
            f"error: --reward-weights needs one weight per reward ({', '.join(reward_names)}), "
            f"got {len(reward_weights)}"
        )
    transformers.utils.logging.disable_progress_bar()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    bf16 = args.mixed_precision == "bf16" or (args.mixed_precision == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    print(f"device {device}, fp32 weights, {'bf16 autocast' if bf16 else 'fp32 compute'}")

    tokenizer, policy, reward_model, rm_tokenizer, max_prompt_length, eos_ids = load_models(args, device)

    # Reference: a frozen copy of the initial policy, only when the KL term is on (detail 12).
    ref_policy = copy.deepcopy(policy).eval().requires_grad_(False) if args.beta else None
    for model in [policy, ref_policy]:
        if model is not None:
            model.to(device)
            model.config.use_cache = True
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    n_params = sum(p.numel() for p in policy.parameters())
    if device.type == "cpu" and n_params < 50e6:
        torch.set_num_threads(1)  # measured on 2 shared cores: small models run faster on one thread
    if args.learning_rate is None:
        args.learning_rate = 1e-4 if n_params < 50e6 else 1e-5
        print(
            f"learning rate {args.learning_rate:g}: the default for {n_params / 1e6:.1f}M parameters "
            "(1e-4 below 50M, 1e-5 above; --learning-rate overrides)"
        )
    params = list(policy.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, eps=1e-5)
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

    def save(path):
        policy.save_pretrained(path)
        tokenizer.save_pretrained(path)

    if eval_problems:
        with autocast:
            accuracy = evaluate(policy, tokenizer, eval_problems, arithmetic_reward, eos_ids, args.batch_size)
        log({"update": 0, "episode": 0, "eval/accuracy": accuracy})
        print(f"update 0: held-out accuracy {accuracy:.3f}")

    update, start_time = 0, time.time()
    try:
        for update in range(1, args.total_steps + 1):
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = args.learning_rate * (1 - (update - 1) / args.total_steps)
            # ALGO LOGIC: 1. rollout -- G completions of each prompt, contiguous (detail 1)
            t0 = timer()
            batch = [row for row in (next(prompts) for _ in range(args.batch_size // G)) for _ in range(G)]
            enc = tokenizer(
                [row["prompt"] for row in batch], padding=True, truncation=max_prompt_length is not None,
                max_length=max_prompt_length, return_tensors="pt",
            ).to(device)  # fmt: skip
            queries, prompt_width = enc.input_ids, enc.input_ids.shape[1]
            policy.eval()
            with autocast:
                responses = generate(policy, queries, enc.attention_mask)
            responses, response_mask = truncate_after_eos(responses, eos_ids, tokenizer.pad_token_id)
            query_responses = torch.cat([queries, responses], dim=1)
            attention_mask = torch.cat([enc.attention_mask, response_mask.long()], dim=1)
            mask = response_mask.float()  # (B, T)
            t1 = timer()

            # 2. rewards: weighted reward functions or the reward model (detail 13), overlong punishment
            completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
            answers = [row["answer"] for row in batch]
            if reward_model is not None:
                with autocast:
                    scores = reward_model_scores(
                        reward_model, rm_tokenizer, tokenizer, query_responses, attention_mask,
                        args.reward_label or 0, args.micro_batch_size,
                    )[:, None]  # fmt: skip
            elif answers[0] is None:
                raise SystemExit(f"error: --reward-fn needs answers: --answer-column {args.answer_column} is empty")
            else:
                scores = torch.tensor(
                    [REWARD_FNS[name](completions, answers) for name in args.reward_fn], dtype=torch.float
                ).T
            scores = scores.to(device)  # (B, number of rewards)
            rewards = scores @ reward_weights.to(device)  # (B,)
            lengths = mask.sum(1)
            if args.overlong_buffer:  # DAPO: linear from 0 to -penalty over the last --overlong-buffer lengths
                over = (lengths - (args.max_new_tokens - args.overlong_buffer)).clamp(min=0) / args.overlong_buffer
                rewards = rewards - args.overlong_penalty * over

            # 3. advantages relative to the group (details 3, 5); which completions the loss sees
            advantages = group_advantages(rewards, G, args.scale_rewards, args.leave_one_out)  # (B,)
            grouped = rewards.view(-1, G)  # (prompts, G)
            zero_std = (grouped.max(1).values == grouped.min(1).values).float()
            truncated = ~torch.isin(responses, torch.tensor(eos_ids, device=device)).any(1)
            loss_mask = mask.clone()
            if args.dynamic_sampling:
                loss_mask *= 1 - zero_std.repeat_interleave(G)[:, None]
            if args.mask_truncated_completions:
                loss_mask *= (~truncated).float()[:, None]

            # 4. old log-probs (mu > 1) and reference log-probs, in the training's micro-batch shapes (detail 8)
            old_logprobs, ref_logprobs, entropies, by_entropy = [], [], [], args.top_entropy_quantile < 1
            with torch.no_grad(), autocast:
                for mc in torch.arange(args.batch_size, device=device).split(args.micro_batch_size):
                    qr, am = query_responses[mc], attention_mask[mc]
                    if args.num_iterations > 1 or by_entropy:  # detail 24: the whole batch's entropy first
                        hidden = hidden_states(policy, qr, am, prompt_width)
                        logprobs, mc_entropy = response_logprobs(policy, hidden, responses[mc], args, by_entropy)
                        old_logprobs.append(logprobs)
                        entropies.append(mc_entropy)
                    if ref_policy is not None:
                        hidden = hidden_states(ref_policy, qr, am, prompt_width)
                        ref_logprobs.append(response_logprobs(ref_policy, hidden, responses[mc], args)[0])
            old_logprobs = torch.cat(old_logprobs) if args.num_iterations > 1 else None
            if by_entropy:
                entropy_mask = high_entropy_mask(torch.cat(entropies), loss_mask, args.top_entropy_quantile)
            ref_logprobs = torch.cat(ref_logprobs) if ref_logprobs else None
            t2 = timer()

            # 5. mu optimizer steps on the batch; micro-batches accumulate the whole batch's gradient (detail 14)
            policy.train()
            stats, losses, grad_norms = {}, [], []
            n_tokens = loss_mask.sum()
            for _ in range(args.num_iterations if n_tokens > 0 else 0):
                loss_sum = torch.zeros((), device=device)
                for mc in torch.arange(args.batch_size, device=device).split(args.micro_batch_size):
                    mc_mask = loss_mask[mc]
                    if mc_mask.sum() == 0:
                        continue  # nothing of it is in the loss: its gradient would be 0
                    with autocast:
                        hidden = hidden_states(policy, query_responses[mc], attention_mask[mc], prompt_width)
                        logprobs, entropy = response_logprobs(policy, hidden, responses[mc], args, with_entropy=True)
                    loss, mc_stats = grpo_loss(
                        logprobs, logprobs.detach() if old_logprobs is None else old_logprobs[mc],
                        None if ref_logprobs is None else ref_logprobs[mc], advantages[mc], mc_mask, args.epsilon,
                        epsilon_high, args.beta, args.loss_type, args.max_new_tokens, args.importance_sampling_level,
                        args.delta, (args.sapo_temperature_pos, args.sapo_temperature_neg),
                        entropy_mask[mc] if by_entropy else 1.0, args.off_policy_mask_threshold,
                        args.use_bias_correction_kl,
                    )  # fmt: skip
                    token_mean = args.loss_type in ("dapo", "cispo")
                    loss = loss * (mc_mask.sum() / n_tokens if token_mean else len(mc) / args.batch_size)
                    if args.ent_coef:  # detail 27: a token mean over the batch, whatever the loss type
                        loss = loss - args.ent_coef * (entropy * mc_mask).sum() / n_tokens
                    loss.backward()
                    loss_sum += loss.detach()  # no .item() per micro-batch: one sync at logging
                    mc_stats["entropy"] = masked_mean(entropy.detach(), mc_mask)
                    for key, value in mc_stats.items():
                        stats.setdefault(key, []).append(value)
                grad_norm = nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                if not torch.isfinite(grad_norm):  # detail 15: the weights are still the last good ones
                    save(os.path.join(run_dir, "policy"))
                    raise SystemExit(
                        f"error: the loss became non-finite at update {update}; the last good weights are "
                        f"in {run_dir}/policy (try a lower --learning-rate)"
                    )
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss_sum)
                grad_norms.append(grad_norm)
            t3 = timer()

            # TRY NOT TO MODIFY: log (TRL's GRPO metric names), evaluate, show samples, save
            mean = {k: torch.stack(v).mean().item() for k, v in stats.items()}
            n_completion_tokens = int(mask.sum().item())
            metrics = {
                "update": update,
                "episode": update * args.batch_size,
                "reward": rewards.mean().item(),
                "reward_std": grouped.std(1).mean().item(),
                "frac_reward_zero_std": zero_std.mean().item(),
                "completions/mean_length": lengths.mean().item(),
                "completions/min_length": lengths.min().item(),
                "completions/max_length": lengths.max().item(),
                "completions/clipped_ratio": truncated.float().mean().item(),
                "learning_rate": optimizer.param_groups[0]["lr"],
                "time/generation": t1 - t0,
                "time/scoring": t2 - t1,
                "time/update": t3 - t2,
                "time/elapsed": time.time() - start_time,
                "perf/tokens_per_sec": n_completion_tokens / (t3 - t0),
                "perf/peak_memory_mb": peak_memory_mb(device),
            }
            for j, name in enumerate(reward_names):
                metrics[f"rewards/{name}/mean"] = scores[:, j].mean().item()
                metrics[f"rewards/{name}/std"] = scores[:, j].std().item()
            if losses:
                metrics |= {
                    "loss": torch.stack(losses).mean().item(),
                    "grad_norm": torch.stack(grad_norms).mean().item(),
                }
                metrics |= mean
            if eval_problems and (update % args.eval_every == 0 or update == args.total_steps):
                policy.eval()
                with autocast:
                    metrics["eval/accuracy"] = evaluate(
                        policy, tokenizer, eval_problems, arithmetic_reward, eos_ids, args.batch_size
                    )
            log(metrics)
            print(
                f"update {update}: reward {metrics['reward']:.3f}  "
                + (f"kl {metrics['kl']:.4f}  " if "kl" in metrics else "")
                + (f"clip {metrics['clip_ratio/region_mean']:.3f}  " if losses else "(no loss tokens)  ")
                + (f"held-out accuracy {metrics['eval/accuracy']:.3f}  " if "eval/accuracy" in metrics else "")
                + f"{t3 - t0:.2f}s  ({time.time() - start_time:.0f}s total)"
            )
            if args.sample_every and update % args.sample_every == 0:
                for j in range(0, min(args.num_samples * G, args.batch_size), G):  # one per group
                    sample = {"update": update, "prompt": batch[j]["prompt"], "completion": completions[j]}
                    sample |= {"reward": rewards[j].item(), "advantage": advantages[j].item()}
                    samples_file.write(json.dumps(sample) + "\n")
                    print(f"  {sample['prompt']!r} -> {sample['completion']!r}  reward {sample['reward']:.2f}")
                samples_file.flush()
            if args.save_every and update % args.save_every == 0:
                save(os.path.join(run_dir, "policy"))
    except KeyboardInterrupt:
        print(f"interrupted at update {update}: saving")
    save(os.path.join(run_dir, "policy"))
    print(f"saved the policy to {run_dir}/policy")
    metrics_file.close()
    samples_file.close()
    if args.track:
        wandb.finish()
    return run_dir


if __name__ == "__main__":
    main()

"""GRPO for language models and its current variants (Dr. GRPO, DAPO, GSPO, RLOO, CISPO, SAPO, ...), in one file.

Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath) is PPO without the critic: every prompt gets a
group of G sampled completions, a completion's advantage is its reward relative to the group's, and the KL to the frozen
reference is a loss term, not a reward penalty. main() is the loop in the algorithm's order: 1. rollout, G completions a
prompt, 2. rewards, 3. group advantages, 4. old and reference log-probs, 5. --num-iterations clipped updates; then log.

    python grpo_llm.py                                  # the embedded arithmetic SFT policy: offline, CPU, minutes
    python grpo_llm.py --model gpt2 --total-steps 200   # a hub model (a GPU is advisable)

Implementation details, cited "detail N":
1. Each prompt gets G = --num-generations completions, contiguous: a group is a row of rewards.view(-1, G).
2. A completion ends at its first EOS (the tokenizer's, the generation_config's, the chat template's end of turn); the
   tokens after it are pad, masked out of every loss and statistic.
3. Advantage = (reward - group mean) / (group std + 1e-4), or / the batch's std, or as is; one per completion, broadcast
   to its tokens; a group of equal rewards gets exactly 0. No value model, no GAE.
4. Sampling is softmax(logits / temperature) alone (the checkpoint's generation_config is replaced), and log-probs
   divide by the same temperature.
5. At --num-iterations 1 the old log-probs are the current ones detached; above, they are recomputed after generation
   in the training's micro-batch shapes. The reference, the SFT policy in fp32 scored the same way, starts at KL 0.
6. Dropout is 0, in the config and in every nn.Dropout; prompts are left-padded, position ids come from the mask.
7. The LM head runs on completion positions only, in chunks recomputed in backward (torch.utils.checkpoint): memory
   does not grow with length x vocabulary. One fp32 log-softmax gives the log-probs and the entropy.
8. A clipped surrogate per token in [1 - epsilon, 1 + epsilon_high]: a higher upper bound lets unlikely tokens with a
   positive advantage grow (DAPO's clip-higher, against entropy collapse).
9. --loss-type's normaliser: each completion's token mean, then their mean (grpo, sapo); one token mean over the batch
   (dapo, cispo); completions x --max-new-tokens (dr_grpo). Micro-batches are weighted to give the batch's gradient.
10. The KL is a loss term beta * k3, out of the advantages (beta 0, TRL's default, loads no reference); with
    --use-bias-correction-kl (on) it is rho k3, whose gradient is KL(pi || ref)'s even at rho = 1 (k3's: KL(ref || pi)).
11. Several reward functions are summed with --reward-weights; a reward model scores alone.
12. cispo (MiniMax-M1): REINFORCE weighted by the detached ratio capped at 1 + --epsilon-high (TRL's 5 is our 4);
    sapo (Gao et al. 2025): a sigmoid gate instead of the clip; --delta (INTELLECT-2): the unclipped ratio capped.
13. --top-entropy-quantile q (Wang et al. 2025): the batch's top q of tokens by entropy alone carry the policy gradient
    and bonus; --off-policy-mask-threshold (DeepSeek-V3.2): completions with A < 0 far from pi_old leave it.

Each variant is a few flags (docs/grpo_llm.md: Dr. GRPO, DAPO, GSPO, RLOO, CISPO, SAPO). Running it for real: any
causal LM, chat templates, bf16 autocast on CUDA, LoRA, torchrun; nothing is lost when a run stops (--resume).
"""

import contextlib
import copy
import itertools
import json
import os
import random
import re
import resource
import runpy
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, fields
from typing import Literal

import datasets
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before init_process_group: its defaults (group=WORLD) would hold the group
import torch.nn as nn
import torch.nn.functional as F
import transformers
import tyro
from torch.utils.checkpoint import checkpoint
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


@dataclass
class Args:
    # ---- experiment
    exp_name: str = "grpo_llm"  # the run directory and the wandb run start with it
    seed: int = 1  # seed of python, numpy, torch and the prompt order
    cuda: bool = True  # use CUDA when it is available
    mixed_precision: Literal["auto", "bf16", "no"] = "auto"  # bf16 autocast over fp32 weights; auto: on CUDA only
    track: bool = False  # log to Weights & Biases (WANDB_MODE=offline works)
    wandb_project_name: str = "rlhf-reference"  # wandb project
    wandb_entity: str | None = None  # wandb entity (team)
    output_dir: str = "runs"  # parent of the run directory: metrics.jsonl, samples.jsonl, policy/, checkpoint.pt
    save_every: int = 20  # write checkpoint.pt and policy/ every N updates (0: only at the end and when stopped)
    resume: str | None = None  # go on with the run in this directory from its checkpoint.pt; flags given win
    # ---- models and data
    model: str = "assets/arith-sft"  # policy and reference: a directory (as the embedded SFT model) or a hub id
    reward_model: str | None = None  # a sequence-classification reward model; it replaces --reward-fn as the reward
    reward_label: int | None = None  # the reward model's logit that is the score, if it has several
    reward_fn: tuple[str, ...] = ("arithmetic",)  # summed: arithmetic, gsm8k, format, path/to/file.py:fn, module:fn
    reward_weights: tuple[float, ...] | None = None  # weight of each reward function (unset: 1 each)
    dataset: str = "assets/arith/train.jsonl"  # prompts: a .jsonl .json .csv .parquet file, or a hub dataset
    dataset_config: str | None = None  # hub dataset configuration (gsm8k: main)
    dataset_split: str = "train"  # hub dataset split
    prompt_column: str = "prompt"  # column of the prompts: strings, or lists of {role, content} messages
    answer_column: str = "answer"  # column of the reference answers that the reward functions check
    chat_template: bool = False  # also put plain-string prompts through the chat template (instruct models)
    system_prompt: str | None = None  # a system message before each prompt (implies --chat-template)
    gradient_checkpointing: bool = False  # trade compute for memory in the policy
    lora_r: int = 0  # LoRA rank (0: off); LoRA usually wants ~10x the learning rate of full fine-tuning
    lora_alpha: int = 32  # the adapters add (alpha / r) B A x
    lora_target_modules: tuple[str, ...] | None = None  # modules to adapt (unset: every linear layer of the trunk)
    save_merged: bool = False  # with --lora-r, also save the base with the adapters merged in, to policy/merged
    # ---- generation
    max_new_tokens: int | None = None  # longest completion (unset: the checkpoint's generation_config's, else 8)
    max_prompt_length: int | None = None  # longer prompts lose their start (unset: the context - --max-new-tokens)
    temperature: float = 1.0  # sampling temperature, also in the log-probs (detail 4)
    cast_lm_head_to_fp32: bool = True  # the LM head's matmul in fp32 under autocast
    # ---- GRPO and its variants
    total_steps: int = 500  # GRPO updates (a generation batch and its --num-iterations each)
    prompts_per_update: int = 8  # prompts per update, each with --num-generations completions
    num_generations: int = 8  # G, completions per prompt: the group whose rewards are the baseline
    micro_batch_size: int = 64  # sequences per forward pass (gradient accumulation, chunks of no-grad passes)
    num_iterations: int = 1  # mu, optimizer steps on each generation batch (detail 5)
    learning_rate: float | None = None  # AdamW learning rate (unset: 1e-4 below 50M parameters, else 1e-5)
    weight_decay: float = 0.0  # AdamW weight decay (0, as TRL; torch's default is 0.01)
    anneal_lr: bool = False  # decay the learning rate linearly to 0
    max_grad_norm: float = 1.0  # global gradient-norm clip
    beta: float = 0.0  # weight of the KL-to-reference loss term (0: no reference model is loaded)
    epsilon: float = 0.2  # lower clip range of the ratio: 1 - epsilon
    epsilon_high: float | None = None  # upper clip range, 1 + epsilon_high (unset: epsilon; DAPO: 0.28; cispo's cap)
    delta: float | None = None  # two-sided clipping: the unclipped ratio capped at delta > 1 + epsilon_high
    loss_type: Literal["grpo", "dapo", "dr_grpo", "cispo", "sapo"] = "grpo"  # the per-token loss and its normaliser
    sapo_temperature_pos: float = 1.0  # sapo's gate temperature for positive advantages
    sapo_temperature_neg: float = 1.05  # sapo's gate temperature for the other advantages
    top_entropy_quantile: float = 1.0  # only the tokens in this top quantile of entropy carry the gradient (paper: 0.2)
    off_policy_mask_threshold: float | None = None  # drop completions with A < 0 this far from the sampling policy
    use_bias_correction_kl: bool = True  # the KL term times the importance ratio: KL(policy || ref)'s gradient
    ent_coef: float = 0.0  # entropy-bonus weight
    scale_rewards: Literal["group", "batch", "none"] = "group"  # divide the advantages by the group's or batch's std
    leave_one_out: bool = False  # RLOO's baseline: the mean of the other G - 1 rewards of the group
    importance_sampling_level: Literal["token", "sequence"] = "token"  # a ratio per token (GRPO) or completion (GSPO)
    dynamic_sampling: bool = False  # drop the groups whose rewards are all equal from the loss (no resampling)
    mask_truncated_completions: bool = False  # drop the completions that never emitted EOS from the loss
    overlong_buffer: int = 0  # DAPO's soft overlong penalty over the last N lengths up to --max-new-tokens (0: off)
    overlong_penalty: float = 1.0  # reward lost by a completion of --max-new-tokens tokens, with --overlong-buffer
    # ---- evaluation and logging
    eval_every: int = 10  # held-out accuracy every N updates (0: off), with the first --reward-fn
    eval_split: str | None = None  # a split of --dataset, or a prompt file (unset: test.jsonl beside a train.jsonl)
    eval_size: int = 256  # distinct prompts drawn from --eval-split
    eval_only: bool = False  # print the accuracy of --model on the evaluation prompts and exit
    sample_every: int = 10  # print and store a few samples every N updates (0: off)
    num_samples: int = 3  # samples shown each time


# ALGO LOGIC: the numerics, checked by tests/ against hand-computed values; under torchrun, over every rank's entries.


def all_reduce(x, op="sum"):
    """The tensor x summed over the torchrun ranks (or their "min" or "max"); x itself in one process."""
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
    """Mean and Bessel-corrected variance of the entries where mask is 1, every rank's: n = sum(m),
    mean = sum(x * m) / n, var = sum((x - mean)^2 * m) / (n - 1)."""
    n = all_reduce(mask.sum())
    mean = all_reduce((values * mask).sum()) / n
    return mean, all_reduce(((values - mean) ** 2 * mask).sum()) / (n - 1)


def masked_mean(values, mask, axis=None):
    """sum(values * mask) / sum(mask), over `axis` or over everything."""
    return (values * mask).sum(axis) / mask.sum(axis)


def kl_penalty(logprobs, ref_logprobs, estimator):
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's r = logp - ref_logp (Schulman 2020):
    k1 = r (unbiased, can be < 0); k2 = r^2 / 2 (biased, low variance); k3 = exp(-r) - 1 + r (unbiased, >= 0)."""
    r = logprobs - ref_logprobs
    return {"k1": r, "k2": 0.5 * r**2, "k3": torch.expm1(-r) + r}[estimator]


def group_advantages(rewards, group_size, scale, leave_one_out=False):
    """Detail 3: A_i = r_i - mean(group of G contiguous), or - the mean of the other G - 1 (RLOO); then / (std(group) +
    1e-4), / (std(batch) + 1e-4) or as is, by `scale` (Bessel). rewards (B,) -> advantages (B,), and zero_std (P,):
    the groups of equal rewards, whose advantages are exactly 0."""
    grouped = rewards.view(-1, group_size)  # (P, G)
    others = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)  # RLOO: the mean of the other G - 1
    advantages = grouped - (others if leave_one_out else grouped.mean(1, keepdim=True))
    if scale == "group":
        advantages = advantages / (grouped.std(1, keepdim=True) + 1e-4)
    elif scale == "batch":
        advantages = advantages / (global_mean_var(rewards, torch.ones_like(rewards))[1].sqrt() + 1e-4)
    zero_std = grouped.max(1).values == grouped.min(1).values  # (P,)
    return advantages.masked_fill(zero_std[:, None], 0.0).view(-1), zero_std


def high_entropy_mask(entropy, mask, quantile):
    """1 on the real tokens whose entropy is in the top `quantile` of every rank's real tokens (detail 13), else 0."""
    values = entropy[mask.bool()].float()
    if dist.is_initialized():  # the ranks hold different numbers of tokens
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, values.cpu())
        values = torch.cat(gathered).to(entropy.device)
    threshold = np.quantile(values.cpu().numpy(), 1 - quantile)  # torch.quantile refuses more than 2^24 values
    return (entropy >= threshold).float() * mask


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, args, entropy_mask=1.0):
    """Per-token policy loss by args.loss_type, plus beta * KL, aggregated by loss type. Returns (loss, stats).
    rho = exp(logprobs - old_logprobs) (token) or exp(mean over the completion of logprobs - old_logprobs)
    broadcast to its tokens (sequence, GSPO); per token, with A the advantage and sg() stop-gradient:
      grpo, dapo, dr_grpo: -min(min(rho, delta) A, clip(rho, 1 - epsilon, 1 + epsilon_high) A)    (details 8, 12)
      cispo: -sg(min(rho, 1 + epsilon_high)) A logprobs;  sapo: -sigmoid(tau (rho - 1)) 4 / tau A   (detail 12)
    times entropy_mask and the off-policy mask (detail 13), plus beta k3 (times rho, detail 10), k3 = exp(ref - logp)
    - (ref - logp) - 1; the masked token sum / (each completion's length x completions) (grpo, sapo), / real tokens
    (dapo, cispo) or / (completions x max_new_tokens) (dr_grpo). logprobs (B, T), advantages (B,) or (B, T);
    ref_logprobs may be None when beta is 0."""
    loss_type, epsilon, delta = args.loss_type, args.epsilon, args.delta
    epsilon_high = epsilon if args.epsilon_high is None else args.epsilon_high
    log_ratio = logprobs - old_logprobs  # (B, T)
    if args.importance_sampling_level == "sequence":
        log_ratio = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # (B, 1)
    ratio = torch.exp(log_ratio)
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
    if loss_type == "cispo":
        per_token_loss = -ratio.clamp(max=1 + epsilon_high).detach() * advantages * logprobs
    elif loss_type == "sapo":
        tau = torch.where(advantages > 0, args.sapo_temperature_pos, args.sapo_temperature_neg)
        per_token_loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages
    else:
        clipped_ratio = ratio.clamp(1 - epsilon, 1 + epsilon_high)
        capped_ratio = ratio if delta is None else ratio.clamp(max=delta)
        per_token_loss = -torch.min(capped_ratio * advantages, clipped_ratio * advantages)
    per_token_loss = per_token_loss * entropy_mask
    if args.off_policy_mask_threshold is not None:  # mean k1 KL(old || current) per completion, over real tokens
        off_policy_kl = masked_mean(old_logprobs - logprobs.detach(), mask, axis=1)[:, None]  # (B, 1)
        per_token_loss = per_token_loss * ~((advantages < 0) & (off_policy_kl > args.off_policy_mask_threshold))
    correction = ratio if args.use_bias_correction_kl else 1  # detail 10: rho k3 has the gradient of KL(pi || ref)
    kl = kl_penalty(logprobs, ref_logprobs, "k3") * correction if ref_logprobs is not None else None
    if args.beta:
        per_token_loss = per_token_loss + args.beta * kl
    n = logprobs.shape[0]  # completions
    normaliser = mask.sum(1).clamp(min=1) * n if loss_type in ("grpo", "sapo") else mask.sum().clamp(min=1)
    normaliser = n * args.max_new_tokens if loss_type == "dr_grpo" else normaliser
    loss = ((per_token_loss * mask).sum(1) / normaliser).sum()
    with torch.no_grad():
        low, high = (ratio < 1 - epsilon) & (advantages < 0), (ratio > 1 + epsilon_high) & (advantages > 0)
        clipped = {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low | high}
        clipped = {"cispo": {"cispo_clip_ratio": high}, "sapo": {}}.get(loss_type, clipped)  # where it acts, as TRL
        means = clipped | {"importance_ratio/mean": ratio.expand_as(mask)} | ({} if kl is None else {"kl": kl})
        stats = {name: masked_mean(x.float(), mask) for name, x in means.items()}
    return loss, stats


# ALGO LOGIC: the forward pass and its LM head, rollout, the gradient of a minibatch, the optimizer step

LM_HEAD_CHUNK = 2**24  # logits per chunk of lm_head_logprobs (64 MiB in fp32), whatever the vocabulary


def lm_head_logprobs(
    hidden, head, labels, temperature, scale=1.0, softcap=None, with_entropy=False, entropy_grad=False, fp32=True
):
    """Log-probs of labels (B, T) and optionally the entropies (B, T) of the next-token distributions, from the last
    hidden states (B, T, H) and the output embedding `head` (details 4, 7):
        z = softcap * tanh(scale * head(h) / softcap) / temperature,  log p = log_softmax(z),  H = -sum_v p_v log p_v.
    In chunks of at most LM_HEAD_CHUNK logits, each under torch.utils.checkpoint: no chunk's logits outlive it, and its
    backward computes them again. The entropy gets a gradient only with entropy_grad (an entropy bonus): one computed
    for the logs alone would keep its recomputed logits until the backward ends. The matmul in fp32 (fp32=True), or
    where F.linear would run it (autocast's dtype)."""
    (B, T), device = labels.shape, hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    dtype = torch.float32 if fp32 else dtype  # else as F.linear would run it

    def logits(h):  # (N, H) -> (N, V) fp32: scaled, softcapped, divided by the temperature, in place where it can be
        z = F.linear(h.to(dtype), head.weight.to(dtype), None if head.bias is None else head.bias.to(dtype)).float()
        if softcap:
            z = z.mul_(scale / softcap).tanh_()
            if torch.is_grad_enabled():
                return z * (softcap / temperature)  # tanh's backward reads its output: not in place
            return z.mul_(softcap / temperature)
        if scale != temperature:
            return z.mul_(scale / temperature)
        return z

    def chunk(h, y):  # (N, H), (N,) -> log p of y (N,), entropy (N,) or None
        with torch.autocast(device, enabled=False):
            logp = logits(h).log_softmax(-1)  # the logits are freed here: two chunk-sized tensors at most
            logprobs = logp.gather(-1, y[:, None])[:, 0]
            if not with_entropy:
                return logprobs, None
            if entropy_grad and torch.is_grad_enabled():
                return logprobs, -(logp.exp() * logp).sum(-1)
            with torch.no_grad():  # for the logs: no recomputed tensors kept for a backward that never reads them
                return logprobs, -logp.exp().mul_(logp).sum(-1)

    n = max(1, LM_HEAD_CHUNK // head.weight.shape[0])  # tokens per chunk
    hidden, labels = hidden.reshape(B * T, -1), labels.reshape(B * T)
    chunks = [checkpoint(chunk, hidden[i : i + n], labels[i : i + n], use_reentrant=False) for i in range(0, B * T, n)]
    logprobs = torch.cat([c[0] for c in chunks]).view(B, T)
    if not with_entropy:
        return logprobs, None
    return logprobs, torch.cat([c[1] for c in chunks]).view(B, T)


def response_logprobs(model, hidden, labels, temperature, fp32=True, with_entropy=False, entropy_grad=False):
    """lm_head_logprobs with the model's output embedding and logit post-processing: logits * scale (Cohere's
    logit_scale, Granite's 1 / logits_scaling), then Gemma's final_logit_softcapping."""
    c = model.config
    scale = (getattr(c, "logit_scale", None) or 1.0) / (getattr(c, "logits_scaling", None) or 1.0)
    softcap, head = getattr(c, "final_logit_softcapping", None), model.get_output_embeddings()
    return lm_head_logprobs(
        hidden,
        head,
        labels,
        temperature,
        scale,
        softcap,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        fp32=fp32,
    )


def position_ids(attention_mask):
    """Detail 6: positions that count the real tokens only, so that left padding does not shift them."""
    return (attention_mask.cumsum(1) - 1).clamp(min=0)


def hidden_states(model, query_responses, attention_mask, prompt_width):
    """The trunk's last hidden states (B, R, H) at the positions that predict the response: the state at t predicts
    token t + 1, so query_responses[:, Q:] comes from positions Q - 1 ... -2 (the off-by-one shift). With LoRA, the
    trunk under peft's wrapper (whose forward ends in the LM head)."""
    trunk = model.get_base_model().base_model if hasattr(model, "get_base_model") else model.base_model
    out = trunk(input_ids=query_responses, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                use_cache=False)  # fmt: skip
    return out.last_hidden_state[:, prompt_width - 1 : -1]


def truncate_after_eos(responses, eos_ids, pad_token_id):
    """Detail 2: keep the tokens up to and including the first EOS (any of eos_ids). Returns (responses, mask)."""
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device))
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0  # an EOS strictly before this position
    return responses.masked_fill(after_eos, pad_token_id), ~after_eos


def tokenize_texts(tokenizer, texts, max_length):
    """Padded ids, cut on the left to max_length (a prompt keeps its assistant header); no second BOS."""
    special = not (tokenizer.bos_token and all(t.startswith(tokenizer.bos_token) for t in texts))
    return tokenizer(texts, padding=True, truncation=max_length is not None, max_length=max_length,
                     add_special_tokens=special, return_tensors="pt")  # fmt: skip


STOP = []  # the signals received: Ctrl-C and SIGTERM (a preemption)


def stop_check():
    """KeyboardInterrupt on every rank once any of them has been signalled: generation ends at its next token, and after
    the rollout every rank stops here, before the update changes anything (a signal during an update lets it finish)."""
    if all_reduce(torch.tensor(float(len(STOP)))).item():
        raise KeyboardInterrupt(signal.Signals(STOP[0]).name if STOP else "another rank's signal")


@torch.no_grad()
def rollout(policy, tokenizer, prompts, max_prompt_length, eos_ids, autocast, stoppable=False):
    """Step 1: the prompts left-padded (detail 6) and cut on the left, a sampled response each, cut after its first EOS
    (detail 2). Returns {query_responses, attention_mask (B, Q + R), responses, mask (B, R) float, prompt_width Q}."""
    enc = tokenize_texts(tokenizer, prompts, max_prompt_length).to(policy.device)
    policy.eval()
    stop = [lambda ids, scores, **kwargs: torch.full((len(ids),), bool(STOP), device=ids.device)] * stoppable
    with autocast:  # sampled with the policy's generation_config (detail 4); a signal ends it at the next token
        out = policy.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask, stopping_criteria=stop)
    responses, mask = truncate_after_eos(out[:, enc.input_ids.shape[1] :], eos_ids, tokenizer.pad_token_id)
    return dict(
        query_responses=torch.cat([enc.input_ids, responses], 1), prompt_width=enc.input_ids.shape[1],
        attention_mask=torch.cat([enc.attention_mask, mask.long()], 1), responses=responses, mask=mask.float(),
    )  # fmt: skip


def training_forward(policy, r, mc, args, with_entropy=True):
    """Micro-batch mc of the rollout r: the completions' log-probs and entropies (B, R) under `policy`."""
    hidden = hidden_states(policy, r["query_responses"][mc], r["attention_mask"][mc], r["prompt_width"])
    return response_logprobs(
        policy,
        hidden,
        r["responses"][mc],
        args.temperature,
        fp32=args.cast_lm_head_to_fp32,
        with_entropy=with_entropy,
        entropy_grad=args.ent_coef != 0,  # else the entropy is for the logs and masks alone, computed without autograd
    )


def accumulate_gradients(policy, r, args, autocast):
    """Forward and backward the whole batch, micro-batch by micro-batch, each weighted by its share of the completions
    or, for dapo and cispo, of the loss tokens (detail 9; per rank); returns (the loss, each micro-batch's stats)."""
    loss_mask, B = r["loss_mask"], len(r["loss_mask"])
    bonus_mask = loss_mask * r["entropy_mask"]  # the tokens that carry the policy gradient
    stats, loss_sum = [], torch.zeros((), device=loss_mask.device)
    n_tokens, n_bonus = global_mean([loss_mask.sum()]), global_mean([bonus_mask.sum()])
    for mc in torch.arange(B, device=loss_mask.device).split(args.micro_batch_size):
        with autocast:
            logprobs, entropy = training_forward(policy, r, mc, args)
        old = logprobs.detach() if r["old_logprobs"] is None else r["old_logprobs"][mc]
        ref = None if r["ref_logprobs"] is None else r["ref_logprobs"][mc]
        loss, mc_stats = grpo_loss(logprobs, old, ref, r["advantages"][mc], loss_mask[mc], args, r["entropy_mask"][mc])
        loss = loss * (loss_mask[mc].sum() / n_tokens if args.loss_type in ("dapo", "cispo") else len(mc) / B)
        if args.ent_coef:
            loss = loss - args.ent_coef * (entropy * bonus_mask[mc]).sum() / n_bonus
        loss.backward()
        loss_sum += loss.detach()  # no .item() per micro-batch: one sync at logging
        stats.append(mc_stats | {"entropy": masked_mean(entropy.detach(), loss_mask[mc])})
    return loss_sum, stats


def optimizer_step(optimizer, params, max_grad_norm):
    """One AdamW step; under torchrun the gradients are first averaged over the ranks (DDP's all-reduce, by hand).
    Clipped to a global norm, returned: a non-finite one stops the run (every rank sees the same norm)."""
    for p in params if dist.is_initialized() else []:  # a rank without a gradient (no loss token) adds zeros
        p.grad = all_reduce(torch.zeros_like(p) if p.grad is None else p.grad) / dist.get_world_size()
    grad_norm = nn.utils.clip_grad_norm_(params, max_grad_norm)
    if not torch.isfinite(grad_norm):
        raise FloatingPointError(f"the gradient norm is {grad_norm.item()}: try a lower --learning-rate")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


# TRY NOT TO MODIFY: rewards, prompts, models (identical in ppo_llm.py)


NUMBER = r"(?:[-+]\$?|\$[-+]?)?\s?\d(?:[\d,]*\d)?(?:\.\d+)?"  # -12, $1,234, 3.5, -$5, $-5; one sign at most


def final_answer(text, strict=False):
    """The last number stated after '####' (GSM8K's format), in \\boxed{} or after 'answer is' / 'answer:'; else,
    unless strict, the text's last number; None if none. Commas and '$' are ignored, and 42.0 is 42."""
    for marker in [r"####([^\n]*)", r"\\boxed\{([^{}]*)\}", r"answer(?:\s+is|:)([^\n]*)"]:
        stated = [m for m in re.findall(marker, text, flags=re.IGNORECASE) if re.search(NUMBER, m)]
        if stated:
            return float(re.sub(r"[$,\s]", "", re.search(NUMBER, stated[-1]).group()))
    found = [] if strict else re.findall(NUMBER, text)
    return float(re.sub(r"[$,\s]", "", found[-1])) if found else None


REWARD_FNS = {  # f(completions, reference answers) -> a score per completion
    "arithmetic": lambda cs, refs: [float(c.strip() == r) for c, r in zip(cs, refs)],  # exactly the answer
    "gsm8k": lambda cs, refs: [float(final_answer(c) == final_answer(r) is not None) for c, r in zip(cs, refs)],
    "format": lambda cs, refs: [float(final_answer(c, strict=True) is not None) for c in cs],  # any stated answer
}


def load_reward_fn(spec):
    """--reward-fn as f(completions, rows) -> a float per completion: a name in REWARD_FNS, or `path/to/file.py:fn` or
    `module:fn`, called by keyword as TRL calls one: fn(completions=[str], prompts=[...], **every other column)."""
    if spec in REWARD_FNS:
        return lambda completions, rows: REWARD_FNS[spec](completions, [row["answer"] for row in rows])
    source, _, name = spec.rpartition(":")
    try:
        fn = (runpy.run_path if source.endswith(".py") else runpy.run_module)(source)[name]
    except Exception as e:  # no such file, module or function, or a file that does not import (a SyntaxError, say)
        why = f" ({type(e).__name__}: {e})" if source else ""
        raise SystemExit(f"error: --reward-fn {spec}: not one of {sorted(REWARD_FNS)}, nor a file.py:function or "
                         f"module:function that loads{why}") from None  # fmt: skip

    def user_fn(completions, rows):
        columns = {k: [row["columns"][k] for row in rows] for k in rows[0]["columns"]}
        scores = [float(x) for x in fn(completions=completions, **columns)]
        if len(scores) != len(completions):
            raise SystemExit(
                f"error: --reward-fn {spec} returned {len(scores)} numbers for {len(completions)} completions"
            )
        return scores

    return user_fn


def load_prompts(args, tokenizer, needs_answers):
    """--dataset's rows: {prompt (the text the policy sees), answer (text or None), messages, columns (reward fns')}."""
    datasets.disable_progress_bars()
    fmt = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}.get(args.dataset.rpartition(".")[2])
    try:
        if fmt:  # a file
            data = datasets.load_dataset(fmt, data_files=args.dataset, split="train")
        else:
            data = datasets.load_dataset(args.dataset, args.dataset_config, split=args.dataset_split)
    except Exception as e:  # datasets' own error, often wrapping the reader's
        cause, hint = e.__cause__ or e, "" if fmt else "; a hub dataset needs the network, a local file does not"
        raise SystemExit(f"error: --dataset {args.dataset} could not be loaded ({type(cause).__name__}: "
                         f"{(str(cause).strip() or 'no rows').splitlines()[0]}){hint}") from None  # fmt: skip
    rows = []
    for i, row in enumerate(data, 1):
        if row.get(args.prompt_column) in (None, ""):  # an empty prompt: nothing to generate from
            raise SystemExit(f"error: --dataset {args.dataset}: row {i} has no --prompt-column {args.prompt_column} "
                             f"(columns: {', '.join(k for k, v in row.items() if v not in (None, ''))})")  # fmt: skip
        answer = row.get(args.answer_column)  # a CSV column with a gap is read as floats: 2.0 must read "2"
        answer = int(answer) if isinstance(answer, float) and answer.is_integer() else answer
        answer = row[args.answer_column] = None if answer is None else str(answer)
        prompt = text = row[args.prompt_column]
        messages = None
        if not isinstance(prompt, str) or args.chat_template or args.system_prompt is not None:  # the data decides
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            if not (isinstance(messages, list) and messages and all({"role", "content"} <= set(m) for m in messages)):
                raise SystemExit(f"error: --dataset {args.dataset}, row {i}: the prompt is neither a string nor a list "
                                 "of {role, content} messages")  # fmt: skip
            if args.system_prompt is not None and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": args.system_prompt}] + messages
            if tokenizer.chat_template is None:
                raise SystemExit(f"error: --model {args.model}: its tokenizer has no chat template, which "
                                 "conversational prompts, --chat-template and --system-prompt need")  # fmt: skip
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        columns = {"prompts": row[args.prompt_column]} | {k: v for k, v in row.items() if k != args.prompt_column}
        rows.append({"prompt": text, "answer": answer, "messages": messages, "columns": columns})
    missing = [i for i, row in enumerate(rows, 1) if row["answer"] is None]
    if missing and (needs_answers or len(missing) < len(rows)):
        raise SystemExit(f"error: --dataset {args.dataset}: row {missing[0]} has no --answer-column "
                         f"{args.answer_column}, which the reward function needs")  # fmt: skip
    return rows


def prompt_stream(rows, seed, start, rank, world):
    """The rows reshuffled every pass (seeded), from the start-th (a resumed run's), every world-th from rank's on."""
    rng = random.Random(seed)
    stream = (row for _ in itertools.count() for row in rng.sample(rows, len(rows)))
    return itertools.islice(stream, start + rank, None, world)


def eval_rows(args, tokenizer):
    """The first --eval-size distinct prompts of --eval-split (unset: test.jsonl beside a train.jsonl), or None."""
    beside = args.dataset.replace("train.jsonl", "test.jsonl") if args.dataset.endswith("train.jsonl") else None
    split = args.eval_split or (beside if beside and os.path.isfile(beside) else args.eval_only and args.dataset_split)
    if not split:
        return None
    source = {"dataset": split} if os.path.isfile(split) else {"dataset_split": split}
    rows = load_prompts(Args(**asdict(args) | source), tokenizer, True)
    return list({row["prompt"]: row for row in rows}.values())[: args.eval_size]


def from_pretrained(cls, name, flag, **kwargs):
    """cls.from_pretrained(name), with a one-line error for a directory without a model or an unreachable hub id."""
    try:
        return cls.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        where = "holds no model it can load" if os.path.isdir(name) else "is no directory, nor reachable on the hub"
        raise SystemExit(f"error: {flag} {name} {where} ({type(e).__name__}); a hub id needs the network (with "
                         "HF_HUB_OFFLINE=1, the cache alone); offline: assets/arith-sft") from None  # fmt: skip


def load_model(cls, name, flag, dtype=torch.float32):
    """Every dropout 0, in the config and in the nn.Dropout modules (detail 6); fp32 trained weights unless dtype."""
    config = from_pretrained(AutoConfig, name, flag)
    config.update({k: 0.0 for k, v in config.to_dict().items() if isinstance(v, float) and ("drop" in k)})
    model = from_pretrained(cls, name, flag, config=config, dtype=dtype)
    for module in filter(lambda m: isinstance(m, nn.Dropout), model.modules()):  # for models that hard-code one
        module.p = 0.0
    return model


def add_lora(model, args):
    """peft's LoRA: fp32 adapters, B = 0 at start, on the frozen base: with its adapters off, the initial policy."""
    try:
        import peft  # optional: only LoRA runs need it
    except ImportError:
        raise SystemExit("error: --lora-r needs peft, which is not installed: pip install peft") from None
    targets = list(args.lora_target_modules or []) or "all-linear"  # all-linear leaves out the LM head
    config = peft.LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules=targets,
                             task_type="CAUSAL_LM" if model.get_output_embeddings() is not None else None)  # fmt: skip
    try:
        model = peft.get_peft_model(model, config)
    except ValueError as e:  # no module matches
        names = {n.rpartition(".")[2] for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")}
        raise SystemExit(f"error: --lora-target-modules {' '.join(targets)}: {str(e).split('. ')[0]} (the model's "
                         f"linear layers: {' '.join(sorted(names - {'lm_head'}))})") from None  # fmt: skip
    if hasattr(model.get_output_embeddings(), "lora_A"):
        raise SystemExit("error: --lora-target-modules: not the LM head, whose adapters would never train (detail 7)")
    return model


def fit_tokenizer(tokenizer, models, eos_ids=()):
    """A pad token that ends no response (Qwen2.5's is an EOS id); the embeddings grown to the tokenizer, not shrunk."""
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id in {tokenizer.eos_token_id, *eos_ids}:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
        print(f"note: the tokenizer had no pad token distinct from EOS; added [PAD] (id {tokenizer.pad_token_id})")
    for model in models:
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            model.resize_token_embeddings(len(tokenizer))
        model.config.pad_token_id = tokenizer.pad_token_id


def rm_text(rm_tokenizer, row, completion):
    """What a reward model with a tokenizer of its own reads: the conversation through its own chat template, if any."""
    if rm_tokenizer.chat_template is None:
        return row["prompt"] + completion
    messages = row["messages"] or [{"role": "user", "content": row["prompt"]}]
    return rm_tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": completion}], tokenize=False)


@torch.no_grad()
def reward_model_scores(reward_model, rm_tokenizer, r, rows, completions, args):
    """Score of each sequence (B,) at its last real token: of the ids (rm_tokenizer None), or of rm_text, cut left."""
    if rm_tokenizer is None:
        am = r["attention_mask"]
        inputs = dict(input_ids=r["query_responses"], attention_mask=am, position_ids=position_ids(am))
    else:
        context = getattr(reward_model.config, "n_positions", 0) or reward_model.config.max_position_embeddings
        context = min(rm_tokenizer.model_max_length, context)
        texts = [rm_text(rm_tokenizer, row, c) for row, c in zip(rows, completions)]
        inputs = {k: v.to(reward_model.device) for k, v in tokenize_texts(rm_tokenizer, texts, context).items()}
    n, chunk = len(completions), args.micro_batch_size
    logits = [reward_model(**{k: v[i : i + chunk] for k, v in inputs.items()}).logits for i in range(0, n, chunk)]
    return torch.cat(logits)[:, args.reward_label or 0].float()


def load_models(args, device):
    """(tokenizer, policy in fp32, frozen reward model, its tokenizer, max_prompt_length, eos_ids), on `device`."""
    policy = load_model(AutoModelForCausalLM, args.model, "--model", "auto" if args.lora_r else torch.float32)
    tokenizer = from_pretrained(AutoTokenizer, args.model, "--model", padding_side="left", truncation_side="left")
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"error: --model {args.model}: the tokenizer has no EOS token, so no response could end")
    with torch.no_grad():  # refuse a model whose logits response_logprobs does not reproduce (an unknown family)
        ids = torch.arange(1, 9)[None] % policy.get_output_embeddings().weight.shape[0]  # matmul in the model's dtype:
        got, _ = response_logprobs(policy, hidden_states(policy, ids, torch.ones_like(ids), 1), ids[:, 1:], 1.0, False)
        want = torch.log_softmax(policy(input_ids=ids).logits[0, :-1].float(), -1)[torch.arange(7), ids[0, 1:]]
    if (error := (got[0] - want).abs().max().item()) > 1e-3:
        raise SystemExit(f"error: --model {args.model}: its forward changes the logits in a way this script does not "
                         f"reproduce (log-probs {error:.3g} apart)")  # fmt: skip
    args.max_new_tokens = args.max_new_tokens or policy.generation_config.max_new_tokens or 8
    context = getattr(policy.config, "n_positions", 0) or getattr(policy.config, "max_position_embeddings", 0)
    max_prompt_length = args.max_prompt_length or (context - args.max_new_tokens if context else None)
    if context and (args.max_new_tokens >= context or max_prompt_length + args.max_new_tokens > context):
        raise SystemExit(f"error: --max-new-tokens {args.max_new_tokens} and a prompt (--max-prompt-length "
                         f"{args.max_prompt_length}) do not fit the model's context of {context} tokens")  # fmt: skip
    reward_model = rm_tokenizer = None
    if args.reward_model is not None:
        reward_model = load_model(AutoModelForSequenceClassification, args.reward_model, "--reward-model", "auto")
        n = reward_model.config.num_labels
        if args.reward_label not in (range(n) if args.reward_label is not None or n > 1 else [None]):
            raise SystemExit(f"error: --reward-model {args.reward_model} has num_labels={n}: --reward-label (0 to "
                             f"{n - 1}) chooses the logit that is the score (got {args.reward_label})")  # fmt: skip
        rm_tokenizer = from_pretrained(AutoTokenizer, args.reward_model, "--reward-model", truncation_side="left")
        if rm_tokenizer.get_vocab() == tokenizer.get_vocab():
            rm_tokenizer = None  # the same tokens: score the ids themselves, no decode and encode
        else:
            fit_tokenizer(rm_tokenizer, [reward_model])
        reward_model.to(device).eval().requires_grad_(False)
    # detail 2: the ids that end a response: the tokenizer's EOS, the generation_config's, and the special tokens that
    # the chat template writes between turns (its end of turn: a base model's config names its EOS alone)
    ids = policy.generation_config.eos_token_id
    turns = {t for t in tokenizer.all_special_tokens if t in str(tokenizer.chat_template or "")}
    turns -= {tokenizer.bos_token, tokenizer.pad_token, tokenizer.unk_token}  # a template starts with the BOS
    eos_ids = sorted({tokenizer.eos_token_id, *([ids] if isinstance(ids, int) else ids or [])} | set(
        tokenizer.convert_tokens_to_ids(sorted(turns))))  # fmt: skip
    fit_tokenizer(tokenizer, [policy] + [reward_model] * (reward_model is not None and rm_tokenizer is None), eos_ids)
    policy.generation_config = transformers.GenerationConfig(  # detail 4: every field set, none left to the checkpoint
        max_new_tokens=args.max_new_tokens, do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=eos_ids)  # fmt: skip
    policy = (add_lora(policy, args) if args.lora_r else policy).to(device)
    return tokenizer, policy, reward_model, rm_tokenizer, max_prompt_length, eos_ids


# TRY NOT TO MODIFY: set-up, the run directory and logging, evaluation, checkpoints (identical in ppo_llm.py)


def setup(args):
    """torchrun's process group (rank 0 alone prints), seeds, device, autocast: ((rank, world), device, autocast)."""
    cuda = args.cuda and torch.cuda.is_available()
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo")
        sys.stdout = open(os.devnull, "w") if dist.get_rank() else sys.stdout
    transformers.utils.logging.disable_progress_bar()
    transformers.set_seed(args.seed)  # python's random, numpy, torch
    args.mixed_precision = ("bf16" if cuda else "no") if args.mixed_precision == "auto" else args.mixed_precision
    device, bf16 = torch.device("cuda" if cuda else "cpu"), args.mixed_precision == "bf16"
    print(f"device: {device}, fp32 weights" + ", bf16 autocast" * bf16)
    rank_world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return rank_world, device, torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


def parse_args(argv=None):
    """The flags; with --resume RUN_DIR the run's args.json gives the defaults: only the flags given change."""
    if (args := tyro.cli(Args, args=argv)).resume is None:
        return args
    try:
        with open(os.path.join(args.resume, "args.json")) as f:
            saved = {k: tuple(v) if isinstance(v, list) else v for k, v in json.load(f).items()}
    except (OSError, ValueError, AttributeError) as e:  # no such file, a damaged one, or no {flag: value} object
        raise SystemExit(f"error: --resume {args.resume}: args.json unreadable ({type(e).__name__}: {e})") from None
    saved = {f.name: saved[f.name] for f in fields(Args) if f.name in saved} | {"resume": args.resume}
    return tyro.cli(Args, args=argv, default=Args(**saved))


def open_run(args, rank, checkpoint):
    """The run directory, the same on every rank; rank 0's args.json and TensorBoard writer (wandb syncs it)."""
    names = [args.resume or os.path.join(args.output_dir, f"{args.exp_name}__{args.seed}__{int(time.time() * 1000)}")]
    if dist.is_initialized():
        dist.broadcast_object_list(names)  # any rank may have to save: an error stops it alone
    if rank:
        return names[0], None
    os.makedirs(names[0], exist_ok=True)
    for name in ["metrics.jsonl", "samples.jsonl"] if (done := checkpoint.get("update", 0)) else []:  # resuming:
        with open(path := os.path.join(names[0], name)) as f:  # drop rows a hard kill left past the checkpoint
            rows = [line for line in f if line.endswith("\n") and json.loads(line)["update"] <= done]
        with open(path, "w") as f:
            f.writelines(rows)
    with open(os.path.join(names[0], "args.json"), "w") as f:
        json.dump(asdict(args), f, indent=1)
    if args.track:  # wandb imported only here: it is slow to import
        __import__("wandb").init(project=args.wandb_project_name, entity=args.wandb_entity, config=asdict(args),
                                 name=os.path.basename(os.path.normpath(names[0])), dir=names[0], sync_tensorboard=True,
                                 id=checkpoint.get("wandb_id"), resume="allow" if checkpoint else None)  # fmt: skip
    return names[0], SummaryWriter(names[0], purge_step=done + 1 if done else None)  # and TensorBoard's past it


def log(writer, metrics, samples=()):
    """A line of metrics.jsonl and the same scalars to TensorBoard at step `update`; samples to samples.jsonl."""
    with open(os.path.join(writer.log_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(metrics) + "\n")
    for key in metrics.keys() - {"update"}:
        writer.add_scalar(key, metrics[key], metrics["update"])
    with open(os.path.join(writer.log_dir, "samples.jsonl"), "a") as f:
        for sample in samples:
            f.write(json.dumps(sample) + "\n")
            values = "  ".join(f"{k} {v:.2f}" for k, v in sample.items() if isinstance(v, float))
            print(f"  {sample['prompt']!r} -> {sample['completion']!r}  {values}")


def global_metrics(metrics, ops):
    """Each metric over every rank: the mean of the ranks' values (each has as many sequences), or ops[key]'s."""
    if not dist.is_initialized():
        return metrics
    reduced = {k: all_reduce(torch.tensor(float(v), dtype=torch.float64), ops.get(k, "sum")).item() for k, v in
               metrics.items()}  # fmt: skip
    return {k: type(v)(reduced[k] if k in ops else reduced[k] / dist.get_world_size()) for k, v in metrics.items()}


def evaluate(policy, tokenizer, rows, reward_fn, eos_ids, max_prompt_length, autocast, chunk):
    """Held-out accuracy: the reward function's mean over `rows`, sampled as in training, its standard error
    std / sqrt(n) (95% of two evaluations differ by < 1.96 sqrt 2 of it), the mean length of right (> 0) and wrong."""
    scores, lengths = [], []
    for i in range(0, len(rows), chunk):
        batch = rows[i : i + chunk]
        r = rollout(policy, tokenizer, [row["prompt"] for row in batch], max_prompt_length, eos_ids, autocast)
        scores += reward_fn(tokenizer.batch_decode(r["responses"], skip_special_tokens=True), batch)
        lengths += r["mask"].sum(1).tolist()
    scores, lengths = torch.tensor(scores, dtype=torch.float64), torch.tensor(lengths)
    stderr = scores.std(correction=0).item() / len(scores) ** 0.5
    metrics = {"eval/accuracy": scores.mean().item(), "eval/accuracy_stderr": stderr}
    for name, chosen in [("right", scores > 0), ("wrong", scores <= 0)]:
        metrics |= {f"eval/mean_length_{name}": lengths[chosen].mean().item()} if chosen.any() else {}
    return metrics


def eval_line(metrics):
    return f"held-out accuracy {metrics['eval/accuracy']:.3f} ± {metrics['eval/accuracy_stderr']:.3f}"


def build_optimizer(args, device, trained, frozen):
    """The models onto the device, activation checkpointing, the learning rate: (trainable parameters, AdamW)."""
    trained = [m for m in trained if m is not None]
    for model in trained + [m for m in frozen if m is not None]:
        model.to(device)
        if args.gradient_checkpointing and model in trained and hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable()  # HF's, in train mode only
    n_params = sum(p.numel() for p in trained[0].parameters())
    if device.type == "cpu" and n_params < 50e6:
        torch.set_num_threads(1)  # measured faster for small models on 2 shared cores
    if args.learning_rate is None:
        args.learning_rate = 1e-4 if n_params < 50e6 else 1e-5
        print(f"learning rate {args.learning_rate:g}: the default for {n_params / 1e6:.1f}M parameters")
    params = [p for m in trained for p in m.parameters() if p.requires_grad]
    # fused: one kernel over all parameters (~0.05 s a step at 124M on a CPU, ~0.6 s as torch's default loop)
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, eps=1e-5, weight_decay=args.weight_decay, fused=True)
    return params, optimizer


def save_checkpoint(run_dir, models, optimizer, state, tokenizer, merged=False):
    """checkpoint.pt (state, weights but a LoRA base's, AdamW, wandb id), written whole or not at all; then policy/."""
    weights = {name: {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()
                      if v.requires_grad or not hasattr(model, "disable_adapter")}
               for name, model in models.items() if model is not None}  # fmt: skip
    wandb_id = getattr(getattr(sys.modules.get("wandb"), "run", None), "id", None)
    path, tmp = os.path.join(run_dir, "checkpoint.pt"), os.path.join(run_dir, f"checkpoint.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:  # a file per process: two ranks stopped by errors may both save
        torch.save(state | dict(weights=weights, optimizer=optimizer.state_dict(), wandb_id=wandb_id), f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename
    os.replace(tmp, path)  # atomic
    save(os.path.join(run_dir, "policy"), models, tokenizer, merged)


def start(args, models, optimizer):
    """--resume's checkpoint.pt with its weights and AdamW back ({} for a new run); each update seeds its own RNG."""
    if not args.resume:
        return {}
    try:  # none (a run killed before its first save), a truncated or damaged one, or one of other models or flags
        checkpoint = torch.load(f"{args.resume}/checkpoint.pt", map_location="cpu", weights_only=False)
        for name, weights in checkpoint["weights"].items():
            if models.get(name) is not None:
                models[name].load_state_dict(weights, strict=not hasattr(models[name], "disable_adapter"))
        optimizer.load_state_dict(checkpoint["optimizer"])
    except Exception as e:
        raise SystemExit(f"error: --resume {args.resume}: checkpoint.pt unreadable, or not of these models "
                         f"({type(e).__name__}: {str(e).strip().splitlines()[0][:100]})") from None  # fmt: skip
    print(f"resuming after update {checkpoint['update']} of the saved run")
    optimizer.param_groups[0]["lr"] = args.learning_rate  # a flag given on resuming wins
    return checkpoint


def stopped(error, update, state, run_dir, rank, save):
    """A stop in the loop saves, shows an error's traceback, says where the checkpoint is and how to go on, and exits
    non-zero. A signal or a non-finite loss stops every rank at once, and rank 0 saves; an error, its rank alone."""
    together = isinstance(error, KeyboardInterrupt | FloatingPointError)
    saved = f"the state after update {state['update']} is in {run_dir}/checkpoint.pt"
    try:
        if rank == 0 or not together:
            save()
    except Exception as e:  # a full disk, say: the last periodic checkpoint is all there is
        saved = f"saving failed ({type(e).__name__}: {e}); {run_dir}/checkpoint.pt holds the last periodic save"
    if not together and not isinstance(error, SystemExit):  # a SystemExit is our one line about the input
        traceback.print_exc()
    if together and dist.is_initialized():  # torchrun ends every rank once one exits: they wait for rank 0's save
        dist.barrier()
        dist.destroy_process_group()
    print(f"stopped in update {update} ({str(error) or type(error).__name__}); {saved}: python "
          f"{os.path.basename(__file__)} --resume {run_dir} goes on", file=sys.stderr)  # fmt: skip
    raise SystemExit(128 + STOP[0] if STOP else 1) from None


def timing(t, start_time, first, update, total, n_tokens, device):
    """time/* and perf/* of one update from its marks t, and the progress line's '(seconds so far, ETA hh:mm:ss)'."""
    elapsed = time.time() - start_time
    left = time.strftime("%H:%M:%S", time.gmtime(elapsed * (total - update) / (update - first)))
    metrics = {"time/generation": t[1] - t[0], "time/scoring": t[2] - t[1], "time/update": t[3] - t[2],
               "time/elapsed": elapsed, "perf/tokens_per_sec": n_tokens / (t[3] - t[0]),
               "perf/peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda"
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10}  # fmt: skip
    return metrics, f"{t[3] - t[0]:.2f}s  ({elapsed:.0f}s, ETA {left})"


def wall_clock(device):
    if device.type == "cuda":  # time.perf_counter() once the GPU's queued work is done: each step timed by its own
        torch.cuda.synchronize()
    return time.perf_counter()


# GRPO: its flags, saving


def check_args(args, world):
    """Every bad combination of flags, one line each, before anything is loaded."""
    G, B = args.num_generations, args.prompts_per_update // world * args.num_generations  # each process's share
    args.micro_batch_size = min(args.micro_batch_size, B)  # the default 64 must not refuse a smaller batch, or 8 GPUs
    high = 1 + (args.epsilon if args.epsilon_high is None else args.epsilon_high)
    split = args.eval_split if args.dataset_split == "train" and args.eval_split else args.dataset_split
    n_rewards = 1 if args.reward_model else len(args.reward_fn)
    for bad, message in [
        (args.prompts_per_update % world, f"{world} processes must divide --prompts-per-update"),
        (args.eval_only and world > 1, "--eval-only runs in one process: python, not torchrun"),
        (G < 2, f"--num-generations must be 2 or more: the group is the baseline (got {G})"),
        (args.micro_batch_size < 1 or B % args.micro_batch_size,
         f"--micro-batch-size ({args.micro_batch_size}) must divide the completions per update ({B} a process)"),
        (args.temperature <= 0, f"--temperature must be > 0: log-probs divide by it (got {args.temperature})"),
        (args.num_iterations < 1, f"--num-iterations must be at least 1 (got {args.num_iterations})"),
        (high < 1 + args.epsilon, f"--epsilon-high must be >= --epsilon (got {args.epsilon_high}, {args.epsilon})"),
        (args.delta is not None and args.delta <= high, f"--delta must be > 1 + --epsilon-high = {high:g}"),
        (not 0 < args.top_entropy_quantile <= 1, "--top-entropy-quantile must be in (0, 1]"),
        (min(args.sapo_temperature_pos, args.sapo_temperature_neg) <= 0, "the --sapo-temperature-* must be > 0"),
        (args.save_merged and not args.lora_r, "--save-merged needs --lora-r: without LoRA the policy is a full model"),
        (os.path.isfile(args.dataset) and split != "train" and not os.path.isfile(split),
         f"--dataset {args.dataset} is a file, with no split {split}: --eval-split FILE instead"),
        (not args.reward_fn or args.reward_weights is not None and len(args.reward_weights) != n_rewards,
         f"--reward-weights needs one weight per reward ({n_rewards}), not {len(args.reward_weights or [])}"),
    ]:  # fmt: skip
        if bad:
            raise SystemExit(f"error: {message}")


def save(path, models, tokenizer, merged=False):
    """save_pretrained of the policy and its tokenizer (with LoRA the adapter; merged=True also the merged model)."""
    models["policy"].save_pretrained(path)
    tokenizer.save_pretrained(path)
    if merged:  # W + (alpha / r) B A, in a copy (one more base in memory, while saving): training keeps its adapters
        copy.deepcopy(models["policy"]).merge_and_unload().save_pretrained(os.path.join(path, "merged"))
        tokenizer.save_pretrained(os.path.join(path, "merged"))


def main(args: Args | None = None):
    args = parse_args() if args is None else args
    # TRY NOT TO MODIFY: set-up
    (rank, world), device, autocast = setup(args)
    check_args(args, world)
    reward_fns = [load_reward_fn(name) for name in args.reward_fn]  # a bad name or file fails here, before loading
    tokenizer, policy, reward_model, rm_tokenizer, max_prompt_length, eos_ids = load_models(args, device)
    G, B = args.num_generations, args.prompts_per_update // world * args.num_generations  # this process's share
    eval_problems = eval_rows(args, tokenizer) if (args.eval_every or args.eval_only) and rank == 0 else None
    evaluation = eval_problems and (lambda: evaluate(policy, tokenizer, eval_problems, reward_fns[0], eos_ids,
                                                     max_prompt_length, autocast, B))  # fmt: skip
    if args.eval_only:  # no training, no run directory; 95% of two evaluations differ by < 1.96 sqrt 2 stderr
        print(f"{eval_line(result := evaluation())} (n={len(eval_problems)}; two evaluations of one policy differ by < "
              f"{2.8 * result['eval/accuracy_stderr']:.3f})")  # fmt: skip
        return result
    ref_policy = None if not args.beta else policy if args.lora_r else copy.deepcopy(policy)  # details 5, 10
    params, optimizer = build_optimizer(args, device, [policy], [ref_policy])
    names = ([os.path.basename(args.reward_model)] if args.reward_model
             else [n.rpartition(":")[2] for n in args.reward_fn])  # fmt: skip
    reward_weights = torch.tensor(args.reward_weights or [1.0] * len(names), device=device)
    rows = load_prompts(args, tokenizer, reward_model is None and {"arithmetic", "gsm8k"} & set(args.reward_fn))
    models = dict(policy=policy)  # what checkpoint.pt and policy/ hold; the reference is --model's
    checkpoint = start(args, models, optimizer)  # {} for a new run
    run_dir, writer = open_run(args, rank, checkpoint)
    if evaluation and not checkpoint:  # the initial policy, at update 0
        log(writer, {"update": 0, "episode": 0} | (initial := evaluation()))
        print(f"update 0: {eval_line(initial)}")
    first_update = update = checkpoint.get("update", 0)
    prompts = prompt_stream(rows, args.seed, update * args.prompts_per_update, rank, world)
    state, start_time = dict(update=update), time.time()  # what a resume restores besides the weights and AdamW
    print(f"{run_dir}/checkpoint.pt: every {args.save_every or args.total_steps} updates (--save-every) and on a stop")
    STOP.clear()
    handlers = {s: signal.signal(s, lambda n, f: signal.default_int_handler(n, f) if STOP else STOP.append(n))
                for s in (signal.SIGINT, signal.SIGTERM)}  # a second signal stops at once  # fmt: skip
    try:
        for update in range(update + 1, args.total_steps + 1):
            torch.manual_seed(hash((args.seed, update, rank)))  # each update's own random numbers: exact resumes
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = args.learning_rate * (1 - (update - 1) / args.total_steps)
            # ALGO LOGIC: 1. rollout -- G completions of each prompt, contiguous (detail 1)
            t0 = wall_clock(device)
            rows = [row for row in (next(prompts) for _ in range(B // G)) for _ in range(G)]
            r = rollout(policy, tokenizer, [row["prompt"] for row in rows], max_prompt_length, eos_ids, autocast, True)
            stop_check()  # a signal on any rank: every rank stops here, before the update changes anything
            responses, mask = r["responses"], r["mask"]  # (B, R)
            t1 = wall_clock(device)

            # 2. rewards: the weighted reward functions, or the reward model (detail 11); DAPO's overlong penalty
            completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
            if reward_model is None:
                scores = torch.tensor([fn(completions, rows) for fn in reward_fns], dtype=torch.float, device=device).T
            else:
                scores = reward_model_scores(reward_model, rm_tokenizer, r, rows, completions, args)[:, None]
            rewards, lengths = scores @ reward_weights, mask.sum(1)  # (B,)
            over = (lengths - args.max_new_tokens + args.overlong_buffer).clamp(min=0) / max(args.overlong_buffer, 1)
            rewards = rewards - args.overlong_penalty * over  # 0 to -penalty over the last --overlong-buffer lengths

            # 3. advantages relative to the group (detail 3); which completions the loss sees
            advantages, zero_std = group_advantages(rewards, G, args.scale_rewards, args.leave_one_out)
            truncated = ~torch.isin(responses, torch.tensor(eos_ids, device=device)).any(1)
            dropped = (zero_std.repeat_interleave(G) & args.dynamic_sampling
                       | truncated & args.mask_truncated_completions)  # fmt: skip
            loss_mask = mask * ~dropped[:, None]  # DAPO's dynamic sampling (without resampling), overlong filtering

            # 4. old log-probs (mu > 1), entropies (detail 13) and reference log-probs: the training forward (detail 5)
            micro_batches, q = torch.arange(B, device=device).split(args.micro_batch_size), args.top_entropy_quantile
            r |= dict(loss_mask=loss_mask, advantages=advantages, entropy_mask=torch.ones_like(mask), old_logprobs=None)
            trains = all_reduce(loss_mask.sum()) > 0  # else no token is in the loss on any rank: no update
            with torch.no_grad(), autocast:
                if trains and (args.num_iterations > 1 or q < 1):
                    out = [training_forward(policy, r, mc, args, q < 1) for mc in micro_batches]
                    if args.num_iterations > 1:
                        r["old_logprobs"] = torch.cat([o[0] for o in out])
                    if q < 1:  # the whole batch's entropies, from the rollout policy
                        r["entropy_mask"] = high_entropy_mask(torch.cat([o[1] for o in out]), loss_mask, q)
                r["ref_logprobs"] = None
                if ref_policy is not None:
                    with ref_policy.disable_adapter() if args.lora_r else contextlib.nullcontext():  # LoRA: the base
                        out = [training_forward(ref_policy, r, mc, args, False) for mc in micro_batches]
                    r["ref_logprobs"] = torch.cat([o[0] for o in out])
            t2 = wall_clock(device)

            # 5. mu optimizer steps on the batch; micro-batches accumulate the whole batch's gradient (detail 9)
            policy.train()
            stats, losses, grad_norms = [], [], []
            for _ in range(args.num_iterations if trains else 0):
                loss_sum, mb_stats = accumulate_gradients(policy, r, args, autocast)
                grad_norms.append(optimizer_step(optimizer, params, args.max_grad_norm))
                stats, losses = stats + mb_stats, losses + [loss_sum]
            state = dict(update=update)  # update done: a stop from here on resumes after it
            t3 = wall_clock(device)

            # TRY NOT TO MODIFY: log (TRL's GRPO metric names), evaluate, show samples, save
            metrics = {"update": update, "episode": update * B * world, "reward": rewards.mean().item(), "reward_std":
                       rewards.view(-1, G).std(1).mean().item(), "frac_reward_zero_std": zero_std.float().mean().item(),
                       "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
                       "completions/max_length": lengths.max().item(), "completions/clipped_ratio":
                       truncated.float().mean().item(), "learning_rate": optimizer.param_groups[0]["lr"]}  # fmt: skip
            times, progress = timing((t0, t1, t2, t3), start_time, first_update, update, args.total_steps,
                                     mask.sum().item(), device)  # fmt: skip
            metrics |= times
            for name, s in zip(names, scores.T):
                metrics[f"rewards/{name}/mean"] = s.mean().item()
                metrics[f"rewards/{name}/std"] = global_mean_var(s, torch.ones_like(s))[1].sqrt().item()
            if losses:  # grpo_loss's stats (importance_ratio/mean, clip_ratio/* or cispo_clip_ratio, kl) and entropy
                metrics |= {"loss": global_mean(losses), "grad_norm": torch.stack(grad_norms).mean().item()}
                metrics |= {k: global_mean([s[k] for s in stats]) for k in stats[0]}
            metrics = global_metrics(metrics, {"completions/min_length": "min", "completions/max_length": "max",
                                               "perf/tokens_per_sec": "sum", "perf/peak_memory_mb": "max"})  # fmt: skip
            if evaluation and not STOP and (update % args.eval_every == 0 or update == args.total_steps):
                metrics |= evaluation()
            if rank == 0:  # samples: one completion per group
                shown = (range(0, min(args.num_samples * G, B), G)
                         if args.sample_every and not update % args.sample_every else [])  # fmt: skip
                line = f"reward {metrics['reward']:.3f}  " + (f"kl {metrics['kl']:.4f}  " if "kl" in metrics else "")
                line += ("" if losses else "(no loss tokens)  ") + (
                    f"{eval_line(metrics)}  " if "eval/accuracy" in metrics else ""
                )
                print(f"update {update}/{args.total_steps}: {line}{progress}")
                samples = [{"update": update, "prompt": rows[j]["prompt"], "completion": completions[j],
                            "reward": rewards[j].item(), "advantage": advantages[j].item()} for j in shown]  # fmt: skip
                log(writer, metrics, samples)
                if args.save_every and update % args.save_every == 0 and not STOP:  # a stop saves anyway
                    save_checkpoint(run_dir, models, optimizer, state, tokenizer)
    except BaseException as e:  # Ctrl-C, SIGTERM, a non-finite loss or an error: nothing is lost
        stopped(e, update, state, run_dir, rank, lambda: save_checkpoint(run_dir, models, optimizer, state, tokenizer))
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if writer is not None:
            writer.close()
    if rank == 0:
        save_checkpoint(run_dir, models, optimizer, state, tokenizer, args.save_merged)
        print(f"saved the policy to {run_dir}/policy")
        if args.track:
            sys.modules["wandb"].finish()
    if dist.is_initialized():
        dist.barrier()  # the other ranks wait while rank 0 saves
        dist.destroy_process_group()  # nothing else holds the group: gloo's threads end before Python's
    return run_dir


if __name__ == "__main__":
    main()

"""GRPO for language models and its current variants (Dr. GRPO, DAPO, GSPO, RLOO, CISPO, SAPO, ...), in one file.

Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath) is PPO without the critic: every prompt gets a
group of G sampled completions, a completion's advantage is its reward relative to the group's, and the KL to the frozen
reference is a loss term, not a reward penalty. Read down to the end of main(), the loop, its steps numbered in the
algorithm's order; below the SHARED label is the plumbing a first reading skips (flags, loading, the chunked LM head,
sharding, logging, evaluation, checkpoints).

    python grpo_llm.py --model gpt2 --total-steps 200   # unset, --model is the embedded arithmetic SFT policy (CPU)

Implementation details, cited "detail N":
1. Each prompt gets G = --num-generations completions, contiguous: a group is a row of rewards.view(-1, G).
2. A completion ends at its first EOS (the tokenizer's, the generation_config's, the chat template's end of turn); the
   tokens after it are pad, masked out of every loss and statistic.
3. Advantage = (reward - group mean) / (group std + 1e-4), or / the batch's std, or as is; one per completion, broadcast
   to its tokens; a group of equal rewards gets exactly 0. No value model, no GAE.
4. Sampling and log-probs both use softmax(logits / temperature) alone (our generation_config, not the checkpoint's).
5. At --num-iterations 1 the old log-probs are the current ones detached (rho = 1: no clip acts, the gradient is the
   policy gradient's with the group as baseline); above, they are recomputed after generation in the training's
   micro-batch shapes. The reference, the SFT policy in fp32 scored the same way, starts at KL 0.
6. Dropout is 0, in the config and in every nn.Dropout; prompts are left-padded, position ids come from the mask.
7. The LM head runs on completion positions only, in chunks recomputed in backward (torch.utils.checkpoint): memory
   does not grow with length x vocabulary. One fp32 log-softmax gives the log-probs and the entropy.
8. A clipped surrogate per token in [1 - epsilon, 1 + epsilon_high]: a higher upper bound lets unlikely tokens with a
   positive advantage grow (DAPO's clip-higher, against entropy collapse).
9. --loss-type's normaliser: each completion's token mean, then their mean (grpo, sapo); one token mean over the batch
   (dapo, cispo); completions x --max-new-tokens (dr_grpo). Micro-batches are weighted to give the batch's gradient.
10. The KL is a loss term beta * k3, out of the advantages (beta 0, TRL's default, loads no reference). With
    --use-bias-correction-kl (on) it is rho k3: its gradient is KL(pi || ref)'s even at rho = 1; k3's, KL(ref || pi)'s.
11. Several reward functions are summed with --reward-weights; a reward model scores alone.
12. cispo (MiniMax-M1): REINFORCE weighted by the detached ratio capped at 1 + --epsilon-high (TRL's epsilon_high 5
    is our 4); sapo (Gao et al. 2025): a sigmoid gate instead of the clip; --delta (INTELLECT-2): the ratio capped.
13. --top-entropy-quantile q (Wang et al. 2025): the batch's top q of tokens by entropy alone carry the policy gradient
    and bonus; --off-policy-mask-threshold (DeepSeek-V3.2): completions with A < 0 far from pi_old leave it.
14. Tools (--tools): a completion is turns, a tool's result appended as the chat template renders it; its tokens are
    context, not actions (mask 0): in no loss or normaliser, in every length.
15. Environments (--environment, TRL's environment_factory): an episode's state is an instance reset with its row, its
    get_reward() one more reward; without a critic every token gets the group advantage of the episode's total.
16. On-policy distillation (--teacher): each token's advantage adds -coef (log pi - log pi_teacher), the sampled
    reverse KL on the student's own states, discount 0.

Each variant is a few flags (docs/grpo_llm.md). Running it for real: any causal LM, chat templates, bf16 autocast on
CUDA, LoRA, torchrun (FSDP2); nothing is lost when a run stops (checkpoint/, --resume).
"""

import ast
import asyncio
import contextlib
import copy
import datetime
import fcntl
import functools
import importlib.util
import inspect
import itertools
import json
import math
import mmap
import operator
import os
import random
import re
import resource
import runpy
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
import zlib
from dataclasses import asdict, dataclass, fields, replace
from types import SimpleNamespace
from typing import Literal

import datasets
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict as dsd
import torch.distributed.nn  # noqa: F401  before init_process_group: imported after it, it would hold the group
import torch.nn as nn
import torch.nn.functional as F
import transformers
import tyro
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

CORRECTIONS = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]  # --vllm's, TRL's
LM_HEAD_CHUNK = 2**24  # logits per chunk of lm_head_logprobs (64 MiB in fp32), whatever the vocabulary


@dataclass
class Args:
    # ---- experiment
    exp_name: str = "grpo_llm"  # the run directory and the wandb run start with it
    seed: int = 1  # seed of python, numpy, torch and the prompt order
    cuda: bool = True  # use CUDA when it is available
    mixed_precision: Literal["auto", "bf16", "no"] = "auto"  # bf16 autocast, fp32 weights; auto: on native-bf16 GPUs
    track: bool = False  # log to Weights & Biases (WANDB_MODE=offline works)
    wandb_project_name: str = "rlhf-reference"  # wandb project
    wandb_entity: str | None = None  # wandb entity (team)
    output_dir: str = "runs"  # parent of the run directory: metrics.jsonl, samples.jsonl, policy/, checkpoint/
    save_every: int = 20  # write checkpoint/ and policy/ every N updates (0: only at the end and when stopped)
    resume: str | None = None  # go on with the run in this directory from its checkpoint/; flags given win
    # ---- models and data
    model: str = "assets/arith-sft"  # policy and reference: a directory (as the embedded SFT model) or a hub id
    reward_model: str | None = None  # a sequence-classification reward model; it replaces --reward-fn as the reward
    reward_label: int | None = None  # the reward model's logit that is the score, if it has several
    reward_fn: tuple[str, ...] | None = None  # summed: arithmetic gsm8k format file.py:fn module:fn (unset: arithmetic)
    reward_timeout: float = 600.0  # seconds a --reward-fn call may take (a judge, a sandbox); then the run stops
    reward_weights: tuple[float, ...] | None = None  # weight of each reward function (unset: 1 each)
    teacher: str | None = None  # on-policy distillation: a causal LM, the policy's tokenizer, grading every token
    teacher_coef: float = 1.0  # --teacher: each token's advantage -coef (log pi - log pi_teacher), discount 0
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
    tools: tuple[str, ...] = ()  # tools the policy may call: calculator (built in), file.py:function (docs: Tools)
    max_tool_calls: int = 4  # tool turns in a response; a call past them cuts the response off
    tool_timeout: float = 10.0  # seconds a tool call may run before it fails (an error result)
    environment: str | None = None  # TRL's environment_factory: file.py:Class or module:Class (docs: Environments)
    vllm: bool = False  # generate with a vLLM engine in this process (its own venv: docs/scaling.md)
    vllm_kv_cache_gb: float = 0.25  # --vllm on a CPU: the engine's KV cache in GiB
    vllm_gpu_memory_utilization: float = 0.3  # --vllm on a GPU: the engine's share of its memory (TRL's)
    vllm_importance_sampling_mode: CORRECTIONS = "token_truncate"  # --vllm: how its sampling is corrected (TRL's modes)
    vllm_importance_sampling_clip_max: float = 3.0  # --vllm: C, the bound of each weight pi / pi_vllm (TRL's)
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
    eval_every: int = 10  # held-out accuracy every N updates (0: off); right: the first reward source's score > 0
    eval_split: str | None = None  # a split of --dataset, or a prompt file (unset: test.jsonl beside a train.jsonl)
    eval_size: int = 256  # distinct prompts drawn from --eval-split
    eval_num_generations: int = 1  # samples of each held-out prompt; above 1, pass@k and maj@n too (docs: Evaluation)
    eval_temperature: float | None = None  # evaluation's sampling temperature, 0: greedy (unset: --temperature)
    eval_only: bool = False  # print the accuracy of --model on the evaluation prompts and exit
    sample_every: int = 10  # print and store a few samples every N updates (0: off)
    num_samples: int = 3  # samples shown each time


# ALGO LOGIC: the numerics, checked by tests/ against hand-computed values (all_reduce: over the ranks under torchrun)


def global_std(values):
    """Bessel-corrected standard deviation of every rank's values (B,): sqrt(sum((x - mean)^2) / (n - 1))."""
    n = all_reduce(torch.tensor(float(len(values)), device=values.device))
    mean = all_reduce(values.sum()) / n
    return (all_reduce(((values - mean) ** 2).sum()) / (n - 1)).sqrt()


def masked_mean(values, mask, axis=None):
    """sum(values * mask) / sum(mask), over `axis` or over everything."""
    return (values * mask).sum(axis) / mask.sum(axis)


def kl_penalty(logprobs, ref_logprobs, estimator):
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's r = logp - ref_logp (Schulman 2020):
    k1 = r (unbiased, can be < 0); k2 = r^2 / 2 (biased, low variance); k3 = exp(-r) - 1 + r (unbiased, >= 0)."""
    estimates = {"k1": lambda r: r, "k2": lambda r: 0.5 * r**2, "k3": lambda r: torch.expm1(-r) + r}
    return estimates[estimator](logprobs - ref_logprobs)


def group_advantages(rewards, group_size, scale, leave_one_out=False):
    """Detail 3: A_i = r_i - mean(group of G contiguous), or - the mean of the other G - 1 (RLOO); then / (std(group) +
    1e-4), / (std(batch) + 1e-4) or as is, by `scale` (Bessel). rewards (B,) -> advantages (B,), and zero_std (P,):
    the groups of equal rewards, whose advantages are exactly 0."""
    grouped = rewards.view(-1, group_size)  # (P, G)
    baseline = grouped.mean(1, keepdim=True)
    if leave_one_out:  # RLOO: the mean of the other G - 1
        baseline = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
    advantages = grouped - baseline
    if scale == "group":
        advantages = advantages / (grouped.std(1, keepdim=True) + 1e-4)
    elif scale == "batch":
        advantages = advantages / (global_std(rewards) + 1e-4)
    zero_std = grouped.max(1).values == grouped.min(1).values  # (P,)
    return advantages.masked_fill(zero_std[:, None], 0.0).view(-1), zero_std


def distillation_advantages(advantages, logprobs, teacher_logprobs, coef):
    """On-policy distillation (Agarwal et al. 2024, GKD; Lu et al. 2025): each token's -coef (log pi(y_t) - log
    pi_teacher(y_t)), the sampled reverse KL's negative, added to its advantage (B,) or (B, T) -> (B, T). Discount 0:
    a token is graded for itself, as the teacher would have chosen it in the state the student reached."""
    return advantages.view(len(advantages), -1) - coef * (logprobs - teacher_logprobs)


def overlong_penalty(lengths, max_new_tokens, buffer, penalty):
    """DAPO's soft overlong punishment of L tokens (B,), a tool's too, -> (B,): penalty * max(0, L - (max_new_tokens -
    buffer)) / buffer, from 0 at L = max_new_tokens - buffer to `penalty` at max_new_tokens; none when buffer is 0."""
    if buffer == 0:
        return torch.zeros_like(lengths, dtype=torch.float)
    return penalty * (lengths - (max_new_tokens - buffer)).clamp(min=0) / buffer


def high_entropy_mask(entropy, mask, quantile):
    """1 on the real tokens whose entropy is in the top `quantile` of every rank's real tokens (detail 13), else 0;
    every rank's gathered (their counts differ), the quantile by numpy: torch.quantile refuses > 2^24 values."""
    values = entropy[mask.bool()].float().cpu()
    if dist.is_initialized():
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, values)
        values = torch.cat(every_rank)
    return (entropy >= np.quantile(values.numpy(), 1 - quantile)).float() * mask


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, n_completions, n_tokens, args, entropy_mask=1.0):
    """A micro-batch's share of the batch's loss, and its stats, by the flags in args. rho = exp(logprobs -
    old_logprobs) per token, or exp of their mean per completion (sequence, GSPO); per token, A the advantage:
      grpo, dapo, dr_grpo: -min(min(rho, delta) A, clip(rho, 1 - epsilon, 1 + epsilon_high) A)    (details 8, 12)
      cispo: -sg(min(rho, 1 + epsilon_high)) A logprobs (sg(): no gradient);  sapo: -sigmoid(tau (rho - 1)) 4 / tau A
    times entropy_mask (detail 13: the high-entropy and off-policy masks), plus beta k3 (times rho, detail 10), k3 =
    exp(ref - logp) - (ref - logp) - 1; the masked token sum / (each completion's length x completions) (grpo, sapo),
    / real tokens (dapo, cispo) or / (completions x max_new_tokens) (dr_grpo), of the batch (n_completions;
    n_tokens, a mean over the ranks) (detail 9). logprobs (B, T), advantages (B,) or (B, T)."""
    epsilon, epsilon_high = args.epsilon, args.epsilon if args.epsilon_high is None else args.epsilon_high
    log_ratio = logprobs - old_logprobs  # (B, T)
    if args.importance_sampling_level == "sequence":
        log_ratio = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # (B, 1)
    ratio = torch.exp(log_ratio)
    advantages = advantages.view(len(advantages), -1)  # (B, 1) or (B, T)
    if args.loss_type == "cispo":
        per_token_loss = -ratio.clamp(max=1 + epsilon_high).detach() * advantages * logprobs
    elif args.loss_type == "sapo":
        tau = torch.where(advantages > 0, args.sapo_temperature_pos, args.sapo_temperature_neg)
        per_token_loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages  # slope A at rho = 1, as PPO's
    else:
        capped_ratio = ratio if args.delta is None else ratio.clamp(max=args.delta)
        per_token_loss = -torch.min(capped_ratio * advantages, ratio.clamp(1 - epsilon, 1 + epsilon_high) * advantages)
    per_token_loss = per_token_loss * entropy_mask
    kl = None
    if args.beta:  # the reference's log-probs are there only then
        kl = kl_penalty(logprobs, ref_logprobs, "k3")
        if args.use_bias_correction_kl:  # detail 10: rho k3 has the gradient of KL(pi || ref)
            kl = kl * ratio
        per_token_loss = per_token_loss + args.beta * kl
    normaliser, share = mask.sum().clamp(min=1), mask.sum() / n_tokens  # dapo, cispo: one mean over the tokens
    if args.loss_type in ("grpo", "sapo", "dr_grpo"):  # a share of the completions; grpo, sapo: each one's token mean
        normaliser, share = mask.sum(1).clamp(min=1) * len(mask), len(mask) / n_completions
    if args.loss_type == "dr_grpo":  # a constant: completions x max_new_tokens
        normaliser = len(mask) * args.max_new_tokens
    loss = ((per_token_loss * mask).sum(1) / normaliser).sum() * share
    return loss, loss_stats(ratio, advantages, mask, kl, args.loss_type, epsilon, epsilon_high)


# ALGO LOGIC: rollout, the forward pass, the gradient of a minibatch, the optimizer step


def truncate_after_eos(responses, eos_ids, pad_token_id):
    """Detail 2: keep the tokens up to and including the first EOS (any of eos_ids). Returns (responses, mask, ended),
    ended (B,) whether a response has an EOS at all (else it ran to --max-new-tokens)."""
    is_eos = torch.isin(responses, torch.tensor(eos_ids, device=responses.device))
    after_eos = (is_eos.cumsum(1) - is_eos.long()) > 0  # an EOS strictly before this position
    return responses.masked_fill(after_eos, pad_token_id), ~after_eos, is_eos.any(1)


def importance_weights(logprobs, vllm_logprobs, mask, args):
    """--vllm's correction: the engine samples from pi_vllm, not quite the trainer's pi. TRL's four modes, C the clip:
    w = pi / pi_vllm = exp(logprobs - vllm_logprobs) per token (B, R), or (sequence_*) exp of their sum over the row's
    policy tokens (B, 1); *_truncate: min(w, C); *_mask: w, but 0 where w > C. Each advantage is multiplied by it."""
    log_ratio, mode = (logprobs - vllm_logprobs) * mask, args.vllm_importance_sampling_mode  # a tool's: 0 here
    if mode.startswith("sequence"):  # a row's ratio drifts from 1 as the row grows, and C acts
        log_ratio = log_ratio.sum(1, keepdim=True)
    weights, cap = torch.exp(log_ratio), args.vllm_importance_sampling_clip_max
    return weights.clamp(max=cap) if mode.endswith("truncate") else weights.masked_fill(weights > cap, 0.0)


@torch.no_grad()
def rollout(policy, tokenizer, prompts, args, autocast, stop=None, tools=None, environments=None, **sampling):
    """Step 1: the prompts left-padded (detail 6), cut on the left to --max-prompt-length; a response sampled for each
    from softmax(logits / temperature) (detail 4: the generation_config load_models sets, or evaluation's `sampling`),
    cut after its first EOS (detail 2); a stop (generate()'s stopping_criteria) ends them all at the next token. With
    tools, a response is turns, each call's result appended (run_episodes; environments: each row's own). Batch:
        query_responses, attention_mask  (B, Q + R)  the prompts and responses, 1 on the real tokens (a tool's too)
        responses, mask                  (B, R)      the response tokens (pad after them), 1.0 on the policy's own
        ended, cut_on_call, lengths      (B,)        ended (a turn without a call), cut off on a call, the length
        tool_calls, tool_failures, turns (B,)        the tool calls, the failed ones, the policy's turns
        vllm_logprobs, turn_rewards      (B, R)      --vllm's log-probs (a tool's: 0); each turn's reward at its end
        messages                         B lists     each response's turns and tool results as messages (TRL's)"""
    inputs = tokenize_texts(tokenizer, prompts, args.max_prompt_length).to(policy.device)
    policy.eval()
    with autocast, unsharded(policy), vllm_pushed(policy, enabled=args.vllm):  # FSDP gathers once for all the turns
        if tools:
            return run_episodes(policy, tokenizer, inputs, args, stop, tools, sampling, environments)
        new, n_sampled, vllm_logprobs = generate_turn(policy, inputs, args.max_new_tokens, stop, args, sampling)
    responses, mask, ended = truncate_after_eos(new, policy.generation_config.eos_token_id, tokenizer.pad_token_id)
    mask &= torch.arange(new.shape[1], device=new.device) < n_sampled[:, None]  # a stop ends the engine's rows early
    return padded_batch(inputs, responses, mask, mask.sum(1), ended=ended, vllm_logprobs=vllm_logprobs)


def position_ids(attention_mask):
    """Detail 6: positions that count the real tokens only, so that left padding does not shift them."""
    return (attention_mask.cumsum(1) - 1).clamp(min=0)


def hidden_states(model, query_responses, attention_mask, prompt_width):
    """The last hidden states (B, R, H) at the positions that predict the response: the state at t predicts token t + 1,
    so query_responses[:, Q:] comes from positions Q - 1 ... -2 (the off-by-one shift). Naively
    model(..., output_hidden_states=True).hidden_states[-1][:, Q - 1 : -1], which keeps every layer's states."""
    inputs = dict(input_ids=query_responses, attention_mask=attention_mask, position_ids=position_ids(attention_mask))
    return last_hidden_state(model, inputs)[:, prompt_width - 1 : -1]


def policy_forward(model, batch, micro_batch, args):
    """The rows micro_batch of the rollout batch through `model`: the last hidden states (B, R, H), each response
    token's log-prob and the entropy of its next-token distribution (B, R) (details 4, 7). Naively
        logits = model.lm_head(hidden) / temperature                      (B, R, V)
        logprobs, entropy = log_softmax(logits).gather(-1, responses), -(softmax(logits) * log_softmax(logits)).sum(-1)
    which lm_head_logprobs computes in fp32 chunks of the tokens (no (B, R, V) tensor is kept), with the model's logit
    scaling and soft-capping; the entropy has a gradient only for an entropy bonus (--ent-coef)."""
    query_responses, attention_mask = batch["query_responses"][micro_batch], batch["attention_mask"][micro_batch]
    hidden = hidden_states(model, query_responses, attention_mask, batch["prompt_width"])
    options = dict(entropy_grad=args.ent_coef != 0, fp32=args.cast_lm_head_to_fp32)
    return hidden, *lm_head_logprobs(hidden, model, batch["responses"][micro_batch], args.temperature, **options)


def accumulate_gradients(policy, batch, micro_batches, args, autocast):
    """Forward and backward of the batch in micro-batches, each its share of the loss (detail 9); (loss, stats)."""
    loss_mask, batch_size = batch["loss_mask"], len(batch["loss_mask"])
    bonus_mask = loss_mask * batch["entropy_mask"]  # the tokens of the policy gradient and entropy bonus (detail 13)
    stats, loss_sum = [], torch.zeros((), device=loss_mask.device)
    n_tokens, n_bonus = global_mean([loss_mask.sum()]), global_mean([bonus_mask.sum()])
    for micro_batch in micro_batches:
        with autocast:
            _, logprobs, entropy = policy_forward(policy, batch, micro_batch, args)
        old_logprobs = batch["old_logprobs"][micro_batch] if args.num_iterations > 1 else logprobs.detach()  # detail 5
        ref_logprobs = batch["ref_logprobs"][micro_batch] if "ref_logprobs" in batch else None  # beta 0: no KL
        advantages, mask = batch["advantages"][micro_batch], batch["loss_mask"][micro_batch]
        entropy_mask, sampling_logprobs = batch["entropy_mask"][micro_batch], old_logprobs  # or the engine's, below
        if args.vllm:  # the engine sampled these tokens, so each token's weight turns A (B,) into (B, R)
            sampling_logprobs = batch["vllm_logprobs"][micro_batch]
            advantages = advantages[:, None] * importance_weights(old_logprobs, sampling_logprobs, mask, args)
            batch.setdefault("old_logprobs", 0 * loss_mask)[micro_batch] = old_logprobs  # read by vllm_metrics
        if args.off_policy_mask_threshold is not None:  # detail 13: A < 0, far from what sampled it (mean k1 KL)
            far = masked_mean(sampling_logprobs - logprobs.detach(), mask, axis=1) > args.off_policy_mask_threshold
            entropy_mask = entropy_mask * ~((advantages.view(len(mask), -1) < 0) & far[:, None])
        if args.teacher:  # on-policy distillation, after the mask (it reads the sign of the group's advantage)
            advantages = distillation_advantages(advantages, old_logprobs, ref_logprobs, args.teacher_coef)
        loss, micro_stats = grpo_loss(
            logprobs, old_logprobs, ref_logprobs, advantages, mask, batch_size, n_tokens, args, entropy_mask
        )
        if args.ent_coef:
            loss = loss - args.ent_coef * (entropy * bonus_mask[micro_batch]).sum() / n_bonus
        loss.backward()
        loss_sum += loss.detach()  # no .item() per micro-batch: one sync at logging
        stats.append(micro_stats | {"entropy": masked_mean(entropy.detach(), mask)})
        if args.teacher:  # the number to watch fall: the sampled reverse KL to the teacher, per policy token
            stats[-1]["distill/reverse_kl"] = masked_mean(old_logprobs - ref_logprobs, mask)
    return loss_sum, stats


def optimizer_step(optimizer, params, max_grad_norm):
    """One AdamW step, the gradients clipped to a global norm, returned; a non-finite one stops the run. Under torchrun
    FSDP's reduce-scatter has averaged the gradients over the ranks already, and the norm is of every rank's shards."""
    grad_norm = nn.utils.clip_grad_norm_(params, max_grad_norm)
    if isinstance(grad_norm, DTensor):  # a sharded norm: the same total on every rank
        grad_norm = grad_norm.full_tensor()
    if not torch.isfinite(grad_norm):
        raise FloatingPointError(f"the gradient norm is {grad_norm.item()}: try a lower --learning-rate")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def main(args: Args | None = None):
    args = parse_args() if args is None else args  # TRY NOT TO MODIFY: set-up, models, a resumed run, run directory
    given = asdict(args)  # the flags as given, for args.json: --resume reads them and derives the rest again
    (rank, world), device, autocast = setup(args)
    check_args(args, world)
    G = args.num_generations
    batch_size = args.prompts_per_update // world * G  # this process's share of the completions
    micro_batch_size = min(args.micro_batch_size, batch_size)  # at most the batch
    tools, environment = load_environment(args)  # --tools, and --environment's instances (TRL's environment_factory)
    reward_fns = load_reward_fns(args, environment)  # --reward-fn's, then the environment's get_reward; before loading
    tokenizer, policy, reward_model, rm_tokenizer = load_models(args, device, tools)  # the RM's own tokenizer, or None
    eval_problems = eval_rows(args, tokenizer, reward_fns, tools)
    held_out = (policy, tokenizer, eval_problems, reward_fns, args, autocast, batch_size, tools, environment)
    if args.eval_only:  # no training, no run directory; a stop ends it after a batch, with one line
        return evaluate_only(held_out)
    ref_policy, distill = load_teacher(args, device, held_out)  # --teacher: it grades every sampled token
    if args.beta:  # with beta 0, TRL's default, there is no KL term and no reference (details 5, 10)
        ref_policy = policy if args.lora_r else frozen_copy(policy, device, uses_bf16(args))  # LoRA: its adapters off
    params, optimizer = prepare(args, [policy])
    fn_names = reward_fn_names(args)  # a reward model's name is its directory's
    names = [os.path.basename(args.reward_model)] if args.reward_model else [n.split(":")[-1] for n in fn_names]
    weights = list(args.reward_weights or [1.0] * len(names))
    if args.teacher and not args.reward_fn:  # pure distillation: the reward functions only measure
        weights = [0.0] * len(names)
    if len(reward_fns) > len(fn_names):  # the environment's get_reward: a source of weight 1 (TRL's)
        names, weights = names + [args.environment.rpartition(":")[2]], weights + [1.0]
    models = nn.ModuleDict({"policy": policy})  # what checkpoint/ and policy/ hold; the reference is --model's
    resumed, prompts, run_dir, writer = start_run(args, given, models, optimizer, tokenizer, tools, eval_problems)
    first_update = resumed.get("update", 0)
    run = {"update": first_update, "state": {"update": first_update}}  # what a stop saves
    clock = Stopwatch(device, first_update, args.total_steps)
    with guarded(args, run, run_dir, writer, models, optimizer, tokenizer):
        if eval_problems and not resumed:  # the initial policy, at update 0
            initial = evaluate(*held_out) | distill
            stop_if_signalled()  # a stopped evaluation ({}) is not logged
            log(writer, {"update": 0, "episode": 0} | initial, "update 0:")
        for update in range(first_update + 1, args.total_steps + 1):
            run["update"] = update
            torch.manual_seed(hash((args.seed, update, rank)))  # ints hash alike anywhere, so a resume repeats it
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = args.learning_rate * (1 - (update - 1) / args.total_steps)
            clock.lap()  # the update starts
            # ALGO LOGIC: 1. rollout, G completions of each prompt, contiguous (detail 1), in turns with tools
            prompt_rows = [next(prompts) for _ in range(batch_size // G)]
            rows = [row for row in prompt_rows for _ in range(G)]
            rows, envs = reset_environments(environment, rows, tokenizer, tools, args)  # each its own instance (TRL's)
            batch = rollout(policy, tokenizer, [r["prompt"] for r in rows], args, autocast, [signalled], tools, envs)
            stop_if_signalled()  # every rank, before the update changes anything
            mask = batch["mask"]  # (B, R)
            clock.lap("generation")
            # 2. rewards: the weighted reward functions, or the reward model (detail 11); DAPO's overlong penalty
            completions, transcripts, conversations = decode_responses(tokenizer, batch)  # see there
            if reward_model is None:
                scores = reward_fn_scores(reward_fns, completions, rows, transcripts, envs, device)  # (B, sources)
            else:
                scores = reward_model_scores(reward_model, rm_tokenizer, batch, rows, conversations, args)[:, None]
            penalty = overlong_penalty(
                batch["lengths"], args.max_new_tokens, args.overlong_buffer, args.overlong_penalty
            )
            rewards = scores @ scores.new_tensor(weights) - penalty
            # 3. advantages relative to the group (detail 3); which completions the loss sees
            advantages, zero_std = group_advantages(rewards, G, args.scale_rewards, args.leave_one_out)
            dropped = torch.zeros_like(batch["ended"])
            if args.dynamic_sampling:  # DAPO's, without resampling: the groups whose rewards are all equal
                dropped |= zero_std.repeat_interleave(G)  # advantage 0 already: out of the KL and entropy terms
            if args.mask_truncated_completions:  # DAPO's overlong filtering: the completions that never ended
                dropped |= ~batch["ended"]
            loss_mask = mask * ~dropped[:, None]
            batch |= {"loss_mask": loss_mask, "advantages": advantages, "entropy_mask": torch.ones_like(mask)}
            # 4. old log-probs (mu > 1), entropies (detail 13) and reference log-probs: the training forward (detail 5)
            micro_batches = torch.arange(batch_size, device=device).split(micro_batch_size)
            has_loss_tokens = all_reduce(loss_mask.sum()) > 0  # on any rank; else no update
            if has_loss_tokens and (args.num_iterations > 1 or args.top_entropy_quantile < 1):
                with scoring(policy), autocast:
                    out = [policy_forward(policy, batch, mb, args)[1:] for mb in micro_batches]
                batch["old_logprobs"], entropy = (torch.cat(x) for x in zip(*out))  # old ones read at mu > 1
                if args.top_entropy_quantile < 1:  # the whole batch's, from the rollout policy
                    batch["entropy_mask"] = high_entropy_mask(entropy, loss_mask, args.top_entropy_quantile)
            if ref_policy is not None:  # the reference's (--beta), or the teacher's (--teacher)
                with scoring(ref_policy, adapters_off=ref_policy is policy and args.lora_r > 0), autocast:
                    out = [policy_forward(ref_policy, batch, mb, args)[1] for mb in micro_batches]
                batch["ref_logprobs"] = torch.cat(out)
            clock.lap("scoring")
            # 5. mu optimizer steps on the batch; micro-batches accumulate the whole batch's gradient (detail 9)
            policy.train()
            stats, losses, grad_norms = [], [], []
            for _ in range(args.num_iterations if has_loss_tokens else 0):
                loss, micro_stats = accumulate_gradients(policy, batch, micro_batches, args, autocast)
                grad_norms.append(optimizer_step(optimizer, params, args.max_grad_norm))
                stats += micro_stats
                losses.append(loss)
            run["state"] = {"update": update}  # the update is done, and a stop from here on resumes after it
            clock.lap("update")
            # TRY NOT TO MODIFY: 6. log (TRL's GRPO metric names), evaluate, show samples, save
            batch |= {"scores": scores, "rewards": rewards, "zero_std": zero_std}
            metrics, line = grpo_metrics(update, args, batch, names, stats, losses, grad_norms, optimizer, clock)
            if eval_problems and due(update, args.eval_every, args.total_steps):
                metrics |= evaluate(*held_out)
            values = dict(reward=rewards[::G], advantage=advantages[::G])  # one of each group
            log(writer, metrics, line, samples_to_log(args, update, rows[::G], transcripts[::G], **values))
            if update < args.total_steps and due(update, args.save_every):  # the last is saved below
                save_checkpoint(run_dir, models, optimizer, run["state"], tokenizer)
        save_checkpoint(run_dir, models, optimizer, run["state"], tokenizer, merged=args.save_merged)
    return run_dir


# SHARED WITH the other LLM script, after this script's own flag checks, metrics and loading; kept identical by
# tests/test_shared.py, as is each function above that both define; a new reward: REWARD_FNS, or --reward-fn file.py:fn.


def check_args(args, world):
    """Every flag out of range and every bad combination, one line each, before anything loads."""
    check_range(args, ">= 0", "save_every lora_r learning_rate weight_decay ent_coef beta off_policy_mask_threshold")
    check_range(args, ">= 0", "overlong_buffer overlong_penalty eval_every sample_every num_samples max_tool_calls")
    check_range(args, ">= 1", "max_new_tokens max_prompt_length total_steps prompts_per_update micro_batch_size")
    check_range(args, ">= 1", "num_iterations eval_size eval_num_generations")
    check_range(args, ">= 2", "num_generations")  # the group is the baseline
    check_range(args, "> 0", "lora_alpha temperature max_grad_norm sapo_temperature_pos sapo_temperature_neg")
    check_range(args, "in (0, 1)", "epsilon")
    check_range(args, "in (0, 1]", "top_entropy_quantile")
    check_range(args, ">= 0", "epsilon_high delta eval_temperature")  # and the bounds below
    check_range(args, "finite", "reward_weights")
    check_run(args, world)
    batch_size = args.prompts_per_update // world * args.num_generations  # this process's completions
    micro_batch_size = min(args.micro_batch_size, batch_size)  # main() caps it so
    n_rewards = 1 if args.reward_model else len(reward_fn_names(args))
    if batch_size % micro_batch_size:
        raise SystemExit(f"error: --micro-batch-size must divide the completions per update ({batch_size} a process)")
    if args.epsilon_high is not None and args.epsilon_high < args.epsilon:
        raise SystemExit(f"error: --epsilon-high must be >= --epsilon (got {args.epsilon_high})")
    if args.delta is not None and args.delta <= 1 + (args.epsilon if args.epsilon_high is None else args.epsilon_high):
        raise SystemExit(f"error: --delta must be > 1 + --epsilon-high (got {args.delta})")
    if args.off_policy_mask_threshold is not None and args.num_iterations == 1 and not args.vllm:  # it never acts
        why = "needs --num-iterations > 1 or --vllm (at 1 the trainer sampled each completion: none is off-policy)"
        raise SystemExit(f"error: --off-policy-mask-threshold {why}")
    if args.teacher and args.beta:  # a KL term to which model? The teacher's is in every token's advantage
        raise SystemExit("error: --teacher needs --beta 0: the teacher's reverse KL is each token's advantage already")
    if args.teacher and args.dynamic_sampling and args.reward_fn is None:
        raise SystemExit("error: --dynamic-sampling with --teacher needs a --reward-fn: else all rewards are 0")
    if args.reward_fn == ():
        raise SystemExit("error: --reward-fn needs at least one reward function")
    if args.reward_weights is not None and len(args.reward_weights) != n_rewards:
        raise SystemExit(f"error: --reward-weights needs one per reward ({n_rewards}), not {len(args.reward_weights)}")


def loss_stats(ratio, advantages, mask, kl, loss_type, epsilon, epsilon_high):
    """grpo_loss's stats: where each loss type acts, as TRL logs it (sapo's gate clips nothing), the mean ratio, k3."""
    with torch.no_grad():
        low, high = (ratio < 1 - epsilon) & (advantages < 0), (ratio > 1 + epsilon_high) & (advantages > 0)
        means = {}
        if loss_type == "cispo":
            means["cispo_clip_ratio"] = high
        elif loss_type != "sapo":
            means["clip_ratio/low_mean"] = low
            means["clip_ratio/high_mean"] = high
            means["clip_ratio/region_mean"] = low | high
        means["importance_ratio/mean"] = ratio.expand_as(mask)
        if kl is not None:
            means["kl"] = kl
        return {name: masked_mean(x.float(), mask) for name, x in means.items()}


def grpo_metrics(update, args, batch, names, stats, losses, grad_norms, optimizer, clock):
    """An update's metrics, TRL's GRPO names (docs/grpo_llm.md), over every rank, and its progress line."""
    rewards, lengths = batch["rewards"], batch["mask"].sum(1)  # TRL's: the policy's tokens, not a tool's
    metrics = {
        "update": update,
        "episode": update * args.prompts_per_update * args.num_generations,
        "reward": rewards.mean().item(),
        "reward_std": rewards.view(-1, args.num_generations).std(1).mean().item(),
        "frac_reward_zero_std": batch["zero_std"].float().mean().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": (~batch["ended"] & ~batch["cut_on_call"]).float().mean().item(),  # TRL's: no EOS
        "learning_rate": optimizer.param_groups[0]["lr"],
    }
    for name, reward in zip(names, batch["scores"].T):
        metrics[f"rewards/{name}/mean"] = reward.mean().item()
        metrics[f"rewards/{name}/std"] = global_std(reward).item()
    metrics |= tool_metrics(batch) if args.tools or args.environment else {}
    if losses:  # grpo_loss's stats (importance_ratio/mean, clip_ratio/* or cispo_clip_ratio, kl) and entropy
        metrics["loss"] = global_mean(losses)
        metrics["grad_norm"] = torch.stack(grad_norms).mean().item()
        metrics |= {key: global_mean([s[key] for s in stats]) for key in stats[0]}
    times, progress = clock.metrics(update, batch["lengths"].sum().item())
    ops = {"completions/min_length": "min", "completions/max_length": "max", "perf/peak_memory_mb": "max"}
    metrics = global_metrics(metrics | times, ops | {"perf/tokens_per_sec": "sum"})
    metrics |= vllm_metrics(batch) if args.vllm and losses else {}  # no update, no old log-probs
    warn_truncated(metrics["completions/clipped_ratio"], args, "; see --mask-truncated-completions, --overlong-buffer")
    line = f"update {update}/{args.total_steps}: reward {metrics['reward']:.3f}  "
    line += f"kl {metrics['kl']:.4f}  " if "kl" in metrics else ""
    line += "" if losses else "(no loss tokens)  "
    return metrics, line + progress


NUMBER = r"(?:[-+]\$?|\$[-+]?)?\s?\d(?:[\d,]*\d)?(?:\.\d+)?"  # -12, $1,234, 3.5, -$5, $-5; one sign at most
REWARD_FNS = {  # f(completions, reference answers) -> a score per completion
    "arithmetic": lambda cs, refs: [float(c.strip() == r) for c, r in zip(cs, refs)],  # exactly the answer
    "gsm8k": lambda cs, refs: [same_answer(c, r) for c, r in zip(cs, refs)],  # the number after '####'
    "format": lambda cs, refs: [float(final_answer(c, strict=True) is not None) for c in cs],  # any stated answer
}


def final_answer(text, strict=False):
    """The last number stated after '####' (GSM8K's format), in \\boxed{} or after 'answer is' / 'answer:'; else,
    unless strict, the text's last number; None if none. Commas and '$' are ignored, and 42.0 is 42."""
    for marker in [r"####([^\n]*)", r"\\boxed\{([^{}]*)\}", r"answer(?:\s+is|:)([^\n]*)"]:
        stated = [m for m in re.findall(marker, text, flags=re.IGNORECASE) if re.search(NUMBER, m)]
        if stated:
            return float(re.sub(r"[$,\s]", "", re.search(NUMBER, stated[-1]).group()))
    found = [] if strict else re.findall(NUMBER, text)
    return float(re.sub(r"[$,\s]", "", found[-1])) if found else None


def same_answer(completion, reference):
    """1.0 if the completion states a final answer and it is the reference's, else 0.0."""
    answer = final_answer(completion)
    return float(answer is not None and answer == final_answer(reference))


def import_function(spec, flag, known):
    """known[spec], or the function that file.py:fn or module:fn names; one line if there is none."""
    if spec in known:
        return known[spec]
    source, _, name = spec.rpartition(":")
    try:
        return (runpy.run_path(source) if source.endswith(".py") else runpy.run_module(source))[name]
    except Exception as e:  # no such file, module or function, or a file that does not import (a SyntaxError, say)
        why = f" ({type(e).__name__}: {e})" if source else ""
        choices = f"not one of {sorted(known)}, nor a file.py:function or module:function that loads"
        raise SystemExit(f"error: {flag} {spec}: {choices}{why}") from None


def load_reward_fn(spec, timeout, environment=False):
    """--reward-fn as f(completions, rows, transcripts, environments): REWARD_FNS', or TRL's call (docs: Rewards)."""
    if spec in REWARD_FNS:
        return lambda completions, rows, *_: REWARD_FNS[spec](completions, [row["answer"] for row in rows])
    fn, keywords = import_function(spec, "--reward-fn", REWARD_FNS), "completions transcripts prompts environments"
    try:  # the columns are checked by name as they come
        inspect.signature(fn).bind_partial(**dict.fromkeys(keywords.split()[: 4 if environment else 3]))
    except TypeError as e:
        why = f"{e}: it is called with {keywords.replace(' ', '=, ')}= (with --environment) and each column by name"
        raise SystemExit(f"error: --reward-fn {spec}: {why}; give it **kwargs") from None

    def user_fn(completions, rows, transcripts, environments=None):
        columns = {key: [row["columns"][key] for row in rows] for key in rows[0]["columns"]}
        if environments is not None:  # as TRL passes them
            columns["environments"] = environments
        with time_limit(timeout, f"--reward-fn {spec}"):  # --reward-timeout: a judge or sandbox that hangs
            values = fn(completions=completions, transcripts=transcripts, **columns)
        return finite_scores(values, f"--reward-fn {spec}", completions)

    return user_fn


def load_reward_fns(args, environment):
    """The reward sources, f(completions, rows, transcripts, environments): --reward-fn's, then get_reward (TRL's)."""
    fns = [load_reward_fn(name, args.reward_timeout, environment is not None) for name in reward_fn_names(args)]
    source = f"--environment {args.environment}"
    if environment is not None and environment.scores and args.reward_model:
        raise SystemExit(f"error: {source} scores with get_reward: use --reward-fn beside it, not --reward-model")
    if environment is not None and not (environment.scores or fns or args.reward_model):
        raise SystemExit(f"error: {source} has no get_reward and no --reward-fn is given: nothing scores its episodes")

    def get_reward(completions, rows, transcripts, environments):
        with time_limit(args.reward_timeout, f"{source}'s get_reward"):  # --reward-timeout, as a reward function's
            values = [awaited(environment.get_reward()) for environment in environments]
        return finite_scores(values, f"{source}'s get_reward()", completions)

    if environment is not None and environment.scores:
        fns.append(get_reward)
    return fns


def finite_scores(values, source, completions):
    """A float per completion, or one line naming their source and the miscount or the first with no finite number."""
    if isinstance(values, str | dict) or not hasattr(values, "__len__"):  # one number, None, a text: not a list
        raise SystemExit(f"error: {source} returned {values!r:.60}, not a list of a number per completion")
    if len(values) != len(completions):
        raise SystemExit(f"error: {source} returned {len(values)} numbers for {len(completions)} completions")
    scores = []
    for value in values:
        try:  # None, a list, text (float() would read "1", but a score is a number): none
            scores.append(math.nan if isinstance(value, str) else float(value))
        except (TypeError, ValueError):
            scores.append(math.nan)
    bad = [i for i, score in enumerate(scores) if not math.isfinite(score)]
    if bad:
        first = f"the first: {values[bad[0]]!r} for {completions[bad[0]]!r}"
        why = f"{len(bad)} of {len(scores)} completions with no finite number ({first})"
        raise SystemExit(f"error: {source} scored {why}")
    return scores


def reward_fn_names(args):
    """--reward-fn's names; unset, arithmetic (the embedded tasks' check), none beside a reward model (docs)."""
    if args.reward_fn is None:  # with --environment: its get_reward, if it has one
        return () if args.reward_model or args.environment else ("arithmetic",)
    return (args.reward_fn,) if isinstance(args.reward_fn, str) else args.reward_fn


def reward_fn_scores(reward_fns, completions, rows, transcripts, environments, device):
    """Each reward source's scores (B, sources); an error of one, on any rank, stops every rank here."""
    scores = on_every_rank(lambda: [fn(completions, rows, transcripts, environments) for fn in reward_fns])
    return torch.tensor(scores, dtype=torch.float, device=device).reshape(len(reward_fns), len(completions)).T


def padded_batch(inputs, responses, mask, lengths, **counts):
    """rollout()'s batch (listed there) from the prompts, responses, policy mask, lengths, counts (unset: no tools)."""
    device, none = responses.device, torch.zeros(len(responses), dtype=torch.long)
    counts = dict(cut_on_call=none.bool(), tool_calls=none, tool_failures=none, turns=none + 1) | counts
    counts = dict(turn_rewards=torch.zeros(responses.shape), messages=[[] for _ in responses]) | counts
    real = torch.arange(responses.shape[1]) < lengths.cpu()[:, None]  # every token of a response, a tool's too
    return {key: value.to(device) if torch.is_tensor(value) else value for key, value in counts.items()} | {
        "query_responses": torch.cat([inputs.input_ids, responses], 1),
        "attention_mask": torch.cat([inputs.attention_mask, real.long().to(device)], 1),
        "responses": responses,
        "mask": mask.float().to(device),
        "lengths": lengths.to(device),
        "prompt_width": inputs.input_ids.shape[1],
    }


def decode_responses(tokenizer, batch):
    """(completions, transcripts, conversations): each response's text after its last tool result, which the reward
    functions score ("" if cut off on a call); with each result as [tool: ...]; as TRL's messages, for rm_text."""
    real, mask = batch["attention_mask"][:, batch["prompt_width"] :].bool(), batch["mask"].bool()
    completions, transcripts, conversations = [], [], []
    rows = zip(batch["responses"].tolist(), (real & ~mask).tolist(), batch["cut_on_call"].tolist(), batch["messages"])
    for ids, is_tool, cut_on_call, messages in rows:  # the pad after a response: not a tool's
        parts = [(tool, [i for i, _ in part]) for tool, part in itertools.groupby(zip(ids, is_tool), lambda x: x[1])]
        texts = [tokenizer.decode(part, skip_special_tokens=True) for _, part in parts]
        completions.append("" if parts[-1][0] or cut_on_call else texts[-1])  # cut off on a call or its result: none
        turns = itertools.groupby(messages, lambda m: m["role"] == "tool")  # a turn's tool messages are one part
        results = iter(["".join(f"[tool: {m['content']}]" for m in group) for tool, group in turns if tool])
        transcripts.append("".join(next(results) if tool else text for (tool, _), text in zip(parts, texts)))
        conversations.append(messages or [{"role": "assistant", "content": texts[0]}])
    return completions, transcripts, conversations


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression of numbers, + - * / // % ** and parentheses.

    Args:
        expression: the expression, as 37*85
    """
    operators = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
    operators |= {ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg}

    def value(node):  # through ast, never eval(): numbers and the operators, bounded (9**9**9 is an error, not a hang)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if type(getattr(node, "op", None)) not in operators:
            raise ValueError(f"not arithmetic: {ast.unparse(node)}")
        operands = [value(node.operand)] if isinstance(node, ast.UnaryOp) else [value(node.left), value(node.right)]
        if not max(map(abs, operands)) <= 1e100 or isinstance(node.op, ast.Pow) and abs(operands[1]) > 100:
            raise ValueError("a number or an exponent too large")
        return operators[type(node.op)](*operands)

    result = value(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(result, complex) or abs(result) == math.inf:  # (-8)**0.5, 1e308*10: no real number
        raise ValueError(f"not a real number: {result}")
    return str(result)


def load_environment(args):
    """--tools and --environment (TRL's environment_factory): ({name: function}, the environment's pool or None)."""
    functions = [import_function(spec, "--tools", {"calculator": calculator}) for spec in args.tools]
    tools = {function.__name__: function for function in functions}
    if args.environment is None:
        return tools, None
    factory = import_function(args.environment, "--environment", {})
    instance = None if isinstance(factory, dict) else factory()  # a dict: TRL's several environments, by a column
    if not callable(getattr(instance, "reset", None)):
        why = "is not a class with a reset(**row) method (TRL's environment_factory; a dict of several: not yet)"
        raise SystemExit(f"error: --environment {args.environment} {why}")
    scores = callable(getattr(instance, "get_reward", None))
    return tools | environment_tools(instance), SimpleNamespace(factory=factory, pool=[instance], scores=scores)


def environment_tools(environment):
    """An environment's tools, as TRL takes them: its public methods but reset and get_reward, bound to it."""
    names = [name for name, _ in inspect.getmembers(type(environment), inspect.isfunction) if name[0] != "_"]
    return {name: getattr(environment, name) for name in names if name not in ("reset", "get_reward")}


def reset_environments(environment, rows, tokenizer, tools, args):
    """--environment: each row's episode on a pool instance, reset(**row) as TRL's; a str returned ends the prompt."""
    if environment is None:
        return rows, None
    environment.pool += [environment.factory() for _ in range(len(rows) - len(environment.pool))]

    def reset(row, instance):
        try:
            observation = awaited(instance.reset(**row["row"]))
        except Exception as e:
            why = f"reset() raised on the row {row['row']!r:.100} ({type(e).__name__}: {e})"
            raise SystemExit(f"error: --environment {args.environment}: {why}") from None
        if observation is None or row["messages"] is None:  # a plain prompt: what it says, after it
            return row | {"prompt": row["prompt"] + str(observation or "")}
        messages = copy.deepcopy(row["messages"])
        messages[-1]["content"] += str(observation)
        text = tokenizer.apply_chat_template(messages, list(tools.values()), tokenize=False, add_generation_prompt=True)
        return row | {"prompt": text, "messages": messages}

    instances = environment.pool[: len(rows)]
    return on_every_rank(lambda: [reset(row, instance) for row, instance in zip(rows, instances)]), instances


def awaited(value):
    """value, or what it returns once awaited if it is a coroutine (an async tool, reset or get_reward, as TRL's)."""
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def setup_tool_parsing(tokenizer, tools, eos_ids, model):
    """With --tools, for the run: tokenizer.response_template (its own, else TRL's for its family, else <tool_call> JSON
    at the assistant header) and, if not prefix-preserving, TRL's training template; a probe's calls must parse back."""
    user, fix = [{"role": "user", "content": "1"}], "install TRL (pip install trl) or give it a response_template"
    flag, options = f"error: --tools: the chat template of --model {model}", [{}, {"tools": list(tools.values())}]
    options.append({"add_generation_prompt": True})
    try:  # transformers reads each tool's JSON schema from its type hints and docstring
        plain, described, header = [tokenizer.apply_chat_template(user, tokenize=False, **o) for o in options]
    except ValueError as e:  # no chat template at all
        plain = described = header = str(e)
    except Exception as e:  # transformers' DocstringParsingException: no docstring, type hint or Args: line
        raise SystemExit(f"error: --tools: {e}: a tool is a function with type hints and an Args: docstring") from None
    if described == plain:
        raise SystemExit(f"{flag} does not render tools: give a --model that does (Qwen2.5-Instruct; assets/calc-sft)")
    try:
        from trl import chat_template_utils as trl_templates  # optional: the formats of the families TRL knows
    except ImportError:
        trl_templates = None
    if getattr(tokenizer, "response_template", None) is None and trl_templates:
        with contextlib.suppress(ValueError):  # a family TRL does not know
            trl_templates.add_response_schema(tokenizer)
    if getattr(tokenizer, "response_template", None) is None and "<tool_call>" in str(tokenizer.chat_template):
        calls = dict(open="<tool_call>", close="</tool_call>", content="json", repeats=True)
        calls["transform"] = {"type": "function", "function": "{content}"}  # parse_response's tool_calls
        start = header.removeprefix(plain)  # each turn's start: the assistant header
        if not start or not header.startswith(plain):  # nothing that marks where a turn starts
            raise SystemExit(f"{flag} adds no assistant header to anchor calls at: give it a response_template")
        tokenizer.response_template = {"start_anchor": start, "fields": {"content": {}, "tool_calls": calls}}
    if getattr(tokenizer, "response_template", None) is None:
        raise SystemExit(f"{flag} writes calls in a format not read here: {fix}")
    if trl_templates and not trl_templates.is_chat_template_prefix_preserving(tokenizer):
        tokenizer.family_chat_template = tokenizer.chat_template  # what save_policy saves
        with contextlib.suppress(ValueError):  # a family TRL has no training template of: refused just below
            tokenizer.chat_template = trl_templates.get_training_chat_template(tokenizer)
    probe = {"name": "probe", "description": "A probe.", "parameters": {"type": "object", "properties": {}}}
    probe["parameters"]["properties"]["n"] = {"type": "integer", "description": "a number"}
    for k in (1, 2):  # Llama 3.x's template raises on two calls in a turn; gpt-oss's ends the turn at the first
        calls = [{"type": "function", "function": {"name": "probe", "arguments": {"n": 7 + i}}} for i in range(k)]
        turn = [{"role": "assistant", "content": "", "tool_calls": calls}]
        turn += [{"role": "tool", "name": "probe", "content": "1"}] * k
        tokenizer.one_call_a_turn, parsed = False, None
        with contextlib.suppress(Exception):
            ids, start, end = rendered_turn(tokenizer, turn, eos_ids, [{"type": "function", "function": probe}])
            parsed = parse_turn(tokenizer, ids[:end], end - start, {"probe": probe})["tool_calls"]
        if parsed != calls and k == 1:
            why = f"a turn that calls probe(n=7), to its first end id, did not parse back as rendered ({parsed})"
            raise SystemExit(f"{flag}: {why}: {fix}")
        tokenizer.one_call_a_turn = parsed != calls
    tool_result_ids(tokenizer, [{"role": "tool", "name": next(iter(tools)), "content": "1"}], eos_ids)


def parse_turn(tokenizer, ids, turn_length, tools):
    """The last turn, ids[-turn_length:], as parse_response reads it with the tools' JSON schemas (an XML-style a=7
    reaches add(a: int) as 7): content without special tokens, tool_calls ([] if none; a failed one: its reason)."""
    text, prefix = tokenizer.decode(ids[-turn_length:]), tokenizer.decode(ids[:-turn_length])
    try:
        message = {"role": "assistant"} | tokenizer.parse_response(text, prefix=prefix, tools=list(tools.values()))
    except ValueError:  # malformed JSON: a failed call
        return {"role": "assistant", "content": text, "tool_calls": ["the call is not valid JSON"]}
    message |= {"content": message.get("content") or "", "tool_calls": message.get("tool_calls") or []}
    for token in tokenizer.all_special_tokens:  # an end of turn that the parser leaves in the content
        message["content"] = message["content"].replace(token, "")
    if len(message["tool_calls"]) > 1 and getattr(tokenizer, "one_call_a_turn", False):  # the template renders one
        message["tool_calls"] = ["this model calls one tool a turn"]
    return message


def rendered_turn(tokenizer, turn, eos_ids, tools=None):
    """A user message, turn and generation prompt rendered: (ids, start, end), ids[start:end] the turn to its end id."""
    user = [{"role": "user", "content": "1"}]
    header = tokenizer.apply_chat_template(user, tools=tools, add_generation_prompt=True, return_dict=False)
    ids = tokenizer.apply_chat_template(user + turn, tools=tools, add_generation_prompt=True, return_dict=False)
    start = next((j for j, (a, b) in enumerate(zip(header, ids)) if a != b), len(header))
    return ids, start, next((j + 1 for j in range(start, len(ids)) if ids[j] in eos_ids), None)  # None: refused


def run_tools(tokenizer, tools, calls, timeout, eos_ids, room):
    """(ids of the calls' tool messages, failures, messages): each result str()'d (an async one awaited), encodable, as
    TRL's; a failed call gets {'error': ...}, which the policy reads; ids None after a stop or for a result too long."""
    messages, failed = [], 0
    for call in calls:
        name = None
        try:  # a call without a name or arguments fails here, as one that names no tool
            if STOP:  # a Ctrl-C or SIGTERM came: no more calls (the rollout ends at its next token)
                raise Stopped("a stop was requested")
            if isinstance(call, str):  # parse_turn's failed call: its reason
                raise ValueError(call)
            name, arguments = call["function"]["name"], call["function"].get("arguments", {})
            if name not in tools or not isinstance(arguments, dict):
                raise ValueError(f"no tool {name!r}" if name not in tools else "the arguments are not a JSON object")
            with time_limit(timeout, f"tool {name}"):  # lone surrogates (os.fsdecode's) in the result become ?
                result = str(awaited(tools[name](**arguments))).encode("utf-8", "replace").decode()
            if len(result) > room and len(result) > room * max(map(len, tokenizer.get_vocab())):  # 1st: no vocab read
                return None, failed, messages
            tool_result_ids(tokenizer, [{"role": "tool", "name": name, "content": result}], eos_ids)  # renders
        except Stopped:  # Ctrl-C or SIGTERM in the call: a stop, not a failure, and no result reaches the policy
            return None, failed, messages
        except (Exception, SystemExit) as e:  # the tool's own errors (sys.exit too), TimedOut: the policy reads them
            result, failed = {"error": f"{type(e).__name__}: {e}"}, failed + 1
        messages.append({"role": "tool", "name": str(name).encode("utf-8", "replace").decode(), "content": str(result)})
    return tool_result_ids(tokenizer, messages, eos_ids), failed, messages


def tool_result_ids(tokenizer, messages, eos_ids):
    """The ids that tool messages and the next header add after an assistant turn (TRL's _get_tool_suffix_ids)."""
    calls = [{"type": "function", "function": {"name": m["name"], "arguments": {}}} for m in messages]
    turn = [{"role": "assistant", "content": "", "tool_calls": calls}]
    ids, _, end = rendered_turn(tokenizer, turn + messages, eos_ids)
    shorter = tokenizer.apply_chat_template([{"role": "user", "content": "1"}] + turn, return_dict=False)
    if ids[: min(end, len(shorter))] != shorter[:end]:  # Qwen3's writes an empty think block into the last turn alone
        why = "renders a turn otherwise once a tool message follows (Qwen3's: install TRL, for its training template)"
        raise SystemExit(f"error: --tools: the chat template of {tokenizer.name_or_path} {why}")
    return ids[end:]


def generate_turn(policy, context, room, stop, args, sampling):
    """Up to `room` new tokens a row of context (left-padded), by generate() or alike by --vllm's engine (details 2, 4):
    (new ids (B, W), each row's count sampled (B,; a stop aborts the engine), its log-probs (B, W; 0 without it))."""
    if not args.vllm:  # FSDP: synced_gpus=False, no collective (the ranks' turns differ)
        out = policy.generate(**context, max_new_tokens=room, stopping_criteria=stop, synced_gpus=False, **sampling)
        new = out[:, context.input_ids.shape[1] :]
        return new, torch.full((len(new),), new.shape[1], device=new.device), torch.zeros(new.shape, device=new.device)
    import vllm

    config, engine = policy.generation_config.to_dict() | sampling, VLLM[0].llm_engine
    params = dict(temperature=config["temperature"] if config["do_sample"] else 0.0, max_tokens=room, logprobs=0)
    params |= dict(stop_token_ids=config["eos_token_id"], ignore_eos=True, detokenize=False)  # detail 2's, not vLLM's
    ids = [row[real.bool()].tolist() for row, real in zip(context.input_ids, context.attention_mask)]
    for i, seed in enumerate(torch.randint(2**31, (len(ids),)).tolist()):
        engine.add_request(str(i), {"prompt_token_ids": ids[i]}, vllm.SamplingParams(seed=seed, **params))
    outputs = {}
    while engine.has_unfinished_requests():
        if stop is not None and STOP:  # the rows keep what they have: main() stops after the rollout
            engine.abort_request([str(i) for i in range(len(ids))])
            break
        for output in engine.step():  # each request's tokens so far
            outputs[int(output.request_id)] = output.outputs[0]
    rows = [outputs.get(i, SimpleNamespace(token_ids=[], logprobs=[])) for i in range(len(ids))]  # none: aborted
    logprobs = [torch.tensor([p[t].logprob for p, t in zip(row.logprobs, row.token_ids)]) for row in rows]
    new = [torch.tensor(row.token_ids, dtype=torch.long) for row in rows]
    pad, device = functools.partial(nn.utils.rnn.pad_sequence, batch_first=True), context.input_ids.device
    n_sampled = torch.tensor([len(row.token_ids) for row in rows], device=device)
    return pad(new, padding_value=config["pad_token_id"]).to(device), n_sampled, pad(logprobs).to(device)


def run_episodes(policy, tokenizer, inputs, args, stop, tools, sampling, environments=None):
    """rollout() with tools: each row's episode in turns, a record each; one generate_turn() serves those that go on."""
    eos_ids, pad_id, device = policy.generation_config.eos_token_id, tokenizer.pad_token_id, inputs.input_ids.device
    prompts = [ids[real.bool()].tolist() for ids, real in zip(inputs.input_ids, inputs.attention_mask)]
    fresh = dict(ids=[], mask=[], vllm_logprobs=[], turn_rewards=[], messages=[], turn_start=0, turns=1, tool_calls=0)
    episodes = [SimpleNamespace(prompt=p, tool_failures=0, **copy.deepcopy(fresh)) for p in prompts]
    for e, environment in zip(episodes, environments or [None] * len(episodes)):
        e.environment, e.tools = environment, tools | environment_tools(environment)
    going = episodes
    while going:
        context = tokenizer.pad({"input_ids": [e.prompt + e.ids for e in going]}, return_tensors="pt").to(device)
        room = args.max_new_tokens - max(len(e.ids) for e in going)
        new, n_sampled, logprobs = generate_turn(policy, context, room, stop, args, sampling)
        new, new_mask, _ = truncate_after_eos(new, eos_ids, pad_id)
        lengths = torch.minimum(new_mask.sum(1), n_sampled)  # each row's new tokens, to its first EOS (detail 2)
        for e, ids, length, logps in zip(going, new.tolist(), lengths.tolist(), logprobs.tolist()):
            e.ids, e.mask = e.ids + ids[:length], e.mask + [1.0] * length
            e.vllm_logprobs, e.turn_rewards = e.vllm_logprobs + logps[:length], e.turn_rewards + [0.0] * length
            e.outcome = end_turn(e, length, room, tokenizer, args, eos_ids)
        going = [e for e in going if e.outcome is None]
    pad = functools.partial(nn.utils.rnn.pad_sequence, batch_first=True)
    responses = pad([torch.tensor(e.ids, dtype=torch.long) for e in episodes], padding_value=pad_id).to(device)
    counts = {k: pad([torch.tensor(vars(e)[k]) for e in episodes]) for k in ("mask", "vllm_logprobs", "turn_rewards")}
    counts |= {k: torch.tensor([vars(e)[k] for e in episodes]) for k in ("tool_calls", "tool_failures", "turns")}
    counts |= {k: torch.tensor([e.outcome == k for e in episodes]) for k in ("ended", "cut_on_call")}
    counts["messages"], lengths = [e.messages for e in episodes], torch.tensor([len(e.ids) for e in episodes])
    return padded_batch(inputs, responses, counts.pop("mask"), lengths, **counts)


def end_turn(episode, length, room, tokenizer, args, eos_ids):
    """The outcome of an episode that has just sampled `length` tokens of `room`: None (it goes on), or why it is done.
    A turn's calls get their results (mask 0); what they append to the environment's turn_rewards is its reward."""
    e, left = episode, args.max_new_tokens - len(episode.ids)
    turn_ended = length > 0 and e.ids[-1] in eos_ids  # none: a stop before its first token
    if not turn_ended and length == room and left:  # it filled the room: the turn goes on in the next generate_turn()
        return None
    if not turn_ended:  # a stop came (neither an end nor a full room), or no room is left: the turn as it is
        e.messages = e.messages + [{"role": "assistant", "content": tokenizer.decode(e.ids[e.turn_start :])}]
        return "stopped" if length < room else "no_room"
    message = parse_turn(tokenizer, e.prompt + e.ids, len(e.ids) - e.turn_start, e.tools)
    calls = message["tool_calls"]  # the failed ones as their reasons, which the message leaves out
    e.messages = e.messages + [message | {"tool_calls": [call for call in calls if isinstance(call, dict)]}]
    if not calls:  # a turn without a call
        return "ended"
    if e.turns > args.max_tool_calls:  # a call past --max-tool-calls
        return "cut_on_call"
    before = len(getattr(e.environment, "turn_rewards", ()))
    result, failed, messages = run_tools(tokenizer, e.tools, calls, args.tool_timeout, eos_ids, left)
    e.tool_calls, e.tool_failures = e.tool_calls + len(calls), e.tool_failures + failed
    appended = list(getattr(e.environment, "turn_rewards", ()))[before:]  # this turn's calls' rewards
    e.turn_rewards[-1] += math.fsum(finite_scores(appended, "--environment's turn_rewards", appended))
    if result is None or len(result) > left:  # a stop during the calls, or results that do not fit
        return "cut_on_call"
    zeros = [0.0] * len(result)
    e.ids, e.mask, e.turn_start, e.turns = e.ids + result, e.mask + zeros, len(e.ids) + len(result), e.turns + 1
    e.vllm_logprobs, e.turn_rewards, e.messages = e.vllm_logprobs + zeros, e.turn_rewards + zeros, e.messages + messages
    return None if len(result) < left else "no_room"


def tool_metrics(batch):
    """tools/* (docs/ppo_llm.md#metrics): TRL's call and failure frequencies and ours, over every rank."""
    counts = [len(batch["turns"]), batch["tool_calls"].sum(), batch["tool_failures"].sum(), batch["turns"].sum()]
    counts += [batch["lengths"].sum(), batch["cut_on_call"].sum()]
    n, calls, failures, turns, tokens, cut = all_reduce(torch.tensor([float(c) for c in counts]).double()).tolist()
    frequencies = {"tools/call_frequency": calls / n, "tools/failure_frequency": failures / max(calls, 1)}
    return frequencies | {
        "tools/mean_turns": turns / n,
        "tools/mean_length": tokens / n,
        "tools/cut_off_ratio": cut / n,
    }


def load_prompts(args, tokenizer, tools=None, flag=None):
    """--dataset's (or flag's: eval_rows') rows: the prompt the policy sees, answer or None, messages, columns, row."""
    flag = flag or f"--dataset {args.dataset}"
    datasets.disable_progress_bars()
    file_format = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}.get(args.dataset.split(".")[-1])
    hub = dict(path=args.dataset, name=args.dataset_config, split=args.dataset_split)
    source = dict(path=file_format, data_files=args.dataset, split="train") if file_format else hub
    try:  # read whole: a byte that is not UTF-8 fails as the rows are read
        data = datasets.load_dataset(**source).to_list()
    except Exception as e:  # datasets' own error, often wrapping the reader's
        cause = e.__cause__ or e
        why = f"{type(cause).__name__}: {(str(cause).strip() or 'no rows').splitlines()[0]}"
        hint = "" if file_format else "; a hub dataset needs the network, a local file does not"
        raise SystemExit(f"error: {flag} could not be loaded ({why}){hint}") from None
    rows = []
    for i, row in enumerate(data, 1):
        prompt, answer = row.get(args.prompt_column), row.get(args.answer_column)
        if prompt in (None, ""):  # nothing to generate from
            columns = ", ".join(k for k, v in row.items() if v not in (None, ""))
            raise SystemExit(f"error: {flag}: row {i} has no --prompt-column {args.prompt_column} (columns: {columns})")
        if isinstance(answer, float) and answer.is_integer():  # a CSV column with a gap is read as floats: 2.0 is "2"
            answer = int(answer)
        if answer is not None:
            answer = row[args.answer_column] = str(answer)
        text, messages = prompt, None
        if not isinstance(prompt, str) or args.chat_template or args.system_prompt is not None or tools:  # a chat
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            if not (isinstance(messages, list) and messages and all({"role", "content"} <= set(m) for m in messages)):
                why = "the prompt is neither a string nor a list of {role, content} messages"
                raise SystemExit(f"error: {flag}, row {i}: {why}")
            if args.system_prompt is not None and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": args.system_prompt}] + messages
            if tokenizer.chat_template is None:
                needs = "conversational prompts, --chat-template and --system-prompt need"
                raise SystemExit(f"error: --model {args.model}: its tokenizer has no chat template, which {needs}")
            functions = list((tools or {}).values()) or None  # the tools the template describes, if any
            text = tokenizer.apply_chat_template(messages, functions, tokenize=False, add_generation_prompt=True)
        columns = {"prompts": prompt} | {k: v for k, v in row.items() if k != args.prompt_column}  # TRL's keywords
        rows.append({"prompt": text, "answer": answer, "messages": messages, "columns": columns, "row": row})
    missing = [i for i, row in enumerate(rows, 1) if row["answer"] is None]
    if missing and ({"arithmetic", "gsm8k"} & set(reward_fn_names(args)) or len(missing) < len(rows)):  # these read it
        why = f"row {missing[0]} has no --answer-column {args.answer_column}, which the reward function needs"
        raise SystemExit(f"error: {flag}: {why}")
    return rows


def prompt_stream(rows, seed, start, rank, world):
    """The rows reshuffled every pass (seeded), from the start-th (a resumed run's), every world-th from rank's on."""
    rng = random.Random(seed)
    stream = (row for _ in itertools.count() for row in rng.sample(rows, len(rows)))
    return itertools.islice(stream, start + rank, None, world)


def eval_rows(args, tokenizer, reward_fns, tools=None):
    """The first --eval-size distinct prompts of --eval-split (unset: test.jsonl beside train.jsonl), or None, why."""
    split, beside = args.eval_split, args.dataset.removesuffix("train.jsonl") + "test.jsonl"
    flag = f"--eval-split {split}"
    if split is None and args.dataset.endswith("train.jsonl") and os.path.isfile(beside):
        split, flag = beside, f"--eval-split {beside}, found beside {args.dataset},"
    if split is None and args.eval_only:
        split, flag = args.dataset_split, None  # --dataset's own rows
    if split is None or not reward_fns or not (args.eval_every or args.eval_only):
        why = "no --eval-split given or found beside --dataset" if split is None else "no reward function to score it"
        if args.eval_every and not args.eval_only:
            print(f"note: no held-out evaluation (--eval-every {args.eval_every}): {why}")
        return None
    source = {"dataset": split} if os.path.isfile(split) else {"dataset_split": split}
    rows = load_prompts(Args(**asdict(args) | source), tokenizer, tools, flag)
    distinct = {json.dumps(row["row"], default=str) if args.environment else row["prompt"]: row for row in rows}
    return list(distinct.values())[: args.eval_size]  # an environment's rows share a prompt, and differ in columns


def from_pretrained(cls, name, flag, **kwargs):
    """cls.from_pretrained(name), with a one-line error for a directory without a model or an unreachable hub id."""
    try:
        return cls.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        where = "holds no model it can load" if os.path.isdir(name) else "is no directory, nor reachable on the hub"
        offline = "assets/arith-rm" if flag == "--reward-model" else "assets/arith-sft"  # the embedded models
        hint = f"a hub id needs the network (with HF_HUB_OFFLINE=1, the cache alone); offline: {offline}"
        if name.startswith("assets/"):  # a copy of the script, without the repository's assets/
            hint = "the embedded models ship in the repository's assets/: give --model (hub id or directory), --dataset"
        raise SystemExit(f"error: {flag} {name} {where} ({type(e).__name__}); {hint}") from None


def load_model(cls, name, flag, dtype=torch.float32, bf16=False):
    """Dropout 0, in the config and every nn.Dropout (detail 6); an adapter on its base (LoRA). In fp32, or "auto": the
    checkpoint's dtype, fp16 read as bf16 (autocast's) or fp32. Under torchrun rank 0 alone reads weights (place())."""
    adapter = os.path.join(name, "adapter_config.json")
    base = json.load(open(adapter))["base_model_name_or_path"] if os.path.isfile(adapter) else name
    config = from_pretrained(AutoConfig, base, flag)
    if dtype == "auto" and config.dtype == torch.float16:
        dtype = torch.bfloat16 if bf16 else torch.float32
        print(f"note: {flag} {name} is float16, which would train without loss scaling: read as {str(dtype)[6:]}")
    config.update({k: 0.0 for k, v in config.to_dict().items() if isinstance(v, float) and "drop" in k})
    meta = dist.is_initialized() and dist.get_rank() > 0
    model = from_pretrained(cls, name, flag, config=config, dtype=dtype, device_map="meta" if meta else None)
    for module in [m for m in model.modules() if isinstance(m, nn.Dropout)]:  # for models that hard-code one
        module.p = 0.0
    return model


def add_lora(model, args):
    """peft's LoRA: fp32 adapters, B = 0 at start, on the frozen base: with its adapters off, the initial policy."""
    try:
        import peft  # optional: only LoRA runs need it
    except ImportError:
        raise SystemExit("error: --lora-r needs peft, which is not installed: pip install peft") from None
    targets = list(args.lora_target_modules or []) or "all-linear"  # all-linear leaves out the LM head
    task_type = "CAUSAL_LM" if model.get_output_embeddings() is not None else None
    config = peft.LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules=targets, task_type=task_type)
    try:
        model = peft.get_peft_model(model, config)
    except ValueError as e:  # no module matches
        linear = {n.split(".")[-1] for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")}
        why = f"{str(e).split('. ')[0]} (the model's linear layers: {' '.join(sorted(linear - {'lm_head'}))})"
        raise SystemExit(f"error: --lora-target-modules {' '.join(targets)}: {why}") from None
    if hasattr(model.get_output_embeddings(), "lora_A"):
        raise SystemExit("error: --lora-target-modules: not the LM head, whose adapters would never train (detail 7)")
    return model


def add_pad_token(tokenizer, models, eos_ids=()):
    """A pad token that ends no response (Qwen2.5's is an EOS id); the embeddings grown to the tokenizer, not shrunk."""
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id in {tokenizer.eos_token_id, *eos_ids}:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
        print(f"note: the tokenizer had no pad token distinct from EOS; added [PAD] (id {tokenizer.pad_token_id})")
    for model in models:
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:  # a meta model's new rows come from rank 0
            model.resize_token_embeddings(len(tokenizer), mean_resizing=model.device.type != "meta")
        model.config.pad_token_id = tokenizer.pad_token_id


def end_of_response_ids(tokenizer, generation_config):
    """Detail 2: the ids that end a response: the tokenizer's EOS, the generation_config's, and the special tokens that
    the chat template writes (its turn markers: a base model's config names its EOS alone, not its end of turn)."""
    configured = generation_config.eos_token_id  # None, an id or a list of them
    configured = [configured] if isinstance(configured, int) else configured or []
    turns = {t for t in tokenizer.all_special_tokens if t in str(tokenizer.chat_template or "")}
    turns -= {tokenizer.bos_token, tokenizer.pad_token, tokenizer.unk_token}  # a template starts with the BOS
    return sorted({tokenizer.eos_token_id, *configured} | set(tokenizer.convert_tokens_to_ids(sorted(turns))))


def tokenize_texts(tokenizer, texts, max_length):
    """Padded ids, cut on the left to max_length (a prompt keeps its assistant header); no second BOS."""
    has_bos = bool(tokenizer.bos_token) and all(text.startswith(tokenizer.bos_token) for text in texts)
    options = dict(padding=True, truncation=max_length is not None, max_length=max_length, return_tensors="pt")
    return tokenizer(texts, add_special_tokens=not has_bos, **options)


def rm_text(rm_tokenizer, row, turns):
    """What a reward model with its own tokenizer reads: the conversation, through its chat template if any (TRL's)."""
    if rm_tokenizer.chat_template is None:  # the contents, each call as its JSON
        calls = [[json.dumps(call["function"]) for call in turn.get("tool_calls") or []] for turn in turns]
        return row["prompt"] + "".join(turn["content"] + "".join(c) for turn, c in zip(turns, calls))
    messages = row["messages"] or [{"role": "user", "content": row["prompt"]}]
    return rm_tokenizer.apply_chat_template(messages + turns, tokenize=False)


def reward_model_scores(reward_model, rm_tokenizer, batch, rows, conversations, args):
    """Each sequence's score (B,) at its last real token: of the policy's ids (rm_tokenizer None), else of rm_text's."""
    if rm_tokenizer is None:
        mask = batch["attention_mask"]
        inputs = dict(input_ids=batch["query_responses"], attention_mask=mask, position_ids=position_ids(mask))
    else:
        context = min(rm_tokenizer.model_max_length, reward_model.config.max_position_embeddings)
        texts = [rm_text(rm_tokenizer, row, turns) for row, turns in zip(rows, conversations)]
        inputs = tokenize_texts(rm_tokenizer, texts, context).to(reward_model.device)
    n = args.micro_batch_size
    with scoring(reward_model):
        logits = [reward_model(**{k: v[i : i + n] for k, v in inputs.items()}).logits for i in range(0, len(rows), n)]
    scores = torch.cat(logits)[:, args.reward_label or 0].float()
    on_every_rank(lambda: finite_scores(scores.tolist(), f"--reward-model {args.reward_model}", conversations))
    return scores


def load_models(args, device, tools=None):
    """(tokenizer, policy, frozen reward model or None, its tokenizer or None when it reads the policy's ids) on the
    device; under torchrun sharded as each loads (rank 0 holds one whole model at a time); --tools' template checked."""
    bf16 = uses_bf16(args)
    policy = load_model(AutoModelForCausalLM, args.model, "--model", "auto" if args.lora_r else torch.float32, bf16)
    weights = f"{str(policy.dtype)[6:]} base weights, fp32 adapters" if args.lora_r else "fp32 weights"
    print(f"device: {device.type}, {weights}" + (", bf16 autocast" if bf16 else ""))
    tokenizer = from_pretrained(AutoTokenizer, args.model, "--model", padding_side="left", truncation_side="left")
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"error: --model {args.model}: the tokenizer has no EOS token, so no response could end")
    model_defaults(args, policy)
    eos_ids = end_of_response_ids(tokenizer, policy.generation_config)
    reward_model = rm_tokenizer = None
    if args.reward_model is not None:
        reward_model = load_model(AutoModelForSequenceClassification, args.reward_model, "--reward-model", "auto", bf16)
        n = reward_model.config.num_labels
        if args.reward_label not in range(n) and not (args.reward_label is None and n == 1):
            why = f"--reward-label (0 to {n - 1}) chooses the logit that is the score (got {args.reward_label})"
            raise SystemExit(f"error: --reward-model {args.reward_model} has num_labels={n}: {why}")
        rm_tokenizer = from_pretrained(AutoTokenizer, args.reward_model, "--reward-model", truncation_side="left")
        if rm_tokenizer.get_vocab() == tokenizer.get_vocab():  # it reads the policy's ids: no decoding and encoding
            rm_tokenizer = None
            add_pad_token(tokenizer, [reward_model], eos_ids)
        else:
            add_pad_token(rm_tokenizer, [reward_model])
        reward_model = place(reward_model.eval().requires_grad_(False), device, bf16)
    add_pad_token(tokenizer, [policy], eos_ids)
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0)  # detail 4: softmax(logits / T)
    ends = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos_ids)
    policy.generation_config = transformers.GenerationConfig(**sampling, **ends)  # all ours, none of the checkpoint's
    if tools:
        setup_tool_parsing(tokenizer, tools, eos_ids, args.model)
    if args.lora_r:
        policy = add_lora(policy, args)
    error = 0.0  # refuse a model whose logits the LM head does not reproduce: rank 0 holds the weights
    if not dist.is_initialized() or dist.get_rank() == 0:
        with torch.no_grad():
            ids = torch.arange(1, 9)[None] % len(tokenizer)
            hidden = hidden_states(policy, ids, torch.ones_like(ids), 1)
            got, _ = lm_head_logprobs(hidden, policy, ids[:, 1:], 1.0, fp32=False)  # the matmul in the model's dtype
            want = torch.log_softmax(policy(input_ids=ids).logits[0, :-1].float(), -1)[torch.arange(7), ids[0, 1:]]
        error = (got[0] - want).abs().max().item()
    error = all_reduce(torch.tensor(error)).item()  # rank 0's verdict, on every rank
    policy = place(policy, device, bf16 and not args.lora_r)  # LoRA: FSDP's bf16 gathers fail its backward
    if error > 1e-3:
        why = f"its forward changes the logits in a way this script does not reproduce (log-probs {error:.3g} apart)"
        raise SystemExit(f"error: --model {args.model}: {why}")
    return tokenizer, policy, reward_model, rm_tokenizer


def model_defaults(args, policy):
    """The flags whose default depends on the model (Args says how), set in args: no other helper writes args."""
    if args.max_new_tokens is None:
        args.max_new_tokens = policy.generation_config.max_new_tokens or 8
    context = getattr(policy.config, "max_position_embeddings", 0)  # GPT-2's n_positions too
    max_prompt_length = args.max_prompt_length or (context - args.max_new_tokens if context else None)
    if context and (args.max_new_tokens >= context or max_prompt_length + args.max_new_tokens > context):
        flags = f"--max-new-tokens {args.max_new_tokens} and a prompt (--max-prompt-length {args.max_prompt_length})"
        raise SystemExit(f"error: {flags} do not fit the model's context of {context} tokens")
    args.max_prompt_length = max_prompt_length
    n_params = sum(p.numel() for p in policy.parameters())
    if args.learning_rate is None:
        args.learning_rate = 1e-4 if n_params < 50e6 else 1e-5
        print(f"learning rate {args.learning_rate:g}: the default for {n_params / 1e6:.1f}M parameters")


def last_hidden_state(model, inputs):
    """The trunk's output (B, T, H), kept by a hook in the model's own forward, not every layer's states at once."""
    if model.get_output_embeddings() is None:  # a trunk (AutoModel): PPO's critic
        return model(**inputs, use_cache=False).last_hidden_state
    kept = []
    with model.get_decoder().register_forward_hook(lambda module, args, out: kept.append(out.last_hidden_state)):
        model(**inputs, use_cache=False, logits_to_keep=1)
    return kept[0]


def lm_head_logprobs(hidden, model, labels, temperature, entropy_grad=False, fp32=True):
    """Log-probs of labels (B, T) and the entropies (B, T) of the next-token distributions, from the last hidden states
    (B, T, H) and the output embedding `head`, scaled (Cohere, Granite) and soft-capped (Gemma) as the model's forward
    does: z = softcap * tanh(scale * head(h) / softcap) / temperature (details 4, 7). In chunks of at most LM_HEAD_CHUNK
    logits, each under torch.utils.checkpoint: no chunk's logits outlive it, its backward computes them again. The
    entropy gets a gradient only with entropy_grad (a bonus): one for the logs alone would keep its recomputed logits
    until the backward ends. The matmul in fp32 (fp32=True) or autocast's dtype, the head cast once, not per chunk."""
    config, head = model.config, model.get_output_embeddings()
    scale = (getattr(config, "logit_scale", None) or 1.0) / (getattr(config, "logits_scaling", None) or 1.0)
    softcap, device_type = getattr(config, "final_logit_softcapping", None), hidden.device.type
    autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else head.weight.dtype
    dtype = torch.float32 if fp32 else autocast

    def logits(h, weight, bias):  # (N, H) -> (N, V) fp32: scaled, softcapped, divided by the temperature, in place
        z = F.linear(h.to(dtype), weight, bias).float()
        if softcap:  # tanh's backward reads its output: that product not in place
            return z.mul_(scale / softcap).tanh_() * (softcap / temperature)
        return z.mul_(scale / temperature)

    def chunk(h, y, weight, bias):  # (N, H), (N,) -> log p of y (N,), entropy (N,)
        with torch.autocast(device_type, enabled=False):
            logp = logits(h, weight, bias).log_softmax(-1)  # the logits are freed here: two chunk-sized tensors at most
            logprobs = logp.gather(-1, y[:, None])[:, 0]
            if entropy_grad and torch.is_grad_enabled():
                return logprobs, -(logp.exp() * logp).sum(-1)
            with torch.no_grad():  # for the logs: no recomputed tensors kept for a backward that never reads them
                return logprobs, -logp.exp().mul_(logp).sum(-1)

    weight, bias = head.weight.to(dtype), None if head.bias is None else head.bias.to(dtype)
    n = max(1, LM_HEAD_CHUNK // head.weight.shape[0])  # tokens per chunk
    hidden_chunks, label_chunks = hidden.flatten(0, 1).split(n), labels.flatten().split(n)  # (N, H), (N,) each
    chunks = [checkpoint(chunk, h, y, weight, bias, use_reentrant=False) for h, y in zip(hidden_chunks, label_chunks)]
    logprobs, entropy = zip(*chunks)
    return torch.cat(logprobs).view_as(labels), torch.cat(entropy).view_as(labels)


def shard(model, bf16=False):
    """FSDP2 (docs/scaling.md): each transformer block a unit, gathered for its forward and backward; the rest, root."""
    mp_policy = MixedPrecisionPolicy(**(dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else {}))
    blocks = getattr(model, "_no_split_modules", None) or ()  # transformers' names of its blocks
    for module in [m for m in model.modules() if type(m).__name__ in blocks]:
        fully_shard(module, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    if hasattr(model, "peft_config"):  # LoRA's generate() runs the inner model's forward, not its own: FSDP's hooks
        register_fsdp_forward_method(model, "generate")  # (a plain model's run in its forward, once a call)
    # transformers returns views (GPT-2's hidden states), which FSDP warns of; none is modified in place here
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def place(model, device, bf16=False):
    """The model on the device; under torchrun sharded, rank 0's weights sent one tensor at a time to the others."""
    if not dist.is_initialized():
        return model.to(device)
    weights = model.state_dict() if dist.get_rank() == 0 else {}
    shard(model, bf16)
    if dist.get_rank():
        model.to_empty(device=device)  # the other ranks' models are on the meta device
    options = dsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    dsd.set_model_state_dict(model, weights, options=options)
    for buffer in model.buffers():  # in no state dict (inv_freq)
        dist.broadcast(buffer, src=0)
    return model


def frozen_copy(model, device, bf16):
    """A copy of the policy that never trains (the reference); under torchrun sharded alike, filled from its shards."""
    if not dist.is_initialized():
        copied = copy.deepcopy(model)
    else:
        with torch.device("meta"):
            copied = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
        shard(copied, bf16)
        copied.to_empty(device=device)
        copied.load_state_dict(model.state_dict())
        for buffer, source in zip(copied.buffers(), model.buffers()):
            buffer.copy_(source)
    copied.eval().requires_grad_(False)
    copied.train = lambda mode=True: copied  # models.train() leaves it in eval mode
    return copied


def load_teacher(args, device, held_out):
    """(--teacher, a causal LM frozen and loaded as the reward model is; its held-out accuracy once) or (None, {})."""
    if args.teacher is None:
        return None, {}
    flag, (policy, tokenizer, problems) = f"error: --teacher {args.teacher}", held_out[:3]
    added = {"[PAD]": tokenizer.pad_token_id}  # the pad token add_pad_token may have given the policy's tokenizer
    if from_pretrained(AutoTokenizer, args.teacher, "--teacher").get_vocab() | added != tokenizer.get_vocab() | added:
        raise SystemExit(f"{flag}: its vocabulary is not --model's, whose ids it must score")  # not its vocab_size
    teacher = load_model(AutoModelForCausalLM, args.teacher, "--teacher", "auto", uses_bf16(args))
    if getattr(teacher.config, "max_position_embeddings", math.inf) < args.max_prompt_length + args.max_new_tokens:
        raise SystemExit(f"{flag}: its context is shorter than --max-prompt-length + --max-new-tokens")
    add_pad_token(tokenizer, [teacher])
    teacher.generation_config = copy.deepcopy(policy.generation_config)  # detail 4's sampling, the policy's
    teacher = place(teacher.eval().requires_grad_(False), device, uses_bf16(args))
    if problems is None or args.resume:
        return teacher, {}
    with torch.random.fork_rng():  # the student's evaluation at update 0 samples as it would without it
        accuracy = evaluate(teacher, *held_out[1:4], replace(args, vllm=False), *held_out[5:])["eval/accuracy"]
    return teacher, {"distill/teacher_accuracy": accuracy}


@contextlib.contextmanager
def unsharded(model):
    """Under torchrun, the model whole on every rank for a while: one all-gather a rollout, not one a token."""
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in sharded:
        module.unshard()
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for module in sharded:
            module.reshard()
            module.set_reshard_after_forward(module is not model, recurse=False)  # FSDP's default: not the root


@contextlib.contextmanager
def scoring(model, adapters_off=False):
    """A no-grad pass, the model gathered once under torchrun (not once a micro-batch), LoRA's adapters off or not."""
    adapters = model.disable_adapter() if adapters_off else contextlib.nullcontext()
    with torch.no_grad(), adapters, unsharded(model):
        yield


def prepare(args, trained):
    """Gradient checkpointing, torch's threads, AdamW over the trained weights: (params, optimizer)."""
    trained = [model for model in trained if model is not None]
    for model in [m for m in trained if args.gradient_checkpointing and hasattr(m, "config")]:  # HF's, in train mode
        enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)  # < 5.20
        enable({"use_reentrant": False})  # reentrant can leave LoRA with no gradient
    if trained[0].device.type == "cpu" and sum(p.numel() for p in trained[0].parameters()) < 50e6:
        torch.set_num_threads(1)  # measured faster for small models on 2 shared cores
    params = [p for model in trained for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, eps=1e-5, weight_decay=args.weight_decay, fused=True)
    optimizer.register_step_post_hook(lambda *_: PUSHED.clear())  # after a step the engine's weights are old
    return params, optimizer


def start_vllm(args, policy, prompt_length):
    """--vllm: a vLLM engine in this process (docs/scaling.md), the policy's config, dtype, weights (vllm_pushed), for
    prompt_length + --max-new-tokens tokens its KV cache must hold (else one line); it seeds python, numpy, torch."""
    config, cuda = policy.config, policy.device.type == "cuda"
    dtype, flag = torch.bfloat16 if uses_bf16(args) else policy.dtype, "--vllm-kv-cache-gb"
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    length, cache = prompt_length + args.max_new_tokens, args.vllm_kv_cache_gb * 2**30
    options = dict(kv_cache_memory_bytes=int(cache))
    if cuda:  # asleep but in rollouts (vllm_pushed); its KV cache gets at most its share of the GPU, less its weights
        options = dict(gpu_memory_utilization=args.vllm_gpu_memory_utilization, enable_sleep_mode=True)
        share, flag = args.vllm_gpu_memory_utilization * torch.cuda.mem_get_info()[1], "--vllm-gpu-memory-utilization"
        cache = share - policy.num_parameters() * dtype.itemsize
    if 2 * config.num_hidden_layers * kv_heads * head_size * dtype.itemsize * length > cache:  # keys and values
        why = f"{length} tokens (the longest prompt, --max-new-tokens) need more KV cache than {cache / 2**30:.2f} GiB"
        raise SystemExit(f"error: --vllm: {why}: lower --max-prompt-length or raise {flag}")
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="ERROR")  # in this process; quiet
    import vllm

    cpu = None if cuda else importlib.import_module("vllm.v1.attention.backends.cpu_attn")  # imported on a CPU alone
    served = cpu.CPUAttentionBackend.get_supported_head_sizes() if cpu else []  # a CPU's attention: some head sizes
    if not cuda and head_size not in served:
        why = f"head size {head_size}, which vLLM's CPU attention does not serve ({served}); a GPU's does"
        raise SystemExit(f"error: --vllm: --model {args.model} has {why}")
    if not set(config.architectures or []) & set(vllm.ModelRegistry.get_supported_archs()):
        raise SystemExit(f"error: --vllm: vLLM cannot load --model {args.model} ({config.architectures})")
    options["distributed_executor_backend"] = "external_launcher" if TORCHRUN else None  # TRL's colocate mode
    options |= dict(load_format="dummy", seed=args.seed, skip_tokenizer_init=True, enforce_eager=True)
    options |= dict(logprobs_mode="processed_logprobs", max_model_len=length)
    with tempfile.TemporaryDirectory() as path:
        config.save_pretrained(path)
        VLLM[:] = [vllm.LLM(path, dtype=dtype, **options)]


@contextlib.contextmanager
def vllm_pushed(policy, enabled=True):
    """--vllm: the policy's weights into the engine unless it holds them (PUSHED); a GPU's sleeps outside rollouts."""
    if enabled and VLLM[0].llm_engine.is_sleeping():  # on a GPU, since the last rollout
        VLLM[0].wake_up(tags=["weights"])
    if enabled and PUSHED != VLLM:  # no push since the engine started, the last optimizer step or the last sleep
        VLLM[0].collective_rpc("reload_weights", kwargs=dict(weights_iterator=pushed_weights(policy)))
        VLLM[0].reset_prefix_cache()
        PUSHED[:] = VLLM
    if enabled and VLLM[0].llm_engine.is_sleeping():  # the KV cache is still asleep
        VLLM[0].wake_up(tags=["kv_cache"])
    yield
    if enabled and policy.device.type == "cuda":  # level 2 keeps no copy of the weights: the next rollout pushes them
        VLLM[0].sleep(level=2)
        PUSHED.clear()


def pushed_weights(policy):
    """The policy's weights a tensor at a time, named as in the checkpoint (a tied LM head too)."""
    model = policy.get_base_model() if hasattr(policy, "peft_config") else policy
    lora = {f"{n}.weight": m for n, m in model.named_modules() if hasattr(m, "get_delta_weight")}  # LoRA layers
    for name, weight in model.state_dict().items():
        name = name.replace(".base_layer.", ".")
        if name in lora:  # the LoRA merge: W + (alpha / r) B A, its adapters as they are
            weight = weight + lora[name].get_delta_weight("default")
        if ".lora_" not in name:  # an adapter is in its layer's merged weight
            yield name, weight.full_tensor() if isinstance(weight, DTensor) else weight  # the FSDP gather


def vllm_metrics(batch):
    """vllm/logprob_diff_max and _mean: |the engine's log-prob - the trainer's| over the policy's tokens, all ranks'."""
    diff = (batch["old_logprobs"] - batch["vllm_logprobs"]).abs()[batch["mask"].bool()]
    metrics = {"vllm/logprob_diff_max": diff.max().item(), "vllm/logprob_diff_mean": diff.mean().item()}
    return global_metrics(metrics, {"vllm/logprob_diff_max": "max"})


# TRY NOT TO MODIFY: set-up, seeding, the run directory, logging, evaluation


def check_range(args, rule, names):
    """One line for the first flag of `names` that breaks the rule; unset (None) passes, NaN and inf do not."""
    rules = {">= 0": lambda x: x >= 0, ">= 1": lambda x: x >= 1, ">= 2": lambda x: x >= 2, "> 0": lambda x: x > 0}
    rules |= {"in [0, 1]": lambda x: 0 <= x <= 1, "in (0, 1)": lambda x: 0 < x < 1, "in (0, 1]": lambda x: 0 < x <= 1}
    rules |= {"finite": lambda x: True}  # what every rule asks of a number
    for name in names.split():
        value = getattr(args, name)
        values = value if isinstance(value, tuple) else (value,)
        if value is not None and not all(math.isfinite(x) and rules[rule](x) for x in values):
            raise SystemExit(f"error: --{name.replace('_', '-')} must be {rule} (got {value})")


def check_run(args, world):
    """Both scripts' checks: the run directory writable (nothing is created), the split, the processes, LoRA's flags."""
    check_range(args, "> 0", "reward_timeout tool_timeout vllm_kv_cache_gb vllm_importance_sampling_clip_max")
    check_range(args, "in (0, 1]", "vllm_gpu_memory_utilization")
    flag, path = ("--resume", args.resume) if args.resume else ("--output-dir", args.output_dir)
    existing = os.path.abspath(path)
    while not os.path.exists(existing):  # where makedirs would start
        existing = os.path.dirname(existing)
    try:  # a file there fails too, as NotADirectoryError
        if not args.eval_only:
            tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise SystemExit(f"error: {flag} {path}: not a directory this run can write ({reason(e)})") from None
    split = args.eval_split if args.dataset_split == "train" and args.eval_split else args.dataset_split
    no_split = os.path.isfile(args.dataset) and split != "train" and not os.path.isfile(split)
    rm_alone = args.eval_only and args.reward_model and not args.reward_fn  # with --environment, get_reward scores
    for bad, message in [
        (no_split, f"--dataset {args.dataset} is a file, with no split {split}: --eval-split FILE instead"),
        (args.prompts_per_update % world, f"{world} processes must divide --prompts-per-update"),
        (args.save_merged and not args.lora_r, "--save-merged needs --lora-r: without LoRA the policy is a full model"),
        (rm_alone, "--eval-only beside --reward-model needs a --reward-fn"),
        (args.vllm and not importlib.util.find_spec("vllm"), "--vllm needs vLLM: its venv is in the README"),
        (args.vllm and args.eval_only, "--vllm does not run --eval-only yet: evaluate without it"),
    ]:
        if bad:
            raise SystemExit(f"error: {message}")


def all_reduce(x, op=dist.ReduceOp.SUM):
    """The tensor x summed (or op's: its max) over the torchrun ranks; x itself in one process."""
    if not TORCHRUN:
        return x
    y = x.detach().to("cuda" if dist.get_backend() == "nccl" else "cpu", copy=True)
    dist.all_reduce(y, op)
    return y.to(x.device)


def global_mean(values):
    """Mean of the scalar tensors in every rank's list, pooled (not a mean of means), NaNs (0 / 0 token means) out."""
    x = torch.stack(values).double()
    total, count = all_reduce(torch.stack([x.nansum(), (~x.isnan()).sum().double()])).tolist()
    return total / count


def uses_bf16(args):
    """--mixed-precision: bf16 autocast over fp32 weights (auto: on a GPU that runs bf16 natively, not a T4 or V100)."""
    native = args.cuda and torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return args.mixed_precision == "bf16" or (args.mixed_precision == "auto" and native)


def setup(args):
    """torchrun's process group (rank 0 alone prints), seeds, device, autocast: ((rank, world), device, autocast)."""
    cuda = args.cuda and torch.cuda.is_available()
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # an hour's timeout: rank 0 may load or merge a 70B model alone
        gpu = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else None
        if cuda:
            torch.cuda.set_device(gpu)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=1), device_id=gpu)
        TORCHRUN.append(True)
        if dist.get_rank():
            sys.stdout = open(os.devnull, "w")
    transformers.utils.logging.disable_progress_bar()
    # a false alarm (docs/grpo_llm.md): generate() drops an all-ones mask, and a finished response's next input is pad
    padding = "We strongly recommend passing in an `attention_mask` since your input_ids may be padded"
    transformers.modeling_utils.logger.addFilter(lambda record: padding not in record.getMessage())
    transformers.set_seed(args.seed)  # python's random, numpy, torch
    device = torch.device("cuda" if cuda else "cpu")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return (rank, world), device, torch.autocast(device.type, dtype=torch.bfloat16, enabled=uses_bf16(args))


def parse_args(argv=None):
    """The flags, with --resume RUN_DIR's args.json as their defaults; an assets/ path not here is the script's own."""
    args = tyro.cli(Args, args=argv)
    if args.resume is not None:
        try:
            with open(os.path.join(args.resume, "args.json")) as f:
                saved = {k: tuple(v) if isinstance(v, list) else v for k, v in json.load(f).items()}
        except (OSError, ValueError, AttributeError) as e:  # no such file, a damaged one, or no {flag: value} object
            raise SystemExit(f"error: --resume {args.resume}: args.json unreadable ({type(e).__name__}: {e})") from None
        script = saved.get("script", os.path.basename(__file__))
        if script != os.path.basename(__file__):
            go_on = f"python {script} --resume {args.resume} goes on with it"
            raise SystemExit(f"error: --resume {args.resume} is a run of {script}: {go_on}")
        saved = {f.name: saved[f.name] for f in fields(Args) if f.name in saved} | {"resume": args.resume}
        args = tyro.cli(Args, args=argv, default=Args(**saved))
    here = os.path.dirname(os.path.abspath(__file__))
    for name in ["model", "reward_model", "dataset", "eval_split"]:  # the embedded ones, run from elsewhere
        path = getattr(args, name) or ""
        if path.startswith("assets/") and not os.path.exists(path) and os.path.exists(os.path.join(here, path)):
            setattr(args, name, os.path.join(here, path))
    return args


def own_run(args, rank):
    """The run directory, the same on every rank, locked by rank 0 before anything in it is written (flock on `lock`,
    which its owner's end frees, killed or not): a second process refuses, every rank together; no locks: a warning."""
    run_dir = args.resume or os.path.join(args.output_dir, f"{args.exp_name}__{args.seed}__{int(time.time() * 1000)}")
    verdict = [run_dir, None]  # rank 0's run directory and refusal
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        fd = os.open(os.path.join(run_dir, "lock"), os.O_RDWR | os.O_CREAT)
        LOCK.callback(os.close, fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # not lockf: any close of the file in the process drops it
            os.ftruncate(fd, os.pwrite(fd, f"process {os.getpid()} on {os.uname().nodename}".encode(), 0))
        except BlockingIOError:
            verdict[1] = f"error: {run_dir} is in use by {os.pread(fd, 99, 0).decode()} (one process at a time)"
        except OSError as e:
            print(f"warning: {run_dir} is not locked ({reason(e)}): run one process at a time in it", file=sys.stderr)
    if dist.is_initialized():
        dist.broadcast_object_list(verdict)
    if verdict[1]:
        raise SystemExit(verdict[1])
    return verdict[0]


def start_run(args, given, models, optimizer, tokenizer, tools, held_out):
    """The engine, the run directory, its checkpoint, args.json, wandb: (resumed state, prompts, run_dir, writer)."""
    ranks = (dist.get_rank(), dist.get_world_size()) if TORCHRUN else (0, 1)
    rows = load_prompts(args, tokenizer, tools=tools)
    if args.vllm:  # after prepare() set torch's threads, and before the run directory, which a refusal leaves none of
        ids = tokenizer([row["prompt"] for row in rows + (held_out or [])], verbose=False).input_ids  # or a BOS more
        longest = min(max(map(len, ids)), args.max_prompt_length or math.inf)  # --environment's reset may lengthen one
        start_vllm(args, models["policy"], args.max_prompt_length if args.environment else longest)
    try:  # the run directory owned before its checkpoint is read, and freed again on a refusal
        run_dir = own_run(args, ranks[0])
        resumed = load_checkpoint(args, models, optimizer)
        update, writer = resumed.get("update", 0), None
        saved = {"script": os.path.basename(__file__), "wandb_id": None}
        if ranks[0] == 0 and update:  # resuming: the rows past the checkpoint go (a hard kill's, half-written ones too)
            for name in ["metrics.jsonl", "samples.jsonl"]:
                with open(os.path.join(run_dir, name)) as f:
                    kept = [line for line in f if line.endswith("\n") and json.loads(line)["update"] <= update]
                with open(os.path.join(run_dir, name), "w") as f:
                    f.writelines(kept)
        if ranks[0] == 0 and args.track:
            import wandb  # here: it is slow to import

            settings = dict(project=args.wandb_project_name, entity=args.wandb_entity, config=asdict(args), dir=run_dir)
            settings |= dict(name=os.path.basename(os.path.normpath(run_dir)), sync_tensorboard=True)
            if update:  # the same wandb run goes on
                settings |= dict(id=json.load(open(os.path.join(run_dir, "args.json"))).get("wandb_id"), resume="allow")
            saved["wandb_id"] = wandb.init(**settings).id
        if ranks[0] == 0:
            with open(os.path.join(run_dir, "args.json"), "w") as f:
                json.dump(given | saved, f, indent=1)
            writer = SummaryWriter(run_dir, purge_step=update + 1)  # and TensorBoard's events past it
    except BaseException:
        LOCK.close()
        raise
    return resumed, prompt_stream(rows, args.seed, update * args.prompts_per_update, *ranks), run_dir, writer


def log(writer, metrics, line, samples=()):
    """On rank 0: the progress line, metrics.jsonl and TensorBoard at step `update`, samples.jsonl and the screen."""
    if writer is None:
        return
    print(f"{line}  {eval_line(metrics)}" if "eval/accuracy" in metrics else line)
    try:
        for name, rows in [("metrics.jsonl", [metrics]), ("samples.jsonl", samples)]:
            with open(os.path.join(writer.log_dir, name), "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
    except OSError as e:  # a full disk, a directory gone
        raise SystemExit(f"error: {writer.log_dir}: the logs could not be written ({reason(e)})") from None
    for key in metrics.keys() - {"update"}:
        writer.add_scalar(key, metrics[key], metrics["update"])
    for sample in samples:
        values = "  ".join(f"{k} {v:.2f}" for k, v in sample.items() if isinstance(v, float))
        print(f"  {sample['prompt']!r} -> {sample['completion']!r}  {values}")


def samples_to_log(args, update, rows, completions, **values):
    """Every --sample-every updates (0: never), the first --num-samples rows: update, prompt, completion, values."""
    if not args.sample_every or update % args.sample_every:
        return []
    shown = range(min(args.num_samples, len(rows)))
    samples = [{"update": update, "prompt": rows[j]["prompt"], "completion": completions[j]} for j in shown]
    return [sample | {name: float(value[j]) for name, value in values.items()} for j, sample in enumerate(samples)]


def warn_truncated(share, args, scoring):
    """A line when half or more of an update's responses hit --max-new-tokens (a silent failure); again as it grows."""
    if share >= 0.5 and share > max(TRUNCATED, default=0):
        TRUNCATED.append(share)
        cut = f"--max-new-tokens {args.max_new_tokens}"  # a response cut off on its call ends in an EOS: not counted
        print(f"warning: {share:.0%} of this update's responses hit {cut}, scored on their cut text{scoring}")


def global_metrics(metrics, ops):
    """Each metric over every rank, in one gather: the ranks' mean (as many sequences each), or ops[key]'s ("max")."""
    if not dist.is_initialized():
        return metrics
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    values = torch.tensor([float(value) for value in metrics.values()], dtype=torch.float64, device=device)
    every = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(every, values)
    every = torch.stack(every).cpu()  # (ranks, metrics)
    reduced = {"sum": every.sum(0), "min": every.min(0).values, "max": every.max(0).values, None: every.mean(0)}
    return {key: type(value)(reduced[ops.get(key)][i].item()) for i, (key, value) in enumerate(metrics.items())}


def evaluate(policy, tokenizer, rows, reward_fns, args, autocast, batch_size, tools=None, environment=None):
    """n = --eval-num-generations samples of each held-out prompt at --eval-temperature (0: greedy), right when the
    first reward source scores them > 0: the eval/ metrics of docs/ppo_llm.md#evaluation. Under torchrun ranks take
    every world-th batch of prompts x samples, as many each (one short repeats the first, uncounted); a stop: {}."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    n, temperature = args.eval_num_generations, args.eval_temperature
    temperature = args.temperature if temperature is None else temperature
    sampling = {"temperature": temperature} if temperature else {"do_sample": False}  # greedy (temperature 0 raises)
    batches = [range(i, min(i + batch_size, len(rows) * n)) for i in range(0, len(rows) * n, batch_size)]  # samples
    batches += [None] * (-len(batches) % world)
    records, stop = [], [signalled]  # each sample's index, score, length, calls, failures, cut-offs, answer
    for chunk in batches[rank::world]:
        chunk_rows = [rows[s // n] for s in chunk or batches[0]]
        chunk_rows, envs = reset_environments(environment, chunk_rows, tokenizer, tools, args)
        prompts = [r["prompt"] for r in chunk_rows]
        batch = rollout(policy, tokenizer, prompts, args, autocast, stop, tools, envs, **sampling)
        if stop_requested():  # every rank, after each batch (each runs as many): a stopped evaluation is not logged
            return {}
        completions, transcripts, _ = decode_responses(tokenizer, batch)
        scores = on_every_rank(lambda: reward_fns[0](completions, chunk_rows, transcripts, envs) if chunk else [])
        if chunk is not None:  # a repeat of the first batch is not counted
            counts = batch["lengths"].float().tolist(), batch["tool_calls"].tolist(), batch["tool_failures"].tolist()
            cut = (~batch["ended"] & ~batch["cut_on_call"]).tolist(), batch["cut_on_call"].tolist()  # no EOS; on a call
            records += zip(chunk, scores, *counts, *cut, map(final_answer, completions))
    if dist.is_initialized():  # every rank's
        every_rank = [None] * world
        dist.all_gather_object(every_rank, records)
        records = [record for rank_records in every_rank for record in rank_records]
    _, scores, lengths, calls, failures, clipped, at_call, answers = zip(*sorted(records, key=lambda r: r[0]))
    right, lengths = torch.tensor(scores, dtype=torch.float64) > 0, torch.tensor(lengths)
    accuracy = right.double().view(-1, n).mean(1)  # each prompt's: pass@1
    metrics = {"eval/accuracy": accuracy.mean().item()}
    metrics["eval/accuracy_stderr"] = accuracy.std().nan_to_num().item() / len(accuracy) ** 0.5  # over n - 1
    metrics["eval/mean_reward"] = sum(scores) / len(scores)
    if not set(scores) <= {0.0, 1.0} and not PARTIAL:  # once a run
        PARTIAL.append(True)
        print("note: held-out scores are not all 0 or 1: eval/accuracy counts a response right when it scores > 0")
    if n > 1:
        for k in sorted({2**i for i in range(n.bit_length())} | {n}):
            metrics[f"eval/pass@{k}"] = sum(pass_at_k(n, c, k) for c in right.view(-1, n).sum(1).tolist()) / len(rows)
        if reward_fn_names(args)[:1] in [("arithmetic",), ("gsm8k",)]:  # a number to vote on, which final_answer reads
            references = [final_answer(row["answer"]) for row in rows]
            votes = [majority_vote(answers[i * n : (i + 1) * n]) for i in range(len(rows))]
            metrics[f"eval/maj@{n}"] = sum(map(operator.eq, votes, references)) / len(rows)
    metrics["eval/clipped_ratio"] = sum(clipped) / len(clipped)  # as completions/clipped_ratio: no EOS at the end
    if tools:  # TRL's tools/ metrics (tool_metrics) of the held-out responses
        metrics["eval/tools/call_frequency"] = sum(calls) / len(calls)
        metrics["eval/tools/failure_frequency"] = sum(failures) / max(sum(calls), 1)
        metrics["eval/tools/cut_off_ratio"] = sum(at_call) / len(at_call)  # past --max-tool-calls, or not fitting
    for name, chosen in [("right", right), ("wrong", ~right)]:
        if chosen.any():
            metrics[f"eval/mean_length_{name}"] = lengths[chosen].mean().item()
    cut_off = (sum(clipped) + sum(at_call)) / len(clipped)  # by --max-new-tokens, or on a call
    if cut_off >= 0.5:  # as warn_truncated's: a cut-off answer scores as wrong
        print(f"warning: {cut_off:.0%} of the held-out responses were cut off, scored as wrong")
    if args.eval_only:
        print(eval_line(metrics, table=(len(rows), n, temperature)))
    return metrics


def pass_at_k(n, c, k):
    """Unbiased pass@k (Chen et al. 2021) from n samples of which c are right: 1 - C(n - c, k) / C(n, k)."""
    return 1 - math.comb(n - c, k) / math.comb(n, k)


def majority_vote(answers):
    """maj@n's answer (Wang et al. 2023): the one most samples state, a tie to the earliest; None does not vote."""
    votes = [answer for answer in answers if answer is not None]
    return max(votes, key=votes.count, default=None)


def eval_line(metrics, table=None):
    """The held-out accuracy ± its standard error; with --eval-only's (prompts, n, temperature), the whole table."""
    line = f"held-out accuracy {metrics['eval/accuracy']:.3f} ± {metrics['eval/accuracy_stderr']:.3f}"
    if table is None:
        return line
    prompts, n, temperature = table
    sampled = f"temperature {temperature:g}" if temperature else "greedy"
    greedy = f"greedy: the {n} samples of a prompt are one, so pass@k and maj@{n} are pass@1 (--eval-temperature)\n"
    gap = f"; two evaluations of one policy differ by < {1.96 * 2**0.5 * metrics['eval/accuracy_stderr']:.3f}"
    rows = [f"  {key.removeprefix('eval/'):<28}{value:.3f}" for key, value in list(metrics.items())[2:]]
    title = f"{prompts} held-out prompts, {n} sample{'s' if n > 1 else ''} each, {sampled}:"
    text = "\n".join([title, f"{line} (pass@1{gap if temperature else ''})", *rows])
    return text if temperature or n == 1 else greedy + text


class Stopwatch:
    """An update's time/* by phase (the GPU's queued work done), its perf/* (docs: Metrics), the run's progress."""

    def __init__(self, device, first_update, total_steps):
        self.device, self.first, self.total, self.start = device, first_update, total_steps, time.time()

    def lap(self, phase=None):
        """time/<phase>, the seconds since the last lap; with no phase an update starts."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            if phase is None:
                torch.cuda.reset_peak_memory_stats()
        now = time.perf_counter()
        self.times = {} if phase is None else self.times | {f"time/{phase}": now - self.last}
        self.last = now

    def metrics(self, update, tokens):
        """time/* and perf/* of the update just timed, and its line's end: '(seconds so far, ETA)'."""
        seconds, elapsed = sum(self.times.values()), time.time() - self.start
        left = time.strftime("%H:%M:%S", time.gmtime(elapsed * (self.total - update) / (update - self.first)))
        peak_memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # ru_maxrss: KiB
        peak_memory = torch.cuda.max_memory_allocated() / 2**20 if self.device.type == "cuda" else peak_memory
        metrics = {"time/elapsed": elapsed, "perf/tokens_per_sec": tokens / seconds, "perf/peak_memory_mb": peak_memory}
        return self.times | metrics, f"{seconds:.2f}s  ({elapsed:.0f}s, ETA {left})"


def due(update, every, total_steps=None):
    """Every N updates (0: never) and the last (total_steps), not once a stop is requested; as every rank sees it."""
    return bool(every) and (update % every == 0 or update == total_steps) and not stop_requested()


# TRY NOT TO MODIFY: stops and checkpoints

STOP = []  # the signals received: Ctrl-C and SIGTERM (a preemption)
TORCHRUN = []  # [True] once setup() has joined torchrun's ranks (vLLM's engine makes a one-rank world of its own)
SAVING = []  # not empty while a checkpoint is gathered and written
LOCK = contextlib.ExitStack()  # the run directory's lock, held while this process owns the run: LOCK.close() frees it
VLLM = []  # --vllm's engine (start_vllm): generate_turn() samples with it instead of generate()
PUSHED = []  # the engine while it holds the policy's weights as they are, else empty (vllm_pushed)
TRUNCATED = []  # the shares of cut-off responses this run has warned of (warn_truncated)
PARTIAL = []  # whether this run has said what eval/accuracy counts when scores are not 0 or 1 (evaluate)


def on_signal(signum, frame):
    """A first Ctrl-C or SIGTERM stops after the update (stop_if_signalled), a second at once, not within a save."""
    if STOP and not SAVING:
        signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt: a second signal stops at once
    if STOP:
        print(f"{signal.Signals(signum).name}: the checkpoint being written is finished first", file=sys.stderr)
    STOP.append(signum)


def signalled(ids, scores, **kwargs):
    """generate()'s stopping criterion: every response ends at its next token once a Ctrl-C or SIGTERM has come."""
    return torch.full((len(ids),), bool(STOP), device=ids.device)


def stop_requested():
    """Whether any rank has had a Ctrl-C or SIGTERM: the same answer on every rank."""
    return all_reduce(torch.tensor(float(len(STOP)))).item() > 0


def stop_if_signalled():
    """KeyboardInterrupt on every rank once any is signalled; called after the rollout, before the update."""
    if stop_requested():
        raise KeyboardInterrupt(signal.Signals(STOP[0]).name if STOP else "another rank's signal")


class TimedOut(Exception):
    """A call ran past --reward-timeout or --tool-timeout; an Exception, so that on_every_rank stops every rank."""


class Stopped(Exception):
    """Ctrl-C or SIGTERM during a call under time_limit: the run stops now, as on TimedOut; never a failed call."""


@contextlib.contextmanager
def time_limit(seconds, what):
    """TimedOut(what) raised into the call past `seconds` (every second, should it catch it), Stopped on a signal."""

    def stop_call(signum, frame):
        if signum == signal.SIGALRM:
            raise TimedOut(f"{what} ran past {seconds:g} s")
        STOP.append(signum)  # the exit status: 128 + signum
        raise Stopped(f"{signal.Signals(signum).name} during {what}")

    previous = {signum: signal.signal(signum, stop_call) for signum in (signal.SIGALRM, signal.SIGINT, signal.SIGTERM)}
    signal.setitimer(signal.ITIMER_REAL, seconds, 1)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class EveryRank(Exception):
    """An error on one rank, raised on every rank at the same point, so that they stop and save together."""


def on_every_rank(fn):
    """fn()'s result; under torchrun an error on any rank stops every rank here (one alone cannot save the shards)."""
    try:
        result, error = fn(), None
    except (Exception, SystemExit) as e:
        result, error = None, e
    if not all_reduce(torch.tensor(float(error is not None))).item():
        return result
    if not TORCHRUN:
        raise error
    raise EveryRank(error or "another rank's error") from error


class SaveFailed(Exception):
    """checkpoint/ or policy/ could not be written (the OS's reason); an earlier checkpoint/ is whole."""


def reason(error):
    """'OSError: [Errno 28] No space left on device': the OSError behind an error (torch wraps it), else it."""
    cause = error
    while cause is not None and not isinstance(cause, OSError):
        if isinstance(cause, dcp.CheckpointException):  # each failed rank's (error, traceback)
            cause = next(iter(cause.failures.values()))[0]
        else:
            cause = cause.__cause__ or cause.__context__
    cause = cause or error
    return f"{type(cause).__name__}: {(str(cause).strip() or ' ').splitlines()[0]}"


def trained_state(models, optimizer):
    """What checkpoint/ holds: this rank's shards of the trained weights (not a LoRA base's) and of AdamW's state."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: no_dist, on purpose
    named = models.named_parameters(remove_duplicate=False)  # tied ones too
    frozen = {name for name, p in named if not (p.requires_grad or name.startswith("ref_policy."))}  # a LoRA base
    weights = {k: v for k, v in dsd.get_model_state_dict(models).items() if k not in frozen}
    return {"models": weights, "optimizer": dsd.get_optimizer_state_dict(models, optimizer)}


def crc32(path):
    """zlib's CRC-32 of a file, through mmap (no copy; 3x sha256's speed, docs/scaling.md): a flipped byte alters it."""
    with open(path, "rb") as f:  # mmap refuses an empty file, whose CRC-32 is 0
        return zlib.crc32(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)) if os.fstat(f.fileno()).st_size else 0


def save_checkpoint(run_dir, models, optimizer, state, tokenizer, merged=False):
    """checkpoint/, whole or not at all (else SaveFailed on every rank): the shards (torch.distributed.checkpoint),
    policy/, state.json and checksums.json (CRC-32s) go in the slot the link does not point to; then it does."""
    SAVING.append(True)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    link, slot, old = os.path.join(run_dir, "checkpoint"), "checkpoint.a", "checkpoint.b"
    if os.path.realpath(link).endswith(".a"):  # the slot in use stays whole until the link points to the other
        slot, old = old, slot
    path, failed, sums = os.path.join(run_dir, slot), None, None
    try:
        try:  # every rank reaches the gather below, whatever fails here
            if rank == 0:  # a failed save's, or a hard kill's (no rank writes before dcp.save's first collective)
                shutil.rmtree(path, ignore_errors=True)
            dcp.save(trained_state(models, optimizer), checkpoint_id=path, no_dist=not TORCHRUN)
            save_policy(os.path.join(path, "policy"), models, tokenizer, merged)
            names = [os.path.relpath(os.path.join(d, n), path) for d, _, ns in os.walk(path) for n in ns]
            mine = [n for n in names if n.startswith(f"__{rank}_") or (rank == 0 and not n.startswith("__"))]  # written
            sums = {name: crc32(os.path.join(path, name)) for name in mine}  # by this rank: its shards, rank 0 the rest
        except (Exception, dcp.CheckpointException) as e:  # a full disk, a file-size limit, a directory gone
            failed = e
        every = [sums] * world  # one gather: each rank's checksums, None where it failed
        if TORCHRUN:
            dist.all_gather_object(every, sums)
        if rank == 0 and None not in every:  # state.json, then checksums.json with its CRC-32 too
            sums = {name: crc for part in every for name, crc in part.items()}
            for name, value in [("state.json", state), ("checksums.json", sums)]:
                with open(os.path.join(path, name), "w") as f:
                    json.dump(value, f)
                    f.flush()
                    os.fsync(f.fileno())  # on disk before the link points to it
                sums[name] = crc32(os.path.join(path, name))
            if os.path.lexists(link + ".tmp"):  # a hard kill's
                os.remove(link + ".tmp")
            os.symlink(slot, link + ".tmp")
            os.replace(link + ".tmp", link)  # atomic
            if not os.path.islink(os.path.join(run_dir, "policy")):  # a first save
                os.symlink(os.path.join("checkpoint", "policy"), os.path.join(run_dir, "policy"))
            shutil.rmtree(os.path.join(run_dir, old), ignore_errors=True)
    except Exception as e:
        failed = e
    finally:
        SAVING.clear()
    if failed is not None and os.path.realpath(link) != os.path.realpath(path):
        shutil.rmtree(path, ignore_errors=True)  # no half-written checkpoint stays
    if all_reduce(torch.tensor(float(failed is not None))).item():
        raise SaveFailed(f"saving update {state['update']} failed ({reason(failed) if failed else 'on another rank'})")


def save_policy(path, models, tokenizer, merged=False):
    """policy/ (docs/ppo_llm.md#what-a-run-writes), under torchrun gathered into rank 0 a model at a time."""
    rank, failed = dist.get_rank() if dist.is_initialized() else 0, None
    tokenizer = copy.copy(tokenizer)  # with its family's chat template, not the training one a tool run renders with
    tokenizer.chat_template = getattr(tokenizer, "family_chat_template", tokenizer.chat_template)
    options = dsd.StateDictOptions(full_state_dict=True, cpu_offload=dist.is_initialized(), ignore_frozen_params=True)
    for name, model in [(n, m) for n, m in models.items() if n != "ref_policy"]:  # the reference: --model's
        weights = dsd.get_model_state_dict(model, options=options)  # every rank gathers, rank 0 too after a failure
        where = os.path.join(path, "critic") if name != "policy" and "critic" in models else path
        try:
            if rank == 0 and failed is None and name == "value_head":
                os.makedirs(where, exist_ok=True)
                torch.save({k: v.cpu() for k, v in weights.items()}, os.path.join(where, "value_head.pt"))
            elif rank == 0 and failed is None:
                model.save_pretrained(where, state_dict=weights)
                tokenizer.save_pretrained(where)
        except Exception as e:
            failed = e
    if merged and rank == 0 and failed is None:  # W + (alpha / r) B A, on the CPU: the adapter loaded as peft loads it
        import peft

        adapter = peft.AutoPeftModelForCausalLM.from_pretrained(path)
        adapter.merge_and_unload().save_pretrained(os.path.join(path, "merged"))
        tokenizer.save_pretrained(os.path.join(path, "merged"))
    if failed is not None:
        raise failed


def load_checkpoint(args, models, optimizer):
    """--resume's checkpoint/ state ({} if none): each rank reads its own shards, whatever the number of processes."""
    if not args.resume:
        return {}
    path, state = os.path.join(args.resume, "checkpoint"), trained_state(models, optimizer)
    try:  # none (a run killed before its first save), a damaged one, or one of other models or flags
        saved = json.load(open(os.path.join(path, "state.json")))
        sums = json.load(open(os.path.join(path, "checksums.json")))
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        names = sorted(sums, key=lambda name: (name.startswith("policy/"), name))  # policy/ last
        readers = [int(n[2:].split("_")[0]) % world if n.startswith("__") else 0 for n in names]  # shard __s_0: s's
        files = [os.path.join(path, name) for name in names]  # a missing one is damaged, on its reader alone
        mine = [r == rank and (not os.path.isfile(f) or crc32(f) != sums[n]) for r, f, n in zip(readers, files, names)]
        bad = [name for name, b in zip(names, all_reduce(torch.tensor(mine, dtype=torch.float64)).tolist()) if b]
        whole = f"its policy/ is whole: --model {args.resume}/policy starts a new run from it"
        if bad and bad[-1].startswith("policy/"):  # resuming never reads it: a warning, and the next save replaces it
            print(f"warning: --resume {args.resume}: {path}/{bad[-1]} is damaged or missing; resuming anyway")
            whole = "its policy/ is damaged too"
        if bad and not bad[0].startswith("policy/"):  # nothing changed; the slot before this one is gone (each save
            raise SystemExit(f"error: --resume {args.resume}: {path}/{bad[0]} is damaged or missing; {whole}")
        names = {k for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata if k.startswith("models.")}
        if names != {f"models.{k}" for k in state["models"]}:
            raise KeyError(f"its weights are of {', '.join(sorted({k.split('.')[1] for k in names}))}, other names")
        dcp.load(state, checkpoint_id=path, no_dist=not TORCHRUN)
    except (Exception, dcp.CheckpointException) as e:
        run_model = json.load(open(os.path.join(args.resume, "args.json")))["model"]
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:100]}"
        if run_model != args.model:
            why += f"; the run trained --model {run_model}, not --model {args.model}"
        raise SystemExit(f"error: --resume {args.resume}: checkpoint unreadable, or of other models ({why})") from None
    dsd.set_model_state_dict(models, state["models"], options=dsd.StateDictOptions(strict=False))  # no LoRA base in it
    dsd.set_optimizer_state_dict(models, optimizer, state["optimizer"])
    print(f"resuming after update {saved['update']} of the saved run")
    optimizer.param_groups[0]["lr"] = args.learning_rate  # a flag given on resuming wins
    return saved


@contextlib.contextmanager
def guarded(args, run, run_dir, writer, models, optimizer, tokenizer):
    """main()'s loop inside the run's plumbing: Ctrl-C and SIGTERM stop it after the update; any exception saves
    run["state"] (every rank together) and says what is on disk and how to go on; the end closes logs and processes."""
    del STOP[:], TRUNCATED[:], PARTIAL[:]  # a new run has had no signal and given no warning
    handlers = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    print(f"{run_dir}/checkpoint: every {args.save_every or args.total_steps} updates (--save-every) and on a stop")
    try:
        yield
    except BaseException as error:  # Ctrl-C, SIGTERM, a non-finite loss, an error, a failed save: nothing is lost
        rank = dist.get_rank() if dist.is_initialized() else 0
        together = isinstance(error, KeyboardInterrupt | FloatingPointError | SaveFailed | EveryRank)
        what, saved = str(error) or type(error).__name__, None
        if not together and TORCHRUN:
            what += "; one rank alone cannot save the sharded weights"
        elif not isinstance(error, SaveFailed):  # a failed save is not tried again
            try:
                save_checkpoint(run_dir, models, optimizer, run["state"], tokenizer)
                saved = f"the state after update {run['state']['update']} is in {run_dir}/checkpoint"
            except SaveFailed as e:
                what += f"; {e}"
        go_on, path = f"python {os.path.basename(__file__)} --resume {run_dir} goes on", f"{run_dir}/checkpoint"
        if saved is None and os.path.exists(path):  # the last save that was written
            saved = f"{path} holds update {json.load(open(os.path.join(path, 'state.json')))['update']}"
        elif saved is None:
            saved, go_on = "no checkpoint was written", "start the run again"
        cause = error.__cause__ if isinstance(error, EveryRank) else error  # a user's error: its own traceback
        if not isinstance(cause, KeyboardInterrupt | FloatingPointError | SaveFailed | SystemExit | Stopped | None):
            traceback.print_exception(cause)
        if together and TORCHRUN:  # torchrun ends every rank once one exits: they wait for rank 0's save
            dist.barrier()
            if not VLLM:  # else the engine's exit destroys its groups in this world, then the world (not twice)
                dist.destroy_process_group()
        line = f"stopped in update {run['update']} ({what}); {saved}: {go_on}"
        if rank == 0 or not together:
            print(line, file=sys.stderr)
            if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's report of a failed rank then ends with it
                with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
                    json.dump({"message": line, "timestamp": int(time.time())}, f)
        raise SystemExit(128 + STOP[0] if STOP else 1) from None
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        if writer is not None:
            writer.close()
        LOCK.close()
    print(f"saved the policy to {run_dir}/policy")
    if args.track and writer is not None:
        sys.modules["wandb"].finish()  # start_run imported it


def evaluate_only(held_out):
    """--eval-only's evaluate(*held_out), which a stop ends after the batch: every rank exits with 128 + signal."""
    STOP.clear()
    handlers = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    metrics = evaluate(*held_out)  # an error ends the process
    signum = int(all_reduce(torch.tensor(float(STOP[0] if STOP else 0)), dist.ReduceOp.MAX).item())
    if signum:  # one line (rank 0 alone prints); every rank exits so, deaf to torchrun's SIGTERM once one has
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(f"stopped ({signal.Signals(signum).name}) during the evaluation: no accuracy to print", flush=True)
        os._exit(128 + signum)  # as clean_exit(): no race with gloo's threads
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    return metrics


@contextlib.contextmanager
def clean_exit():
    """Under torchrun, rank 0 alone prints a refusal (in torchrun's report too); a good end ends all ranks together."""
    try:
        yield
    except SystemExit as e:
        if isinstance(e.code, str) and int(os.environ.get("WORLD_SIZE", 1)) > 1:
            sys.stderr = sys.stderr if int(os.environ["RANK"]) == 0 else open(os.devnull, "w")
            if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's report of a failed rank ends with it
                with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
                    json.dump({"message": e.code, "timestamp": int(time.time())}, f)
        raise
    if dist.is_initialized():  # Python's exit would race gloo's threads, which FSDP's device mesh keeps past a destroy
        dist.barrier()  # every rank done, rank 0's last save too
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    with clean_exit():  # under torchrun: a refusal in one line, once; the ranks end together
        main()

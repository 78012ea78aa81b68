"""PPO for language models (RLHF), in one file.

Stage 3 of RLHF (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences"; Ouyang et al. 2022, InstructGPT): a
policy generates responses to prompts, a reward model or a reward function scores them, and PPO (Schulman et al. 2017)
raises the score while a per-token KL penalty keeps the policy close to the frozen reference, the SFT model it started
from. main() is the loop in the algorithm's order: 1. rollout, 2. log-probs of policy and reference, values and scores,
3. per-token rewards, 4. GAE, 5. epochs of clipped minibatch updates, 6. the KL controller; then log, evaluate, save.

    python ppo_llm.py                                  # the embedded arithmetic SFT policy: offline, CPU, minutes
    python ppo_llm.py --model gpt2 --total-steps 200   # a hub model (a GPU is advisable)

Implementation details (after "The N+ Implementation Details of RLHF with PPO", Huang et al. 2024), cited "detail N":
1. Tokens are actions and a response is an episode; the state is the prompt and the tokens so far.
2. A response ends at its first EOS (the tokenizer's, the generation_config's, the chat template's end of turn); the
   tokens after it are pad, masked out of every loss and statistic.
3. The score is added to the reward of the last real token; every token gets -beta * KL to the reference (dense).
4. Sampling is softmax(logits / temperature) alone (the checkpoint's generation_config, whose top_k or
   repetition_penalty transformers would apply, is replaced), and log-probs divide by the same temperature.
5. Old log-probs and values are recomputed after generation by the training forward in its micro-batch shapes, and the
   reference is the SFT policy in fp32 scored the same way: the first ratio is exactly 1 and the first KL exactly 0.
6. Dropout is 0, in the config and in every nn.Dropout; prompts are left-padded, position ids come from the mask.
7. The LM head runs on response positions only, in chunks recomputed in backward (torch.utils.checkpoint): memory does
   not grow with length x vocabulary. One fp32 log-softmax gives the log-probs and the entropy.
8. Values: a zero-initialised scalar head in fp32, on a critic initialised from the reward model (same tokenizer) or
   the policy; --critic head puts it on the policy's trunk (cheaper, learns slower).
9. GAE (gamma 1, lambda 0.95) over the response tokens, returns = advantages + values; the advantages are whitened
   over the batch's real tokens, the rewards optionally (scale only).
10. Clipped surrogate and clipped value loss, each a mean over real tokens; an optional entropy bonus.
11. Epochs of shuffled minibatches accumulated over micro-batches, each weighted by its share of the minibatch's real
    tokens; a global grad-norm clip; AdamW; optional lr decay; an epoch whose approx-KL passes --target-kl ends it.
12. beta fixed, or adapted towards a target KL (Ziegler et al.'s proportional controller).
13. An optional missing-EOS penalty and score clip; a reward model's scores (of arbitrary scale) are whitened per batch.

Running it for real (docs/ppo_llm.md): any causal LM of transformers, chat templates, bf16 autocast on CUDA, LoRA
(--lora-r), torchrun (each update is the one-process update on the union of the ranks' batches). Nothing is lost when a
run stops: checkpoint.pt is written every --save-every updates and on Ctrl-C, SIGTERM, a non-finite loss or an error.
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
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before init_process_group: its defaults (group=WORLD) would hold the group
import torch.nn as nn
import torch.nn.functional as F
import transformers
import tyro
from torch.utils.checkpoint import checkpoint
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


@dataclass
class Args:
    # ---- experiment
    exp_name: str = "ppo_llm"  # the run directory and the wandb run start with it
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
    reward_model: str | None = None  # a sequence-classification reward model; without one, --reward-fn scores
    reward_label: int | None = None  # the reward model's logit that is the score, if it has several
    reward_fn: str = "arithmetic"  # arithmetic (exact), gsm8k ('#### N'), format, path/to/file.py:fn, or module:fn
    dataset: str = "assets/arith/train.jsonl"  # prompts: a .jsonl .json .csv .parquet file, or a hub dataset
    dataset_config: str | None = None  # hub dataset configuration (gsm8k: main)
    dataset_split: str = "train"  # hub dataset split
    prompt_column: str = "prompt"  # column of the prompts: strings, or lists of {role, content} messages
    answer_column: str = "answer"  # column of the reference answers that the reward function checks
    chat_template: bool = False  # also put plain-string prompts through the chat template (instruct models)
    system_prompt: str | None = None  # a system message before each prompt (implies --chat-template)
    critic: Literal["head", "separate"] = "separate"  # the value function: a head on the policy's trunk, or a network
    gradient_checkpointing: bool = False  # trade compute for memory in the policy and the critic
    lora_r: int = 0  # LoRA rank (0: off); LoRA usually wants ~10x the learning rate of full fine-tuning
    lora_alpha: int = 32  # the adapters add (alpha / r) B A x
    lora_target_modules: tuple[str, ...] | None = None  # modules to adapt (unset: every linear layer of the trunk)
    save_merged: bool = False  # with --lora-r, also save the base with the adapters merged in, to policy/merged
    # ---- generation
    max_new_tokens: int | None = None  # longest response (unset: the checkpoint's generation_config's, else 8)
    max_prompt_length: int | None = None  # longer prompts lose their start (unset: the context - --max-new-tokens)
    temperature: float = 1.0  # sampling temperature, also in the log-probs (detail 4)
    cast_lm_head_to_fp32: bool = True  # the LM head's matmul in fp32 under autocast
    # ---- PPO
    total_steps: int = 300  # PPO updates (a rollout batch and its epochs each)
    prompts_per_update: int = 128  # prompts per rollout batch, one response each
    num_mini_batches: int = 2  # minibatches (optimizer steps) per epoch
    micro_batch_size: int = 64  # sequences per forward pass (gradient accumulation, chunks of no-grad passes)
    num_ppo_epochs: int = 2  # passes over each rollout batch
    learning_rate: float | None = None  # AdamW learning rate (unset: 1e-4 below 50M parameters, else 1e-5)
    weight_decay: float = 0.0  # AdamW weight decay (0, as TRL; torch's default is 0.01)
    anneal_lr: bool = False  # decay the learning rate linearly to 0
    gamma: float = 1.0  # discount over response tokens
    lam: float = 0.95  # GAE lambda
    cliprange: float = 0.2  # clip range of the policy ratio
    cliprange_value: float = 0.2  # clip range of the value update
    vf_coef: float = 0.1  # value-loss weight
    ent_coef: float = 0.0  # entropy-bonus weight
    max_grad_norm: float = 1.0  # global gradient-norm clip
    target_kl: float | None = None  # end an update once an epoch's mean approx-KL, 1/2 (log ratio)^2, passes this
    kl_coef: float = 0.05  # beta of the per-token KL penalty (its start value with --kl-target)
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"  # per-token KL estimator in the reward
    kl_target: float | None = None  # adapt beta towards this KL per sequence (off when unset)
    kl_horizon: int = 10000  # horizon in samples of the adaptive KL controller
    ref_update_every: int = 0  # copy the policy into the reference every N updates (0: never)
    whiten_rewards: bool = False  # whiten the per-token rewards (scale only) before GAE
    missing_eos_penalty: float | None = None  # subtract this from the score of a response without EOS
    score_norm: Literal["auto", "on", "off"] = "auto"  # whiten each batch's scores; auto: on with a reward model
    score_clip: float | None = None  # clip the scores to [-c, c], after --score-norm
    # ---- evaluation and logging
    eval_every: int = 10  # held-out accuracy every N updates (0: off)
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


def masked_mean(values, mask, axis=None):
    """sum(values * mask) / sum(mask), over `axis` or over everything."""
    return (values * mask).sum(axis) / mask.sum(axis)


def masked_whiten(values, mask, shift_mean=True):
    """(x - mean) / sqrt(var + 1e-8) over the entries where mask is 1, every rank's: n = sum(m), mean = sum(x m) / n,
    var = sum((x - mean)^2 m) / (n - 1); shift_mean=False adds the mean back (only the scale changes, as in TRL)."""
    n = all_reduce(mask.sum())
    mean = all_reduce((values * mask).sum()) / n
    var = all_reduce(((values - mean) ** 2 * mask).sum()) / (n - 1)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def kl_penalty(logprobs, ref_logprobs, estimator):
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's r = logp - ref_logp (Schulman 2020):
    k1 = r (unbiased, can be < 0); k2 = r^2 / 2 (biased, low variance); k3 = exp(-r) - 1 + r (unbiased, >= 0)."""
    r = logprobs - ref_logprobs
    return {"k1": r, "k2": 0.5 * r**2, "k3": torch.expm1(-r) + r}[estimator]


def compute_gae(rewards, values, mask, gamma, lam):
    """GAE over the response tokens, (B, T) -> (advantages, returns) (detail 9):
    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1},  returns = A + V.
    Rewards and values count as 0 where mask is 0 and past the last position (the episode ends at the last real
    token); advantages and returns are 0 where mask is 0."""
    rewards, values = rewards * mask, values * mask
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    deltas = rewards + gamma * next_values - values
    advantages, last = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        last = deltas[:, t] + gamma * lam * last
        advantages[:, t] = last
    return advantages * mask, (advantages + values) * mask


def policy_loss(logprobs, old_logprobs, advantages, mask, clip_range):
    """PPO's clipped surrogate: masked mean of max(-A * rho, -A * clip(rho, 1 - eps, 1 + eps)),
    rho = exp(logprobs - old_logprobs). Returns (loss, stats): clipfrac, approxkl = mean (log rho)^2 / 2, mean rho."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    losses, clipped_losses = -advantages * ratio, -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = masked_mean(torch.max(losses, clipped_losses), mask)
    with torch.no_grad():
        stats = {"policy/clipfrac_avg": masked_mean((clipped_losses > losses).float(), mask), "val/ratio":
                 masked_mean(ratio, mask), "policy/approxkl_avg": 0.5 * masked_mean(log_ratio**2, mask)}  # fmt: skip
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
    """Detail 13: the scores (B,) whitened over the batch when `whiten`, then clipped to [-clip, clip] unless None."""
    scores = masked_whiten(scores, torch.ones_like(scores)) if whiten else scores
    return scores if clip is None else scores.clamp(-clip, clip)


def adaptive_kl_coef(kl_coef, kl, target, horizon, n_steps):
    """Ziegler et al.'s proportional controller (detail 12), the beta after n_steps more sequences of mean KL kl:
    beta * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon)."""
    proportional_error = min(max(kl / target - 1, -0.2), 0.2)
    return kl_coef * (1 + proportional_error * n_steps / horizon)


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


def training_forward(policy, critic, value_head, r, mc, args, with_entropy=True):
    """Micro-batch mc of the rollout r: the responses' log-probs and entropies (B, R) under `policy`, and with a value
    head their values (B, R) in fp32, on the critic's trunk or the policy's (detail 8)."""
    qr, am = r["query_responses"][mc], r["attention_mask"][mc]
    hidden = hidden_states(policy, qr, am, r["prompt_width"])
    responses = r["responses"][mc]
    logprobs, entropy = response_logprobs(
        policy,
        hidden,
        responses,
        args.temperature,
        fp32=args.cast_lm_head_to_fp32,
        with_entropy=with_entropy,
        entropy_grad=args.ent_coef != 0,  # else the entropy is for the logs alone, computed without autograd
    )
    if value_head is None:
        return logprobs, entropy, None
    if critic is not None:
        hidden = hidden_states(critic, qr, am, r["prompt_width"])
    with torch.autocast(hidden.device.type, enabled=False):
        return logprobs, entropy, value_head(hidden.float()).squeeze(-1)


def accumulate_gradients(policy, critic, value_head, r, mb_inds, args, autocast):
    """Forward and backward one minibatch, micro-batch by micro-batch (detail 11); returns each micro-batch's stats.
    Under torchrun n_tokens is the union minibatch's real tokens per rank, as optimizer_step averages the ranks'."""
    stats, n_tokens = [], global_mean([r["mask"][mb_inds].sum()])
    for mc in mb_inds.split(args.micro_batch_size):
        mask = r["mask"][mc]
        with autocast:
            logprobs, entropy, values = training_forward(policy, critic, value_head, r, mc, args)
        pg_loss, pg_stats = policy_loss(logprobs, r["old_logprobs"][mc], r["advantages"][mc], mask, args.cliprange)
        vf_loss, vf_stats = value_loss(values, r["values"][mc], r["returns"][mc], mask, args.cliprange_value)
        entropy = masked_mean(entropy, mask)
        loss = pg_loss + args.vf_coef * vf_loss
        if args.ent_coef:  # only then does backward go through the entropy
            loss = loss - args.ent_coef * entropy
        (loss * mask.sum() / n_tokens).backward()  # weighted by its share of the minibatch's real tokens (detail 11)
        stats.append(pg_stats | vf_stats | {"loss/policy_avg": pg_loss.detach(), "loss/value_avg": vf_loss.detach(),
                                            "policy/entropy_avg": entropy.detach()})  # fmt: skip
    return stats


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


# TRY NOT TO MODIFY: rewards, prompts, models (identical in grpo_llm.py)

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


# TRY NOT TO MODIFY: set-up, the run directory and logging, evaluation, checkpoints (identical in grpo_llm.py)


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


# PPO: its flags, the value model, saving


def check_args(args, world):
    """Every bad combination of flags, one line each, before anything is loaded."""
    B, n_mb = args.prompts_per_update // world, max(args.num_mini_batches, 1)  # each process's share, minibatches
    if args.micro_batch_size > B // n_mb > 0:  # the default 64 must not refuse a smaller batch, or 8 GPUs
        args.micro_batch_size = B // n_mb
    args.score_norm = ("on" if args.reward_model else "off") if args.score_norm == "auto" else args.score_norm
    split = args.eval_split if args.dataset_split == "train" and args.eval_split else args.dataset_split
    for bad, message in [
        (args.prompts_per_update % world, f"{world} processes must divide --prompts-per-update"),
        (args.eval_only and world > 1, "--eval-only runs in one process: python, not torchrun"),
        (min(args.num_mini_batches, args.micro_batch_size, B) < 1 or B % n_mb or B // n_mb % args.micro_batch_size,
         f"--num-mini-batches must divide --prompts-per-update ({B} a process), and --micro-batch-size "
         f"({args.micro_batch_size}) the minibatch"),
        (args.num_ppo_epochs < 1, f"--num-ppo-epochs must be 1 or more (got {args.num_ppo_epochs})"),
        (args.temperature <= 0, f"--temperature must be > 0: log-probs divide by it (got {args.temperature})"),
        (args.save_merged and not args.lora_r, "--save-merged needs --lora-r: without LoRA the policy is a full model"),
        (args.lora_r and args.ref_update_every, "--ref-update-every cannot refresh a LoRA run's reference, its base"),
        (os.path.isfile(args.dataset) and split != "train" and not os.path.isfile(split),
         f"--dataset {args.dataset} is a file, with no split {split}: --eval-split FILE instead"),
        (args.score_norm == "on" and args.prompts_per_update < 2, "--score-norm on needs --prompts-per-update >= 2"),
        (args.kl_target and not args.kl_coef, "--kl-target scales --kl-coef up or down: start it above 0 (got 0)"),
    ]:  # fmt: skip
        if bad:
            raise SystemExit(f"error: {message}")


def build_value_model(args, policy, tokenizer, reward_model, rm_tokenizer):
    """Detail 8: (critic: None with --critic head, else from the reward model if it reads our tokens, value head)."""
    critic = None
    if args.critic == "separate":
        source = args.reward_model if reward_model is not None and rm_tokenizer is None else args.model
        critic = load_model(AutoModel, source, "--critic source", "auto" if args.lora_r else torch.float32)
        fit_tokenizer(tokenizer, [critic])
        critic = add_lora(critic, args) if args.lora_r else critic  # adapters of its own; the head trains in full
    value_head = nn.Linear((critic or policy).config.hidden_size, 1)
    nn.init.zeros_(value_head.weight)
    nn.init.zeros_(value_head.bias)
    return critic, value_head


def save(path, models, tokenizer, merged=False):
    """save_pretrained of the policy, its tokenizer (with LoRA the adapter; merged: also path/merged) and the value
    model (critic and value_head.pt in path/critic, or in path with --critic head; docs/ppo_llm.md loads it back)."""
    policy, critic, value_head = models["policy"], models["critic"], models["value_head"]
    policy.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if merged:  # W + (alpha / r) B A, in a copy (one more base in memory, while saving): training keeps its adapters
        for saved in [copy.deepcopy(policy).merge_and_unload(), tokenizer]:
            saved.save_pretrained(os.path.join(path, "merged"))
    value_dir = path if critic is None else os.path.join(path, "critic")
    for saved in [critic, tokenizer] if critic is not None else []:
        saved.save_pretrained(value_dir)
    torch.save(value_head.state_dict(), os.path.join(value_dir, "value_head.pt"))


def main(args: Args | None = None):
    args = parse_args() if args is None else args
    # TRY NOT TO MODIFY: set-up
    (rank, world), device, autocast = setup(args)
    check_args(args, world)
    reward_fn = load_reward_fn(args.reward_fn)  # a bad name or file fails here, before anything is loaded
    tokenizer, policy, reward_model, rm_tokenizer, max_prompt_length, eos_ids = load_models(args, device)
    B = args.prompts_per_update // world  # this process's share
    eval_problems = eval_rows(args, tokenizer) if (args.eval_every or args.eval_only) and rank == 0 else None
    evaluation = eval_problems and (lambda: evaluate(policy, tokenizer, eval_problems, reward_fn, eos_ids,
                                                     max_prompt_length, autocast, B))  # fmt: skip
    if args.eval_only:  # no training, no run directory; 95% of two evaluations differ by < 1.96 sqrt 2 stderr
        print(f"{eval_line(result := evaluation())} (n={len(eval_problems)}; two evaluations of one policy differ by < "
              f"{2.8 * result['eval/accuracy_stderr']:.3f})")  # fmt: skip
        return result
    critic, value_head = build_value_model(args, policy, tokenizer, reward_model, rm_tokenizer)
    ref_policy = None if not (args.kl_coef or args.kl_target) else policy if args.lora_r else copy.deepcopy(policy)
    params, optimizer = build_optimizer(args, device, [policy, critic, value_head], [ref_policy])
    models = dict(policy=policy, critic=critic, value_head=value_head)  # what checkpoint.pt and policy/ hold
    models["ref_policy"] = ref_policy if args.ref_update_every else None  # else the reference is --model's
    checkpoint = start(args, models, optimizer)  # {} for a new run
    rows = load_prompts(args, tokenizer, reward_model is None and args.reward_fn in ("arithmetic", "gsm8k"))
    run_dir, writer = open_run(args, rank, checkpoint)
    if evaluation and not checkpoint:  # the initial policy, at update 0
        log(writer, {"update": 0, "episode": 0} | (initial := evaluation()))
        print(f"update 0: {eval_line(initial)}")
    first_update = update = checkpoint.get("update", 0)
    kl_coef, start_time = checkpoint.get("kl_coef", args.kl_coef), time.time()
    prompts = prompt_stream(rows, args.seed, update * args.prompts_per_update, rank, world)
    state = dict(update=update, kl_coef=kl_coef)  # what a resume restores besides the weights and AdamW
    print(f"{run_dir}/checkpoint.pt: every {args.save_every or args.total_steps} updates (--save-every) and on a stop")
    STOP.clear()
    handlers = {s: signal.signal(s, lambda n, f: signal.default_int_handler(n, f) if STOP else STOP.append(n))
                for s in (signal.SIGINT, signal.SIGTERM)}  # a second signal stops at once  # fmt: skip
    try:
        for update in range(update + 1, args.total_steps + 1):
            torch.manual_seed(hash((args.seed, update, rank)))  # each update's own random numbers: exact resumes
            if args.anneal_lr:
                optimizer.param_groups[0]["lr"] = args.learning_rate * (1 - (update - 1) / args.total_steps)
            # ALGO LOGIC: 1. rollout -- one response per prompt
            t0 = wall_clock(device)
            rows = [next(prompts) for _ in range(B)]
            r = rollout(policy, tokenizer, [row["prompt"] for row in rows], max_prompt_length, eos_ids, autocast, True)
            stop_check()  # a signal on any rank: every rank stops here, before the update changes anything
            responses, mask = r["responses"], r["mask"]  # (B, R)
            t1 = wall_clock(device)

            # 2. old and reference log-probs and values: the training forward in its shapes (detail 5); scores
            micro_batches = torch.arange(B, device=device).split(args.micro_batch_size)
            with torch.no_grad(), autocast:
                out = [training_forward(policy, critic, value_head, r, mc, args, False) for mc in micro_batches]
                old_logprobs, values = torch.cat([o[0] for o in out]), torch.cat([o[2] for o in out])
                ref_logprobs = old_logprobs
                if ref_policy is not None:
                    with ref_policy.disable_adapter() if args.lora_r else contextlib.nullcontext():  # LoRA: the base
                        out = [training_forward(ref_policy, None, None, r, mc, args, False) for mc in micro_batches]
                    ref_logprobs = torch.cat([o[0] for o in out])
            completions = tokenizer.batch_decode(responses, skip_special_tokens=True)
            verdicts = reward_fn(completions, rows) if reward_model is None or rows[0]["answer"] is not None else None
            scores = (torch.tensor(verdicts, dtype=torch.float, device=device) if reward_model is None
                      else reward_model_scores(reward_model, rm_tokenizer, r, rows, completions, args))  # fmt: skip
            contains_eos = torch.isin(responses, torch.tensor(eos_ids, device=device)).any(1)
            if args.missing_eos_penalty is not None:
                scores = scores - args.missing_eos_penalty * (~contains_eos).float()
            t2 = wall_clock(device)

            # 3. per-token rewards: -beta * KL everywhere, plus the score at the last real token (detail 3)
            kl = kl_penalty(old_logprobs, ref_logprobs, args.kl_estimator) * mask
            non_score_reward = -kl_coef * kl
            rewards = non_score_reward.clone()
            normalized = normalize_scores(scores, args.score_norm == "on", args.score_clip)  # detail 13
            rewards[torch.arange(B, device=device), mask.long().sum(1) - 1] += normalized
            if args.whiten_rewards:
                rewards = masked_whiten(rewards, mask, shift_mean=False) * mask

            # 4. advantages: GAE over the response tokens, whitened over the batch (detail 9)
            advantages, returns = compute_gae(rewards, values, mask, args.gamma, args.lam)
            advantages = masked_whiten(advantages, mask)

            # 5. PPO update: epochs of shuffled minibatches, micro-batches accumulate gradients (details 10, 11)
            r |= dict(old_logprobs=old_logprobs, values=values, advantages=advantages, returns=returns)
            for model in [m for m in (policy, critic) if m is not None]:
                model.train()  # HF's activation checkpointing acts in train mode only
            stats = []
            for _ in range(args.num_ppo_epochs):
                epoch_stats = []
                for mb_inds in torch.randperm(B, device=device).split(B // args.num_mini_batches):
                    epoch_stats += accumulate_gradients(policy, critic, value_head, r, mb_inds, args, autocast)
                    optimizer_step(optimizer, params, args.max_grad_norm)
                stats += epoch_stats
                approxkl = global_mean([s["policy/approxkl_avg"] for s in epoch_stats])  # all ranks stop together
                if args.target_kl is not None and approxkl > args.target_kl:
                    break
            t3 = wall_clock(device)

            # 6. KL controller and reference refresh
            mean_kl = global_mean([kl.sum(1).mean()])
            if args.kl_target:
                kl_coef = adaptive_kl_coef(kl_coef, mean_kl, args.kl_target, args.kl_horizon, args.prompts_per_update)
            if args.ref_update_every and update % args.ref_update_every == 0 and ref_policy is not None:
                ref_policy.load_state_dict(policy.state_dict())
            state = dict(update=update, kl_coef=kl_coef)  # update done: a stop from here on resumes after it

            # TRY NOT TO MODIFY: log (TRL's metric names), evaluate, show samples, save
            n_tokens = mask.sum().item()
            metrics = {"update": update, "episode": update * args.prompts_per_update, "objective/kl": mean_kl,
                       "objective/kl_coef": kl_coef, "objective/entropy": (-old_logprobs * mask).sum(1).mean().item(),
                       "objective/non_score_reward": non_score_reward.sum(1).mean().item(), "objective/scores":
                       scores.mean().item(), "val/num_eos_tokens": int(contains_eos.sum().item()), "val/mean_length":
                       n_tokens / B, "lr": optimizer.param_groups[0]["lr"]}  # fmt: skip
            times, progress = timing((t0, t1, t2, t3), start_time, first_update, update, args.total_steps, n_tokens,
                                     device)  # fmt: skip
            # the stats of policy_loss (policy/*, val/ratio), value_loss (val/clipfrac_avg), the losses and entropy
            metrics |= times | {k: torch.stack([s[k] for s in stats]).mean().item() for k in stats[0]}
            metrics["objective/rlhf_reward"] = metrics["objective/scores"] + metrics["objective/non_score_reward"]
            if rows[0]["answer"] is not None:  # the reward function's verdict, beside a reward model too
                metrics["objective/accuracy"] = sum(verdicts) / B
            metrics = global_metrics(metrics, {"val/num_eos_tokens": "sum", "perf/tokens_per_sec": "sum",
                                               "perf/peak_memory_mb": "max"})  # fmt: skip
            if evaluation and not STOP and (update % args.eval_every == 0 or update == args.total_steps):
                metrics |= evaluation()
            if rank == 0:
                shown = range(min(args.num_samples, B)) if args.sample_every and update % args.sample_every == 0 else []
                print(f"update {update}/{args.total_steps}: score {metrics['objective/scores']:.3f}  kl {mean_kl:.3f}  "
                      f"approxkl {metrics['policy/approxkl_avg']:.4f}  clipfrac {metrics['policy/clipfrac_avg']:.3f}  "
                      + (f"{eval_line(metrics)}  " if "eval/accuracy" in metrics else "") + progress)  # fmt: skip
                log(writer, metrics, [{"update": update, "prompt": rows[j]["prompt"], "completion": completions[j],
                                       "score": scores[j].item()} for j in shown])  # fmt: skip
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

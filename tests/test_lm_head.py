"""lm_head_logprobs (chunks under torch.utils.checkpoint) against autograd through the full (B, T, V) logits in
float64: values, and gradients into the hidden states, the head weight and its bias, for a loss of both outputs."""

import os
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from conftest import lm

import ppo_llm

B, T, H, V = 3, 5, 8, 11  # 15 tokens
# the CPU, or the GPU with TEST_DEVICE=cuda (benchmarks/gpu.py runs this file on one)
DEVICE = torch.device(os.environ.get("TEST_DEVICE", "cpu"))


def reference(hidden, weight, bias, labels, temperature, scale, softcap):
    """The full logits, the obvious way: log-probs of the labels and entropies, under autograd."""
    logits = F.linear(hidden, weight, bias) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logp = torch.log_softmax(logits / temperature, -1)
    return logp.gather(-1, labels[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def inputs(bias=True, weight_grad=True, seed=0):
    """Drawn on the CPU (the same numbers on every device), then on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(DEVICE).requires_grad_()
    head = torch.nn.Linear(H, V, bias=bias)
    with torch.no_grad():  # logits of a few units: the softcap of 3 bends them
        head.weight.copy_(torch.randn(V, H, generator=g))
        if bias:
            head.bias.copy_(torch.randn(V, generator=g))
    head.to(DEVICE).requires_grad_(weight_grad)
    labels = torch.randint(0, V, (B, T), generator=g).to(DEVICE)
    coefs = torch.randn(2, B, T, generator=g).to(DEVICE)  # the loss: sum(a * logprobs + c * entropy)
    return hidden, head, labels, coefs


def values_and_grads(fn, hidden, head, coefs, use=(0, 1), context=nullcontext()):
    """fn() under `context` (autocast), its backward outside it, as the scripts call backward."""
    hidden.grad = head.weight.grad = None
    if head.bias is not None:
        head.bias.grad = None
    with context:
        outs = fn()
    sum(coefs[i] * outs[i] for i in use).sum().backward()
    grads = [hidden.grad, head.weight.grad, None if head.bias is None else head.bias.grad]
    return [x.detach().clone() for x in outs], [None if x is None else x.clone() for x in grads]


def expected(hidden, head, labels, coefs, temperature, scale, softcap, use=(0, 1)):
    """The reference in float64, its values and gradients cast back to the inputs' dtypes."""
    h64 = hidden.detach().double().requires_grad_()
    head64 = torch.nn.Linear(H, V, bias=head.bias is not None).double().to(hidden.device)
    with torch.no_grad():
        head64.weight.copy_(head.weight)
        if head.bias is not None:
            head64.bias.copy_(head.bias)
    head64.requires_grad_(head.weight.requires_grad)

    def fn():
        return reference(h64, head64.weight, head64.bias, labels, temperature, scale, softcap)

    outs, grads = values_and_grads(fn, h64, head64, coefs.double(), use)
    dtypes = [hidden.dtype, head.weight.dtype, None if head.bias is None else head.bias.dtype]
    return [x.float() for x in outs], [None if x is None else x.to(d) for x, d in zip(grads, dtypes)]


def check(
    hidden, head, labels, coefs, temperature, scale, softcap, fp32=True, use=(0, 1), tol=1e-5, context=nullcontext()
):
    def fn():
        return ppo_llm.lm_head_logprobs(
            hidden, lm(head, scale, softcap), labels, temperature, entropy_grad=1 in use, fp32=fp32
        )

    got, got_grads = values_and_grads(fn, hidden, head, coefs, use, context)
    want, want_grads = expected(hidden, head, labels, coefs, temperature, scale, softcap, use)
    for a, b in zip(got + got_grads, want + want_grads):
        if b is None:
            assert a is None  # a frozen weight gets no gradient
        else:
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("chunk_logits", [2 * V, 2**24])  # 2 tokens per chunk (the last one alone), or one chunk
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weight_grad", [True, False])  # False: a frozen head, as under LoRA
@pytest.mark.parametrize("temperature, scale", [(0.7, 1.3), (1.0, 1.0)])  # (1, 1): the multiplications skipped
def test_matches_full_logits(monkeypatch, chunk_logits, softcap, bias, weight_grad, temperature, scale):
    monkeypatch.setattr(ppo_llm, "LM_HEAD_CHUNK", chunk_logits)
    hidden, head, labels, coefs = inputs(bias, weight_grad)
    check(hidden, head, labels, coefs, temperature=temperature, scale=scale, softcap=softcap)


@pytest.mark.parametrize("use", [(0,), (1,)])  # the loss uses one output: the other's gradient is None
def test_one_output_in_the_loss(monkeypatch, use):
    monkeypatch.setattr(ppo_llm, "LM_HEAD_CHUNK", 4 * V)
    hidden, head, labels, coefs = inputs()
    check(hidden, head, labels, coefs, temperature=1.0, scale=0.8, softcap=2.0, use=use)


def test_bf16_weight(monkeypatch):
    # a frozen bf16 head, as a LoRA base keeps it (trained weights are fp32): the matmul in fp32 (fp32=True) or in bf16
    # (fp32=False, bf16 hidden states); the hidden states' gradient in their dtype
    monkeypatch.setattr(ppo_llm, "LM_HEAD_CHUNK", 2 * V)
    hidden, head, labels, coefs = inputs(weight_grad=False)
    head.to(torch.bfloat16)
    check(hidden, head, labels, coefs, temperature=0.7, scale=1.3, softcap=3.0, fp32=True, tol=1e-4)
    bf16_hidden = hidden.detach().bfloat16().requires_grad_()  # a bf16 matmul: errors up to 0.034 seen (tol 0.05)
    check(bf16_hidden, head, labels, coefs, temperature=0.7, scale=1.3, softcap=3.0, fp32=False, tol=0.05)
    # a trained bf16 head (FSDP gathers bf16 copies under --mixed-precision bf16): cast to fp32 once, its gradient
    # summed over the 15 one-token chunks in fp32 and rounded once, to the float64 gradient rounded to bf16 (summed in
    # bf16, chunk by chunk, it was up to 0.016 off, 4 bf16 steps)
    monkeypatch.setattr(ppo_llm, "LM_HEAD_CHUNK", V)
    hidden, head, labels, coefs = inputs(weight_grad=True)
    check(hidden, head.to(torch.bfloat16), labels, coefs, temperature=0.7, scale=1.3, softcap=3.0, tol=1e-4)


def test_autocast(monkeypatch):
    # fp32=True: the same numbers as without autocast; fp32=False: a bf16 matmul, the fp32 weight's gradient fp32
    monkeypatch.setattr(ppo_llm, "LM_HEAD_CHUNK", 2 * V)
    hidden, head, labels, coefs = inputs()
    autocast = torch.autocast(DEVICE.type, dtype=torch.bfloat16)
    check(hidden, head, labels, coefs, temperature=0.7, scale=1.3, softcap=3.0, fp32=True, context=autocast)
    check(hidden, head, labels, coefs, temperature=0.7, scale=1.3, softcap=3.0, fp32=False, tol=0.05, context=autocast)


def test_no_grad_is_the_same_forward(monkeypatch):
    monkeypatch.setattr(ppo_llm, "LM_HEAD_CHUNK", 2 * V)
    hidden, head, labels, _ = inputs()
    with_grad = ppo_llm.lm_head_logprobs(hidden, lm(head, 1.3, 3.0), labels, 0.7)
    with torch.no_grad():
        logprobs, entropy = ppo_llm.lm_head_logprobs(hidden, lm(head, 1.3, 3.0), labels, 0.7)
    assert logprobs.grad_fn is None and entropy.grad_fn is None
    assert torch.equal(logprobs, with_grad[0]) and torch.equal(entropy, with_grad[1])


def peak_chunks(tokens, grad, entropy_grad):
    """Peak bytes of the tensors alive during one call and its backward, in chunks of LM_HEAD_CHUNK fp32 logits.
    torch's MemTracker sees every allocation and free on the CPU too (it is private API, pinned by requirements.txt)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    vocab = 4096  # 16 tokens a chunk; a head of 2 x 4096 weights is 1/8 of a chunk
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(2, vocab, bias=False).to(DEVICE)
    hidden = torch.randn(1, tokens, 2, generator=g).to(DEVICE).requires_grad_(grad)
    labels = torch.randint(0, vocab, (1, tokens), generator=g).to(DEVICE)
    tracker = MemTracker()
    with tracker, torch.set_grad_enabled(grad):
        logprobs, entropy = ppo_llm.lm_head_logprobs(hidden, lm(head), labels, 0.7, entropy_grad=entropy_grad)
        if grad:
            loss = logprobs.sum() + (entropy.sum() if entropy_grad else 0)
            loss.backward()
    return tracker.get_tracker_snapshot("peak")[hidden.device]["Total"] / (ppo_llm.LM_HEAD_CHUNK * 4)


@pytest.mark.parametrize(
    "grad, entropy_grad, bound",
    [
        (False, False, 2.5),  # old log-probs, reference: the logits, their log-softmax, then its exp in their place
        (True, False, 4),  # the entropy logged (--ent-coef 0): no gradient, no more memory
        (True, True, 6),  # an entropy bonus: its backward needs p and log p of a chunk too
    ],
)
def test_memory_does_not_grow_with_tokens(monkeypatch, grad, entropy_grad, bound):
    # 4 chunks of tokens against 16: the same peak. Computed with autograd, an entropy that the loss never reads kept
    # each recomputed chunk's p and log p until the backward ended, 2 chunks more per chunk (10.3 -> 34.3 chunks).
    monkeypatch.setattr(ppo_llm, "LM_HEAD_CHUNK", 16 * 4096)
    small, large = (peak_chunks(n, grad, entropy_grad) for n in (4 * 16, 16 * 16))
    assert large - small < 0.1, (small, large)
    assert large < bound, large

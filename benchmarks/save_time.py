"""How long a stop's save takes: the grace period a scheduler must give a preempted run (SIGTERM, then SIGKILL).

On SIGTERM a run finishes nothing: it writes checkpoint.pt (the trained weights, AdamW's two moments, the state) and
policy/ (save_pretrained), then exits. With LoRA only the adapters are trained, so both stay small whatever the base.
This builds Llama-2-7B's shape (32 layers, hidden 4,096, MLP 11,008, vocabulary 32,000) with its base weights on
the meta device (a save never writes them), puts grpo_llm.py's LoRA on it (--lora-r 16, every linear layer) in real
memory, takes one AdamW step so that its moments exist, and times grpo_llm.save_checkpoint (the median of 5); the
embedded default, trained in full, beside it.

    python benchmarks/save_time.py          # writes benchmarks/results/save_time.md (and into docs/)
"""

import os
import platform
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from docs_tables import write_table  # noqa: E402

import grpo_llm  # noqa: E402


def llama_7b_lora():
    """Llama-2-7B's shape with LoRA r 16 on every linear layer: the base on the meta device, the adapters in memory."""
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                         num_hidden_layers=32, vocab_size=32000)  # fmt: skip
    with torch.device("meta"):
        policy = LlamaForCausalLM(config).to(torch.bfloat16)
        policy = grpo_llm.add_lora(policy, grpo_llm.Args(lora_r=16, lora_alpha=32))
    for name, module in policy.named_modules():  # initialised as peft does (B = 0)
        if name.endswith(("lora_A.default", "lora_B.default")):
            module.to_empty(device="cpu")
            for p in module.parameters():
                torch.nn.init.normal_(p, std=0.01) if "lora_A" in name else torch.nn.init.zeros_(p)
    return policy


def save_seconds(policy, tokenizer):
    """(median seconds of grpo_llm.save_checkpoint over 5 saves, MB written, trained parameters)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW's moments, as after the first update
    times, models = [], torch.nn.ModuleDict({"policy": policy})
    with tempfile.TemporaryDirectory() as run_dir:
        for _ in range(5):
            start = time.perf_counter()
            grpo_llm.save_checkpoint(run_dir, models, optimizer, dict(update=1), tokenizer)
            times.append(time.perf_counter() - start)
        written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(run_dir) for f in fs)
    return sorted(times)[2], written / 2**20, sum(p.numel() for p in params)


def main():
    path = os.path.join(ROOT, "assets", "arith-sft")
    tokenizer = AutoTokenizer.from_pretrained(path)
    runs = {"the embedded default (full fine-tuning)": AutoModelForCausalLM.from_pretrained(path),
            "Llama-2-7B shape, LoRA r 16 on every linear layer": llama_7b_lora()}  # fmt: skip
    rows = [f"| {name} | {n / 1e6:.1f}M | {mb:.1f} MB | {t:.2f} s |"
            for name, (t, mb, n) in ((name, save_seconds(m, tokenizer)) for name, m in runs.items())]  # fmt: skip
    write_table("save_time.md", "\n".join([
        f"`python benchmarks/save_time.py` ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        "local disk): grpo_llm.save_checkpoint (checkpoint.pt: trained weights, AdamW, state; policy/: "
        "save_pretrained), the median of 5 saves:", "",
        "| run | trained parameters | written | save |", "|---|---|---|---|", *rows,
    ]))  # fmt: skip


if __name__ == "__main__":
    main()

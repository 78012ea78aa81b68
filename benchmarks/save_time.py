"""How long a stop's save takes: the grace period a scheduler must give a preempted run (SIGTERM, then SIGKILL).

On SIGTERM a run finishes nothing: it writes checkpoint/ (the trained weights, AdamW's two moments, the state) and
policy/ (save_pretrained), then exits. With LoRA only the adapters are trained, so both stay small whatever the base.
This builds Llama-2-7B's shape (32 layers, hidden 4,096, MLP 11,008, vocabulary 32,000) with its base weights on
the meta device (a save never writes them), puts grpo_llm.py's LoRA on it (--lora-r 16, every linear layer) in real
memory, takes one AdamW step so that its moments exist, and times grpo_llm.save_checkpoint (the median of 5); the
embedded default and a 58M-parameter Llama, trained in full, beside it, each in one process and under
`torchrun --nproc_per_node 2` (sharded, each rank writing its shards). Within each save it also times the checksums
(grpo_llm.crc32 on each file a rank wrote, read back from the page cache): their share of the save on rank 0, which
hashes the most (its shards, the metadata, state.json and policy/), the median of the 5 shares.

    python benchmarks/save_time.py          # writes benchmarks/results/save_time.json and .md (and into docs/)
    python benchmarks/save_time.py --table  # measure nothing: save_time.md from save_time.json

--table without save_time.json says so and writes nothing.
"""

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import tyro
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from docs_tables import saved_results, write_table  # noqa: E402

import grpo_llm  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")


@dataclass
class Args:
    table: bool = False
    """measure nothing: save_time.md from save_time.json"""
    worker: str = ""
    """(internal) under torchrun: the sharded saves, rank 0's result written to this file"""


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


def llama_58m():
    """A 58M-parameter Llama (hidden 512, 8 layers, vocabulary 32,000), trained in full: 0.9 GB a save."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=8,
                         num_hidden_layers=8, vocab_size=32000)  # fmt: skip
    return LlamaForCausalLM(config)


def save_seconds(policy, tokenizer):
    """(median seconds of grpo_llm.save_checkpoint over 5 saves, median share of them its checksums took on this rank,
    MB written, trained parameters); under torchrun every rank saves into rank 0's temporary directory."""
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW's moments, as after the first update
    times, hashing, models = [], [], torch.nn.ModuleDict({"policy": policy})
    crc32 = grpo_llm.crc32

    def timed_crc32(path):
        start = time.perf_counter()
        crc = crc32(path)
        hashing[-1] += time.perf_counter() - start
        return crc

    grpo_llm.crc32 = timed_crc32
    with tempfile.TemporaryDirectory() as run_dir:
        if dist.is_initialized():  # rank 0's
            shared = [run_dir]
            dist.broadcast_object_list(shared)
            run_dir = shared[0]
        for _ in range(5):
            hashing.append(0.0)
            start = time.perf_counter()
            grpo_llm.save_checkpoint(run_dir, models, optimizer, dict(update=1), tokenizer)
            times.append(time.perf_counter() - start)
        slot = os.path.realpath(os.path.join(run_dir, "checkpoint"))  # what one save wrote
        written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(slot) for f in fs)
        if dist.is_initialized():  # rank 0's directory stays until every rank is done with it
            dist.barrier()
    grpo_llm.crc32 = crc32
    shares = sorted(h / t for h, t in zip(hashing, times))
    return sorted(times)[2], shares[2], written / 2**20, sum(p.numel() for p in params)


def measure(processes):
    """{run: its numbers} of the runs measured in `processes` processes (2: this one a torchrun rank, sharded)."""
    model_path = os.path.join(ROOT, "assets", "arith-sft")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    runs = {"the embedded default (full fine-tuning)": lambda: AutoModelForCausalLM.from_pretrained(model_path),
            "58M-parameter Llama (full fine-tuning)": llama_58m}  # fmt: skip
    if processes == 1:
        runs["Llama-2-7B shape, LoRA r 16 on every linear layer"] = llama_7b_lora
    results = {}
    for name, build in runs.items():
        model = build()
        if processes > 1:
            grpo_llm.shard(model)
        seconds, share, mb, n = save_seconds(model, tokenizer)
        numbers = {"processes": processes, "seconds": seconds, "checksum_share": share, "mb": mb}
        results[f"{name}, {processes} process{'es' if processes > 1 else ''}"] = numbers | {"trained_parameters": n}
    return results


def main():
    args = tyro.cli(Args)
    path = os.path.join(RESULTS, "save_time.json")
    if args.table:
        return print(table(saved_results(path)[0]))
    if args.worker:  # a torchrun rank
        grpo_llm.setup(grpo_llm.Args())
        results = measure(dist.get_world_size())
        if dist.get_rank() == 0:
            with open(args.worker, "w") as f:
                json.dump(results, f)
        return dist.destroy_process_group()
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "runs": measure(1)}
    with tempfile.TemporaryDirectory() as tmp:
        torchrun = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node", "2"]
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        subprocess.run([*torchrun, __file__, "--worker", f"{tmp}/2.json"], env=env, check=True)
        with open(f"{tmp}/2.json") as f:
            result["runs"] |= json.load(f)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(table(result))


def table(result):
    """save_time.md from a result (into the docs through write_table)."""
    rows = [f"| {name} | {r['trained_parameters'] / 1e6:.1f}M | {r['mb']:.1f} MB | {r['seconds']:.2f} s | "
            f"{r['checksum_share']:.0%} |" for name, r in result["runs"].items()]  # fmt: skip
    text = "\n".join([
        f"`python benchmarks/save_time.py` ({result['machine']}, local disk): grpo_llm.save_checkpoint (checkpoint/: "
        "trained weights, AdamW, state; policy/: save_pretrained; checksums.json: the CRC-32 of each file, each by "
        "the rank that wrote it), the median of 5 saves, and the median share of a save that rank 0's checksums took "
        "(2 processes: `torchrun --nproc_per_node 2`, sharded):", "",
        "| run | trained parameters | written | save | checksums |", "|---|---|---|---|---|", *rows,
    ])  # fmt: skip
    write_table("save_time.md", text, RESULTS)
    return text


if __name__ == "__main__":
    main()

"""--cast-lm-head-to-fp32: how far the log-probs move when the LM head's matmul runs in bf16, and what it costs.

Under bf16 autocast the trunk runs in bf16 either way; the flag decides whether the head's matmul does too (the
log-sum-exp is fp32 in both cases). This samples responses of the embedded policy (trained weights, so the logits
have a realistic scale), scores them with both settings and the fp32 reference, and times the head alone at
GPT-2-124M's shape (768 x 50,257, 1,024 tokens) on this machine.

    python benchmarks/head_precision.py          # writes benchmarks/results/head_precision_<device>.json and .md
    python benchmarks/head_precision.py --table  # measure nothing: each .md from its .json

The table also goes into the docs pages that quote it (benchmarks/docs_tables.py). --table without a .json says so
and writes nothing.
"""

import contextlib
import json
import os
import sys
import time
import types
from dataclasses import dataclass

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import ppo_llm  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from docs_tables import saved_results, write_table  # noqa: E402
from scale import machine_name  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")


@dataclass
class Args:
    table: bool = False
    """measure nothing: head_precision_<device>.md from each head_precision_<device>.json"""


def main():
    args = tyro.cli(Args)
    if args.table:
        for result in saved_results(os.path.join(RESULTS, "head_precision_*.json")):
            print(table(result))
        return
    torch.manual_seed(0)
    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = ppo_llm.Args(max_new_tokens=8)
    tokenizer, policy, *_ = ppo_llm.load_models(args, torch.device("cpu"))
    policy.to(device)
    with open(os.path.join(ROOT, "assets", "arith", "test.jsonl")) as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    r = ppo_llm.rollout(policy, tokenizer, prompts, args, contextlib.nullcontext())
    qr, am, width, responses, mask = (
        r["query_responses"],
        r["attention_mask"],
        r["prompt_width"],
        r["responses"],
        r["mask"].bool(),
    )
    results = {}
    for name, bf16, fp32_head in [("fp32", False, True), ("bf16, fp32 head", True, True), ("bf16", True, False)]:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            hidden = ppo_llm.hidden_states(policy, qr, am, width)
            results[name] = ppo_llm.lm_head_logprobs(hidden, policy, responses, 1.0, fp32=fp32_head)[0]
    errors = {}
    for name in ["bf16, fp32 head", "bf16"]:
        error = (results[name] - results["fp32"]).abs()[mask]
        errors[name] = [error.mean().item(), error.max().item()]

    hidden, head = torch.randn(1024, 768, device=device), torch.nn.Linear(768, 50257, bias=False).to(device)
    model = types.SimpleNamespace(config=types.SimpleNamespace(), get_output_embeddings=lambda: head)  # as an LM's
    labels = torch.randint(0, 50257, (1, 1024), device=device)
    timings = {}
    for fp32_head in [True, False]:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            for i in range(4):  # one warm-up
                if i == 1:
                    start = time.perf_counter()
                ppo_llm.lm_head_logprobs(hidden[None], model, labels, 1.0, fp32=fp32_head)
            if device.type == "cuda":
                torch.cuda.synchronize()
        timings["fp32" if fp32_head else "bf16"] = (time.perf_counter() - start) / 3 * 1000
    load = "" if device.type == "cuda" else f", 1 torch thread, load average {os.getloadavg()[0]:.1f}"
    result = {"device": device.type, "machine": machine_name(device.type) + load, "torch": torch.__version__}
    result |= {"tokens": int(mask.sum()), "errors": errors, "ms": timings}
    with open(os.path.join(RESULTS, f"head_precision_{device.type}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(table(result))


def table(result):
    """head_precision_<device>.md from a result (into the docs through write_table)."""
    text = "\n".join([
        f"LM head precision under bf16 autocast ({result['machine']}, torch {result['torch']}).",
        f"`python benchmarks/head_precision.py`: {result['tokens']} sampled response tokens of assets/arith-sft on "
        "its 256 held-out prompts, |log-prob - fp32 log-prob| in nats:", "",
        "| setting | mean | max |", "|---|---|---|",
        *[f"| {name} | {mean:.4f} | {top:.4f} |" for name, (mean, top) in result["errors"].items()], "",
        "Head alone, GPT-2-124M shape (1,024 tokens x 768 -> 50,257), no grad, mean of 3 calls after one warm-up:", "",
        "| head matmul | time |", "|---|---|", *[f"| {name} | {ms:.0f} ms |" for name, ms in result["ms"].items()], "",
    ])  # fmt: skip
    write_table(f"head_precision_{result['device']}.md", text, RESULTS)
    return text


if __name__ == "__main__":
    main()

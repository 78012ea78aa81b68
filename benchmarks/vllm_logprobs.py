"""Where --vllm's log-prob difference comes from, in fp32 on the CPU. Each rollout of `grpo_llm.py --vllm` (its
defaults, on --model) is scored four ways, over the policy's tokens:

- vLLM while sampling (decode, the engine's KV cache): the log-probs the run logs against the trainer's;
- vLLM again, the whole sequences in one prefill (`prompt_logprobs`): no KV cache, no sampler;
- the trainer's forward (policy_forward, fp32): what vllm/logprob_diff_* compares with;
- an fp64 copy of the trainer: the exact value, to fp32's rounding.

Run it in the vLLM venv (README):

    .venv-vllm/bin/python benchmarks/vllm_logprobs.py [--updates 3]
    python benchmarks/vllm_logprobs.py --table      # measure nothing: the table from vllm_logprobs_cpu.json

The default model is docs/scaling.md's arith2 (assets/arith-sft's weights with 2 heads: head size 80, which vLLM's
CPU attention serves), built into benchmarks/runs/ when missing."""

import copy
import json
import os
import shutil
import sys
import tempfile

import torch
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from docs_tables import saved_results, write_table  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
ARITH2 = os.path.join(ROOT, "benchmarks", "runs", "arith2")


def arith2():
    """assets/arith-sft with 2 heads (the same weights, not the same function), as docs/scaling.md builds it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.exists(os.path.join(ARITH2, "config.json")):
        sft = os.path.join(ROOT, "assets", "arith-sft")
        AutoModelForCausalLM.from_pretrained(sft, n_head=2).save_pretrained(ARITH2)
        AutoTokenizer.from_pretrained(sft).save_pretrained(ARITH2)
    return ARITH2


def compare(script, policy, args, batch):
    """One rollout's batch scored the four ways: {"a - b": (max, mean)} over the policy's tokens."""
    import vllm

    mask, rows = batch["mask"].bool(), torch.arange(len(batch["mask"]))
    with torch.no_grad():
        trainer = script.policy_forward(policy, batch, rows, args)[1]
        exact = script.policy_forward(copy.deepcopy(policy).double(), batch, rows, args)[1]
    prefill, width = torch.zeros_like(trainer), batch["query_responses"].shape[1] - batch["responses"].shape[1]
    for i in rows.tolist():
        ids = batch["query_responses"][i][batch["attention_mask"][i].bool()].tolist()
        start, n = int(batch["attention_mask"][i][:width].sum()), int(mask[i].sum())
        params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        out = script.VLLM[0].generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        scored = [p[t].logprob for p, t in zip(out.prompt_logprobs[start : start + n], ids[start : start + n])]
        prefill[i, :n] = torch.tensor(scored)
    decode = batch["vllm_logprobs"]
    pairs = {"vLLM decode - trainer": (decode, trainer), "vLLM decode - vLLM prefill": (decode, prefill),
             "vLLM decode - fp64": (decode, exact), "trainer - fp64": (trainer, exact)}  # fmt: skip
    diffs = {name: (a - b).abs()[mask] for name, (a, b) in pairs.items()}
    result = {name: (d.max().item(), d.mean().item()) for name, d in diffs.items()}
    return result | {"tokens": int(mask.sum()), "above 1e-5": int((diffs["vLLM decode - trainer"] > 1e-5).sum())}


def measure(model: str | None = None, updates: int = 3, table: bool = False, out_dir: str = RESULTS):
    """model: a served-shape causal LM (default arith2); updates: rollouts scored; table: only the table."""
    path = os.path.join(out_dir, "vllm_logprobs_cpu.json")
    if table:
        write(saved_results(path)[0], out_dir)
        return
    sys.path.insert(0, ROOT)
    import grpo_llm as script

    os.makedirs(os.path.join(ROOT, "benchmarks", "runs"), exist_ok=True)
    runs = tempfile.mkdtemp(dir=os.path.join(ROOT, "benchmarks", "runs"))  # ignored by git
    flags = ["--vllm", "--model", model or arith2(), "--total-steps", str(updates), "--eval-every", "0"]
    args = script.parse_args([*flags, "--sample-every", "0", "--output-dir", runs])
    rollout, prepare, seen, rows = script.rollout, script.prepare, {}, []

    def prepared(args, trained):  # the policy, for compare()
        seen["policy"] = trained[0]
        return prepare(args, trained)

    def scored(*a, **k):  # each training rollout, before its update
        batch = rollout(*a, **k)
        rows.append(compare(script, seen["policy"], args, batch))
        print(json.dumps(rows[-1]), flush=True)
        return batch

    script.prepare, script.rollout = prepared, scored
    script.main(args)
    shutil.rmtree(runs)
    saved = {"model": "arith2" if model is None else model, "updates": updates, "rows": rows}
    with open(path, "w") as f:
        json.dump(saved, f, indent=1)
    write(saved, out_dir)


def write(saved, out_dir):
    names = [name for name in saved["rows"][0] if " - " in name]
    command = ".venv-vllm/bin/python benchmarks/vllm_logprobs.py" + f" --updates {saved['updates']}"
    lines = [f"Model {saved['model']}, fp32, the CPU. Command: `{command}`. |a - b| over the policy's tokens, max "
             "(mean), each update's rollout:", "", "| update | tokens | above 1e-5 | " + " | ".join(names) + " |",
             "|---" * (len(names) + 3) + "|"]  # fmt: skip
    for update, row in enumerate(saved["rows"], 1):
        cells = [f"{row[name][0]:.1e} ({row[name][1]:.1e})" for name in names]
        lines.append(f"| {update} | {row['tokens']} | {row['above 1e-5']} | " + " | ".join(cells) + " |")
    write_table("vllm_logprobs_cpu.md", "\n".join(lines), out_dir)


def main():
    tyro.cli(measure)


if __name__ == "__main__":
    main()

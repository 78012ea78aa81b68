"""Build the two models of on-policy distillation on the arithmetic task: a teacher that RL trained, a smaller student.

In on-policy distillation the student samples its own responses and a stronger teacher's per-token log-probs grade
them (Agarwal et al. 2024, GKD; Lu et al. 2025, Thinking Machines). This script makes a pair for the embedded task,
two-digit addition (assets/arith), that differ in size as a teacher and a student do in practice:

- the teacher, `arith-teacher/`: the policy that `python ppo_llm.py` (the README's first command, PPO from
  assets/arith-sft with its defaults) trains, copied out of its run's `policy/` (without the critic);
- the student, `arith-student/`: a GPT-2 of 2 layers and width 128 (3x fewer parameters than arith-sft), trained from
  scratch with the arithmetic builder's SFT recipe (its noisy demonstrations, loss, optimizer and schedule).

Usage: python assets/make_distill_models.py --out-dir /tmp/distill   # writes /tmp/distill/arith-teacher, arith-student
       python assets/make_distill_models.py --overwrite            # replaces the embedded ones in assets/

Design choices, each with its reason:
1. The teacher is RL's result, not a bigger SFT model: SFT on the noisy demonstrations is right only about as often
   as they are when sampled (57%), while PPO's policy is right about 95% of the time, so the student has a sampled
   accuracy far below the teacher's to gain.
2. The teacher is made by running ppo_llm.py itself (a subprocess, its defaults, on the CPU): it is what a user gets
   from the README's first command, and nothing here re-implements PPO.
3. Both have arith-sft's tokenizer files (make_tokenizer), so `tokenizer.get_vocab()` is the same: the teacher can
   score the student's sampled ids in its own softmax. The teacher's replace those ppo_llm.py saved, which keep the
   left padding and truncation that its last tokenizer call set in the backend.
4. The student's heads are 32 wide (width 128, 4 heads), a head size vLLM's CPU attention serves, so `--vllm` can run
   it; its 2 layers still learn the carry (greedy about as right as arith-sft), so distillation can reach the teacher.
5. Both are evaluated by ppo_llm.py --eval-only on the 256 held-out prompts, as the RL scripts report accuracy:
   sampled at temperature 1 (pass@1 of 8 samples a prompt) and greedy.
6. The tokenizer, the model, the SFT loop and the task are the arithmetic builder's, imported from it.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import tyro
from transformers import AutoModelForCausalLM

# the arithmetic builder beside this file, also when this one is imported from elsewhere (the tests)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_arith_models as mam  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PPO = os.path.join(ROOT, "ppo_llm.py")


@dataclass
class Args:
    # experiment
    out_dir: str = os.path.dirname(os.path.abspath(__file__))
    """folder to write arith-teacher/ and arith-student/ into (default: the folder of this script, assets/)"""
    overwrite: bool = False
    """replace arith-teacher/ and arith-student/ when --out-dir already has them (assets/ has the embedded ones)"""
    seed: int = 1
    """seed of the student's SFT (its problems, noise and initialisation); the teacher is ppo_llm.py's default seed"""
    threads: int = 1
    """torch CPU threads of the student's SFT (ppo_llm.py picks its own: 1 for a small model on a CPU)"""

    # the student
    n_embd: int = 128
    """width of the student's GPT-2 trunk (arith-sft's is 160)"""
    n_layer: int = 2
    """number of the student's transformer blocks (arith-sft has 4)"""
    n_head: int = 4
    """number of the student's attention heads (head size n_embd / n_head)"""

    # evaluation
    eval_num_generations: int = 8
    """samples of each held-out prompt in the sampled evaluation (its pass@1 is the mean over them)"""


def run_ppo(flags: list[str], capture: bool) -> str:
    """python ppo_llm.py FLAGS from the repository's root (its default paths are relative to it), on the CPU; its
    output is printed as it comes, and returned when `capture`."""
    command = [sys.executable, PPO, "--no-cuda", *flags]
    print("$", " ".join(["python", "ppo_llm.py", *command[2:]]), flush=True)
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        print(line, end="", flush=True)
        if capture:
            lines.append(line)
    if process.wait():
        raise SystemExit(f"error: ppo_llm.py {' '.join(flags)} exited with {process.returncode} (its output is above)")
    return "".join(lines)


def make_student(args: Args, path: str):
    """The arithmetic builder's SFT of a GPT-2 of the student's shape, saved with arith-sft's tokenizer."""
    sft_args = mam.Args(seed=args.seed, n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    student = mam.train_sft(sft_args, mam.make_tokenizer())
    student.save_pretrained(path)
    # a fresh tokenizer is saved: padding calls leave their settings behind in the backend tokenizer
    mam.make_tokenizer().save_pretrained(path)


def make_teacher(path: str):
    """`python ppo_llm.py` with its defaults into a temporary folder, and its run's policy/ (without the critic)."""
    with tempfile.TemporaryDirectory() as runs:
        run_ppo(["--output-dir", runs], capture=False)
        (run_dir,) = glob.glob(os.path.join(runs, "*", ""))
        # policy/ links to the last checkpoint's copy: the final policy
        policy = os.path.realpath(os.path.join(run_dir, "policy"))
        shutil.copytree(policy, path, ignore=shutil.ignore_patterns("critic"))
        # arith-sft's tokenizer files: ppo_llm.py's save keeps the padding and truncation its last call left behind
        mam.make_tokenizer().save_pretrained(path)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            evaluations = [row for row in map(json.loads, f) if "eval/accuracy" in row]
    return evaluations[-1]["eval/accuracy"]


def held_out(path: str, flags: list[str]) -> dict:
    """ppo_llm.py --eval-only's accuracy of the model at `path`, its standard error, and the share without EOS."""
    out = run_ppo(["--eval-only", "--model", path, *flags], capture=True)
    accuracy, stderr = re.search(r"held-out accuracy ([0-9.]+) ± ([0-9.]+)", out).groups()
    clipped = re.search(r"clipped_ratio +([0-9.]+)", out)
    return {"accuracy": float(accuracy), "stderr": float(stderr), "clipped_ratio": float(clipped.group(1))}


def main(args: Args) -> dict:
    """Build the student and the teacher, evaluate both, save them; returns the measured held-out metrics."""
    start = time.time()
    # absolute, since ppo_llm.py runs from the repository's root
    student_dir = os.path.abspath(os.path.join(args.out_dir, "arith-student"))
    teacher_dir = os.path.abspath(os.path.join(args.out_dir, "arith-teacher"))
    existing = [path for path in (teacher_dir, student_dir) if os.path.exists(path)]
    if existing and not args.overwrite:
        raise SystemExit(f"error: {existing[0]} exists: pass --overwrite to replace it, or another --out-dir")
    for path in existing:
        shutil.rmtree(path)

    print(f"1/3 the student: SFT of a GPT-2 of {args.n_layer} layers, width {args.n_embd}, {args.n_head} heads")
    make_student(args, student_dir)
    print(f"2/3 the teacher: PPO from assets/arith-sft ({time.time() - start:.0f}s so far)", flush=True)
    teacher_train_accuracy = make_teacher(teacher_dir)
    print(f"3/3 held-out evaluation of both ({time.time() - start:.0f}s so far)", flush=True)
    metrics = {"teacher_last_training_eval_accuracy": teacher_train_accuracy}
    sampled = ["--eval-num-generations", str(args.eval_num_generations)]
    for name, path in [("teacher", teacher_dir), ("student", student_dir)]:
        model = AutoModelForCausalLM.from_pretrained(path)
        metrics[f"{name}_parameters"] = sum(p.numel() for p in model.parameters())
        metrics[f"{name}_safetensors_bytes"] = os.path.getsize(os.path.join(path, "model.safetensors"))
        for mode, flags in [("sampled", sampled), ("greedy", ["--eval-temperature", "0"])]:
            result = held_out(path, flags)
            metrics[f"{name}_{mode}_accuracy"] = result["accuracy"]
            metrics[f"{name}_{mode}_accuracy_stderr"] = result["stderr"]
            metrics[f"{name}_{mode}_eos_rate"] = 1 - result["clipped_ratio"]
    metrics["seconds"] = time.time() - start
    print("held-out (256 prompts):")
    for key, value in metrics.items():
        print(f"  {key:40s} {value:.3f}" if isinstance(value, float) else f"  {key:40s} {value}")
    return metrics


if __name__ == "__main__":
    main(tyro.cli(Args))

"""The benchmarks' table-only commands: without their result files they say so in one line and write nothing (a
table with a header and no rows would replace the docs'); with them, they write the tables the docs show."""

import csv
import functools
import glob
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import docs_tables  # noqa: E402


def pages():
    """The text of every page write_table may edit."""
    paths = glob.glob(os.path.join(ROOT, "docs", "*.md")) + [os.path.join(ROOT, "README.md")]
    return {path: open(path).read() for path in paths}


def redirect(monkeypatch, module, results):
    """`module` reads and writes its result files in `results`, and its tables go there only (not into the docs)."""
    monkeypatch.setattr(module, "RESULTS" if hasattr(module, "RESULTS") else "OUT", str(results))
    monkeypatch.setattr(module, "write_table", functools.partial(docs_tables.write_table, results_dir=str(results)))


def run_main(monkeypatch, module, argv):
    monkeypatch.setattr(sys, "argv", [module.__file__, *argv])
    return module.main()


@pytest.mark.parametrize(
    "script, argv, names",
    [
        ("lora", ["--part", "table"], ["--part table", "lora.json does not exist"]),
        ("classic", ["--only-existing", "--skip-speed"], ["--merge"]),
        ("classic", ["--only-existing", "--merge", "--skip-speed"], ["classic.csv"]),
        ("psi_variance", ["--from-csv"], ["--from-csv", "psi_variance.csv does not exist"]),
        ("llm_learning", ["--no-run", "--configs", "trace"], ["trace-ppo trace-grpo", "--configs trace-ppo"]),
        ("llm_learning", ["--no-run", "--configs", "vllm"], ["grpo-2heads grpo-2heads-vllm", "--configs grpo-2heads"]),
        ("llm_learning", ["--no-run", "--configs", "distill"], ["distill-grpo distill-ppo", "--configs distill-grpo"]),
        ("trl_learning", ["--part", "table"], ["--part table", "trl_learning.json does not exist"]),
        ("trl_learning", ["--task", "calc", "--part", "table"], ["--part table", "trl_calc.json does not exist"]),
        ("trl_learning", ["--task", "distill", "--part", "table"], ["--part table", "trl_distill.json does not exist"]),
        ("trl_learning", ["--task", "guess", "--part", "table"], ["--part table", "trl_guess.json does not exist"]),
        ("llm_learning", ["--no-run", "--configs", "guess"], ["guess-ppo guess-ppo-summed", "--configs guess-ppo"]),
        ("eval_noise", ["--table"], ["--table", "eval_noise.json does not exist"]),
        ("head_precision", ["--table"], ["--table", "head_precision_*.json does not exist"]),
        ("save_time", ["--table"], ["--table", "save_time.json does not exist"]),
        ("llm_speed", ["--table"], ["--table", "llm_speed_*.json does not exist"]),
        ("torchrun_stress", ["--table"], ["--table", "torchrun_stress_ppo_llm.json does not exist"]),
        ("scale", ["--table"], ["--table", "scale_c*.json does not exist"]),
        ("gpu", ["--table"], ["--table", "gpu_*.json does not exist"]),
        ("ablations", ["--table"], ["--table", "ablations.json does not exist"]),
        ("passes", ["--table"], ["--table", "passes_*.json does not exist"]),
        ("vllm_speed", ["--table"], ["--table", "vllm_c*.json does not exist"]),
        ("vllm_logprobs", ["--table"], ["--table", "vllm_logprobs_cpu.json does not exist"]),
    ],
)
def test_a_table_only_command_without_its_results_says_so_and_writes_nothing(
    monkeypatch, tmp_path, script, argv, names
):
    module = importlib.import_module(script)
    results = tmp_path / "results"
    if script in ("llm_learning", "trl_learning"):
        argv = [*argv, "--out-dir", str(results), "--runs-dir", str(tmp_path / "runs")]
    elif script in ("eval_noise", "llm_speed", "scale", "vllm_speed", "vllm_logprobs"):
        argv = [*argv, "--out-dir", str(results)]
    elif script == "torchrun_stress":
        argv = [*argv, "--root", str(tmp_path)]
    else:
        redirect(monkeypatch, module, results)
    if script == "classic":
        monkeypatch.setattr(module, "REPO", str(tmp_path))  # no runs/ there either
    before = pages()
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, module, argv)
    message = str(e.value)
    assert message.startswith("error: ") and "\n" not in message, message
    for name in names:
        assert name in message, (name, message)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    assert pages() == before


def test_lora_table_refuses_a_results_file_without_results(monkeypatch, tmp_path):
    lora = importlib.import_module("lora")
    redirect(monkeypatch, lora, tmp_path)
    (tmp_path / "lora.json").write_text(json.dumps({"machine": "m", "memory": {}, "learning": {}}))
    with pytest.raises(SystemExit, match="lora.json has no results"):
        run_main(monkeypatch, lora, ["--part", "table"])
    assert sorted(os.listdir(tmp_path)) == ["lora.json"]


def fake_run(runs_dir, name, seed, total_steps, records, ms=1000):
    """A run directory as the scripts write it (<exp-name>__<seed>__<ms>): args.json and metrics.jsonl."""
    run_dir = runs_dir / name / f"{name}__{seed}__{ms}"
    run_dir.mkdir(parents=True)
    (run_dir / "args.json").write_text(json.dumps({"seed": seed, "total_steps": total_steps}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_llm_learning_keeps_each_seeds_curves_and_writes_its_tables_from_them_alone(monkeypatch, tmp_path):
    llm_learning = importlib.import_module("llm_learning")
    runs, out = tmp_path / "runs", tmp_path / "out"
    for name in ["trace-ppo", "trace-grpo"]:
        for seed in [1, 2]:
            start = [{"update": 0, "episode": 0, "eval/accuracy": 0.25 * seed, "eval/accuracy_stderr": 0.03}]
            updates = [{"update": u, "episode": 64 * u, "time/elapsed": 400.0 * u, "loss": 1.0} for u in [1, 2, 3]]
            updates[-1] |= {"eval/accuracy": 0.5 + 0.125 * seed, "eval/accuracy_stderr": 0.03}
            fake_run(runs, name, seed, 3, start + updates)
    fake_run(runs, "trace-grpo", 2, 5, start + updates, ms=2000)  # a later run of seed 2, unfinished: not collected
    args = llm_learning.Args(seeds=[1, 2], runs_dir=str(runs), out_dir=str(out))
    for name in ["trace-ppo", "trace-grpo"]:
        llm_learning.collect(args, name)
    with open(out / "llm_curves" / "trace-grpo.csv") as f:
        lines = f.read().splitlines()
    # the metrics the tables read, not the others ("loss"); an accuracy k/256 exactly; 1 + 4 rows a seed
    assert lines[0] == "seed,update,episode,time/elapsed,eval/accuracy,eval/accuracy_stderr"
    assert lines[1:3] == ["1,0,0,,0.25,0.03", "1,1,64,400,,"] and len(lines) == 1 + 2 * 4
    written = []
    for _ in range(2):  # the table-only command twice: the same bytes (what a clean git diff needs)
        run_main(monkeypatch, llm_learning, ["--no-run", "--configs", "trace", "--out-dir", str(out)])
        written.append({name: (out / name).read_bytes() for name in ["trace_learning.md", "trace_learning.png"]})
    assert written[0] == written[1]
    table = written[0]["trace_learning.md"].decode()
    # start (0.25 + 0.5) / 2 = 0.375 ± 0.125; after 15 min (900 s): update 2 at 800 s has no evaluation, so the
    # last one at or before is update 0's; end (0.625 + 0.75) / 2 = 0.6875; 3 updates in 1200 s = 20.0 min
    assert "| trace-ppo (`ppo_llm.py --total-steps 150`) | 2 | 0.375 ± 0.125 | 0.375 ± 0.125 | 0.688 ± 0.062 |" in table
    assert "3 updates in 20.0 min; 3 updates in 20.0 min |" in table


def test_llm_learning_vllm_table_and_verdict_from_the_curves(monkeypatch, tmp_path):
    llm_learning = importlib.import_module("llm_learning")
    runs, out = tmp_path / "runs", tmp_path / "out"
    # held-out accuracy of each seed (seed 1, seed 2): grpo's at updates 0, 10, 20 of 20; ppo's at 0, 10, .., 40 of 40,
    # the same in both legs
    accuracy = {
        "grpo-2heads": [[0.5, 0.5, 0.75], [0.5, 0.75, 0.875]],
        "grpo-2heads-vllm": [[0.5, 0.75, 0.75], [0.5, 0.875, 0.75]],
        "ppo-2heads": [[0.5] * 5, [0.625] * 5],
        "ppo-2heads-vllm": [[0.5] * 5, [0.625] * 5],
    }
    for name, seeds in accuracy.items():
        for seed, acc in enumerate(seeds, start=1):
            last = 10 * (len(acc) - 1)
            records = [{"update": u, "episode": 64 * u, "time/elapsed": 6.0 * u} for u in range(last + 1)]
            for u, a in zip(range(0, last + 1, 10), acc):
                records[u]["eval/accuracy"] = a
            if name.endswith("vllm"):
                for u in range(1, last + 1):
                    records[u]["vllm/logprob_diff_max"] = 1e-6 * seed if u == last else 4e-6 * seed**3
            fake_run(runs, name, seed, last, records)
    args = llm_learning.Args(seeds=[1, 2], runs_dir=str(runs), out_dir=str(out))
    for name in accuracy:
        llm_learning.collect(args, name)
    run_main(monkeypatch, llm_learning, ["--no-run", "--configs", "vllm", "--out-dir", str(out)])
    grpo, ppo = (out / "vllm_learning.md").read_text().split("\n\n`.venv-vllm/bin/python ")[1:]
    assert grpo.startswith("grpo_llm.py --model benchmarks/runs/arith-2heads/arith-sft --seed S [--vllm]`, 2 seeds")
    assert ppo.startswith("ppo_llm.py --model benchmarks/runs/arith-2heads/arith-sft --total-steps 100 --seed S")
    # grpo: a row for each of its 3 evaluations (every 3 // 10 -> 1st); the means: update 0 0.5 and 0.5; update 10
    # (0.5 + 0.75) / 2 = 0.625 and (0.75 + 0.875) / 2 = 0.8125, above [0.5, 0.75]; update 20 (0.75 + 0.875) / 2 = 0.8125
    # and (0.75 + 0.75) / 2 = 0.75, within [0.75, 0.875]
    assert "| 0 | 0.500 | 0.500, 0.500 | 0.500 | 0.500, 0.500 | yes |" in grpo
    assert "| 10 | 0.625 | 0.500, 0.750 | 0.812 | 0.750, 0.875 | no |" in grpo
    assert "| 20 | 0.812 | 0.750, 0.875 | 0.750 | 0.750, 0.750 | yes |" in grpo
    # inside at 2 of 3; the gaps 0, 0.8125 - 0.625 = 0.1875 and 0.8125 - 0.75 = 0.0625 average 0.25 / 3 = 0.083; the
    # spreads 0, 0.25 and 0.125 average 0.125: 0.083 <= 0.125
    assert "within generate()'s seeds' min-max at 2 of 3 evaluations" in grpo
    assert "differ by 0.083 on average, generate()'s seeds by 0.125" in grpo and grpo.rstrip().endswith(": yes.")
    # the last update's diff 1e-6 and 2e-6; the others' 4e-6 * 1 and 4e-6 * 8 = 3.2e-5: the largest, and above 1e-5 in
    # seed 2's 19 updates before its last; 20 updates of 6 s = 2.0 min
    assert "at the last update: 1.0e-06, 2.0e-06; the largest over every update: 4.0e-06, 3.2e-05" in grpo
    assert "updates above 1e-5: 0 of 20, 19 of 20." in grpo
    assert "generate() 2.0, 2.0, vLLM 2.0, 2.0." in grpo
    # ppo: a row for each of its 5 evaluations, the same in both legs: means (0.5 + 0.625) / 2 = 0.5625
    assert (
        "Rows: 5 of the 5 evaluations" in ppo
        and ppo.count("| 0.562 | 0.500, 0.625 | 0.562 | 0.500, 0.625 | yes |") == 5
    )
    assert "at 5 of 5 evaluations; the two means differ by 0.000 on average, generate()'s seeds by 0.125" in ppo


def test_llm_learning_distill_table_from_the_curves(monkeypatch, tmp_path):
    llm_learning = importlib.import_module("llm_learning")
    runs, out = tmp_path / "runs", tmp_path / "out"
    # held-out accuracy of seed 1 and seed 2 at updates 0, 10, 20, 30 of 30; GRPO 64 samples and 6 s an update, PPO 128
    # and 12 s; the teacher's accuracy 0.875 (seed 1) and 1.0 (seed 2) in every distillation run: mean 0.9375, 90% of
    # it 0.84375
    accuracy = {
        "distill-grpo": [[0.5, 0.75, 0.875, 0.875], [0.5, 0.875, 0.875, 0.875]],
        "distill-ppo": [[0.5, 0.875, 0.875, 0.875], [0.5, 0.875, 0.875, 0.875]],
        "distill-ppo-gamma0": [[0.5, 0.625, 0.75, 0.875], [0.5, 0.5, 0.5, 0.5]],
        "rl-grpo": [[0.5, 0.5, 0.625, 0.75], [0.5, 0.625, 0.75, 0.875]],
        "rl-ppo": [[0.5, 0.625, 0.875, 0.875], [0.5, 0.75, 0.75, 0.875]],
    }
    for name, seeds in accuracy.items():
        samples, seconds = (64, 6.0) if "grpo" in name else (128, 12.0)
        for seed, acc in enumerate(seeds, start=1):
            records = [{"update": u, "episode": samples * u, "time/elapsed": seconds * u} for u in range(31)]
            for u, a in zip([0, 10, 20, 30], acc):
                records[u]["eval/accuracy"] = a
            if name.startswith("distill"):  # the reverse KL 0.5, then 0.25 (seed 1) and 0.5 (seed 2) in the last 10
                records[0]["distill/teacher_accuracy"] = 0.75 + 0.25 * seed / 2
                for u in range(1, 31):
                    records[u]["distill/reverse_kl"] = 0.5 if u <= 20 else 0.25 * seed
            fake_run(runs, name, seed, 30, records)
    args = llm_learning.Args(seeds=[1, 2], runs_dir=str(runs), out_dir=str(out))
    for name in accuracy:
        llm_learning.collect(args, name)
    run_main(monkeypatch, llm_learning, ["--no-run", "--configs", "distill", "--out-dir", str(out)])
    assert (out / "distill_learning.png").exists()
    table = (out / "distill_learning.md").read_text()
    rows = {line.split(" (`")[0][2:]: line.split("`) | ")[1] for line in table.splitlines() if "`) | 2 |" in line}
    # distill-grpo: 0.84375 first reached at update 20 (seed 1) and 10 (seed 2): 1280 and 640 samples, 120 and 60 s;
    # the reverse KL's last 10 updates 0.25 and 0.5: mean 0.375 +- 0.125
    assert rows["distill-grpo"] == (
        "2 | 0.500 ± 0.000 | 0.875 ± 0.000 | 15 ± 5 | 960 ± 320 | 1.5 ± 0.5 | 0.375 ± 0.125 |"
    )
    assert rows["distill-ppo"] == "2 | 0.500 ± 0.000 | 0.875 ± 0.000 | 10 ± 0 | 1280 ± 0 | 2.0 ± 0.0 | 0.375 ± 0.125 |"
    # seed 2 at gamma 0 never gets there; seed 1 at update 30, 3840 samples, 360 s
    assert "| 30 ± 0 (1/2 seeds) | 3840 ± 0 (1/2 seeds) | 6.0 ± 0.0 (1/2 seeds) |" in rows["distill-ppo-gamma0"]
    # rl-ppo: update 20 and 30, 2560 and 3840 samples (mean 3200), 240 and 360 s; RL logs no reverse KL
    assert rows["rl-ppo"] == "2 | 0.500 ± 0.000 | 0.875 ± 0.000 | 25 ± 5 | 3200 ± 640 | 5.0 ± 1.0 | no teacher |"
    assert "| 30 ± 0 (1/2 seeds) | 1920 ± 0 (1/2 seeds) |" in rows["rl-grpo"]
    teacher = (
        "the teacher (assets/arith-teacher): held-out accuracy 0.938 ± 0.062 (`distill/teacher_accuracy` of the 6 "
    )
    assert teacher + "runs with a teacher), 90% of it 0.844." in table
    assert (
        "| the teacher (`assets/arith-teacher`: `distill/teacher_accuracy` of each run with a teacher) | 6 runs | "
        "0.938 ± 0.062 | - |" in table
    )
    # GRPO: rl-grpo's seed 1 never gets there, so its 30 x 64 = 1920 samples count (a lower bound), seed 2 1920:
    # 1920 / 960 = 2.0, 1920 / 1280 = 1.5 to 1920 / 640 = 3.0; PPO: 3200 / 1280 = 2.5, 2560 / 1280 = 2.0 to
    # 3840 / 1280 = 3.0; at gamma 0 distillation's seed 2 never gets there, so its 30 x 128 = 3840 samples count (an
    # upper bound): 3200 / 3840 = 0.83, 2560 / 3840 = 0.67 to 3840 / 3840 = 1.0
    assert "| GRPO (rl-grpo / distill-grpo) | >= 2.0x (>= 1.5x to >= 3.0x) |" in table
    assert "| PPO (rl-ppo / distill-ppo) | 2.5x (2.0x to 3.0x) |" in table
    assert "| PPO, distillation at gamma 0 (rl-ppo / distill-ppo-gamma0) | <= 0.8x (<= 0.7x to <= 1.0x) |" in table
    # the ends: GRPO 0.875 (std 0) against (0.75 + 0.875) / 2 = 0.8125 (std 0.0625), a gap of 0.0625, not more than
    # 0 + 0.0625; PPO 0.875 and 0.875; at gamma 0 (0.875 + 0.5) / 2 = 0.6875 (std 0.1875) against 0.875 (std 0)
    assert (
        "(Lu et al., 2025, math with Qwen3 models): GRPO: at least 2.0x (an RL seed never got there), which does not "
        "place it; PPO: 2.5x, below it; PPO, distillation at gamma 0: at most 0.8x (a distillation seed never got "
        "there), below it."
        " Held-out accuracy at the end, after the same samples: GRPO: distillation 0.875, RL 0.812, a difference of "
        "+0.062, not more than their standard deviations together (0.062); PPO: distillation 0.875, RL 0.875, a "
        "difference of +0.000, not more than their standard deviations together (0.000); PPO, distillation at gamma 0: "
        "distillation 0.688, RL 0.875, a difference of -0.188, not more than their standard deviations together "
        "(0.188). That is what 2 seeds of one toy task show (evaluations 10 updates apart"
    ) in table


def test_llm_learning_guess_table_and_verdict_from_the_curves(monkeypatch, tmp_path):
    llm_learning = importlib.import_module("llm_learning")
    runs, out = tmp_path / "runs", tmp_path / "out"
    # held-out (success, guesses) of seeds 1 and 2 at updates 0, 10, 20 of 20; 128 samples and 30 s an update
    evals = {
        "guess-ppo": [[(0.75, 6.0), (0.875, 5.5), (1.0, 4.5)], [(0.75, 6.0), (0.875, 5.0), (0.875, 4.75)]],
        "guess-ppo-summed": [[(0.75, 6.0), (0.75, 5.75), (0.875, 5.25)], [(0.75, 6.0), (0.875, 5.5), (0.875, 5.5)]],
        "guess-grpo": [[(0.75, 6.0), (0.875, 6.0), (0.875, 5.5)], [(0.75, 6.0), (0.75, 6.0), (0.875, 5.0)]],
        "guess-ppo-control": [[(0.75, 6.0), (0.75, 7.0), (0.5, 8.0)], [(0.75, 6.0), (0.625, 7.0), (0.625, 8.0)]],
    }
    for name, seeds in evals.items():
        for seed, points in enumerate(seeds, start=1):
            records = [{"update": u, "episode": 128 * u, "time/elapsed": 30.0 * u} for u in range(21)]
            for u, (success, guesses) in zip([0, 10, 20], points):
                records[u] |= {"eval/accuracy": success, "eval/tools/call_frequency": guesses}
                records[u]["eval/mean_reward"] = success - 0.1 * guesses
            fake_run(runs, name, seed, 20, records)
    args = llm_learning.Args(seeds=[1, 2], runs_dir=str(runs), out_dir=str(out))
    for name in evals:
        llm_learning.collect(args, name)
    run_main(monkeypatch, llm_learning, ["--no-run", "--configs", "guess", "--out-dir", str(out)])
    assert (out / "guess_learning.png").exists()
    table = (out / "guess_learning.md").read_text()
    rows = {line.split(" (`")[0][2:]: line.split("`) | ")[1] for line in table.splitlines() if "`) | 2 |" in line}
    # guess-ppo: success at the end 1.0 and 0.875 (0.9375 +- 0.0625), guesses 4.5 and 4.75 (4.625 +- 0.125), against
    # bisection's 129 / 31 = 4.161: +0.464 (+0.46); mean reward 1 - 0.45 = 0.55 and 0.875 - 0.475 = 0.4 (0.475 +-
    # 0.075); seed 1 reaches success 0.9 at update 20 (2560 samples, 10.0 min), seed 2 never; <= 5 guesses at update
    # 20 (seed 1) and 10 (seed 2): 2560 and 1280 samples; 20 x 30 s = 10 min a run
    assert rows["guess-ppo"] == (
        "2 | 0.750 ± 0.000 | 0.938 ± 0.062 | 6.00 ± 0.00 | 4.62 ± 0.12 | +0.46 ± 0.12 | 0.475 ± 0.075 | 20 ± 0 (1/2 "
        "seeds) | 2560 ± 0 (1/2 seeds) | 10.0 ± 0.0 (1/2 seeds) | 1920 ± 640 | 10.0 ± 0.0 |"
    )
    # summed: never success 0.9 nor <= 5 guesses
    assert "| not reached | not reached | not reached | not reached | 10.0 ± 0.0 |" in rows["guess-ppo-summed"]
    assert "| guess-ppo | 1.000, 0.875 | 4.50, 4.75 | 2560, - |" in table
    # the verdict: success 0.9375 against 0.875, the seeds overlap (0.875 in both); guesses 4.625 against 5.375, every
    # per-turn seed below every summed one; samples to 0.9: per-turn 2560 and 2560 (the whole run, a lower bound),
    # summed 2560 and 2560: overlap; to <= 5 guesses per-turn 2560 and 1280, summed 2560 and 2560 (their whole runs):
    # overlap at 2560
    assert (
        "Verdict: per-turn credit helped, on 1 of 4 measures with no seed overlap (held-out success at the end: "
        "per-turn 0.938, summed 0.875, no clear difference (the seeds overlap); held-out guesses at the end: per-turn "
        "4.62, summed 5.38, per-turn better; samples to success >= 0.9: per-turn 2560, summed 2560, no clear "
        "difference (the seeds overlap); samples to <= 5 guesses: per-turn 1920, summed 2560, no clear difference (the "
        "seeds overlap)). The control gained -0.188 success from start to end, guess-ppo +0.188: what PPO learns needs "
        "the answers. GRPO, which credits every token with the episode's total, ends at success 0.875 and 5.25 guesses"
    ) in table


def test_trl_guess_table_from_its_results(monkeypatch, tmp_path):
    trl_learning = importlib.import_module("trl_learning")
    args = {"jobs": 2, "trl": ["fixed"], "seeds": [1, 2], "updates": 20, "eval_every": 10}
    runs = {}
    for kind, success, calls, seconds in [("ours", 0.875, 5.0, [2.0, 4.0]), ("fixed", 0.75, 5.5, [1.0, 3.0, 5.0])]:
        for seed in [1, 2]:
            runs[f"{kind}-{seed}"] = {"kind": kind, "seed": seed, "updates": [0, 10, 20], "s_per_update": seconds}
            runs[f"{kind}-{seed}"] |= {
                "accuracy": [0.75, 0.75, success + 0.125 * (seed - 1)],
                "calls": [6.0, 6.0, calls],
            }
    results = {"machine": "a test", "torch": "x", "args": args, "runs": runs}
    (tmp_path / "trl_guess.json").write_text(json.dumps(results))
    run_main(monkeypatch, trl_learning, ["--task", "guess", "--part", "table", "--out-dir", str(tmp_path)])
    table = (tmp_path / "trl_guess.md").read_text()
    # success at update 20: ours 0.875 and 1.0 (mean 0.9375, shown 0.94), TRL 0.75 and 0.875 (0.81); guesses 5.0 and
    # 5.5; seconds per update: the median of 2, 4, 2, 4 = 3.0 and of 1, 3, 5, 1, 3, 5 = 3.0
    assert (
        "| 2 | 0.75 (0.75, 0.75) | 0.75 (0.75, 0.75) | 0.94 (0.88, 1.00) | 6.00 (6.00, 6.00) | 6.00 (6.00, 6.00) "
        in table
    )
    assert "| 5.00 (5.00, 5.00) | 3.00 |" in table
    assert "(this benchmark's patches) | 2 | 0.75 (0.75, 0.75) | 0.75 (0.75, 0.75) | 0.81 (0.75, 0.88) |" in table
    assert (
        "`python benchmarks/trl_learning.py --task guess --trl fixed --seeds 1 2 --updates 20 --eval-every 10`" in table
    )


def test_llm_learning_vllm_without_the_vllm_venv_says_so_and_runs_nothing(monkeypatch, tmp_path):
    llm_learning = importlib.import_module("llm_learning")
    monkeypatch.setattr(llm_learning, "VLLM_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    args = llm_learning.Args(seeds=[1], runs_dir=str(tmp_path / "runs"), out_dir=str(tmp_path / "out"))
    with pytest.raises(SystemExit, match="^error: --configs vllm runs in .*no-venv/bin/python, which is missing: the"):
        llm_learning.run_all(args, ["grpo-2heads"])
    assert not list(tmp_path.iterdir())


def test_llm_learning_collect_names_a_seed_without_a_finished_run(tmp_path):
    llm_learning = importlib.import_module("llm_learning")
    fake_run(tmp_path / "runs", "trace-ppo", 1, 3, [{"update": 0, "episode": 0}, {"update": 1, "episode": 128}])
    args = llm_learning.Args(seeds=[1], runs_dir=str(tmp_path / "runs"), out_dir=str(tmp_path / "out"))
    with pytest.raises(SystemExit, match="^error: trace-ppo: no finished run of seed 1 in .*trace-ppo_<seed>.log"):
        llm_learning.collect(args, "trace-ppo")
    assert not (tmp_path / "out").exists()


def test_the_committed_curves_rebuild_every_committed_learning_table_and_figure(monkeypatch, tmp_path):
    """llm_learning.py's table-only command, from the committed benchmarks/results/llm_curves/ alone, writes each of
    its tables and figures byte for byte as committed: after it, git diff is empty."""
    llm_learning = importlib.import_module("llm_learning")
    shutil.copytree(os.path.join(RESULTS, "llm_curves"), tmp_path / "llm_curves")
    groups = ["arithmetic", "trace", "trace-family", "calc", "vllm", "distill", "guess"]
    run_main(monkeypatch, llm_learning, ["--no-run", "--configs", *groups, "--out-dir", str(tmp_path)])
    written = sorted(path.name for path in tmp_path.iterdir() if path.is_file())
    assert written == [
        "calc_learning.md",
        "calc_learning.png",
        "distill_learning.md",
        "distill_learning.png",
        "guess_learning.md",
        "guess_learning.png",
        "llm_accuracy.png",
        "llm_learning.md",
        "llm_reward_hacking.png",
        "trace_family.md",
        "trace_family.png",
        "trace_learning.md",
        "trace_learning.png",
        "vllm_learning.md",
        "vllm_learning.png",
    ]
    for name in written:
        with open(os.path.join(RESULTS, name), "rb") as f:
            assert (tmp_path / name).read_bytes() == f.read(), name


@pytest.mark.e2e
def test_gpu_smoke_runs_every_part(tmp_path):
    """benchmarks/gpu.py --smoke: each part at toy size on the CPU, into OUT alone; every part runs and writes its
    result files, with numbers in them."""
    results_before = {path: path.read_bytes() for path in sorted(Path(RESULTS).rglob("*")) if path.is_file()}
    before = pages()
    out = tmp_path / "out"
    command = [sys.executable, "benchmarks/gpu.py", "--smoke", "--vllm-python", str(tmp_path / "no-venv"), str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    # three files: few enough for a machine that hands back a handful
    assert sorted(os.listdir(out)) == ["results.tar.gz", "summary.json", "summary.md"]
    summary = json.loads((out / "summary.json").read_text())
    parts = summary["parts"]
    assert list(parts) == ["setup", "tests", "speed", "trl", "head", "learning", "vllm"]
    for name in parts:  # the vllm part: in tests/test_vllm.py, with the vLLM venv
        assert parts[name]["state"] == ("skipped: no vLLM venv (--vllm-python)" if name == "vllm" else "ok"), name
    assert parts["tests"]["tests"]["tests"] > 0 and parts["tests"]["tests"]["failed"] == []
    assert {"torch", "transformers", "peft", "pyarrow", "fsspec"} <= set(summary["versions"])
    assert "| setup | " in (out / "summary.md").read_text() and "torchrun with NCCL" in (out / "summary.md").read_text()

    with tarfile.open(out / "results.tar.gz") as tar:
        packed = {member.name: tar.extractfile(member).read().decode() for member in tar if member.isfile()}
    assert {"logs/speed.log", "logs/tests-test_lm_head.xml", "logs/learning.log", "logs/gpu-ppo_1.log"} <= set(packed)
    speed = json.loads(packed["results/llm_speed_arith-sft_cpu.json"])
    assert len(speed["results"]) == 3 and "--out-dir" not in speed["command"]
    for r in speed["results"].values():
        assert r["time/total"] > 0 and r["perf/tokens_per_sec"] > 0 and r["perf/peak_memory_mb"] > 0
    scale = json.loads(packed["results/scale_cpu.json"])
    ours = scale["results"]["tiny-grpo"]["ours"]
    assert ours["s/update"] > 0 and ours["perf/peak_memory_mb"] > 0 and ours["estimate_gb"] > 0
    assert [(row["impl"], sorted(row["peak_mb"])) for row in scale["head"]["rows"]] == [
        ("chunked", ["16"]),
        ("naive", ["16"]),
    ]
    assert all(row["peak_mb"]["16"] >= 0 for row in scale["head"]["rows"])
    curves = csv.DictReader(packed["results/llm_curves/gpu-ppo.csv"].splitlines())
    accuracy = [float(row["eval/accuracy"]) for row in curves if row["eval/accuracy"]]
    assert len(accuracy) == 2 and all(0 <= a <= 1 for a in accuracy)  # before the update and after it
    for table in ["llm_speed_arith-sft_cpu.md", "scale_cpu.md", "scale_head_cpu.md", "llm_learning_cuda.md"]:
        assert "|---|" in packed[f"results/{table}"], table

    gpu = importlib.import_module("gpu")
    with pytest.raises(SystemExit, match="^error: --install-results .*: a --smoke run; only a GPU run's results"):
        gpu.install(str(out), str(tmp_path / "installed"))
    assert pages() == before
    assert {path: path.read_bytes() for path in sorted(Path(RESULTS).rglob("*")) if path.is_file()} == results_before


def test_gpu_a_set_up_that_does_not_finish_ends_the_run_in_one_line(tmp_path):
    # without tyro and datasets no part can run: a set-up cut off (or failed) ends the run, with the versions found
    out = tmp_path / "out"
    command = [sys.executable, "benchmarks/gpu.py", "--smoke", "--budget", "setup=0.1", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: the set-up cut off (cut off: past its budget of 0.1 s), so no part can run")
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["parts"]) == ["setup"] and summary["versions"]["torch"] != "not installed"


def test_gpu_a_pytest_cut_off_writes_its_report(tmp_path):
    # stop() sends SIGINT first: pytest, interrupted in its second test, still writes the junit XML of the first
    gpu = importlib.import_module("gpu")
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_quick():\n    pass\n\ndef test_slow():\n    time.sleep(60)\n"
    )
    xml = tmp_path / "tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", str(tmp_path)]
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # as gpu.py's main() sets it
    try:
        state = gpu.run_part([command], os.environ, 6, tmp_path / "log")
    finally:
        signal.signal(signal.SIGINT, handler)
    assert state == "cut off" and "KeyboardInterrupt" in (tmp_path / "log").read_text()
    assert gpu.junit_counts([xml]) == {"tests": 1, "failures": 0, "errors": 0, "skipped": 0, "failed": []}
    # the tests part's files run one after the other, a failed one or not; the part is then "failed"
    commands = [[sys.executable, "-c", "raise SystemExit(3)"], [sys.executable, "-c", f"open({str(xml)!r}, 'w')"]]
    assert gpu.run_part(commands, os.environ, 60, tmp_path / "log", keep_going=True) == "failed (exit 3)"
    assert xml.read_text() == ""


def ablated(name):
    """A fresh copy of ppo_llm with ablation `name` applied (the imported ppo_llm stays as it is)."""
    ablations = importlib.import_module("ablations")
    spec = importlib.util.spec_from_file_location(f"ppo_llm_{len(name)}", os.path.join(ROOT, "ppo_llm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ablations.apply(module, name)
    return module


def test_each_ablation_changes_what_it_says(tmp_path):
    import torch

    ablations = importlib.import_module("ablations")
    for name in ablations.ABLATIONS:  # every line an ablation replaces is in ppo_llm.py, once
        ablated(name)
    # detail 2: tokens after the first EOS (id 1) stay in the mask
    responses = torch.tensor([[5, 1, 0, 0]])
    assert ablated("no EOS cut").truncate_after_eos(responses, [1], 0)[1].tolist() == [[True] * 4]
    # detail 6: positions counted from the left edge, padding included
    assert ablated("position ids 0, 1, 2, ...").position_ids(torch.tensor([[0, 1, 1]])).tolist() == [[0, 1, 2]]
    # detail 10: V = 2 from V_old = 0 with c = 0.2 against R = 2: clipped, 1/2 (0.2 - 2)^2 = 1.62; unclipped, 0
    args = (torch.tensor([[2.0]]), torch.zeros(1, 1), torch.tensor([[2.0]]), torch.ones(1, 1), 0.2)
    assert ablated("full").value_loss(*args)[0].item() == pytest.approx(1.62)
    assert ablated("no value clipping").value_loss(*args)[0].item() == 0.0
    # detail 8: the value head's weight random; detail 3, 12: beta 0, the reference still scored: its KL is logged
    policy = torch.nn.Module()
    policy.config = types.SimpleNamespace(hidden_size=4)
    args = importlib.import_module("ppo_llm").Args(critic="head")
    _, head = ablated("random value head").build_value_model(args, torch.device("cpu"), policy, None, None, None)
    assert head.weight.abs().sum() > 0 and not head.bias.any()
    # the run itself at toy size, in a process of its own as every ablation's: beta 0 logged, the KL measured still
    toy = ["--prompts-per-update", "8", "--num-mini-batches", "1", "--eval-size", "8", "--eval-every", "2"]
    spec = {"ablation": "no KL penalty", "seed": 1, "total_steps": 2, "run_dir": str(tmp_path), "toy": toy}
    done = subprocess.run([sys.executable, "benchmarks/ablations.py", "--child", json.dumps(spec)], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout.splitlines()[-1])
    assert record["kl_coef"] == 0 and record["final_kl"] != 0 and record["first_ratio"] == 1.0
    assert [update for update, _ in record["curve"]] == [0, 2] and not record["diverged"]


def test_the_committed_ablations_rebuild_their_table_and_figure(monkeypatch, tmp_path):
    # ablations.py --table, from the committed ablations.json alone, writes its table and figure byte for byte
    ablations = importlib.import_module("ablations")
    shutil.copy(os.path.join(RESULTS, "ablations.json"), tmp_path)
    redirect(monkeypatch, ablations, tmp_path)
    run_main(monkeypatch, ablations, ["--table"])
    for name in ["ablations.md", "ablations.png"]:
        with open(os.path.join(RESULTS, name), "rb") as f:
            assert (tmp_path / name).read_bytes() == f.read(), name

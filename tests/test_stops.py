"""Nothing is lost when a run stops: an error inside the loop saves first and --resume goes on where the run would
have been; SIGTERM (a scheduler's preemption) saves and exits 128 + 15; bad files are one line."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import interrupt_generation, untimed_metrics

import grpo_llm
import ppo_llm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAKY = """import os

calls = []


def exact(completions, answer, **columns):
    # the arithmetic reward, but the `fail_at`-th call raises once (a marker file remembers it), as a user's function
    # can on one odd completion late in a run
    calls.append(1)
    if len(calls) == {fail_at} and not os.path.exists({marker!r}):
        open({marker!r}, "w").close()
        raise ValueError("an odd completion")
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
"""


def run(script, tiny, tmp_path, **kwargs):
    ppo = script is ppo_llm
    shape = dict(prompts_per_update=8, num_mini_batches=2) if ppo else dict(prompts_per_update=2, num_generations=4)
    settings = dict(model=tiny["policy"], dataset=tiny["jsonl"], total_steps=3, micro_batch_size=4, max_new_tokens=3,
                    eval_every=0, sample_every=0, output_dir=str(tmp_path)) | shape  # fmt: skip
    return script.main(script.Args(**(settings | kwargs)))


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
def test_an_error_saves_first_and_resume_goes_on(script, tiny, tmp_path, capsys):
    rewards = tmp_path / "flaky.py"
    rewards.write_text(FLAKY.format(fail_at=2, marker=str(tmp_path / "failed")))  # one call an update
    spec = f"{rewards}:exact"
    reward_fn = spec if script is ppo_llm else (spec,)
    with pytest.raises(SystemExit) as stop:
        run(script, tiny, tmp_path / "split", reward_fn=reward_fn)
    err = capsys.readouterr().err
    (run_dir,) = (tmp_path / "split").iterdir()
    assert stop.value.code == 1 and "ValueError: an odd completion" in err  # the user's own traceback
    assert err.rstrip().splitlines()[-1].endswith(f"python {script.__name__}.py --resume {run_dir} goes on")
    assert [m["update"] for m in untimed_metrics(run_dir)] == [1]  # update 2 raised in its scoring
    assert os.path.isfile(run_dir / "policy" / "config.json")
    with open(run_dir / "metrics.jsonl", "a") as f:  # as a hard kill leaves it: a row past the checkpoint, half a row
        f.write(json.dumps({"update": 2, "reward": -1.0}) + '\n{"update": 3, "rew')
    with open(run_dir / "samples.jsonl", "a") as f:
        f.write(json.dumps({"update": 2, "prompt": "1+1=", "completion": "3"}) + "\n")
    script.main(script.parse_args(["--resume", str(run_dir)]))  # the marker exists: it does not raise again
    whole = run(script, tiny, tmp_path / "whole", reward_fn=reward_fn)
    assert [m["update"] for m in untimed_metrics(run_dir)] == [1, 2, 3]
    assert untimed_metrics(run_dir) == untimed_metrics(whole)
    assert (run_dir / "samples.jsonl").read_text() == ""  # --sample-every 0: the stale row went, and none came


def test_sigterm_saves_and_resume_goes_on(tiny, tmp_path):
    # a real process sent SIGTERM, as SLURM or Kubernetes preempts one: it saves, exits 128 + 15, and --resume goes on
    command = [sys.executable, "ppo_llm.py", "--model", tiny["policy"], "--dataset", tiny["jsonl"], "--reward-fn",
               "gsm8k", "--total-steps", "500", "--prompts-per-update", "8", "--micro-batch-size", "4",
               "--max-new-tokens", "3", "--eval-every", "0", "--output-dir", str(tmp_path)]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(3000):  # until a first update is logged (five minutes at most, on a loaded machine)
        time.sleep(0.1)
        logged = list(tmp_path.glob("*/metrics.jsonl"))
        if logged and logged[0].read_text().strip():
            break
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    (run_dir,) = tmp_path.iterdir()
    done = [json.loads(line)["update"] for line in open(run_dir / "metrics.jsonl")]
    assert process.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "(SIGTERM)" in err and err.rstrip().endswith(f"--resume {run_dir} goes on") and "Traceback" not in err
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert checkpoint["update"] == done[-1] < 500  # the state after the last finished update
    command = [sys.executable, "ppo_llm.py", "--resume", str(run_dir), "--total-steps", str(done[-1] + 2)]
    resumed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [json.loads(line)["update"] for line in open(run_dir / "metrics.jsonl")] == list(range(1, done[-1] + 3))


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
def test_a_reward_file_that_does_not_import_is_one_line(script, tiny, tmp_path):
    (tmp_path / "broken.py").write_text("def reward(completions, **kwargs):\n    return [1.0 for c in completions\n")
    spec = f"{tmp_path / 'broken.py'}:reward"
    with pytest.raises(SystemExit) as e:
        run(script, tiny, tmp_path, reward_fn=spec if script is ppo_llm else (spec,))
    assert str(e.value).startswith(f"error: --reward-fn {spec}: not one of") and "(SyntaxError: " in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
def test_a_signal_during_an_update_lets_it_finish(script, tiny, tmp_path, monkeypatch, capsys):
    # SIGTERM arrives at update 2's first optimizer step (its handler appends to STOP): update 2 finishes, the next
    # rollout ends at its first token and stops every rank, so checkpoint.pt holds exactly the state after update 2
    steps, real = [], script.optimizer_step
    per_update = 2 * 2 if script is ppo_llm else 1  # PPO: 2 epochs x 2 minibatches; GRPO: --num-iterations 1

    def step(*args):
        steps.append(1)
        if len(steps) == per_update + 1:
            script.STOP.append(signal.SIGTERM)
        return real(*args)

    saves, real_save = [], script.save_checkpoint
    monkeypatch.setattr(script, "save_checkpoint", lambda *args: saves.append(1) or real_save(*args))
    monkeypatch.setattr(script, "optimizer_step", step)
    with pytest.raises(SystemExit) as stop:
        run(script, tiny, tmp_path / "split", save_every=2)  # update 2's periodic save waits for the stop's
    (run_dir,) = (tmp_path / "split").iterdir()
    assert stop.value.code == 128 + signal.SIGTERM and "stopped in update 3 (SIGTERM)" in capsys.readouterr().err
    assert torch.load(run_dir / "checkpoint.pt", weights_only=False)["update"] == 2 and len(steps) == 2 * per_update
    assert len(saves) == 1
    monkeypatch.setattr(script, "optimizer_step", real)
    script.main(script.parse_args(["--resume", str(run_dir)]))
    assert untimed_metrics(run_dir) == untimed_metrics(run(script, tiny, tmp_path / "whole"))


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
def test_a_second_signal_stops_at_once(script, tiny, tmp_path, monkeypatch, capsys):
    # two SIGTERMs at update 2's first optimizer step, through the handler the run installed: the second does not wait
    # for the update to finish; the checkpoint holds the count of update 1 (and the weights of that moment)
    steps, real = [], script.optimizer_step
    per_update = 2 * 2 if script is ppo_llm else 1

    def step(*args):
        steps.append(1)
        if len(steps) == per_update + 1:
            for _ in range(2):
                signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        return real(*args)

    monkeypatch.setattr(script, "optimizer_step", step)
    with pytest.raises(SystemExit) as stop:
        run(script, tiny, tmp_path)
    (run_dir,) = tmp_path.iterdir()
    assert stop.value.code == 128 + signal.SIGTERM and "stopped in update 2 (" in capsys.readouterr().err
    assert torch.load(run_dir / "checkpoint.pt", weights_only=False)["update"] == 1 and len(steps) == per_update + 1


def test_a_save_that_fails_still_says_how_to_go_on(tiny, tmp_path, monkeypatch, capsys):
    # Ctrl-C in update 2, and the save fails (a full disk): the last line says so, and where the last good one is
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ppo_llm, "save_checkpoint", full_disk)
    interrupt_generation(monkeypatch, call=2)
    with pytest.raises(SystemExit):
        run(ppo_llm, tiny, tmp_path)
    (run_dir,) = tmp_path.iterdir()
    last = capsys.readouterr().err.rstrip().splitlines()[-1]
    assert last == (f"stopped in update 2 (interrupted by the test); saving failed (OSError: [Errno 28] No space left "
                    f"on device); {run_dir}/checkpoint.pt holds the last periodic save: python ppo_llm.py --resume "
                    f"{run_dir} goes on")  # fmt: skip

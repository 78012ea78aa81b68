"""Nothing is lost when a run stops: an error inside the loop saves first and --resume goes on where the run would
have been; SIGTERM (a scheduler's preemption) saves and exits 128 + 15; bad files are one line."""

import glob
import json
import os
import resource
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import contents, interrupt_generation, saved_update, saved_weights, untimed_metrics

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


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
def test_an_error_beside_vllms_one_rank_world_saves_as_one_process(script, tiny, tmp_path, monkeypatch, capsys):
    # vLLM's engine creates a one-rank torch.distributed world in the training process (here after prepare(), as
    # start_vllm would); the run is still one process, so an error in update 2 (a RuntimeError, as an out-of-memory
    # in its rollout) saves update 1, as it does without the engine
    prepare = script.prepare

    def prepare_and_a_world(*args):
        prepared = prepare(*args)
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'world'}", rank=0, world_size=1)
        return prepared

    monkeypatch.setattr(script, "prepare", prepare_and_a_world)
    interrupt_generation(monkeypatch, call=2, error=RuntimeError)  # update 2's rollout
    try:
        with pytest.raises(SystemExit):
            run(script, tiny, tmp_path / "runs")
    finally:
        dist.destroy_process_group()
    (run_dir,) = (tmp_path / "runs").iterdir()
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("stopped in update 2 (interrupted by the test); the state after update 1 is in"), last
    assert saved_update(run_dir) == 1


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
    assert saved_update(run_dir) == done[-1] < 500  # the state after the last finished update
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
    # rollout ends at its first token and stops every rank, so the checkpoint holds exactly the state after update 2
    steps, real = [], script.optimizer_step
    per_update = 2 * 2 if script is ppo_llm else 1  # PPO: 2 epochs x 2 minibatches; GRPO: --num-iterations 1

    def step(*args):
        steps.append(1)
        if len(steps) == per_update + 1:
            script.STOP.append(signal.SIGTERM)
        return real(*args)

    saves, real_save = [], script.save_checkpoint
    monkeypatch.setattr(
        script, "save_checkpoint", lambda *args, **kwargs: saves.append(1) or real_save(*args, **kwargs)
    )
    monkeypatch.setattr(script, "optimizer_step", step)
    with pytest.raises(SystemExit) as stop:
        run(script, tiny, tmp_path / "split", save_every=2)  # update 2's periodic save waits for the stop's
    (run_dir,) = (tmp_path / "split").iterdir()
    assert stop.value.code == 128 + signal.SIGTERM and "stopped in update 3 (SIGTERM)" in capsys.readouterr().err
    assert saved_update(run_dir) == 2 and len(steps) == 2 * per_update
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
    assert saved_update(run_dir) == 1 and len(steps) == per_update + 1


def test_a_second_signal_during_the_stops_save_waits_for_it(tiny, tmp_path, monkeypatch, capsys):
    # SIGTERM in update 2's generation; a second one while the stop writes the checkpoint: the save finishes (a line
    # says it will), the last line says where the state is, no temporary file stays, and --resume goes on
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))  # as torchrun sets it
    generate, calls = ppo_llm.transformers.GenerationMixin.generate, []

    def signalled(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return generate(self, *args, **kwargs)

    real_save = torch.save

    def save_signalled(obj, f):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered between two tensors of the pickle
        real_save(obj, f)

    monkeypatch.setattr(ppo_llm.transformers.GenerationMixin, "generate", signalled)
    monkeypatch.setattr(ppo_llm.torch, "save", save_signalled)
    with pytest.raises(SystemExit) as stop:
        run(ppo_llm, tiny, tmp_path / "runs")
    monkeypatch.undo()
    (run_dir,) = (tmp_path / "runs").iterdir()
    err = capsys.readouterr().err
    last = f"stopped in update 2 (SIGTERM); the state after update 1 is in {run_dir}/checkpoint: python ppo_llm.py"
    assert stop.value.code == 128 + signal.SIGTERM and err.splitlines()[-1].startswith(last), err
    assert "SIGTERM: the checkpoint being written is finished first" in err and "Traceback" not in err
    assert saved_update(run_dir) == 1
    assert not list(run_dir.glob("*.tmp"))
    assert json.load(open(tmp_path / "error.json"))["message"] == err.splitlines()[-1]  # torchrun's report ends so
    ppo_llm.main(ppo_llm.parse_args(["--resume", str(run_dir)]))
    assert [m["update"] for m in untimed_metrics(run_dir)] == [1, 2, 3]


def test_a_save_that_fails_says_why_and_what_is_on_disk(tiny, tmp_path):
    # a file-size limit (ulimit -f) that the checkpoint's shards exceed: the final save of update 3 fails; one line
    # gives the OS's reason (not torch.distributed.checkpoint's wrapping) and the checkpoint that is there, no
    # half-written one stays, exit 1
    run_dir = run(ppo_llm, tiny, tmp_path, total_steps=2)
    size = os.path.getsize(os.path.join(run_dir, "checkpoint", "__0_0.distcp"))
    command = [sys.executable, "ppo_llm.py", "--resume", run_dir, "--total-steps", "3", "--save-every", "0"]

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))

    p = subprocess.run(command, cwd=ROOT, preexec_fn=limit, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.rstrip().splitlines()[-1] == (
        f"stopped in update 3 (saving update 3 failed (OSError: [Errno 27] File too large)); {run_dir}/checkpoint "
        f"holds update 2: python ppo_llm.py --resume {run_dir} goes on"
    )
    assert saved_update(run_dir) == 2
    assert glob.glob(os.path.join(run_dir, "checkpoint.*")) == [os.path.realpath(os.path.join(run_dir, "checkpoint"))]


def test_a_stop_whose_save_fails_names_the_last_checkpoint(tiny, tmp_path, monkeypatch, capsys):
    # Ctrl-C in update 4 and then a full disk: the line gives the reason and the periodic save of update 2 that is
    # there; stopped before any save, the line says there is nothing to resume
    real_save, saves = ppo_llm.dcp.save, []

    def full_disk(state_dict, checkpoint_id, **kwargs):
        saves.append(checkpoint_id)
        if len(saves) == 1:  # update 2's
            return real_save(state_dict, checkpoint_id=checkpoint_id, **kwargs)
        os.makedirs(checkpoint_id)
        open(os.path.join(checkpoint_id, "__0_0.distcp"), "w").close()  # half written, then torch's wrapping
        raise ppo_llm.dcp.CheckpointException("write", {0: (OSError(28, "No space left"), None)})

    monkeypatch.setattr(ppo_llm.dcp, "save", full_disk)
    interrupt_generation(monkeypatch, call=4)
    with pytest.raises(SystemExit):
        run(ppo_llm, tiny, tmp_path / "a", save_every=2, total_steps=4)
    (run_dir,) = (tmp_path / "a").iterdir()
    assert capsys.readouterr().err.rstrip().splitlines()[-1] == (
        f"stopped in update 4 (interrupted by the test; saving update 3 failed (OSError: [Errno 28] No space left)); "
        f"{run_dir}/checkpoint holds update 2: python ppo_llm.py --resume {run_dir} goes on"
    )
    assert [str(p) for p in run_dir.glob("checkpoint.*")] == [os.path.realpath(run_dir / "checkpoint")]
    interrupt_generation(monkeypatch, call=1)
    with pytest.raises(SystemExit):
        run(ppo_llm, tiny, tmp_path / "b")
    assert capsys.readouterr().err.rstrip().endswith("no checkpoint was written: start the run again")


@pytest.mark.parametrize("script, other", [(ppo_llm, grpo_llm), (grpo_llm, ppo_llm)])
def test_a_run_directory_belongs_to_its_script(script, other, tiny, tmp_path):
    run_dir = run(other, tiny, tmp_path, total_steps=1)
    with pytest.raises(SystemExit) as e:
        script.parse_args(["--resume", run_dir])
    name = other.__name__
    assert (
        str(e.value)
        == f"error: --resume {run_dir} is a run of {name}.py: " + f"python {name}.py --resume {run_dir} goes on with it"
    )


NAN_REWARD = """import math


def reward(completions, **columns):
    return [math.nan if i == 1 else 1.0 for i, c in enumerate(completions)]
"""


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
def test_a_reward_that_is_no_finite_number_is_refused_by_name(script, tiny, tmp_path, capsys):
    # a reward function that returns NaN for one completion: named in one line with the completion, after the save,
    # not blamed on the optimizer; a reward model whose score is NaN (its score layer's weights) likewise
    (tmp_path / "nan.py").write_text(NAN_REWARD)
    spec = f"{tmp_path / 'nan.py'}:reward"
    with pytest.raises(SystemExit):
        run(script, tiny, tmp_path / "fn", reward_fn=spec if script is ppo_llm else (spec,))
    line = capsys.readouterr().err.rstrip().splitlines()[-1]
    assert f"(error: --reward-fn {spec} scored 1 of 8 completions with no finite number (the first: nan for '" in line
    assert "learning-rate" not in line
    rm = ppo_llm.AutoModelForSequenceClassification.from_pretrained(tiny["rm"])
    torch.nn.init.constant_(rm.score.weight, float("nan"))
    rm.save_pretrained(tmp_path / "nan_rm")
    ppo_llm.AutoTokenizer.from_pretrained(tiny["rm"]).save_pretrained(tmp_path / "nan_rm")
    with pytest.raises(SystemExit):
        run(script, tiny, tmp_path / "rm", reward_model=str(tmp_path / "nan_rm"))
    line = capsys.readouterr().err.rstrip().splitlines()[-1]
    assert f"(error: --reward-model {tmp_path / 'nan_rm'} scored 8 of 8 completions with no finite number" in line


@pytest.mark.parametrize(
    "script, flags, message",
    [
        (ppo_llm, ["--learning-rate", "-1"], "--learning-rate must be >= 0 (got -1.0)"),
        (ppo_llm, ["--learning-rate", "nan"], "--learning-rate must be >= 0 (got nan)"),
        (ppo_llm, ["--max-new-tokens", "-1"], "--max-new-tokens must be >= 1 (got -1)"),
        (ppo_llm, ["--max-new-tokens", "0"], "--max-new-tokens must be >= 1 (got 0)"),
        (ppo_llm, ["--gamma", "1.5"], "--gamma must be in [0, 1] (got 1.5)"),
        (ppo_llm, ["--cliprange", "0"], "--cliprange must be > 0 (got 0.0)"),
        (ppo_llm, ["--max-grad-norm", "inf"], "--max-grad-norm must be > 0 (got inf)"),
        (ppo_llm, ["--save-every", "-5"], "--save-every must be >= 0 (got -5)"),
        (ppo_llm, ["--eval-size", "0"], "--eval-size must be >= 1 (got 0)"),
        (grpo_llm, ["--epsilon", "1.5"], "--epsilon must be in (0, 1) (got 1.5)"),
        (grpo_llm, ["--beta", "-0.1"], "--beta must be >= 0 (got -0.1)"),
        (grpo_llm, ["--total-steps", "0"], "--total-steps must be >= 1 (got 0)"),
        (grpo_llm, ["--reward-weights", "1", "nan"], "--reward-weights must be finite (got (1.0, nan))"),
        (grpo_llm, ["--overlong-buffer", "-1"], "--overlong-buffer must be >= 0 (got -1)"),
    ],
)
def test_a_flag_out_of_range_is_one_line_before_anything_loads(script, flags, message):
    # --model does not exist: the flag's line comes first, so nothing was loaded
    with pytest.raises(SystemExit) as e:
        script.main(script.parse_args(["--model", "/no/such/model", *flags]))
    assert str(e.value) == f"error: {message}"


def test_paths_that_cannot_be_read_or_written_are_one_line(tiny, tmp_path):
    (tmp_path / "file").write_text("")
    for flag, path, why in [
        ("--output-dir", tmp_path / "file", "NotADirectoryError: [Errno 20] Not a directory"),
        ("--output-dir", tmp_path / "file" / "runs", "NotADirectoryError: [Errno 20] Not a directory"),
        ("--output-dir", "/proc/self/runs", "Error"),  # /proc: no file can be made there, not even by root
    ]:
        with pytest.raises(SystemExit) as e:
            ppo_llm.main(ppo_llm.parse_args([flag, str(path), "--model", "/no/such/model"]))
        assert str(e.value).startswith(f"error: {flag} {path}: not a directory this run can write (") and why in str(
            e.value
        )
    latin1 = b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xe9+1=", "answer": "2"}\n'  # \xe9: not UTF-8
    (tmp_path / "latin1.jsonl").write_bytes(latin1)
    with pytest.raises(SystemExit) as e:
        run(ppo_llm, tiny, tmp_path / "runs", dataset=str(tmp_path / "latin1.jsonl"))
    assert str(e.value).startswith(f"error: --dataset {tmp_path / 'latin1.jsonl'} could not be loaded (") and (
        "UnicodeDecodeError" in str(e.value)
    )


def test_a_resume_removes_a_stale_temporary_and_a_signal_in_the_first_evaluation_saves(
    tiny, tmp_path, monkeypatch, capsys
):
    # a hard kill in the middle of a save leaves half a checkpoint in the slot not in use, and one at its end the
    # link that was to replace `checkpoint`: the resumed run's next save removes both; SIGTERM while the initial
    # policy is evaluated (4 prompts x 4 samples, in 2 batches of 8) stops the evaluation after its first batch and
    # the run with its line and a checkpoint of update 0, and nothing of the evaluation is logged
    run_dir = run(ppo_llm, tiny, tmp_path / "a", total_steps=1)
    half = os.path.join(run_dir, "checkpoint.b")
    os.makedirs(half)
    open(os.path.join(half, "__0_0.distcp"), "wb").close()
    os.symlink("checkpoint.b", os.path.join(run_dir, "checkpoint.tmp"))
    ppo_llm.main(ppo_llm.parse_args(["--resume", run_dir, "--total-steps", "2"]))
    assert saved_update(run_dir) == 2 and not os.path.lexists(os.path.join(run_dir, "checkpoint.tmp"))
    assert glob.glob(os.path.join(run_dir, "checkpoint.*")) == [os.path.realpath(os.path.join(run_dir, "checkpoint"))]
    generate, calls = ppo_llm.transformers.GenerationMixin.generate, []

    def signalled(self, *args, **kwargs):
        calls.append(1)
        os.kill(os.getpid(), signal.SIGTERM)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(ppo_llm.transformers.GenerationMixin, "generate", signalled)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        run(ppo_llm, tiny, tmp_path / "b", eval_every=1, eval_split=tiny["jsonl"], eval_size=4, eval_num_generations=4)
    (run_dir,) = (tmp_path / "b").iterdir()
    assert stop.value.code == 128 + signal.SIGTERM and "stopped in update 0 (SIGTERM)" in capsys.readouterr().err
    assert saved_update(run_dir) == 0 and len(calls) == 1
    assert not (run_dir / "metrics.jsonl").exists()  # the evaluation cut short, not logged


def test_logs_that_cannot_be_written_are_one_line(tmp_path):
    # metrics.jsonl where a directory is (as a full disk fails the same write): one line naming the run directory
    (tmp_path / "metrics.jsonl").mkdir()
    writer = types.SimpleNamespace(log_dir=str(tmp_path))
    with pytest.raises(SystemExit) as e:
        ppo_llm.log(writer, {"update": 1, "reward": 0.5}, "update 1/1")
    assert str(e.value) == f"error: {tmp_path}: the logs could not be written (IsADirectoryError: [Errno 21] Is a " + (
        f"directory: '{tmp_path / 'metrics.jsonl'}')"
    )


def test_a_score_that_is_text_is_refused_as_none_is():
    # a reward function that returns "1" (text that float() would read), None or a list: one line naming it and the
    # first such completion; numbers of any type (int, numpy's, a 0-d tensor) are scores
    source, completions = "--reward-fn f.py:r", ["12", "13", "14"]
    for bad in ["1", "0.5", None, [1.0]]:
        with pytest.raises(SystemExit) as e:
            ppo_llm.finite_scores([1.0, bad, 0.0], source, completions)
        first = f"(the first: {bad!r} for '13')"
        assert str(e.value) == f"error: {source} scored 1 of 3 completions with no finite number {first}"
    assert ppo_llm.finite_scores([1, np.float32(0.5), torch.tensor(2.0)], source, completions) == [1.0, 0.5, 2.0]


def live_run(tiny, tmp_path, *flags, code=None):
    """A PPO run in its own process (a script that runs `code` first, or ppo_llm.py) with a checkpoint every update,
    started in tmp_path: its process."""
    flags = ["--model", tiny["policy"], "--dataset", tiny["jsonl"], "--prompts-per-update", "8", "--micro-batch-size",
             "4", "--max-new-tokens", "3", "--eval-every", "0", "--save-every", "1", "--output-dir", str(tmp_path),
             *flags]  # fmt: skip
    command = [sys.executable, "ppo_llm.py"] if code is None else [sys.executable, "-c", code]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*command, *flags], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_a_run_directory_has_one_owner(tiny, tmp_path):
    # a run that saves every update, and a second process's --resume on its directory (a requeued job whose first copy
    # is alive): the second refuses in one line naming the owner, and the owner goes on unharmed (no update logged
    # twice, none lost); its death, even kill -9, frees the directory: --resume goes on
    owner = live_run(tiny, tmp_path, "--total-steps", "500")
    for _ in range(3000):  # until a first checkpoint is there (five minutes at most, on a loaded machine)
        time.sleep(0.1)
        if glob.glob(str(tmp_path / "*" / "checkpoint" / "state.json")):
            break
    (run_dir,) = tmp_path.iterdir()
    with pytest.raises(SystemExit) as e:
        ppo_llm.main(ppo_llm.parse_args(["--resume", str(run_dir)]))
    assert str(e.value) == f"error: {run_dir} is in use by process {owner.pid} on {os.uname().nodename} " + (
        "(one process at a time)"
    )
    time.sleep(1)  # the owner's next save, had the refusal deleted its slot
    assert owner.poll() is None, owner.stderr.read()[-2000:]  # alive
    owner.kill()
    owner.wait()
    logged = [m["update"] for m in untimed_metrics(run_dir)]
    assert logged == list(range(1, len(logged) + 1))
    done = saved_update(run_dir)
    ppo_llm.main(ppo_llm.parse_args(["--resume", str(run_dir), "--total-steps", str(done + 1)]))
    assert [m["update"] for m in untimed_metrics(run_dir)] == list(range(1, done + 2))


KILLED_IN_POLICY = """import os, signal, sys
import transformers
import ppo_llm

real, calls = transformers.PreTrainedModel.save_pretrained, []


def save_pretrained(self, where, **kwargs):
    # the third model written (update 1's: policy, critic; update 2's: policy): half its weights, then kill -9
    real(self, where, **kwargs)
    calls.append(where)
    if len(calls) == 3:
        weights = os.path.join(where, "model.safetensors")
        os.truncate(weights, os.path.getsize(weights) // 2)
        os.kill(os.getpid(), signal.SIGKILL)


transformers.PreTrainedModel.save_pretrained = save_pretrained
ppo_llm.main(ppo_llm.parse_args(sys.argv[1:]))
"""


def test_a_kill_while_policy_is_written_leaves_the_previous_policy(tiny, tmp_path):
    # kill -9 halfway through update 2's policy/model.safetensors: policy/ is update 1's, whole, as checkpoint/ is
    # (both in the slot that the link `checkpoint` points to), and it loads, critic too
    killed = live_run(tiny, tmp_path, "--total-steps", "2", code=KILLED_IN_POLICY)
    assert killed.wait(timeout=300) == -signal.SIGKILL, killed.stderr.read()[-2000:]
    (run_dir,) = tmp_path.iterdir()
    assert saved_update(run_dir) == 1
    policy = ppo_llm.AutoModelForCausalLM.from_pretrained(run_dir / "policy")
    for key, value in saved_weights(run_dir, "policy").items():  # update 1's weights, as the checkpoint holds them
        assert torch.equal(policy.state_dict()[key], value), key
    ppo_llm.AutoModel.from_pretrained(run_dir / "policy" / "critic")


def flip_byte(path):
    """The byte in the middle of the file, inverted (a bit rot, a bad copy); again, it is back."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))


def test_a_flipped_byte_is_refused_by_name_and_an_untouched_checkpoint_resumes(tiny, tmp_path, capsys):
    # a byte flipped in the checkpoint's shard: --resume refuses in one line naming the file, and says that policy/ is
    # whole (as --model of a new run); flipped in policy/ too, that it is not; the directory is as it was. Flipped
    # back, and flipped in policy/ alone (which resuming never reads), the resume goes on with one warning naming it:
    # two updates and a resume to three log what three in one go log, and the save replaces the damaged policy/
    run_dir = run(ppo_llm, tiny, tmp_path / "split", total_steps=2)
    before = contents(run_dir)
    shard, weights = f"{run_dir}/checkpoint/__0_0.distcp", f"{run_dir}/checkpoint/policy/model.safetensors"
    refusal = f"error: --resume {run_dir}: {run_dir}/checkpoint/__0_0.distcp is damaged or missing; its"
    whole = f"policy/ is whole: --model {run_dir}/policy starts a new run from it"
    for flipped, policy in [([shard], whole), ([shard, weights], "policy/ is damaged too")]:
        for path in flipped:
            flip_byte(path)
        with pytest.raises(SystemExit) as e:
            ppo_llm.main(ppo_llm.parse_args(["--resume", run_dir, "--total-steps", "3"]))
        assert str(e.value) == f"{refusal} {policy}"
        for path in flipped:
            flip_byte(path)
    assert contents(run_dir) == before  # (the lock names its last owner: this process, as before)
    flip_byte(weights)
    capsys.readouterr()
    ppo_llm.main(ppo_llm.parse_args(["--resume", run_dir, "--total-steps", "3"]))
    warning = f"warning: --resume {run_dir}: {weights} is damaged or missing; resuming anyway"
    assert capsys.readouterr().out.count(warning) == 1
    assert untimed_metrics(run_dir) == untimed_metrics(run(ppo_llm, tiny, tmp_path / "whole"))
    sums = json.load(open(f"{run_dir}/checkpoint/checksums.json"))  # update 3's save: policy/ written anew, whole
    assert "policy/model.safetensors" in sums and "state.json" in sums and "__0_0.distcp" in sums
    assert all(ppo_llm.crc32(f"{run_dir}/checkpoint/{name}") == crc for name, crc in sums.items())


SLOW = """import os, signal, threading, time

calls = []


def exact(completions, answer, **columns):
    # the arithmetic reward, but the second call hangs (a judge that never answers), or is sent SIGTERM while it does
    calls.append(1)
    if len(calls) == 2 and {sigterm}:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    if len(calls) == 2:
        time.sleep(30)
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
"""


@pytest.mark.parametrize("script, sigterm", [(ppo_llm, False), (grpo_llm, False), (ppo_llm, True)])
def test_a_reward_call_that_hangs_stops_at_its_timeout_or_a_signal(script, sigterm, tiny, tmp_path, capsys):
    # update 2's reward call sleeps: past --reward-timeout 0.5 s, or at a SIGTERM during it (--reward-timeout 600), the
    # run stops at once with the state after update 1 saved, in one line naming the function (exit 1, or 128 + 15)
    (tmp_path / "slow.py").write_text(SLOW.format(sigterm=sigterm))
    spec = f"{tmp_path / 'slow.py'}:exact"
    timeout = 600 if sigterm else 0.5  # the signal comes 0.5 s into the call
    with pytest.raises(SystemExit) as stop:
        run(script, tiny, tmp_path / "runs", reward_fn=spec if script is ppo_llm else (spec,), reward_timeout=timeout)
    (run_dir,) = (tmp_path / "runs").iterdir()
    what = f"SIGTERM during --reward-fn {spec}" if sigterm else f"--reward-fn {spec} ran past 0.5 s"
    assert stop.value.code == (128 + signal.SIGTERM if sigterm else 1)
    assert capsys.readouterr().err.rstrip().splitlines()[-1] == (
        f"stopped in update 2 ({what}); the state after update 1 is in {run_dir}/checkpoint: "
        f"python {script.__name__}.py --resume {run_dir} goes on"
    )
    assert saved_update(run_dir) == 1


@pytest.mark.parametrize("script", [ppo_llm, grpo_llm])
def test_a_stop_before_a_turns_first_token_ends_the_rollout(script, monkeypatch):
    # vLLM's engine aborted before its first step gives a row no token: the turn neither ended nor filled its room,
    # so the row is done (a stop), with an empty response, not an IndexError on its last token
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets/arith-sft"), padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "assets/arith-sft"))
    policy.generation_config.update(eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    monkeypatch.setattr(policy, "generate", lambda **inputs: inputs["input_ids"])  # no new token
    batch = script.rollout(
        policy, tok, ["1+2=", "3+4="], script.Args(max_new_tokens=4), torch.autocast("cpu", enabled=False)
    )
    assert batch["responses"].shape == (2, 0) and batch["lengths"].tolist() == [0, 0]
    assert batch["ended"].tolist() == [False, False] and batch["cut_on_call"].tolist() == [False, False]

"""Tests of reinforce.py: reward-to-go against hand-computed values, short end-to-end runs, bad input."""

import glob
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import reinforce

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNKNOWN_ENV = "error: --env-id NoSuchEnv-v0 is not a registered Gymnasium environment"


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------------
# reward_to_go: (T, N) tensors, dones[t] = 1 when the episode ended at step t, G after the last step = 0
# ---------------------------------------------------------------------------------------------------------
def test_reward_to_go_episode_ends_mid_batch_several_envs():
    rewards = t([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0], [1.0, 4.0]])
    dones = t([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    returns = reinforce.reward_to_go(rewards, dones, gamma=0.5)
    # env 0, two episodes (t=0..1 and t=2..3):
    #   G3 = 1, G2 = 1 + 0.5*1 = 1.5, G1 = 1 (ended), G0 = 1 + 0.5*1 = 1.5
    # env 1, one unfinished episode, G after the last step = 0:
    #   G3 = 4, G2 = 3 + 0.5*4 = 5, G1 = 2 + 0.5*5 = 4.5, G0 = 1 + 0.5*4.5 = 3.25
    torch.testing.assert_close(returns, t([[1.5, 3.25], [1.0, 4.5], [1.5, 5.0], [1.0, 4.0]]))


def test_reward_to_go_gamma_one_is_the_sum_of_the_rest_of_the_episode():
    rewards, dones = t([[2.0], [3.0], [5.0], [7.0]]), t([[0.0], [0.0], [1.0], [1.0]])
    returns = reinforce.reward_to_go(rewards, dones, gamma=1.0)
    # episode t=0..2: 2+3+5 = 10, 3+5 = 8, 5; episode t=3: 7
    torch.testing.assert_close(returns, t([[10.0], [8.0], [5.0], [7.0]]))


def test_reward_to_go_padding_after_the_end_adds_nothing():
    # reinforce.py pads an env that finished early with reward 0, done 1: the real steps must not change
    rewards, dones = t([[1.0], [1.0], [0.0], [0.0]]), t([[0.0], [1.0], [1.0], [1.0]])
    returns = reinforce.reward_to_go(rewards, dones, gamma=0.9)
    torch.testing.assert_close(returns, t([[1.9], [1.0], [0.0], [0.0]]))  # G0 = 1 + 0.9*1


# ---------------------------------------------------------------------------------------------------------
# end to end, in-process in a temporary directory
# ---------------------------------------------------------------------------------------------------------
def run(monkeypatch, tmp_path, *flags):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["reinforce.py", *flags])
    reinforce.main()
    run_dirs = sorted(glob.glob(str(tmp_path / "runs" / "*")))
    with open(os.path.join(run_dirs[-1], "metrics.jsonl")) as f:
        return run_dirs[-1], [json.loads(line) for line in f]


@pytest.mark.parametrize(
    "env_id, psi",
    [
        ("CartPole-v1", "episode-return"),
        ("CartPole-v1", "reward-to-go"),
        ("CartPole-v1", "reward-to-go-baseline"),
        ("Acrobot-v1", "reward-to-go-baseline"),
        ("Pendulum-v1", "reward-to-go-baseline"),
    ],
)
def test_runs(monkeypatch, tmp_path, env_id, psi):
    _, records = run(monkeypatch, tmp_path, "--env-id", env_id, "--psi", psi, "--total-timesteps", "2000")
    updates = [r for r in records if "losses/policy_loss" in r]
    episodes = [r for r in records if "charts/episodic_return" in r]
    assert updates and len(episodes) == 8 * len(updates)  # 8 envs = 8 whole episodes per update
    assert records[-1]["global_step"] == sum(r["charts/episodic_length"] for r in episodes) >= 2000
    names = {"charts/learning_rate", "charts/SPS", "losses/policy_loss", "losses/entropy"}
    if psi == "reward-to-go-baseline":
        names |= {"losses/value_loss", "losses/explained_variance"}
    assert all(names <= set(r) and np.isfinite(r["losses/policy_loss"]) for r in updates)
    assert ("losses/value_loss" in updates[0]) == (psi == "reward-to-go-baseline")


def test_learns_cartpole_a_little(monkeypatch, tmp_path):
    _, records = run(monkeypatch, tmp_path, "--total-timesteps", "20000")
    returns = [r["charts/episodic_return"] for r in records if "charts/episodic_return" in r]
    # a uniform random policy averages about 22 on CartPole
    assert np.mean(returns[:24]) < 30 and np.mean(returns[-24:]) > 45


def test_save_and_eval(monkeypatch, tmp_path, capsys):
    flags = ["--total-timesteps", "500", "--save-model", "--eval-episodes", "2"]
    run_dir, records = run(monkeypatch, tmp_path, *flags)
    assert len([r for r in records if "eval/episodic_return" in r]) == 2
    model = os.path.join(run_dir, "reinforce.cleanrl_model")
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["reinforce.py", "--eval-checkpoint", model, "--eval-episodes", "3"])
    reinforce.main()
    assert "over 3" in capsys.readouterr().out.strip().splitlines()[-1]


def test_track_wandb_offline(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    cmd = [sys.executable, os.path.join(REPO, "reinforce.py"), "--track", "--total-timesteps", "500"]
    subprocess.run(cmd, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=120)
    offline_runs = glob.glob(str(tmp_path / "runs" / "*" / "wandb" / "offline-run-*" / "*.wandb"))
    assert len(offline_runs) == 1 and os.path.getsize(offline_runs[0]) > 0


def test_ctrl_c_saves_model_and_metrics(tmp_path):
    cmd = [sys.executable, os.path.join(REPO, "reinforce.py"), "--save-model", "--total-timesteps=9999999"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:  # wait for the first finished update
        if line.startswith("iter="):
            break
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in out
    run_dir = glob.glob(str(tmp_path / "runs" / "*"))[0]
    assert os.path.getsize(os.path.join(run_dir, "reinforce.cleanrl_model")) > 0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert any("losses/policy_loss" in json.loads(line) for line in f)


# ---------------------------------------------------------------------------------------------------------
# bad input: one line naming the flag
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--env-id", "NoSuchEnv-v0"], UNKNOWN_ENV),
        (["--env-id", "Blackjack-v1"], "error: --env-id Blackjack-v1 has observation space Tuple("),
        (["--eval-checkpoint", "missing.pt"], "error: --eval-checkpoint missing.pt is not a file"),
    ],
)
def test_bad_input(monkeypatch, tmp_path, flags, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["reinforce.py", *flags])
    with pytest.raises(SystemExit) as e:
        reinforce.main()
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "runs")


def test_unsupported_action_space(monkeypatch, tmp_path):
    import test_classic  # noqa: F401  registers tests/MultiBinaryAction-v0

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["reinforce.py", "--env-id", "tests/MultiBinaryAction-v0"])
    with pytest.raises(SystemExit, match=r"^error: --env-id tests/MultiBinaryAction-v0 has action space "):
        reinforce.main()


def test_cli_error_is_one_line_and_import_prints_nothing(tmp_path):
    cmd = [sys.executable, os.path.join(REPO, "reinforce.py"), "--env-id", "NoSuchEnv-v0"]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr == UNKNOWN_ENV + "\n"
    p = subprocess.run([sys.executable, "-c", "import reinforce"], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout == "" and p.stderr == ""

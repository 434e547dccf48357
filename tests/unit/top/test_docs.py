"""The documentation is executable: every snippet runs, top to bottom, as written.

For each page, a fresh Python process (in an empty working folder) runs the
page's fenced ``python`` blocks in one namespace and its ``sh`` blocks with
``bash -e``, in the order they appear, after a setup that builds the objects
the prose assumes (a filled replay buffer ``rb``, ``policy``, ``optim``...).
Blocks in other fences (plain listings, ``cron``) are formats and examples of
output, not snippets. Shell lines that start with ``make`` or run
``benchmarks`` are the set-up and benchmark commands that CI and ``make bench``
run themselves; they are skipped here. A snippet that fails names its page and
line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

PAGES = ["README.md", "docs/quickstart.md", "docs/training.md", "docs/operations.md", "docs/adapters.md", "docs/performance.md", "docs/distributed.md", "docs/object-storage.md"]

SETUP = """
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer
import ckptstore

torch.manual_seed(0)

def make_rb():
    return TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=LazyTensorStorage(1000), batch_size=16)

def make_policy():
    return torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))

rb, fresh_rb = make_rb(), make_rb()
rb.extend(TensorDict({"observation": torch.randn(200, 4), "action": torch.randint(2, (200,))}, [200]))
rb.dumps("rb_dump")                                     # a TorchRL dump, for import-torchrl
policy, policy2 = make_policy(), make_policy()
optim = torch.optim.Adam(policy.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=10)
other_store = ckptstore.Store("runs/other-store", create=True)
total_steps = 2000

def train_one_step():
    loss = policy(rb.sample()["observation"]).pow(2).mean()
    optim.zero_grad(); loss.backward(); optim.step(); scheduler.step()

def make_trainer():
    from torchrl.collectors import Collector
    from torchrl.envs import GymEnv
    from torchrl.modules import MLP, QValueActor
    from torchrl.objectives import DQNLoss
    from torchrl.trainers import Trainer
    env = GymEnv("CartPole-v1")
    actor = QValueActor(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"], spec=env.action_spec)
    loss = DQNLoss(actor, action_space=env.action_spec)
    opt = torch.optim.Adam(loss.parameters(), lr=1e-3)
    collector = Collector(env, actor, frames_per_batch=50, total_frames=100, auto_register_policy_transforms=False)
    return actor, Trainer(collector=collector, total_frames=100, frame_skip=1, optim_steps_per_batch=1, loss_module=loss,
                          optimizer=opt, progress_bar=False, save_trainer_file=None)

if PAGE in ("docs/training.md",):
    actor, trainer = make_trainer()
if PAGE in ("docs/operations.md",):                     # a store with some history to operate on
    s = ckptstore.Store("runs/store", create=True)
    for i in range(3):
        s.commit({"policy": policy, "i": i}, tag=["latest", f"step-{i}"])
    s.close()
"""

RUNNER = """
import os, re, subprocess, sys, traceback
PAGE = sys.argv[1]
text = open(os.path.join(sys.argv[2], PAGE), encoding="utf-8").read()
exec(compile(sys.argv[3], "<setup>", "exec"), globals())
SKIP = re.compile(r"^\\s*(make\\s|\\.venv/bin/python -m benchmarks)")
fence = re.compile(r"^```([a-z]*)\\n(.*?)^```", re.M | re.S)
ran = 0
for m in fence.finditer(text):
    lang, code = m.group(1), m.group(2)
    line = text.count("\\n", 0, m.start()) + 2
    if lang == "python":
        try:
            exec(compile(code, f"{PAGE}:{line}", "exec"), globals())
        except BaseException:
            traceback.print_exc()
            sys.exit(f"{PAGE}:{line}: python snippet failed")
    elif lang == "sh":  # one shell session per page: what a block exports, later blocks see
        script = "\\n".join("" if SKIP.match(l) else l for l in code.splitlines())
        for name, value in re.findall(r"^export (\\w+)=(\\S+)$", script, re.M):
            os.environ[name] = value
        proc = subprocess.run(["bash", "-e", "-c", script], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{PAGE}:{line}: sh snippet failed ({proc.returncode}):\\n{proc.stdout}\\n{proc.stderr}")
    else:
        continue
    ran += 1
print("snippets", ran)
"""


@pytest.mark.parametrize("page", PAGES)
def test_every_snippet_runs_as_written(page, tmp_path, request):
    if page in ("docs/object-storage.md", "docs/distributed.md"):  # their snippets use bucket "ckpt" of the tests' S3 server
        request.getfixturevalue("s3_server")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("CKPTSTORE_PATH", None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RUNNER), page, str(ROOT), textwrap.dedent(SETUP)],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert int(proc.stdout.split("snippets")[-1]) >= 1

"""Trainer runs on two "nodes" joined by a shaped link: network namespaces on one switch
(`namespaces.linked_hosts`), one trainer process each under torchrun's c10d rendezvous, the
link capped by a token bucket on each host (`Network.shape`); and the same model on one node
alone, the baseline the speedup is measured against."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.baseline import WARMUP_WINDOWS
from benchmarks.metrics import free_port
from benchmarks.namespaces import Network
from benchmarks.runner import checkout_path
from trainer.launcher.launch import RDZV_ENV

# the transformer config grown until its gradients matter on these links: about 9.6 M
# parameters (38 MB of fp32 gradients) against 32 tokens a rank per step. 256 samples of a
# uniform token stream: nothing to learn but the samples themselves, which 200 steps begin
# to memorize, so that the training loss after them compares the hooks (a held-out window
# of a uniform stream has nothing to learn at all)
MODEL = (
    "model.width=512,model.depth=3,model.heads=8,data.synthetic.seq_len=32,"
    "data.synthetic.num_samples=256,train.batch_size=1,optim.warmup_steps=20"
)
QUICK_MODEL = "model.width=64,model.depth=2,model.heads=4,data.synthetic.seq_len=16,train.batch_size=4"
FIXED = (
    "log.format=json,metrics.port=0,checkpoint.every_steps=0,checkpoint.snapshot_every_steps=0,"
    "train.epochs=1000"
)


@dataclass(frozen=True)
class LinkRun:
    """One run's steady figures from rank 0's progress lines (the first `WARMUP_WINDOWS`
    left out): median global samples/s, mean step and exposed communication (the trainer's
    own step split), and the training loss of its last progress line."""

    samples_per_second: float
    step_ms: float
    communication_ms: float
    loss: float
    parameters: int

    @property
    def communication_share(self) -> float:
        return self.communication_ms / self.step_ms


def environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": checkout_path(), **RDZV_ENV}


def on_host(network: Network, host: int, command: list[str], cwd: Path) -> subprocess.Popen:
    """`command` started on `host`, in a session of its own (so that all of it can be killed),
    its output piped."""
    return subprocess.Popen(
        [*network.prefix(host), *command], cwd=cwd, env=environment(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def trainer_overrides(ddp: str) -> str:
    """`ddp`'s `--set` (`ddp.*` keys, or nothing) on top of the runs' fixed settings; PowerSGD
    starts after 10 plain steps, so that a run measures it rather than its warm-up."""
    return ",".join(part for part in (FIXED, "ddp.powersgd_start_step=10", ddp) if part)


def trainer_args(model: str, ddp: str, steps: int, log_every: int) -> list[str]:
    """The trainer's arguments for one run, checkpoints in its own temporary folder."""
    overrides = (
        f"{model},{trainer_overrides(ddp)},train.max_steps={steps},log.every_steps={log_every},"
        "checkpoint.uri=checkpoints"
    )
    return ["-m", "trainer", "--config", "tokens", "--set", overrides]


def records(stdout: str) -> LinkRun:
    """Rank 0's JSON lines as one run's figures."""
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    start = next(line for line in lines if line["event"] == "start")
    steady = [line for line in lines if line["event"] == "progress"][WARMUP_WINDOWS:]
    if not steady:
        raise RuntimeError("too few progress lines for a steady window: give the run more steps")
    return LinkRun(
        statistics.median(line["samples_per_second"] for line in steady),
        statistics.mean(line["step_ms"] for line in steady),
        statistics.mean(line["communication_ms"] for line in steady),
        steady[-1]["loss"],
        start["parameters"],
    )


def one_node(network: Network, args: list[str], timeout_s: float, *, beside: bool = False) -> LinkRun:
    """The model on one node alone: no link, the same per-rank batch. `beside`: while the
    other host runs the same, so that the two share this machine's CPUs as the two nodes
    will (what one step costs beside a busy neighbour)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", *args]
    with tempfile.TemporaryDirectory(prefix="link-one-") as workdir:
        runs = []
        for host in (0, 1) if beside else (0,):  # each in a folder of its own: a checkpoint owner each
            folder = Path(workdir) / f"host{host}"
            folder.mkdir()
            runs.append(on_host(network, host, command, folder))
        outputs = [run.communicate(timeout=timeout_s) for run in runs]
    for run, (_, stderr) in zip(runs, outputs, strict=True):
        if run.returncode != 0:
            raise RuntimeError(f"a one-node run failed:\n{stderr[-3000:]}")
    return records(outputs[0][0])


def two_nodes(network: Network, args: list[str], timeout_s: float) -> LinkRun:
    """One trainer process on each of the network's first two hosts, rendezvous on host 0."""
    return records(on_two_hosts(network, args, timeout_s))


@dataclass(frozen=True)
class MeasuredLink:
    """What gloo's own all-reduces get between the two hosts: the per-hop latency (a 1 KiB
    all-reduce's time over its two hops) and the bandwidth of a 64 MiB one."""

    latency_s: float
    bandwidth_bytes_s: float


def measure_link(network: Network, dtype: str = "float32") -> MeasuredLink:
    """`benchmarks.allreduce` on the two hosts in `dtype`, as the trainer's all-reduces
    would run there."""
    args = ["-m", "benchmarks.allreduce", "--dtype", dtype]
    result = json.loads(on_two_hosts(network, args, 300).strip().splitlines()[-1])
    return MeasuredLink(result["latency_s"], result["bandwidth_bytes_s"])


def on_two_hosts(network: Network, args: list[str], timeout_s: float) -> str:
    """`torchrun ARGS` with one process on each of hosts 0 and 1 (c10d rendezvous on host 0):
    host 0's stdout. A failure raises with its stderr's tail."""
    port = free_port()
    agents = []
    with tempfile.TemporaryDirectory(prefix="link-two-") as workdir:
        for index in range(2):
            command = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={network.addresses[0]}:{port}", "--rdzv-id=links",
                f"--rdzv-conf=is_host={int(index == 0)}", f"--local-addr={network.addresses[index]}", *args,
            ]  # fmt: skip
            agents.append(on_host(network, index, command, Path(workdir)))
        try:
            outputs = [agent.communicate(timeout=timeout_s) for agent in agents]
        finally:
            for agent in agents:
                if agent.poll() is None:
                    os.killpg(agent.pid, 9)
                    agent.wait()
    for agent, (_, stderr) in zip(agents, outputs, strict=True):
        if agent.returncode != 0:
            raise RuntimeError(f"a two-host run failed:\n{stderr[-3000:]}")
    return outputs[0][0]

"""Two torchrun agents acting as two nodes (c10d rendezvous on loopback), 2 stages × 2 replicas."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from distributed_harness import free_port

JOB = Path(__file__).with_name("multinode_job.py")


def test_two_torchrun_nodes_run_a_pipeline_with_two_replicas(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
         f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
         "--rdzv-id=seqpipe-multinode-test", "--max-restarts=0", str(JOB),
         "--out", str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=180)[0])
    finally:
        for node in nodes:
            node.kill()
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-3000:]
    verdicts = sorted((tmp_path / f"rank{r}").read_text() for r in range(4))
    assert verdicts == ["ok node=0 stage=0", "ok node=0 stage=0",
                        "ok node=1 stage=1", "ok node=1 stage=1"], verdicts

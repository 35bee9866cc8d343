"""Two torchrun "nodes" on loopback (c10d rendezvous, 2 processes each) train what one node
with 4 processes trains: the multi-node launch path is the same program."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
from helpers import BASE, explain, losses, torchrun

from moe_core.convert.native import load_model_dir

LAYOUT = ["parallel.ep=2", "parallel.dp=2", "train.steps=3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_match_one_node(tmp_path):
    one = tmp_path / "one-node"
    result = torchrun(4, ["-m", "moe_core.cli", "train", *BASE, *LAYOUT, f"out_dir={one}"])
    assert result.returncode == 0, explain(result)

    two = tmp_path / "two-nodes"
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = []
    for node_rank in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node_rank}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=moe-test",
            "-m", "moe_core.cli", "train", *BASE, *LAYOUT, f"out_dir={two}",
        ]  # fmt: skip
        nodes.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    for node in nodes:
        out, err = node.communicate(timeout=300)
        assert node.returncode == 0, out[-2000:] + err[-3000:]

    assert losses(two) == losses(one)
    _, a = load_model_dir(one / "model")
    _, b = load_model_dir(two / "model")
    assert all(torch.equal(a[k], b[k]) for k in a)

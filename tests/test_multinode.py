"""Two torchrun "nodes" on loopback, started by the multi-node launcher (c10d rendezvous, 2
processes each, `moe train --config`), train exactly what one node with 4 processes trains."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from helpers import BASE, losses

from flows.render import torchrun_command
from moe_core.compose import compose_run
from moe_core.config_dict import to_dict
from moe_core.convert.native import load_model_dir

LAYOUT = ["parallel.ep=2", "parallel.dp=2"]  # the session's one-node run (conftest)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.extended  # the launch commands' tests cover the rendezvous; this runs two agents
def test_two_nodes_match_one_node(tmp_path, dp2_ep2_run):
    one = dp2_ep2_run  # one node, 4 processes: the same BASE + LAYOUT
    two = tmp_path / "two-nodes"
    run = compose_run(
        [*BASE, *LAYOUT, "cluster.nodes=2", "cluster.procs_per_node=2", f"out_dir={two}"]
    )
    config = tmp_path / "config.json"
    config.write_text(json.dumps(to_dict(run)))
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            torchrun_command(run, str(config), 2, rank, endpoint, python=sys.executable),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        for node in nodes:
            out, err = node.communicate(timeout=300)
            assert node.returncode == 0, out[-2000:] + err[-3000:]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()

    assert losses(two) == losses(one)
    _, a = load_model_dir(one / "model")
    _, b = load_model_dir(two / "model")
    assert all(torch.equal(a[k], b[k]) for k in a)

"""``infra/prefect.yaml`` generated from the Hydra configs (Hydra stays the single source).

    python -m flows.deployments > infra/prefect.yaml

One deployment of the ``pretrain`` flow per top-level ``conf/pretrain-*.yaml``; its parameter
is that config resolved to a plain dict (each flow run then gets a run folder of its own). Its
work pool follows the config's ``cluster.kind``: the train stage launches the training itself,
so a flow run must execute where that launch works (``local``: this machine; ``slurm``: a login
node with sbatch; ``kubernetes``: where the cluster is reachable). A test keeps the committed
file equal to what this prints.
"""

from __future__ import annotations

import sys

import yaml

from moe_core.compose import DEFAULT_CONFIG_DIR, compose_dict

# A process work pool per cluster kind; start its worker where that kind launches
# (infra/start-worker.sh POOL).
WORK_POOLS = {"local": "local", "slurm": "slurm", "kubernetes": "kubernetes"}


def deployment_names() -> list[str]:
    configs = DEFAULT_CONFIG_DIR.glob("pretrain-*.yaml")
    return sorted(p.stem.removeprefix("pretrain-") for p in configs)


def render() -> str:
    deployments = []
    for name in deployment_names():
        config = compose_dict([], config_name=f"pretrain-{name}")
        deployments.append(
            {
                "name": name,
                "description": f"Pretraining pipeline for conf/pretrain-{name}.yaml",
                "entrypoint": "flows/pretrain.py:pretrain",
                # No run_dir: each flow run gets its own (flows.pretrain.default_run_dir);
                # `--param run_dir=...` resumes a given one.
                "parameters": {"config": config},
                "work_pool": {"name": WORK_POOLS[config["cluster"]["kind"]]},
            }
        )
    doc = {"name": "moe-core", "prefect-version": "3.9.1", "deployments": deployments}
    header = (
        "# Generated from conf/ by `python -m flows.deployments > infra/prefect.yaml`: do not "
        "edit.\n"
        "# Deploy from the project root: prefect --no-prompt deploy --all --prefect-file "
        "infra/prefect.yaml\n"
    )
    return header + yaml.safe_dump(doc, sort_keys=False, width=100)


if __name__ == "__main__":
    sys.stdout.write(render())

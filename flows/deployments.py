"""``infra/prefect.yaml`` generated from the Hydra configs (Hydra stays the single source).

    python -m flows.deployments > infra/prefect.yaml

One deployment of the ``pretrain`` flow per top-level ``conf/pretrain-*.yaml``; its parameter
is that config resolved to a plain dict (each flow run then gets a run folder of its own). Its
work pool follows the config's ``cluster.kind``: the train stage launches the training itself,
so a flow run must execute where that launch works (``local``: this machine; ``slurm``: a login
node with sbatch; ``kubernetes``: where the cluster is reachable). A test keeps the committed
file equal to what this prints.

A config on Slurm also gets a twin, ``<name>-kubernetes`` (the same config with
``cluster=kubernetes``), in the pool ``kubernetes``: a Prefect work pool of type ``kubernetes``
made from ``infra/kubernetes-pool.json`` (``python -m flows.deployments kubernetes-pool``), whose
flow-run pods run the project's image with the launcher's service account
(``infra/kubernetes-rbac.yaml``) and the runs volume mounted, so the train stage creates the
training Job from inside the cluster.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import yaml

from moe_core.compose import DEFAULT_CONFIG_DIR, compose_dict
from moe_core.config import ClusterConfig, RunConfig
from moe_core.config_dict import from_dict, to_dict

# A process work pool per cluster kind; start its worker where that kind launches
# (infra/start-worker.sh POOL).
WORK_POOLS = {"local": "local", "slurm": "slurm", "kubernetes": "kubernetes"}
# Where infra/Containerfile installs the project (its WORKDIR): a flow-run pod runs the
# deployment's entrypoint from there.
IMAGE_WORKDIR = "/opt/moe_core"
# The service account of infra/kubernetes-rbac.yaml: it may create and follow the training Job.
SERVICE_ACCOUNT = "moe-core-launcher"


def deployment_names() -> list[str]:
    configs = DEFAULT_CONFIG_DIR.glob("pretrain-*.yaml")
    return sorted(p.stem.removeprefix("pretrain-") for p in configs)


def _deployment(name: str, config: dict[str, Any], run: RunConfig) -> dict[str, Any]:
    """``config`` as composed (what the flow run receives), ``run`` it resolved."""
    cluster = to_dict(run.cluster)  # with the dataclass defaults
    deployment: dict[str, Any] = {
        "name": name,
        "description": f"Pretraining pipeline for conf/pretrain-{name}.yaml",
        "entrypoint": "flows/pretrain.py:pretrain",
        # No run_dir: each flow run gets its own (flows.pretrain.default_run_dir);
        # `--param run_dir=...` resumes a given one.
        "parameters": {"config": config},
        "work_pool": {"name": WORK_POOLS[cluster["kind"]]},
    }
    if cluster["kind"] == "kubernetes":
        base = name.removesuffix("-kubernetes")
        deployment["description"] = (
            f"Pretraining pipeline for conf/pretrain-{base}.yaml with cluster=kubernetes"
        )
        deployment["pull"] = [
            {"prefect.deployments.steps.set_working_directory": {"directory": IMAGE_WORKDIR}}
        ]
        deployment["work_pool"]["job_variables"] = {
            key: cluster[key] for key in ("image", "namespace", "volume_claim", "volume_path")
        }
    return deployment


def render() -> str:
    deployments = []
    for name in deployment_names():
        config = compose_dict([], config_name=f"pretrain-{name}")
        run = from_dict(RunConfig, config)
        deployments.append(_deployment(name, config, run))
        if run.cluster.kind == "slurm":
            twin = compose_dict(["cluster=kubernetes"], config_name=f"pretrain-{name}")
            deployments.append(_deployment(f"{name}-kubernetes", twin, from_dict(RunConfig, twin)))
    doc = {"name": "moe-core", "prefect-version": "3.9.1", "deployments": deployments}
    header = (
        "# Generated from conf/ by `python -m flows.deployments > infra/prefect.yaml`: do not "
        "edit.\n"
        "# Deploy from the project root: prefect --no-prompt deploy --all --prefect-file "
        "infra/prefect.yaml\n"
    )
    return header + yaml.safe_dump(doc, sort_keys=False, width=100)


def kubernetes_pool_template() -> dict[str, Any]:
    """The base job template of the ``kubernetes`` work pool: prefect-kubernetes' default, with
    the project's image and service account as defaults and two more variables,
    ``volume_claim`` mounted at ``volume_path`` in the flow-run pod (the run directory lies
    there, shared with the training pods)."""
    from prefect_kubernetes.worker import KubernetesWorker

    template = copy.deepcopy(KubernetesWorker.get_default_base_job_template())
    defaults = ClusterConfig()
    variables = template["variables"]["properties"]
    variables["image"]["default"] = defaults.image
    variables["service_account_name"]["default"] = SERVICE_ACCOUNT
    variables["volume_claim"] = {
        "title": "Volume Claim",
        "description": "A ReadWriteMany PersistentVolumeClaim holding the run directories "
        "(cluster.volume_claim).",
        "type": "string",
        "default": defaults.volume_claim,
    }
    variables["volume_path"] = {
        "title": "Volume Path",
        "description": "Where the flow-run pod mounts it (cluster.volume_path).",
        "type": "string",
        "default": defaults.volume_path,
    }
    pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    pod["volumes"] = [
        {"name": "runs", "persistentVolumeClaim": {"claimName": "{{ volume_claim }}"}}
    ]
    pod["containers"][0]["volumeMounts"] = [{"name": "runs", "mountPath": "{{ volume_path }}"}]
    return template


if __name__ == "__main__":
    if sys.argv[1:] == ["kubernetes-pool"]:
        sys.stdout.write(json.dumps(kubernetes_pool_template(), indent=2) + "\n")
    elif sys.argv[1:]:
        sys.exit(f"usage: python -m flows.deployments [kubernetes-pool], not {sys.argv[1:]}")
    else:
        sys.stdout.write(render())

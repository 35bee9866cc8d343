"""The Kubernetes launcher against a fake API that replays recorded Job and pod states, one
snapshot per look: what it creates, the log it streams, when it deletes the Job, how it ends."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from flows.launchers import KubernetesLauncher, KubernetesTokenizeLauncher, LaunchTimeoutError
from flows.render import (
    kubernetes_objects,
    kubernetes_tokenize_objects,
    render_kubernetes,
    run_id,
)
from moe_core.compose import compose_run
from moe_core.config import ConfigError, RunConfig
from moe_core.config_dict import from_dict, to_dict

# the `kubernetes` extra (in `test`); a GPU machine running `pytest -m gpu` may lack it
client = pytest.importorskip("kubernetes.client", reason="needs the kubernetes extra")
ApiException = client.exceptions.ApiException

INDEX = "batch.kubernetes.io/job-completion-index"


def snapshot(*phases: str, log: str = "", succeeded: int = 0, failed: int = 0) -> dict:
    """One look at the Job: its pods' phases (pod i has completion index i), pod 0's whole
    log so far, and the Job's counts of succeeded and failed pods."""
    return {"phases": phases, "log": log, "succeeded": succeeded, "failed": failed}


STARTS_AND_FINISHES = [
    snapshot("Pending", "Pending"),
    snapshot("Running", "Pending", log="moe_core: rendezvous\n"),
    snapshot("Running", "Running", log="moe_core: rendezvous\nstep 0 loss 8.3\n"),
    snapshot(
        "Succeeded",
        "Succeeded",
        log="moe_core: rendezvous\nstep 0 loss 8.3\nstep 1 loss 8.1\ndone\n",
        succeeded=2,
    ),
]
LOSES_A_POD = [
    snapshot("Running", "Running", log="step 0 loss 8.3\n"),
    snapshot("Running", "Failed", log="step 0 loss 8.3\n", failed=1),
]


class FakeKube:
    """CoreV1Api and BatchV1Api in one: each Job created replays the next recorded sequence,
    advancing one snapshot per status read and staying on the last."""

    def __init__(self, *sequences: list[dict], interrupt_at: int | None = None) -> None:
        self.sequences = list(sequences)
        self.interrupt_at = interrupt_at  # status read that raises, as a cancelled run would
        self.services: list[client.V1Service] = []
        self.jobs: list[client.V1Job] = []
        self.deleted: list[tuple[str, str, str]] = []
        self.reads = 0
        self.current: list[dict] = []
        self.step = -1

    def create_namespaced_service(self, namespace: str, body: client.V1Service) -> None:
        if any(s.metadata.name == body.metadata.name for s in self.services):
            raise ApiException(status=409, reason="AlreadyExists")
        self.services.append(body)

    def create_namespaced_job(self, namespace: str, body: client.V1Job) -> None:
        self.jobs.append(body)
        self.current, self.step = self.sequences.pop(0), -1

    def read_namespaced_job_status(self, name: str, namespace: str) -> client.V1Job:
        assert name == self.jobs[-1].metadata.name
        self.reads += 1
        if self.reads == self.interrupt_at:
            raise KeyboardInterrupt
        self.step = min(self.step + 1, len(self.current) - 1)
        s = self.current[self.step]
        status = client.V1JobStatus(succeeded=s["succeeded"] or None, failed=s["failed"] or None)
        return client.V1Job(status=status)

    def list_namespaced_pod(self, namespace: str, label_selector: str) -> client.V1PodList:
        job = label_selector.removeprefix("job-name=")
        pods = [
            client.V1Pod(
                metadata=client.V1ObjectMeta(name=f"{job}-{i}-x", labels={INDEX: str(i)}),
                status=client.V1PodStatus(phase=phase),
            )
            for i, phase in enumerate(self.current[self.step]["phases"])
        ]
        return client.V1PodList(items=pods)

    def read_namespaced_pod_log(self, name: str, namespace: str) -> str:
        assert name.endswith("-0-x"), "only pod 0's log is streamed"
        return self.current[self.step]["log"]

    def delete_namespaced_job(self, name: str, namespace: str, propagation_policy: str) -> None:
        self.deleted.append((name, namespace, propagation_policy))


@pytest.fixture
def run(tmp_path: Path):
    return compose_run(
        [
            "cluster=kubernetes",
            "cluster.nodes=2",
            "cluster.procs_per_node=4",
            "cluster.gpus_per_node=4",
            f"cluster.volume_path={tmp_path}",
            "cluster.namespace=ml",
            "cluster.poll_s=0.001",
            "cluster.start_timeout_s=0.2",
            "parallel=ep8",
            f"out_dir={tmp_path}/train",
        ],
        config_name="pretrain-47b",
    )


def launcher(run, tmp_path: Path, fake: FakeKube) -> tuple[KubernetesLauncher, list[str]]:
    logged: list[str] = []
    train = tmp_path / "train"
    train.mkdir(exist_ok=True)
    return KubernetesLauncher(run, train, logged.append, apis=(fake, fake)), logged


def test_a_job_that_finishes_is_created_from_the_typed_objects_and_followed(run, tmp_path):
    fake = FakeKube(STARTS_AND_FINISHES)
    k8s, logged = launcher(run, tmp_path, fake)
    attempt = k8s.attempt(1)
    name = f"{run_id(run)}-1"
    train = tmp_path / "train"
    assert attempt.ok and attempt.state == "COMPLETED" and attempt.job_id == name
    service, job = kubernetes_objects(run, str(train), str(train / "config.json"), 1)
    assert fake.services == [service] and fake.jobs == [job]
    manifest = train / "kubernetes-1.yaml"
    assert attempt.script == str(manifest)
    assert manifest.read_text() == render_kubernetes(run, str(train), str(train / "config.json"), 1)
    assert [x for x in logged if not x.startswith("kubernetes job")] == [
        "moe_core: rendezvous",
        "step 0 loss 8.3",
        "step 1 loss 8.1",
        "done",
    ], "pod 0's log, each line once"
    states = [x.rsplit(": ", 1)[1] for x in logged if x.startswith(f"kubernetes job {name}: ")]
    assert states == ["PENDING", "RUNNING", "COMPLETED"]
    assert fake.deleted == []


def test_a_failed_pod_fails_the_attempt_and_the_next_one_is_a_new_job(run, tmp_path):
    import json
    from dataclasses import asdict

    from moe_core.train.torchrun import FailedRank

    fake = FakeKube(LOSES_A_POD, STARTS_AND_FINISHES)
    k8s, _ = launcher(run, tmp_path, fake)
    # an earlier pipeline in this run folder, stopped during its attempt 1 (launches.json never
    # recorded it), had a Job of this name whose node recorded a failure: this Job's pods
    # record none, and the old record is not theirs
    stale = tmp_path / "train" / "logs" / f"{run_id(run)}-1" / "node-0"
    stale.mkdir(parents=True)
    old = FailedRank(3, 3, 9, 1, None, "an earlier pipeline's failure", None)
    (stale / "failure.json").write_text(json.dumps(asdict(old)))
    first = k8s.attempt(1)
    assert not first.ok and first.state == "FAILED"
    assert first.detail == f"kubernetes job {run_id(run)}-1 ended FAILED"
    kept = stale.parent.with_name(f"{run_id(run)}-1.old") / "node-0" / "failure.json"
    assert json.loads(kept.read_text())["message"] == "an earlier pipeline's failure"
    second = k8s.attempt(2)
    assert second.ok and second.job_id == f"{run_id(run)}-2"
    assert [j.metadata.name for j in fake.jobs] == [f"{run_id(run)}-1", f"{run_id(run)}-2"]
    assert len(fake.services) == 1, "the Service is kept across attempts"
    (container,) = fake.jobs[1].spec.template.spec.containers
    assert f"--rdzv-endpoint={run_id(run)}-2-0.{run_id(run)}:29500" in container.command
    assert fake.deleted == [], "a Job that ended needs no delete"


def test_with_shrink_a_job_is_sized_to_the_ready_nodes(run, tmp_path):
    """cluster.on_node_loss=shrink, dp 2 x ep 4 on 2 nodes of 4 GPUs: with one node ready
    (the other NotReady, a third without GPUs) the Job is 1 pod training at dp 1 (moe train
    --nodes 1); with both ready, 2 pods as planned. The attempts record it."""
    shrink = compose_run(
        [*(f"{k}={v}" for k, v in _overrides(run).items()), "cluster.on_node_loss=shrink"],
        config_name="pretrain-47b",
    )
    assert shrink.node_counts == {2: 2, 1: 1}

    def node(ready: str, gpus: int, unschedulable: bool = False):
        return client.V1Node(
            spec=client.V1NodeSpec(unschedulable=unschedulable),
            status=client.V1NodeStatus(
                conditions=[client.V1NodeCondition(type="Ready", status=ready)],
                allocatable={"nvidia.com/gpu": str(gpus)},
            ),
        )

    fake = FakeKube(LOSES_A_POD, STARTS_AND_FINISHES)
    fake.nodes = [node("True", 4), node("False", 4), node("True", 0), node("True", 4, True)]
    fake.list_node = lambda: client.V1NodeList(items=fake.nodes)
    k8s, logged = launcher(shrink, tmp_path, fake)
    first = k8s.attempt(1)
    assert (first.nodes, first.dp, first.accumulation) == (1, 1, shrink.micro_batches * 2)
    spec = fake.jobs[0].spec
    assert spec.completions == spec.parallelism == 1
    (container,) = spec.template.spec.containers
    assert "--nnodes=1" in container.command and container.command[-2:] == ["--nodes", "1"]
    sentence = f"continuing on 1 of 2 nodes: dp 2 -> 1, accumulation {shrink.micro_batches}"
    assert any(x.startswith(f"kubernetes job {first.job_id}: {sentence}") for x in logged)
    assert (
        "# moe_core: model 47b on 1 pods" in (tmp_path / "train" / "kubernetes-1.yaml").read_text()
    )

    fake.nodes[1] = node("True", 4)  # back
    logged.clear()
    second = k8s.attempt(2)
    assert second.ok and (second.nodes, second.dp) == (2, 2)
    assert (
        fake.jobs[1].spec.completions == 2
        and "--nodes" not in fake.jobs[1].spec.template.spec.containers[0].command
    )


def test_with_shrink_a_cluster_that_hides_its_nodes_gets_a_full_size_job(run, tmp_path):
    """A service account without permission to list nodes: the Job asks for all of them."""
    shrink = compose_run(
        [*(f"{k}={v}" for k, v in _overrides(run).items()), "cluster.on_node_loss=shrink"],
        config_name="pretrain-47b",
    )

    def forbidden():
        raise ApiException(status=403, reason="Forbidden")

    fake = FakeKube(STARTS_AND_FINISHES)
    fake.list_node = forbidden
    k8s, logged = launcher(shrink, tmp_path, fake)
    attempt = k8s.attempt(1)
    assert attempt.ok and attempt.nodes == 2 and fake.jobs[0].spec.completions == 2
    assert "cannot list the cluster's nodes (403 Forbidden): asking for all 2" in logged

    # an API server that does not answer: the same, not a traceback
    from urllib3.exceptions import MaxRetryError

    def unreachable():
        raise MaxRetryError(None, "/api/v1/nodes", "connection refused")

    fake = FakeKube(STARTS_AND_FINISHES)
    fake.list_node = unreachable
    (tmp_path / "unreachable").mkdir()
    k8s, logged = launcher(shrink, tmp_path / "unreachable", fake)
    attempt = k8s.attempt(1)
    assert attempt.ok and fake.jobs[0].spec.completions == 2
    assert any(
        line.startswith("cannot list the cluster's nodes (") and "connection refused" in line
        for line in logged
    )


def _overrides(run: RunConfig) -> dict[str, object]:
    """The fixture's cluster and layout as overrides, with dp 2 x ep 4 instead of ep 8."""
    c = run.cluster
    return {
        "cluster": "kubernetes",
        "cluster.nodes": 2,
        "cluster.procs_per_node": 4,
        "cluster.gpus_per_node": 4,
        "cluster.volume_path": c.volume_path,
        "cluster.namespace": "ml",
        "cluster.poll_s": 0.001,
        "parallel": "ep8",
        "parallel.ep": 4,
        "parallel.dp": 2,
        "out_dir": run.out_dir,
    }


def test_cancelling_deletes_the_job(run, tmp_path):
    fake = FakeKube(STARTS_AND_FINISHES, interrupt_at=3)
    k8s, logged = launcher(run, tmp_path, fake)
    with pytest.raises(KeyboardInterrupt):
        k8s.attempt(1)
    name = f"{run_id(run)}-1"
    assert fake.deleted == [(name, "ml", "Foreground")]
    assert f"kubernetes job {name}: deleting it (cancel)" in logged


def test_a_job_that_never_starts_times_out_and_is_deleted(run, tmp_path):
    fake = FakeKube([snapshot("Pending", "Pending")])
    k8s, _ = launcher(run, tmp_path, fake)
    with pytest.raises(LaunchTimeoutError) as err:
        k8s.attempt(1)
    name = f"{run_id(run)}-1"
    assert str(err.value) == (
        f"kubernetes job {name} did not start within cluster.start_timeout_s=0.2 s (no pod "
        "running), so it was deleted: check the pods' events (kubectl describe pods), or raise "
        "cluster.start_timeout_s."
    )
    assert fake.deleted == [(name, "ml", "Foreground")]


def test_check_refuses_without_cluster_access_or_off_the_volume(run, tmp_path, monkeypatch):
    import dataclasses

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"^cluster\.kind='kubernetes' is not allowed on this"):
        KubernetesLauncher.check(run)
    elsewhere = dataclasses.replace(run, out_dir="/scratch/train")
    with pytest.raises(ConfigError, match=r"^run_dir='/scratch/train' is not allowed: it must lie"):
        KubernetesLauncher.check(elsewhere)


# The `kubernetes` work pool: the flow run itself in a pod, which then launches the training.

INFRA = Path(__file__).resolve().parents[1] / "infra"


def test_the_committed_pool_template_is_what_deployments_renders():
    import json

    from flows.deployments import kubernetes_pool_template

    assert json.loads((INFRA / "kubernetes-pool.json").read_text()) == kubernetes_pool_template(), (
        "regenerate it: python -m flows.deployments kubernetes-pool > infra/kubernetes-pool.json"
    )


def test_a_kubernetes_deployments_flow_run_pod_mounts_the_runs_volume_as_its_launcher():
    """The pod prefect-kubernetes' worker would create for pretrain/1t-kubernetes, rendered by
    Prefect's own templating from the committed pool template and the deployment's variables."""
    import json

    import yaml
    from prefect.utilities.templating import apply_values
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    from flows.deployments import IMAGE_WORKDIR, render

    template = json.loads((INFRA / "kubernetes-pool.json").read_text())
    deployment = next(
        d for d in yaml.safe_load(render())["deployments"] if d["name"] == "1t-kubernetes"
    )
    assert deployment["work_pool"]["name"] == "kubernetes"
    cluster = to_dict(from_dict(RunConfig, deployment["parameters"]["config"]).cluster)
    assert cluster["kind"] == "kubernetes" and cluster["nodes"] * cluster["procs_per_node"] == 512
    step = deployment["pull"][0]["prefect.deployments.steps.set_working_directory"]
    assert step == {"directory": IMAGE_WORKDIR}

    variables = template["variables"]["properties"]
    values = {k: v["default"] for k, v in variables.items() if "default" in v}
    values |= deployment["work_pool"]["job_variables"] | {"volume_claim": "claim-7"}
    config = KubernetesWorkerJobConfiguration(**apply_values(template["job_configuration"], values))
    pod = config.job_manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == cluster["image"]
    assert pod["serviceAccountName"] == "moe-core-launcher"
    assert pod["volumes"] == [{"name": "runs", "persistentVolumeClaim": {"claimName": "claim-7"}}]
    assert container["volumeMounts"] == [{"name": "runs", "mountPath": cluster["volume_path"]}]
    assert config.namespace == cluster["namespace"]


def test_the_containerfile_installs_the_project_where_kubernetes_deployments_look():
    from flows.deployments import IMAGE_WORKDIR

    workdirs = [
        line.split()[1]
        for line in (INFRA / "Containerfile").read_text().splitlines()
        if line.startswith("WORKDIR ")
    ]
    assert workdirs[-1] == IMAGE_WORKDIR


# Each call the launcher makes -> the (API group, resource, verb) it needs.
PERMISSIONS = {
    "create_namespaced_service": ("", "services", "create"),
    "list_namespaced_pod": ("", "pods", "list"),
    "read_namespaced_pod_log": ("", "pods/log", "get"),
    "create_namespaced_job": ("batch", "jobs", "create"),
    "read_namespaced_job_status": ("batch", "jobs/status", "get"),
    "delete_namespaced_job": ("batch", "jobs", "delete"),
}


def test_the_launchers_role_grants_every_call_it_makes():
    import re

    import yaml

    from flows.deployments import SERVICE_ACCOUNT

    source = (Path(__file__).resolve().parents[1] / "flows" / "launchers.py").read_text()
    calls = set(re.findall(r"\b(?:core|batch)\.(\w+_namespaced_\w+)\(", source))
    assert calls, "the launcher's API calls were not found"
    unknown = calls - set(PERMISSIONS)
    assert not unknown, (
        f"add the permission these calls need to PERMISSIONS and the Role: {unknown}"
    )
    docs = list(yaml.safe_load_all((INFRA / "kubernetes-rbac.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert kinds["ServiceAccount"]["metadata"]["name"] == SERVICE_ACCOUNT
    binding = kinds["RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT}]
    assert binding["roleRef"]["name"] == kinds["Role"]["metadata"]["name"]
    granted = {
        (group, resource, verb)
        for rule in kinds["Role"]["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert {PERMISSIONS[c] for c in calls} == granted, "the Role grants what is used, no more"


def test_the_tokenize_job_runs_a_dask_scheduler_and_driver_on_pod_0_and_workers_elsewhere(
    run, tmp_path
):
    fake = FakeKube(STARTS_AND_FINISHES)
    folder = tmp_path / "tokenize"
    folder.mkdir()
    config = str(folder / "config.json")
    attempt = KubernetesTokenizeLauncher(run, folder, [].append, apis=(fake, fake)).attempt(1)
    assert attempt.ok and attempt.job_id == f"{run_id(run)}-tok-1"
    service, job = kubernetes_tokenize_objects(run, str(folder), config, 1)
    assert fake.services == [service] and fake.jobs == [job]
    assert (folder / "kubernetes-1.yaml").read_text() == render_kubernetes(
        run, str(folder), config, 1, make=kubernetes_tokenize_objects
    )
    (train_service, _) = kubernetes_objects(run, str(folder), config, 1)
    assert service.metadata.name != train_service.metadata.name  # selects no training pod
    assert job.spec.completions == 2 and service.spec.ports[0].port == run.cluster.dask_port
    (container,) = job.spec.template.spec.containers
    assert container.resources is None, "tokenizing asks for no GPU"
    bash, flag, script = container.command
    assert (bash, flag) == ("bash", "-c")
    syntax = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    address = f"tcp://{run_id(run)}-tok-1-0.{run_id(run)}-tok:{run.cluster.dask_port}"
    assert f"MOE_DASK={address}" in script
    pod0, others = script.split("\nelse\n")
    assert "dask_scheduler" in pod0 and "dask_worker" in pod0 and "trap moe_stop EXIT" in pod0
    assert f"moe_core.cli tokenize --config {config} --scheduler" in pod0
    assert "dask_worker" in others and "dask_scheduler" not in others
    assert "--nworkers=$(nproc)" in others  # data.workers=0: one per core

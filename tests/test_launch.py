"""Multi-node launchers (torchrun command, Slurm script, Kubernetes manifests) and
``moe train --config``: rendered for the named deployments and checked without a cluster."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.render import render_kubernetes, render_slurm, run_id, torchrun_command
from moe_core.cli import main
from moe_core.compose import compose_dict, compose_run
from moe_core.config import ConfigError
from moe_core.config_dict import to_dict


def one_sentence(message: str) -> bool:
    import re

    return message.endswith(".") and not re.search(r"[.!?]\s+[A-Z]", message)


def sbatch_directives(script: str) -> dict[str, str]:
    out = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line.removeprefix("#SBATCH ").partition("=")
            out[key] = value
    return out


def run_slurm_script(
    tmp_path: Path, path: Path, hosts: list[str], **env: str
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run a rendered batch script with stand-ins for ``scontrol`` (expanding the nodelist to
    ``hosts``) and ``srun`` (recording its arguments): what it printed, and the arguments the
    nodes' command was given, expanded; ``env``: the job's SLURM_* variables."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "srun.json"
    listing = "\\n".join(hosts)
    stubs = {
        "scontrol": f"#!/bin/sh\nprintf '{listing}\\n'\n",
        "srun": f"#!{sys.executable}\nimport json, sys\n"
        f"json.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n",
    }
    for tool, body in stubs.items():
        (bin_dir / tool).write_text(body)
        (bin_dir / tool).chmod(stat.S_IRWXU)
    path_var = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    full = {**os.environ, "PATH": path_var, **env}
    done = subprocess.run(["bash", str(path)], env=full, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done, json.loads(record.read_text())


def test_torchrun_command_is_c10d_into_moe_train():
    run = compose_run(["out_dir=/runs/47b/train"], config_name="pretrain-47b")
    cmd = torchrun_command(run, "/runs/47b/config.json", 8, 3, "node-a:29500")
    assert cmd == [
        "torchrun",
        "--nnodes=8",
        "--nproc-per-node=8",
        "--node-rank=3",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node-a:29500",
        f"--rdzv-id={run_id(run)}",
        "--max-restarts=0",
        "-m",
        "moe_core.cli",
        "train",
        "--config",
        "/runs/47b/config.json",
    ]
    py = torchrun_command(run, "c.json", 8, None, "h:1", python="/x/python", rdzv_id="job7")
    assert py[:3] == ["/x/python", "-m", "torch.distributed.run"]
    assert "--rdzv-id=job7" in py and not any(a.startswith("--node-rank") for a in py)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"nnodes": 4}, "nnodes=4 is not allowed"),
        ({"node_rank": 8}, "node_rank=8 is not allowed"),
        ({"rdzv_endpoint": "node-a"}, "rdzv_endpoint='node-a' is not allowed"),
    ],
)
def test_torchrun_command_refusals(kwargs, fragment):
    run = compose_run([], config_name="pretrain-47b")
    args = {"nnodes": 8, "node_rank": 0, "rdzv_endpoint": "node-a:29500", **kwargs}
    with pytest.raises(ConfigError) as err:
        torchrun_command(run, "c.json", **args)
    assert fragment in str(err.value) and one_sentence(str(err.value))


@pytest.mark.parametrize(
    "name,overrides,nodes",
    [
        ("pretrain-47b", ["cluster.account=proj-42", "cluster.time_limit=12:00:00"], 8),
        ("pretrain-1t", [], 64),
    ],
)
def test_slurm_script(tmp_path: Path, name: str, overrides: list[str], nodes: int):
    run = compose_run(overrides, config_name=name)
    run_dir = tmp_path / "run"
    script = render_slurm(run, str(run_dir), str(run_dir / "config.json"))
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    expected = {
        "--job-name": run_id(run),
        "--nodes": str(nodes),
        "--ntasks-per-node": "1",
        "--gpus-per-node": "8",
        "--partition": "gpu",
        "--time": run.cluster.time_limit,
        "--output": f"{run_dir}/slurm-%j.out",
        "--chdir": str(run_dir),
        "--exclusive": "",
    }
    if run.cluster.account:
        expected["--account"] = "proj-42"
    assert sbatch_directives(script) == expected
    assert script.startswith("#!/bin/bash\n")

    # Run it with stand-ins for scontrol and srun: the command each node gets, expanded.
    job = {"SLURM_JOB_NODELIST": "gpu-node-[07-08]", "SLURM_JOB_ID": "4242"}
    hosts = ["gpu-node-07", "gpu-node-08"]
    _, argv = run_slurm_script(tmp_path, path, hosts, **job, SLURM_CPUS_ON_NODE="96")
    torchrun = argv.index("python")
    assert argv[:torchrun] == [
        "--ntasks-per-node=1",
        "--cpus-per-task=96",
        "--cpu-bind=none",
        "--kill-on-bad-exit=1",
    ]
    # each node through moe_core.train.torchrun, its logs and failure record in a folder of
    # its own ({node}: the wrapper puts in the node's SLURM_NODEID)
    logs = f"{run_dir}/logs/job-4242/node-{{node}}"
    expected_cmd = torchrun_command(
        run,
        str(run_dir / "config.json"),
        nodes,
        None,
        "gpu-node-07:29500",
        rdzv_id="4242",
        log_dir=logs,
    )
    assert argv[torchrun:] == expected_cmd
    assert argv[torchrun : torchrun + 6] == [
        "python",
        "-m",
        "moe_core.train.torchrun",
        "--failure",
        f"{logs}/failure.json",
        "--log-dir",
    ]


def test_slurm_refusals(tmp_path: Path):
    run = compose_run([], config_name="pretrain-47b")
    with pytest.raises(ConfigError) as err:
        render_slurm(run, str(tmp_path / "my run"), str(tmp_path / "c.json"))
    assert "run_dir=" in str(err.value) and one_sentence(str(err.value))
    wrong = compose_run(["cluster.nodes=2"], config_name="pretrain-47b")
    with pytest.raises(ConfigError) as err:
        render_slurm(wrong, str(tmp_path), str(tmp_path / "c.json"))
    assert "needs 64" in str(err.value) and one_sentence(str(err.value))
    k8s = compose_run(["cluster=kubernetes", "cluster.nodes=8"], config_name="pretrain-47b")
    with pytest.raises(ConfigError, match=r"cluster\.kind='kubernetes' is not allowed"):
        render_slurm(k8s, str(tmp_path), str(tmp_path / "c.json"))


@pytest.mark.parametrize(
    "name,overrides,nodes",
    [
        ("pretrain-47b", ["cluster=kubernetes", "cluster.nodes=8", "cluster.namespace=ml"], 8),
        ("pretrain-1t", ["cluster=kubernetes", "cluster.image=reg.example/moe:1.0"], 64),
    ],
)
def test_kubernetes_manifests(name: str, overrides: list[str], nodes: int):
    run = compose_run(overrides, config_name=name)
    c = run.cluster
    run_dir = f"/runs/{name}"
    docs = list(yaml.safe_load_all(render_kubernetes(run, run_dir, f"{run_dir}/config.json")))
    assert [d["kind"] for d in docs] == ["Service", "Job"]
    service, job = docs
    job_name = run_id(run)
    assert service["apiVersion"] == "v1"
    assert service["metadata"] == {
        "name": job_name,
        "namespace": c.namespace,
        "labels": {"app.kubernetes.io/name": "moe-core", "moe-core/run": job_name},
    }
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["ports"][0]["port"] == c.rdzv_port

    assert job["apiVersion"] == "batch/v1"
    assert job["metadata"]["namespace"] == c.namespace
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == nodes
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    assert pod["restartPolicy"] == "Never"
    # The Service selects exactly the Job's pods.
    labels = spec["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    (container,) = pod["containers"]
    assert container["image"] == c.image
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}  # a quantity
    assert container["command"] == torchrun_command(
        run,
        f"{run_dir}/config.json",
        nodes,
        None,
        f"{job_name}-0.{job_name}:{c.rdzv_port}",
        log_dir=f"{run_dir}/logs/{job_name}/node-{{node}}",  # a folder per pod
    )
    assert container["workingDir"] == run_dir
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts == {"runs": c.volume_path, "shm": "/dev/shm"}
    assert volumes["runs"]["persistentVolumeClaim"] == {"claimName": c.volume_claim}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory"}


def test_kubernetes_objects_are_the_clients_typed_models_field_by_field():
    from kubernetes import client

    from flows.render import kubernetes_objects

    run = compose_run(
        [
            "cluster=kubernetes",
            "cluster.nodes=8",
            "cluster.namespace=ml",
            "cluster.rdzv_port=29400",
        ],
        config_name="pretrain-47b",
    )
    service, job = kubernetes_objects(run, "/runs/47b/train", "/runs/47b/train/config.json", 3)
    name = run_id(run)
    assert isinstance(service, client.V1Service) and isinstance(job, client.V1Job)
    labels = {"app.kubernetes.io/name": "moe-core", "moe-core/run": name}
    assert (service.metadata.name, service.metadata.namespace) == (name, "ml")
    assert service.metadata.labels == labels
    assert service.spec.cluster_ip == "None" and service.spec.publish_not_ready_addresses
    assert service.spec.selector == {"moe-core/run": name}
    (port,) = service.spec.ports
    assert (port.name, port.port, port.target_port) == ("rdzv", 29400, 29400)

    assert (job.metadata.name, job.metadata.namespace) == (f"{name}-3", "ml")
    spec = job.spec
    assert spec.completion_mode == "Indexed" and spec.completions == spec.parallelism == 8
    assert spec.backoff_limit == 0
    assert spec.template.metadata.labels == labels
    pod = spec.template.spec
    assert pod.restart_policy == "Never" and pod.subdomain == name
    (container,) = pod.containers
    assert container.image == run.cluster.image and container.working_dir == "/runs/47b/train"
    # Pod 0 of this attempt's Job hosts the rendezvous, reached through the headless Service.
    assert container.command == torchrun_command(
        run,
        "/runs/47b/train/config.json",
        8,
        None,
        f"{name}-3-0.{name}:29400",
        log_dir=f"/runs/47b/train/logs/{name}-3/node-{{node}}",
    )
    assert [(e.name, e.value) for e in container.env] == [("PYTHONUNBUFFERED", "1")]
    assert [(p.name, p.container_port) for p in container.ports] == [("rdzv", 29400)]
    assert container.resources.limits == {"nvidia.com/gpu": "8"}
    assert [(m.name, m.mount_path) for m in container.volume_mounts] == [
        ("runs", "/runs"),
        ("shm", "/dev/shm"),
    ]
    runs, shm = pod.volumes
    assert runs.name == "runs" and runs.persistent_volume_claim.claim_name == "moe-runs"
    assert shm.name == "shm" and shm.empty_dir.medium == "Memory"


def test_kubernetes_refuses_a_run_dir_off_the_volume():
    run = compose_run(["cluster=kubernetes", "cluster.nodes=8"], config_name="pretrain-47b")
    with pytest.raises(ConfigError) as err:
        render_kubernetes(run, "/scratch/x", "/scratch/x/config.json")
    assert "below cluster.volume_path (/runs)" in str(err.value) and one_sentence(str(err.value))


# ---- moe train --config -----------------------------------------------------------------


def _resolved(tmp_path: Path, *overrides: str) -> tuple[Path, dict]:
    run = compose_run(
        [
            "model=tiny",
            "train.steps=2",
            "train.seq_len=32",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "train.eval_batches=2",
            f"out_dir={tmp_path / 'out'}",
            *overrides,
        ]
    )
    path = tmp_path / "config.json"
    data = to_dict(run)
    path.write_text(json.dumps(data))
    return path, data


@pytest.mark.slow
def test_train_from_a_resolved_config_in_a_process_without_triton(tmp_path: Path):
    """``moe train`` on the CPU needs no triton (a CPU install leaves out the ``gpu`` extra):
    in a process where importing it fails, training runs on the kernels' PyTorch references."""
    path, _ = _resolved(tmp_path)
    code = (
        "import sys; sys.modules['triton'] = None; from moe_core.cli import main; "
        "sys.exit(main(['train', '--config', sys.argv[1]]))"
    )
    paths = [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    cmd = [sys.executable, "-c", code, str(path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1]


def test_train_config_refusals(tmp_path: Path, capsys):
    path, data = _resolved(tmp_path)
    assert main(["train", "--config", str(path), "train.steps=5"]) == 2
    out = capsys.readouterr().out.strip()
    assert "takes no Hydra options" in out and "train.steps=5" in out
    assert len(out.splitlines()) == 1 and one_sentence(out)
    assert main(["train", "--config", str(tmp_path / "missing.json")]) == 2
    out = capsys.readouterr().out.strip()
    assert "missing.json' does not exist" in out and one_sentence(out)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert main(["train", "--config", str(broken)]) == 2
    out = capsys.readouterr().out.strip()
    assert "is not valid JSON" in out and one_sentence(out)
    data["train"]["stepz"] = 3
    path.write_text(json.dumps(data))
    assert main(["train", "--config", str(path)]) == 2
    assert "train.stepz is not a known option" in capsys.readouterr().out
    del data["train"]["stepz"]
    path.write_text(json.dumps(data))
    assert main(["train", "--config", str(path), "--nodes", "2"]) == 2  # waits for all
    out = capsys.readouterr().out.strip()
    assert out.startswith(
        "error: --nodes=2 is not allowed: one of 1 (cluster.nodes=1, "
    ) and one_sentence(out)
    assert main(["train", "--nodes", "1", "train.steps=5"]) == 2
    out = capsys.readouterr().out.strip()
    assert out.startswith("error: --nodes 1 is not allowed without --config: ") and one_sentence(
        out
    )
    assert not (tmp_path / "out").exists()  # refused before anything ran


# ---- what a script or manifest holds is checked first ------------------------------------


def _with(section: str, key: str, value: object, name: str = "pretrain-47b") -> dict:
    """A deployment's config (what Prefect passes as a parameter) with one value changed."""
    from moe_core.compose import compose_dict

    config = compose_dict([], config_name=name)
    config[section][key] = value
    return config


# Every string of the config that flows.render writes into a script or manifest.
WRITTEN = [
    ("cluster", "name"),
    ("cluster", "partition"),
    ("cluster", "account"),
    ("cluster", "time_limit"),
    ("cluster", "image"),
    ("cluster", "namespace"),
    ("cluster", "volume_claim"),
    ("cluster", "volume_path"),
    ("model", "name"),
]


@pytest.mark.parametrize("section,key", WRITTEN)
@pytest.mark.parametrize("bad", ["gpu\nrm -rf ~", "gpu'; reboot; '", "$(reboot)", "a b", "`id`"])
def test_a_line_break_quote_or_shell_syntax_is_refused(section: str, key: str, bad: str):
    from moe_core.config import RunConfig
    from moe_core.config_dict import from_dict

    with pytest.raises(ConfigError) as err:
        from_dict(RunConfig, _with(section, key, bad))
    text = str(err.value)
    assert text.startswith(f"{section}.{key}={bad!r} is not allowed: ") and one_sentence(text)
    assert "\n" not in text


@pytest.mark.parametrize(
    "section,key,value,message",
    [
        (
            "cluster",
            "partition",
            "gpu\n#SBATCH --wrap=id",
            "cluster.partition='gpu\\n#SBATCH --wrap=id' is not allowed: letters, digits and "
            ". _ - (starting with a letter or digit, at most 100), comma-separated.",
        ),
        (
            "cluster",
            "time_limit",
            "12:00:00; id",
            "cluster.time_limit='12:00:00; id' is not allowed: a Slurm time such as 90, "
            "12:00:00 or 2-00:00:00 (minutes, [days-]hours:minutes:seconds) or UNLIMITED.",
        ),
        (
            "model",
            "name",
            "../../home",
            "model.name='../../home' is not allowed: letters, digits and . _ - (starting with a "
            "letter or digit, at most 100), so it names one folder in runs/.",
        ),
        (
            "cluster",
            "namespace",
            "Prod",
            "cluster.namespace='Prod' is not allowed: a Kubernetes namespace: lower-case "
            "letters, digits and -, at most 63.",
        ),
        (
            "cluster",
            "volume_path",
            "/runs/a b",
            "cluster.volume_path='/runs/a b' is not allowed: letters, digits and . _ / + = @ : , "
            "- only (no spaces, quotes, newlines or shell metacharacters), so a batch script or "
            "manifest holds it as written.",
        ),
        (
            "",
            "out_dir",
            "/runs/my run",
            "out_dir='/runs/my run' is not allowed: letters, digits and . _ / + = @ : , - only "
            "(no spaces, quotes, newlines or shell metacharacters), so a batch script or "
            "manifest holds it as written.",
        ),
    ],
)
def test_refusal_messages(section: str, key: str, value: str, message: str):
    from moe_core.compose import compose_dict
    from moe_core.config import RunConfig
    from moe_core.config_dict import from_dict

    if section:
        config = _with(section, key, value)
    else:
        config = {**compose_dict([], config_name="pretrain-47b"), key: value}
    with pytest.raises(ConfigError) as err:
        from_dict(RunConfig, config)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "key,value",
    [
        ("partition", "gpu,gpu-large"),
        ("account", "proj_42.a"),
        ("time_limit", "2-12:30:00"),
        ("time_limit", "90"),
        ("time_limit", "unlimited"),
        ("image", "reg.example:5000/team/moe-core:1.0@sha256:0abc"),
        ("namespace", "ml-team"),
        ("volume_claim", "runs.shared"),
    ],
)
def test_ordinary_values_pass_and_reach_the_script_as_written(tmp_path: Path, key, value):
    from moe_core.config import RunConfig
    from moe_core.config_dict import from_dict

    run = from_dict(RunConfig, _with("cluster", key, value))
    assert getattr(run.cluster, key) == value
    script = render_slurm(run, str(tmp_path), str(tmp_path / "c.json"))
    if key in ("partition", "account", "time_limit"):
        flag = {"time_limit": "--time"}.get(key, f"--{key}")
        assert sbatch_directives(script)[flag] == value


def test_model_name_keeps_out_dir_in_runs():
    """The default out_dir is runs/<model.name>: a name with a path in it is refused."""
    for name in ("..", "../x", "a/../../b", "/etc", ".hidden"):
        with pytest.raises(ConfigError, match=r"^model\.name=.* so it names one folder in runs/"):
            compose_run([f"model.name={name}"])
    run = compose_run(["model.name=tiny-v2.1"])
    assert Path(run.out_dir) == Path("runs") / "tiny-v2.1"


def test_pipeline_run_dir_is_checked_for_a_cluster(tmp_path: Path):
    from flows.layout import resolve

    config = _with("cluster", "nodes", 8)
    with pytest.raises(ConfigError) as err:
        resolve(config, tmp_path / "a;b")
    assert str(err.value).startswith(f"run_dir={str(tmp_path / 'a;b')!r} is not allowed: ")
    assert one_sentence(str(err.value)) and not (tmp_path / "a;b").exists()
    local = compose_run([f"out_dir={tmp_path / 'my run'}"])  # local runs take any folder
    assert local.out_dir.endswith("my run")


def test_pipeline_keeps_the_shards_in_its_run_folder_and_refuses_another_data_dir(tmp_path):
    from flows.layout import resolve

    config = compose_dict(["data=kjv"])
    assert resolve(config, tmp_path).data.dir == str(tmp_path / "data")
    with pytest.raises(ConfigError) as err:
        resolve(compose_dict(["data=kjv", "data.dir=/shared/tokens"]), tmp_path / "run")
    assert str(err.value) == (
        "data.dir='/shared/tokens' is not allowed for the pipeline: its tokenize stage writes "
        f"the shards into the run folder ({tmp_path / 'run' / 'data'}), so leave it unset."
    )
    assert not (tmp_path / "run").exists()


def test_stage_keys_of_run_folders_from_before_the_precision_section_still_match(tmp_path):
    """The train key hashes precision where it lived before (train.dtype, parallel.param_dtype,
    ...), so rerunning an existing run folder skips its finished stages. The digests were
    computed by the code before the precision section on these configs."""
    from flows.layout import resolve
    from flows.migrate import old_stage_keys
    from flows.pretrain import EVAL_BATCHES

    def stage_keys(run):  # the keys as run folders of that time hold them (flows.migrate)
        return old_stage_keys(run, EVAL_BATCHES)

    before = {
        "pretrain-tiny": "334a55d6317397a86305bc8741b9b32a39a013256ae7e32bfbbc9d66a2ec9f8a",
        "pretrain-1t": "f2d06237bc65f408dde3a13708b23719f3f8564b8a341cafb23b9cea7b7bc34b",
    }
    # those folders trained the router losses' sum over layers, the default then (the mean is
    # the default since 2026-12-04: a default config now trains another objective)
    then = ["model.aux_loss_reduction=sum"]
    for name, key in before.items():
        run = resolve(compose_dict(then, config_name=name), tmp_path)
        assert stage_keys(run)["train"] == key
    now = resolve(compose_dict([], config_name="pretrain-tiny"), tmp_path)
    assert stage_keys(now)["train"] != before["pretrain-tiny"]
    fp8 = stage_keys(
        resolve(compose_dict(["precision=fp8", *then], config_name="pretrain-tiny"), tmp_path)
    )
    assert fp8["train"] == "0d8e8c597159682c5ac9c9bc93536a9048ced4da05cf7abaa516918eace9b3fa"
    # an option added later is hashed only when set otherwise than before (migrate.ADDED_LATER)
    gathered = ["parallel.ep=1", "parallel.expert_gemm=quack", "parallel.gather_rows=true", *then]
    quack = resolve(compose_dict([*gathered[:2], *then], config_name="pretrain-tiny"), tmp_path)
    assert (
        stage_keys(resolve(compose_dict(gathered, config_name="pretrain-tiny"), tmp_path))["train"]
        != stage_keys(quack)["train"]
    )


# ---- which launcher the train stage uses ------------------------------------------------


def test_each_cluster_kind_has_its_launcher(tmp_path: Path):
    from flows.launchers import KubernetesLauncher, LocalLauncher, SlurmLauncher, launcher_class

    assert launcher_class(compose_run([])) is LocalLauncher
    assert launcher_class(compose_run([], config_name="pretrain-47b")) is SlurmLauncher
    k8s = compose_run(["cluster=kubernetes", "cluster.nodes=8"], config_name="pretrain-47b")
    assert launcher_class(k8s) is KubernetesLauncher
    two = compose_run(["cluster.nodes=2", "cluster.procs_per_node=1"])
    with pytest.raises(ConfigError) as err:
        LocalLauncher.check(two)
    assert str(err.value).startswith("cluster.nodes=2 is not allowed with cluster.kind='local'")
    assert one_sentence(str(err.value))


def test_a_failed_rank_is_one_sentence_not_torchruns_summary(tmp_path: Path):
    """What the local launcher says of a rank that failed (``moe_core.train.torchrun``'s
    record; the kill -9 pipeline test sees it end to end): the rank, how it ended, its own
    last lines, where its log and torchrun's full report are."""
    from flows.render import standalone_command
    from moe_core.train.torchrun import FailedRank, failure_context, failure_detail, split_rank

    cmd = standalone_command("/r/train/config.json", 2, "py", "/r/train/logs/attempt-3")
    assert cmd[:5] == ["py", "-m", "moe_core.train.torchrun", "--failure", f"{cmd[6]}/failure.json"]
    assert cmd[-5:] == ["-m", "moe_core.cli", "train", "--config", "/r/train/config.json"]
    assert split_rank("[rank12]:step 3\n") == (12, "step 3\n")
    assert split_rank("W1205 torchrun's own") == (None, "W1205 torchrun's own")

    rank_dir = tmp_path / "run_x" / "attempt_0" / "1"
    rank_dir.mkdir(parents=True)
    (rank_dir / "stdout.log").write_text("step 0\nstep 1\n")
    (rank_dir / "stderr.log").write_text("Traceback\n  x\nValueError: bad\n")
    os.utime(rank_dir / "stdout.log", (1, 1))  # stderr was written last
    failed = FailedRank(1, 1, 7, 1, None, None, str(rank_dir))
    assert failure_detail(failed) == "rank 1 exited with code 1"
    assert failure_context(failed, tmp_path / "torchrun.log") == (
        f"its last lines: Traceback | x | ValueError: bad (its log: {rank_dir}); "
        f"torchrun's report: {tmp_path / 'torchrun.log'}"
    )
    killed = FailedRank(0, 0, 7, -9, "SIGKILL", None, None)
    assert failure_detail(killed) == "rank 0 was killed by SIGKILL (exit code -9)"


def test_a_failed_cluster_job_says_which_rank_failed_first_on_which_node(tmp_path: Path):
    """A Slurm or Kubernetes job's nodes each keep a folder (``node-N``); the earliest failure
    record names the rank, its node and its last lines; without any record, the processes were
    killed from outside (a node's launcher killed with its ranks records nothing)."""
    import json
    from dataclasses import asdict

    from moe_core.train.torchrun import REPORT, FailedRank, cluster_failure, main

    root = tmp_path / "logs" / "job-7"
    assert cluster_failure(root) is None  # no node started
    for n in range(3):
        (root / f"node-{n}").mkdir(parents=True)
    assert cluster_failure(root) == (
        "no node recorded a failed rank, so the job's processes were killed from outside "
        "(a lost node, the out-of-memory killer or a cancellation)",
        f"the nodes' logs: {root}",
    )
    later = FailedRank(0, 0, 5, 1, None, "connection reset by peer", None)
    first = FailedRank(9, 1, 6, 1, None, "CUDA out of memory", None)
    (root / "node-0" / "failure.json").write_text(json.dumps(asdict(later)))
    (root / "node-2" / "failure.json").write_text(json.dumps(asdict(first)))
    os.utime(root / "node-0" / "failure.json", (2000, 2000))
    os.utime(root / "node-2" / "failure.json", (1000, 1000))  # recorded first
    detail, context = cluster_failure(root)
    assert detail == "rank 9 exited with code 1 (CUDA out of memory) on node 2"
    assert context == f"torchrun's report: {root / 'node-2' / REPORT}"

    # the wrapper puts each node's number into its arguments (Slurm's, else Kubernetes')
    for variable, value in (("SLURM_NODEID", "3"), ("JOB_COMPLETION_INDEX", "5")):
        env = {"SLURM_NODEID": "", "JOB_COMPLETION_INDEX": "", variable: value}
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            with pytest.raises(SystemExit, match="usage"):
                main(["--failure"])  # too few arguments: refused before anything starts
            out = tmp_path / "nodes"
            # a requeued Slurm job keeps its id, so its node folders hold the first run's records
            (out / f"node-{value}").mkdir(parents=True)
            (out / f"node-{value}" / "failure.json").write_text(json.dumps(asdict(first)))
            with pytest.raises(SystemExit):  # torchrun's own parser: no script given
                main(["--failure", f"{out}/node-{{node}}/failure.json", "--standalone"])
            assert (out / f"node-{value}").is_dir()
            assert not (out / f"node-{value}" / "failure.json").exists()

    # a node "number" that climbs out of the job's folder is refused before anything is touched
    elsewhere = tmp_path / "elsewhere" / "failure.json"
    elsewhere.parent.mkdir()
    elsewhere.write_text("another job's record")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_NODEID", "../../elsewhere")
        with pytest.raises(SystemExit, match=r"SLURM_NODEID='\.\./\.\./elsewhere' is not allowed"):
            main(["--failure", f"{tmp_path}/nodes/node-{{node}}/failure.json", "--standalone"])
    assert elsewhere.read_text() == "another job's record"


def test_slurm_is_refused_where_its_commands_are_missing(tmp_path: Path, monkeypatch):
    from flows.launchers import SlurmLauncher

    run = compose_run([], config_name="pretrain-47b")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sbatch", "squeue"):  # a machine with only some of them
        (bin_dir / tool).write_text("#!/bin/sh\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(ConfigError) as err:
        SlurmLauncher.check(run)
    assert str(err.value) == (
        "cluster.kind='slurm' is not allowed on this machine: it submits with sbatch and follows "
        "with squeue, sacct and scancel, and sacct and scancel are not on PATH (run the pipeline "
        "on a Slurm login node, infra/README.md)."
    )
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # a machine with none of them
    with pytest.raises(ConfigError) as err:
        SlurmLauncher.check(run)
    assert "sbatch and squeue" not in str(err.value), "each command is named once"
    assert str(err.value).endswith(
        "scancel, and none of them is on PATH (run the pipeline on a Slurm login node, "
        "infra/README.md)."
    )
    shrink = compose_run(["cluster.on_node_loss=shrink"], config_name="pretrain-47b")
    with pytest.raises(ConfigError) as err:  # growing back asks sinfo for idle nodes
        SlurmLauncher.check(shrink)
    assert "follows with squeue, sacct, scancel and sinfo, and none of them" in str(err.value)


# ---- cluster.on_node_loss=shrink -------------------------------------------------------------

# pretrain-47b's pp 2 x dp 4 x ep 8 on 8 nodes of 8 GPUs, a global batch of 1024 sequences of one
SHRINK = ["cluster.on_node_loss=shrink"]


def test_node_counts_and_their_refusals():
    assert compose_run(SHRINK, config_name="pretrain-47b").node_counts == {8: 4, 4: 2, 2: 1}
    wait = compose_run([], config_name="pretrain-47b")
    assert wait.node_counts == {8: 4}  # waits for all of them
    smaller = compose_run([*SHRINK, "cluster.min_nodes=4"], config_name="pretrain-47b")
    assert smaller.node_counts == {8: 4, 4: 2}
    at4 = smaller.on_nodes(4)
    assert (at4.cluster.nodes, at4.parallel.dp, at4.micro_batches) == (4, 2, 64)
    assert smaller.micro_batches == 32 and at4.train.global_batch_size == 1024
    refusals = {
        "cluster.min_nodes=3": "cluster.min_nodes=3 is not allowed: a node count whose 8 "
        "processes per node make whole groups of pp x cp x ep = 16 ranks and whose dp divides "
        "train.global_batch_size (1024) into micro-batches of train.micro_batch_size (1): 2, 4.",
        "cluster.min_nodes=9": "cluster.min_nodes=9 is not allowed: from 1 to cluster.nodes (8).",
        "parallel.dp=1": "cluster.on_node_loss='shrink' is not allowed: 'wait' for this "
        "layout: no node count below cluster.nodes (2) holds whole groups of pp x cp x ep = 16 "
        "ranks with a dp that divides train.global_batch_size (1024) into micro-batches.",
    }
    for override, message in refusals.items():
        on_two = ["cluster.nodes=2"] if override == "parallel.dp=1" else []
        with pytest.raises(ConfigError) as err:
            compose_run([*SHRINK, override, *on_two], config_name="pretrain-47b")
        assert str(err.value) == message and one_sentence(message)
    with pytest.raises(ConfigError, match=r"^cluster\.min_nodes=4 is not allowed: null with "):
        compose_run(["cluster.min_nodes=4"], config_name="pretrain-47b")
    with pytest.raises(ConfigError, match=r"^cluster\.on_node_loss='shrink' is not allowed: "):
        compose_run(SHRINK)  # the local cluster: one machine
    with pytest.raises(ConfigError, match=r"^nodes=3 is not allowed: one of 2, 4, 8 "):
        compose_run(SHRINK, config_name="pretrain-47b").on_nodes(3)


def test_a_shrinking_slurm_script_trains_on_the_most_nodes_it_got_that_the_layout_allows(
    tmp_path: Path,
):
    """sbatch --nodes=2-8; given 7 of them the script trains on 4 (dp 2): srun on 4 nodes,
    torchrun --nnodes=4, moe train --nodes 4. With on_node_loss=wait it asks for all 8."""
    run = compose_run(SHRINK, config_name="pretrain-47b")
    script = render_slurm(run, str(tmp_path), str(tmp_path / "config.json"))
    assert sbatch_directives(script)["--nodes"] == "2-8"
    wait = compose_run([], config_name="pretrain-47b")
    waiting = render_slurm(wait, str(tmp_path), str(tmp_path / "config.json"))
    assert sbatch_directives(waiting)["--nodes"] == "8" and "MOE_NODES" not in waiting
    (tmp_path / "job.sbatch").write_text(script)
    job = {"SLURM_JOB_NODELIST": "gpu-node-[01-07]", "SLURM_JOB_ID": "77"}
    done, argv = run_slurm_script(
        tmp_path,
        tmp_path / "job.sbatch",
        ["gpu-node-01"],
        **job,
        SLURM_JOB_NUM_NODES="7",
        SLURM_CPUS_ON_NODE="96",
    )
    assert "training on 4 of the 7 nodes allocated (cluster.nodes=8)" in done.stdout
    torchrun = argv.index("python")
    assert argv[:3] == ["--nodes=4", "--ntasks=4", "--ntasks-per-node=1"]
    logs = f"{tmp_path}/logs/job-77/node-{{node}}"
    assert argv[torchrun:] == torchrun_command(
        run, str(tmp_path / "config.json"), 4, None, "gpu-node-01:29500", rdzv_id="77", log_dir=logs
    )
    assert argv[-2:] == ["--nodes", "4"]


def test_a_shrinking_slurm_script_gives_the_grow_back_stop_time_to_checkpoint(tmp_path: Path):
    """Growing back sends SIGTERM to the job's steps; torchrun then kills its workers after its
    shutdown timeout (30 s unless TORCH_ELASTIC_SHUTDOWN_TIMEOUT says otherwise), while the
    plan writes pretrain-47b's checkpoint on 2 nodes in about 57 s: the script sets a timeout
    covering a step's hang limit and twice the slowest count's checkpoint, so the stop ends in
    that checkpoint instead of losing the steps since the last one."""
    from moe_core.plan import plan

    run = compose_run(SHRINK, config_name="pretrain-47b")
    script = render_slurm(run, str(tmp_path), str(tmp_path / "config.json"))
    found = re.search(r"^export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=(\d+)$", script, re.M)
    assert found, script
    slowest = max(plan(run.on_nodes(n)).checkpoint.seconds for n in run.node_counts)
    assert slowest > 30 and int(found.group(1)) >= run.train.hang_min_s + 2 * slowest
    assert script.index("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") < script.index("srun --nodes")


class ScriptedCluster:
    """A cluster for ``ClusterLauncher``'s loop: each job plays a list of (state, nodes) polls,
    staying on the last; ``free`` says when all nodes are free again (from which poll)."""

    def __init__(self, jobs: list[list[tuple[str, int]]], free_from: int | None = None):
        self.jobs, self.free_from = jobs, free_from
        self.polls, self.stopped, self.asked = 0, [], 0
        self.stop_ends = "COMPLETED"  # the state a job stopped at a checkpoint ends in


def scripted_launcher(run, tmp_path: Path, cluster: ScriptedCluster, logged: list[str]):
    from flows.launchers import SLURM_ENDED, SLURM_QUEUED, ClusterLauncher

    class Scripted(ClusterLauncher):
        kind, noun, queued, ended = "slurm", "job", SLURM_QUEUED, SLURM_ENDED

        @classmethod
        def check(cls, run) -> None:
            pass

        def start(self, number):
            self.playing, self.at = cluster.jobs.pop(0), -1
            return str(number), tmp_path / "job.sbatch"

        def state(self, job_id):
            if job_id in cluster.stopped:  # the ranks checkpoint and end
                return cluster.stop_ends
            self.at = min(self.at + 1, len(self.playing) - 1)
            return self.playing[self.at][0]

        def nodes(self, job_id):
            return self.playing[self.at][1]

        def all_nodes_free(self, job_id, nodes):
            cluster.asked += 1
            return cluster.free_from is not None and cluster.asked >= cluster.free_from

        def stop_at_checkpoint(self, job_id):
            cluster.stopped.append(job_id)

        def failure_root(self, job_id):
            return tmp_path / "logs" / f"job-{job_id}"

        def stream(self, job_id, final=False):
            pass

        def cancel(self, job_id):
            pass

        def not_started(self, job_id, state):
            return "never"

    return Scripted(run, tmp_path, logged.append)


class NoTracker:
    def params(self, run_id, values) -> None:
        self.last = values

    def send_metrics_file(self, run_id, path) -> None:
        pass


def test_the_launch_loop_shrinks_then_grows_back_without_spending_a_retry(tmp_path: Path):
    """Job 1 fails on 8 nodes; job 2 runs on 4 (the cluster's count) until all 8 are free
    again (the third look), is stopped at a checkpoint and job 3 finishes on 8; one retry
    was enough (cluster.launch_retries=1): growing back spends none."""
    import logging

    from flows.launch import launch_attempts

    run = compose_run(
        [*SHRINK, "cluster.launch_retries=1", "cluster.poll_s=0.001"], config_name="pretrain-47b"
    )
    jobs = [
        [("RUNNING", 8), ("FAILED", 8)],
        [("PENDING", 4), *[("RUNNING", 4)] * 10],
        [("RUNNING", 8), ("COMPLETED", 8)],
    ]
    cluster, logged, warned = ScriptedCluster(jobs, free_from=3), [], []
    # torchrun ends on the SIGTERM with an error (its SignalException), so the job FAILED, and
    # its nodes recorded no failed rank: that is the stop, not processes killed from outside
    cluster.stop_ends = "FAILED"
    for node in range(4):
        (tmp_path / "logs" / "job-2" / f"node-{node}").mkdir(parents=True)
    logger = logging.getLogger("test-grow")
    logger.warning = lambda msg, *a: warned.append(msg % a)  # type: ignore[method-assign]
    tracker = NoTracker()
    attempts = launch_attempts(
        scripted_launcher(run, tmp_path, cluster, logged), tracker, None, logger
    )
    failed, shrunk, grown = attempts
    assert (failed.ok, failed.nodes, failed.dp, failed.accumulation) == (False, 8, 4, 32)
    assert (shrunk.nodes, shrunk.dp, shrunk.accumulation, shrunk.grow) == (4, 2, 64, True)
    assert shrunk.detail == "job 2 ended FAILED (stopped at a checkpoint to grow back to 8 nodes)"
    assert shrunk.context == ""
    assert (grown.ok, grown.nodes, grown.dp, grown.grow) == (True, 8, 4, False)
    assert cluster.stopped == ["2"] and cluster.asked == 3
    assert "job 2: continuing on 4 of 8 nodes: dp 4 -> 2, accumulation 32 -> 64" in logged
    assert (
        "all 8 nodes are free again: stopping job 2 at a checkpoint to relaunch on them" in logged
    )
    assert warned[1].startswith(
        shrunk.detail + "; launching again, asking for all 8 nodes, resuming from "
    )
    assert tracker.last == {
        "launch": {
            "attempt_3": {
                "kind": "slurm",
                "job_id": "3",
                "state": "COMPLETED",
                "script": str(tmp_path / "job.sbatch"),
                "nodes": 8,
                "dp": 4,
                "accumulation": 32,
            }
        }
    }
    records = json.loads((tmp_path / "launches.json").read_text())
    assert [(r["nodes"], r["dp"], r["grow"]) for r in records] == [
        (8, 4, False),
        (4, 2, True),
        (8, 4, False),
    ]

    # on_node_loss=wait: a job on all its nodes never asks whether they are free
    wait = compose_run(["cluster.poll_s=0.001"], config_name="pretrain-47b")
    cluster = ScriptedCluster([[("RUNNING", 8), ("COMPLETED", 8)]], free_from=1)
    (tmp_path / "w").mkdir()
    (done,) = launch_attempts(
        scripted_launcher(wait, tmp_path / "w", cluster, []), NoTracker(), None, logger
    )
    assert done.ok and cluster.asked == 0 and done.nodes == 8

    # without train.checkpoint_at_end a stop would lose the steps since the last checkpoint:
    # a shrunk job runs on, never stopped to grow back
    keep = compose_run(
        [*SHRINK, "cluster.poll_s=0.001", "train.checkpoint_at_end=false"],
        config_name="pretrain-47b",
    )
    cluster = ScriptedCluster([[*[("RUNNING", 4)] * 5, ("COMPLETED", 4)]], free_from=1)
    (tmp_path / "k").mkdir()
    (done,) = launch_attempts(
        scripted_launcher(keep, tmp_path / "k", cluster, []), NoTracker(), None, logger
    )
    assert done.ok and not done.grow and cluster.stopped == [] and cluster.asked == 0


def test_nodes_that_keep_looking_free_stop_the_growing_back_not_the_run(
    tmp_path: Path, monkeypatch
):
    """Idle nodes the relaunch never gets (another partition's, or taken again before it
    starts) make every shrunk job look growable: after MAX_GROW_BACKS stops the launcher
    grows back no more and the run finishes on the nodes it has, rather than failing with a
    grow-back counted as a failed attempt (cluster.launch_retries=0)."""
    import logging

    import flows.launch

    monkeypatch.setattr(flows.launch, "MAX_GROW_BACKS", 2)
    run = compose_run([*SHRINK, "cluster.poll_s=0.001"], config_name="pretrain-47b")
    jobs = [[*[("RUNNING", 4)] * 3, ("COMPLETED", 4)] for _ in range(4)]
    cluster = ScriptedCluster(jobs, free_from=1)
    logged: list[str] = []
    attempts = flows.launch.launch_attempts(
        scripted_launcher(run, tmp_path, cluster, logged),
        NoTracker(),
        None,
        logging.getLogger("test-grow-cap"),
    )
    assert [(a.grow, a.ok) for a in attempts] == [(True, False), (True, False), (False, True)]
    assert cluster.stopped == ["1", "2"]
    assert any(line.startswith("2 relaunches to grow back to 8 nodes: no more") for line in logged)

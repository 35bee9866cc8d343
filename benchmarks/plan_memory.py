"""``moe plan``'s memory against what ``moe train`` allocates, one GPU, OLMoE-1B-7B width.

    python benchmarks/plan_memory.py --layers 8,16 --out plan_memory.json

Each configuration runs in its own child process: the ``Trainer`` of ``trainer_step.py``'s run
(synthetic tokens, micro-batch 4 x 4096, ``--precision``), built in-process with
``parallel.cuda_graph=false`` so that every allocation shows in the allocator's counters, and,
after ``--warmup`` steps, one instrumented step. Recorded (GiB, ``torch.cuda.memory_allocated``):

- ``static``: right after the step releases the last step's gradients (weights, optimizer
  state, anything else kept between steps);
- ``forward``: at the loss's call, less ``static`` (what the blocks keep for backward, the
  logits);
- ``loss``: what the loss call adds;
- ``peak``: the step's ``max_memory_allocated`` less ``static`` (activations and the gradients
  alive together in backward);
- ``device_used``: the GPU's used memory after the step (``mem_get_info``: this process's
  context, libraries and the allocator's cache included);
- the plan's parts for the same run (``moe_core.plan.plan``).

Two layer counts give the per-layer slope; the intercept is the embedding and the LM head.
The plan is the run's on a one-GPU cluster (``cluster=local-gpu``, one GPU, where blocks
compile by default). ``--replan FILE`` plans a written JSON's runs again with this checkout's
planner (no GPU needed) and compares: the plan's total per GPU against the GPU's used memory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from report import save, stamp

HERE = Path(__file__).resolve().parent
GIB = 2**30


ONE_GPU = ["cluster=local-gpu", "cluster.procs_per_node=1", "cluster.gpus_per_node=1"]


def overrides(
    layers: int, precision: str, expert_gemm: str, attention: str, out: str, warmup: int = 2
) -> list:
    """``trainer_step.py``'s run with graphs off: ``warmup`` steps and the instrumented one."""
    from trainer_step import run_shape, trainer_overrides

    shape = run_shape(
        layers=layers,
        precision=precision,
        cuda_graph="false",
        expert_gemm=expert_gemm,
        attention=attention,
        warmup=warmup,
        steps=1,
    )
    return trainer_overrides(shape, out, data_dir="")


def plan_gib(layers: int, precision: str, expert_gemm: str, attention: str) -> dict:
    """The plan's parts (GiB) for the measured run on one GPU."""
    from moe_core.compose import compose_run
    from moe_core.plan import plan

    args = overrides(layers, precision, expert_gemm, attention, "OUT")
    mem = plan(compose_run([*args, *ONE_GPU])).memory
    parts = ("weights", "gradients", "grad_buffers", "optimizer", "activations", "transient")
    return {k: getattr(mem, k) / GIB for k in (*parts, "reserve", "total")}


def measure(layers: int, precision: str, warmup: int, expert_gemm: str, attention: str) -> dict:
    import torch

    from moe_core.compose import compose_run
    from moe_core.train.trainer import Trainer

    out = tempfile.mkdtemp()
    run = compose_run(overrides(layers, precision, expert_gemm, attention, out, warmup))
    trainer = Trainer(run)
    for _ in range(warmup):
        trainer.train_step()
    seen: dict[str, int] = {}
    start_step, loss_fn = trainer.buckets.start_step, trainer.loss_fn

    def start_step_probe() -> None:
        start_step()
        seen["static"] = torch.cuda.memory_allocated()

    def loss_probe(logits, targets):
        seen["at_loss"] = torch.cuda.memory_allocated()
        loss = loss_fn(logits, targets)
        seen["after_loss"] = torch.cuda.memory_allocated()
        return loss

    trainer.buckets.start_step, trainer.loss_fn = start_step_probe, loss_probe
    torch.cuda.synchronize()
    metrics = trainer.train_step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    free, total = torch.cuda.mem_get_info()
    static = seen["static"]
    return {
        "layers": layers,
        "precision": precision,
        "measured_gib": {
            "static": static / GIB,
            "forward": (seen["at_loss"] - static) / GIB,
            "loss": (seen["after_loss"] - seen["at_loss"]) / GIB,
            "peak_over_static": (peak - static) / GIB,
            "peak_allocated": peak / GIB,
            "trainer_printed_peak": metrics.peak_mem_gib,
            "device_used": (total - free) / GIB,
        },
        "plan_gib": plan_gib(layers, precision, expert_gemm, attention),
    }


def replan(path: Path) -> dict:
    """A written result's runs planned again by this checkout, against what they measured."""
    result = json.loads(path.read_text())
    rows = []
    for r in result["rows"]:
        planned = plan_gib(r["layers"], r["precision"], result["expert_gemm"], result["attention"])
        used = r["measured_gib"]["device_used"]
        rows.append(
            {
                "layers": r["layers"],
                "measured_device_used_gib": used,
                "measured_peak_allocated_gib": r["measured_gib"]["peak_allocated"],
                "plan_gib": planned,
                "plan_over_measured": planned["total"] / used,
            }
        )
        print(f"{r['layers']} layers: plan {planned['total']:.2f} GiB, used {used:.2f} GiB")
    return {"benchmark": "plan_memory_replan", "measured": path.name, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", default="8,16")
    p.add_argument("--precision", default="pure-bf16")
    p.add_argument("--expert-gemm", default="quack")
    p.add_argument("--attention", default="flash4")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--one", action="store_true", help="(internal) measure one layer count")
    p.add_argument("--replan", default="", help="plan a written JSON's runs again (no GPU)")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--commit-note", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.replan:
        result = {**replan(Path(args.replan)), "commit": args.commit}
        save(result, args.out)
        return
    if args.one:
        row = measure(
            int(args.layers), args.precision, args.warmup, args.expert_gemm, args.attention
        )
        print("ROW " + json.dumps(row))
        return
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        cmd = [sys.executable, __file__, "--one", f"--layers={layers}"]
        cmd += [f"--precision={args.precision}", f"--expert-gemm={args.expert_gemm}"]
        cmd += [f"--attention={args.attention}", f"--warmup={args.warmup}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in done.stdout.splitlines() if x.startswith("ROW ")]
        if done.returncode or not line:
            raise SystemExit(
                f"{layers} layers failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            )
        rows.append(json.loads(line[0][4:]))
        print(json.dumps(rows[-1]))
    result = {
        "benchmark": "plan_memory",
        **stamp(args.commit),
        "commit_note": args.commit_note,
        "expert_gemm": args.expert_gemm,
        "attention": args.attention,
        "rows": rows,
    }
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        n = b["layers"] - a["layers"]
        result["per_layer_gib"] = {
            k: (b["measured_gib"][k] - a["measured_gib"][k]) / n
            for k in ("forward", "peak_over_static")
        }
        result["plan_per_layer_activations_gib"] = (
            b["plan_gib"]["activations"] - a["plan_gib"]["activations"]
        ) / n
    save(result, args.out)


if __name__ == "__main__":
    main()

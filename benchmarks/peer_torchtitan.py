"""torchtitan 0.3.0's training step at the shape of one of our named models.

The peer kit's ``bench_torchtitan.py`` (``--kit DIR``: the folder holding it) runs torchtitan's
own ``Trainer.train_step`` at OLMoE-1B-7B's shape with as many KV heads as query heads. This
script loads that module, points its shape at ``conf/model/NAME.yaml`` cut to ``--layers``
layers (``--set`` overrides on top), counts model FLOPs per token with
``moe_core.model.flops.count`` (the figure ``moe train`` prints, so both sides divide the same
FLOPs by their own step time), and runs the kit's ``main`` (its warm-up, timing, memory and
JSON) with the remaining arguments:

    python benchmarks/peer_torchtitan.py --kit KIT --model qwen3-30b-a3b --layers 8 \\
        --out tt.json -- --compile 1 --mbs 4 --seq 4096 --dtype bfloat16 --cuda-graphs 0
    python benchmarks/peer_torchtitan.py --kit KIT --model deepseek-v3 --layers 7 \\
        --set model.n_dense_layers=1 --set model.n_experts=32 --set model.mtp_depth=1 \\
        --out tt.json -- --compile 1 --mbs 1 --dtype bfloat16 --cuda-graphs 0 --ac full

The family follows from the config. Standard attention with per-head QK-norm runs torchtitan's
Qwen3-MoE family (``torchtitan.models.qwen3``), which computes what ``qwen3-30b-a3b`` does
except its balancing (an expert bias moved before each optimizer step, no auxiliary loss),
which changes no FLOP.

Multi-head latent attention (``model.kv_lora_rank`` set) runs ``torchtitan.models.deepseek_v3``
built at our shape: MLA with our q_lora_rank (none: torchtitan's full-rank ``wq``),
kv_lora_rank, qk_rope/qk_nope/v head dims and heads; the first ``n_dense_layers`` blocks a
SwiGLU of ``dense_hidden``, the others ``n_experts`` routed experts of ``expert_hidden``, top-k,
``n_shared_experts`` shared ones; softmax or sigmoid scores, groups (a group scored by its two
best experts, as V3 and ours), top-k renormalized or not, the routed scale; RMSNorm eps, RoPE
theta and YaRN (factor, original length, beta fast/slow, DeepSeek's floor/ceil cut-offs, the
softmax scale times (0.1 mscale_all_dim ln factor + 1)^2); ``model.mtp_depth`` MTP blocks (a copy
of the last block's config after eh_proj over the two RMS-normed halves, then a norm; the
shared embedding and LM head) trained by torchtitan's ``MTPLoss`` (weight 0.3). What torchtitan
cannot express, none of it a FLOP of the convention (matmuls and attention):

- balancing: torchtitan moves an expert bias (coefficient 1e-3) before each optimizer step in
  every MoE layer; ours uses the bias where the config sets ``expert_bias`` and a Switch-style
  auxiliary loss otherwise (DeepSeek-V2-Lite): a [tokens, experts] reduction, not a matmul;
- YaRN's rotation scale: torchtitan rotates without HF's cos/sin factor
  mscale(yarn_mscale) / mscale(yarn_mscale_all_dim), which is 1 for V3 (1.0 / 1.0) and
  V2-Lite (0.707 / 0.707); recorded in the shape where it is not;
- RoPE pairs adjacent dimensions (DeepSeek's complex form), HF's and ours pair halves: a
  permutation of the q/k projection's rows;
- the MTP loss weight: torchtitan's 0.3 (V3's first stage), a scalar;
- in torchtitan 0.3.0 neither per-block compile nor activation checkpointing reaches the MTP
  blocks (both walk ``model.layers`` only); ``--compile-mtp 1`` compiles them too.

DeepSeek-V3 on one H200 (the issue's GPU item): V3's block is d_model 7168, 128 heads, MLA
(q_lora 1536, kv_lora 512, rope 64, nope 128, v 128), 256 experts of 2048, top-8 in 8 groups
top-4, one shared expert, the first 3 of 61 blocks dense of 18,432, vocab 129,280. One MoE
block holds 11.50B parameters (92 GB at 8 bytes a parameter: bf16 weights, gradients and both
AdamW moments), so the experts are pruned: 32 per block (4 per group, top-4 groups leave 16
candidates for the top-8; the slice one GPU holds under EP 8). A token's work is unchanged:
its top-8 experts, the shared expert and MLA, 583.5M matmul parameters a block, so the FLOPs
per token of a block are V3's (only the router, E x 7168 and not a counted FLOP, shrinks),
and each expert sees tokens x 8 / 32 rows, as one rank of that EP-8 layout does. Keep one
dense block (``model.n_dense_layers=1``): its SwiGLU of 18,432 = 9 x 2048 is as many matmul
parameters as 8 routed + 1 shared experts, so a dense block costs what an MoE block costs per
token, and it runs the dense path at 0.58B parameters instead of 1.64B. Parameters (bf16,
8 bytes each static): embedding and LM head 1.853B, the dense block 0.584B, each MoE block
1.641B (MLA 187.1M, experts 32 x 44.04M, shared 44.04M, router 0.23M), an MTP block 1.743B
(its MoE block and eh_proj 102.8M). 1 dense + 6 MoE blocks (7 layers): 12.28B (98.2 GB,
91.5 GiB), with MTP 14.02B (112.2 GB, 104.5 GiB), leaving 34 GiB at micro-batch 1 x 4096 for
activations and the two 129,280-wide logits: block recompute (ours ``parallel.recompute=block``,
torchtitan ``--ac full``) on both sides. Without recompute, 1 dense + 5 MoE blocks (6 layers:
10.64B, with MTP 12.38B, 99.1 GB).

DeepSeek-V2-Lite (15.71B in 27 blocks) needs no pruning, only fewer blocks: 0.585B a MoE block
(64 experts of 1408 with 2 shared, MLA with full-rank queries 13.8M), 0.081B the dense one,
0.419B embedding and head. 14 blocks (1 dense + 13 MoE): 8.10B, 60.4 GiB at 8 bytes a
parameter, 64.8 GiB with MTP, leaving about 70 GiB for micro-batch 4 x 4096 without recompute.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def qwen3_shape(m: Any) -> dict:
    """The kit's ``SHAPE`` keys for a Qwen3-MoE block."""
    assert m.qk_norm == "head" and m.n_shared_experts == 0 and m.n_dense_layers == 0, (
        f"{m.name} is not a Qwen3-MoE block: torchtitan's qwen3 family cannot run it"
    )
    assert not getattr(m, "mtp_depth", 0), "torchtitan's qwen3 family has no MTP"
    return dict(
        family="qwen3",
        d_model=m.d_model,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        n_kv_heads=m.kv_heads,
        head_dim=m.head_dim,
        num_experts=m.n_experts,
        top_k=m.top_k,
        expert_hidden=m.expert_hidden,
        vocab=m.vocab_size,
        rope_theta=m.rope_theta,
        norm_eps=m.norm_eps,
    )


def _yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude factor: 0.1 mscale ln(factor) + 1 (1 at factor <= 1)."""
    import math

    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def deepseek_shape(m: Any) -> dict:
    """The shape torchtitan's ``deepseek_v3`` family is built at for an MLA config ``m`` (a
    ``ModelConfig`` or anything with its field names)."""
    assert not m.tie_embeddings, "torchtitan's deepseek_v3 has its own LM head (no tying)"
    groups = m.n_expert_groups
    if groups > 1:  # torchtitan scores a group by its two best experts
        assert m.n_experts // groups >= 2, "torchtitan needs at least 2 experts a group"
    shape = dict(
        family="deepseek_v3",
        d_model=m.d_model,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        q_lora_rank=m.q_lora_rank or 0,  # 0: torchtitan's full-rank wq
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        n_dense_layers=m.n_dense_layers,
        dense_hidden=m.dense_hidden or 0,  # read only by dense blocks
        num_experts=m.n_experts,
        expert_hidden=m.expert_hidden,
        n_shared_experts=m.n_shared_experts,
        top_k=m.top_k,
        score_func=m.router,
        n_groups=groups if groups > 1 else None,  # None: plain top-k
        topk_groups=m.top_k_groups if groups > 1 else None,
        route_norm=bool(m.normalize_top_k),
        route_scale=float(m.routed_scale),
        vocab=m.vocab_size,
        rope_theta=m.rope_theta,
        norm_eps=m.norm_eps,
        mtp_depth=getattr(m, "mtp_depth", 0),
        rope_scaling=getattr(m, "rope_scaling", "none"),
    )
    if shape["rope_scaling"] == "yarn":
        shape.update(
            yarn_factor=float(m.yarn_factor),
            yarn_original_max_seq_len=int(m.yarn_original_max_seq_len),
            yarn_beta_fast=float(m.yarn_beta_fast),
            yarn_beta_slow=float(m.yarn_beta_slow),
            yarn_mscale_all_dim=float(m.yarn_mscale_all_dim),
        )
        rotation = _yarn_mscale(m.yarn_factor, m.yarn_mscale) / _yarn_mscale(
            m.yarn_factor, m.yarn_mscale_all_dim
        )
        if abs(rotation - 1) > 1e-9:  # torchtitan rotates without it (no FLOP either way)
            shape["yarn_rotation_scale_not_applied"] = rotation
    return shape


def shape_of(m: Any) -> dict:
    """The kit's ``SHAPE`` for our model config ``m``: MLA runs torchtitan's deepseek_v3
    family, standard attention its qwen3 family."""
    return deepseek_shape(m) if getattr(m, "kv_lora_rank", None) else qwen3_shape(m)


def our_shape(
    model: str, layers: int, seq: int, overrides: list[str] | None = None
) -> tuple[dict, int]:
    """The kit's ``SHAPE`` for our named model at ``layers`` (with config ``overrides``,
    e.g. a pruned expert count or MTP), and its FLOPs per token."""
    sys.path.insert(0, str(ROOT))
    from moe_core.compose import compose_run
    from moe_core.model.flops import count

    m = compose_run([f"model={model}", f"model.n_layers={layers}", *(overrides or [])]).model
    return shape_of(m), count(m, seq).flops_per_token


def qwen3_spec(s: dict, attn: str, seq: int):
    """torchtitan's Qwen3-MoE spec (its registry entry's parallelize function and hooks) with
    the layers built at shape ``s``, grouped-query heads included."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        _build_qwen3_moe_layers,
        _qwen3_norm,
        model_registry,
    )
    from torchtitan.models.qwen3.model import Qwen3Model

    base = model_registry("30B-A3B", attn_backend=attn)
    d, vocab = s["d_model"], s["vocab"]
    layers = _build_qwen3_moe_layers(
        fuse_qkv=True,
        n_layers=s["n_layers"],
        dim=d,
        n_heads=s["n_heads"],
        n_kv_heads=s["n_kv_heads"],
        head_dim=s["head_dim"],
        moe_hidden_dim=s["expert_hidden"],
        num_experts=s["num_experts"],
        top_k=s["top_k"],
        attn_backend=attn,
        rope=CosSinRoPE.Config(dim=s["head_dim"], max_seq_len=seq, theta=s["rope_theta"]),
        moe_comm_backend="standard",
    )
    cfg = Qwen3Model.Config(
        vocab_size=vocab,
        dim=d,
        norm=_qwen3_norm(d),
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=d, param_init=_EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=d, out_features=vocab, param_init=_LINEAR_INIT),
        layers=layers,
    )
    return dataclasses.replace(base, flavor=f"moe_core_shape_{s['n_layers']}l", model=cfg)


def _set_norm_eps(cfg: Any, eps: float, seen: set[int] | None = None) -> None:
    """Every ``RMSNorm.Config`` under ``cfg`` to ``eps``: torchtitan's builders leave its
    1e-5 default, V3 and V2-Lite use 1e-6."""
    from torchtitan.models.common import RMSNorm

    seen = set() if seen is None else seen
    if id(cfg) in seen:
        return
    seen.add(id(cfg))
    if isinstance(cfg, RMSNorm.Config):
        cfg.eps = eps
    elif isinstance(cfg, list):
        for c in cfg:
            _set_norm_eps(c, eps, seen)
    elif dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        for f in dataclasses.fields(cfg):
            _set_norm_eps(getattr(cfg, f.name), eps, seen)


def deepseek_spec(s: dict, attn: str, seq: int, compile_mtp: bool = False):
    """torchtitan's DeepSeek-V3 spec (its registry's parallelize function, load-balancing hook
    and state-dict adapter) with the blocks and MTP blocks built at shape ``s``."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        _build_dsv3_layers,
        _build_mtp_layers,
        _output_linear_init,
        model_registry,
    )
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    base = model_registry("debugmodel", attn_backend=attn)
    d, vocab, yarn = s["d_model"], s["vocab"], s["rope_scaling"] == "yarn"
    rope = ComplexRoPE.Config(
        dim=s["qk_rope_head_dim"],
        max_seq_len=seq,
        theta=s["rope_theta"],
        scaling="yarn" if yarn else "none",
        **(
            dict(
                rope_factor=s["yarn_factor"],
                beta_fast=s["yarn_beta_fast"],
                beta_slow=s["yarn_beta_slow"],
                original_seq_len=s["yarn_original_max_seq_len"],
                truncate=True,  # DeepSeek's floor / ceil of the correction range
            )
            if yarn
            else {}
        ),
    )
    layers = _build_dsv3_layers(
        n_layers=s["n_layers"],
        n_dense_layers=s["n_dense_layers"],
        dim=d,
        n_heads=s["n_heads"],
        q_lora_rank=s["q_lora_rank"],
        kv_lora_rank=s["kv_lora_rank"],
        qk_nope_head_dim=s["qk_nope_head_dim"],
        qk_rope_head_dim=s["qk_rope_head_dim"],
        v_head_dim=s["v_head_dim"],
        mscale=s["yarn_mscale_all_dim"] if yarn else 1.0,
        dense_hidden_dim=s["dense_hidden"],
        moe_hidden_dim=s["expert_hidden"],
        num_experts=s["num_experts"],
        num_shared_experts=s["n_shared_experts"],
        router_top_k=s["top_k"],
        router_score_func=s["score_func"],
        router_num_expert_groups=s["n_groups"],
        router_num_limited_groups=s["topk_groups"],
        router_route_scale=s["route_scale"],
        router_route_norm=s["route_norm"],
        attn_backend=attn,
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=rope,
    )
    if s["n_shared_experts"] == 0:  # the builder would make a SwiGLU of width 0
        for layer in layers:
            if layer.moe is not None:
                layer.moe.shared_experts = None
    cfg = DeepSeekV3Model.Config(
        vocab_size=vocab,
        dim=d,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=d, param_init=_EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=d, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=d, out_features=vocab, param_init=_output_linear_init(d)),
        layers=layers,
        mtp_layers=_build_mtp_layers(layers[-1], dim=d, num_mtp_layers=s["mtp_depth"]),
    )
    _set_norm_eps(cfg, s["norm_eps"])
    parallelize = base.parallelize_fn
    if compile_mtp:
        parallelize = _compiling_mtp(parallelize)
    name = f"moe_core_shape_{s['n_layers']}l_mtp{s['mtp_depth']}"
    return dataclasses.replace(base, flavor=name, model=cfg, parallelize_fn=parallelize)


def _compiling_mtp(parallelize):
    """``parallelize`` that also compiles each MTP block as torchtitan compiles a block."""

    def run(model, **kw):
        if model.mtp_layers is not None and kw["compile_config"].enable:
            for block in model.mtp_layers:
                block.compile(backend=kw["compile_config"].backend, fullgraph=True)
        return parallelize(model, **kw)

    return run


def model_spec(s: dict, attn: str, seq: int, compile_mtp: bool = False):
    """The kit's ``build_model_spec``: the family's spec at shape ``s``."""
    if s["family"] == "deepseek_v3":
        return deepseek_spec(s, attn, seq, compile_mtp)
    return qwen3_spec(s, attn, seq)


def _what_ran(model: Any) -> dict:
    """The DeepSeek model's modules as built (the kit's own introspection reads Qwen3's)."""
    blocks = [getattr(b, "_orig_mod", b) for b in model.layers.values()]
    moe = next(b.moe for b in blocks if b.moe_enabled)
    att = blocks[0].attention
    mtp = list(model.mtp_layers or [])
    return dict(
        model_class=type(model).__name__,
        attention=type(att).__name__,
        inner_attention=type(att.inner_attention).__name__,
        q_lora=att.q_lora_rank,
        softmax_scale=att.softmax_scale,
        dense_blocks=sum(not b.moe_enabled for b in blocks),
        moe_blocks=sum(b.moe_enabled for b in blocks),
        router_score_func=moe.router.score_func,
        router_groups=[moe.router.num_expert_groups, moe.router.num_limited_groups],
        router_route_norm=moe.router.route_norm,
        router_route_scale=moe.router.route_scale,
        load_balance_coeff=moe.load_balance_coeff,
        shared_experts=moe.shared_experts is not None,
        inner_experts=type(moe.routed_experts.inner_experts).__name__,
        mtp_blocks=len(mtp),
        mtp_compiled=[getattr(b, "_compiled_call_impl", None) is not None for b in mtp],
        norm_eps=model.norm.eps if hasattr(model.norm, "eps") else None,
    )


def install_shims() -> list[str]:
    """Stand-ins for what torchtitan imports but this step never uses, where absent."""
    shims = []
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        # torchtitan.components.metrics imports SummaryWriter at module level; no metrics
        # logger is built here
        board = types.ModuleType("torch.utils.tensorboard")
        board.SummaryWriter = type("SummaryWriter", (), {})
        sys.modules["torch.utils.tensorboard"] = board
        shims.append("torch.utils.tensorboard (import stub; no metrics logger)")
    return shims


def load_kit(kit_dir: str) -> types.ModuleType:
    """The kit's ``bench_torchtitan`` module, loaded from its folder."""
    path = Path(kit_dir) / "bench_torchtitan.py"
    spec = importlib.util.spec_from_file_location("bench_torchtitan", path)
    assert spec is not None and spec.loader is not None, f"no bench_torchtitan.py in {kit_dir}"
    kit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kit)
    return kit


def run_kit(
    kit: types.ModuleType, shape: dict, flops: int, argv: list[str], compile_mtp: bool = False
) -> dict:
    """The kit's ``main`` at ``shape`` with ``argv``; what this script adds to its result."""
    extra: dict = dict(peer_family=shape["family"], shims=install_shims())
    kit.SHAPE = shape
    kit.FLOPS_PER_TOKEN = flops
    kit.build_model_spec = lambda s, attn, seq: model_spec(s, attn, seq, compile_mtp)
    if shape["family"] == "deepseek_v3":
        make_trainer = kit.make_trainer_cls

        def make_trainer_cls():
            from torchtitan.models.deepseek_v3.mtp import MTPLoss

            base = make_trainer()

            class PeerTrainer(base):
                """The kit's trainer with MTPLoss where MTP blocks predict further tokens."""

                def __init__(self, config):
                    if shape["mtp_depth"]:  # the model returns [logits, MTP logits ...]
                        config.loss = MTPLoss.Config(global_vocab_size=shape["vocab"])
                        extra["loss"] = (
                            f"MTPLoss(CrossEntropyLoss, mtp_scale 0.3, depth {shape['mtp_depth']})"
                        )
                    super().__init__(config)
                    extra["compile_mtp"] = compile_mtp
                    extra["paths"] = _what_ran(self.model_parts[0])

            return PeerTrainer

        kit.make_trainer_cls = make_trainer_cls
    sys.argv = ["bench_torchtitan.py", *argv]
    kit.main()
    return extra


def _take_out(rest: list[str]) -> tuple[str, list[str]]:
    """``--out`` among the kit's arguments (where it stood after ``--``), and the others."""
    out, keep = "", []
    items = iter(rest)
    for r in items:
        if r.startswith("--out="):
            out = r.split("=", 1)[1]
        elif r == "--out":
            out = next(items, "")
        else:
            keep.append(r)
    return out, keep


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kit", required=True, help="the folder holding bench_torchtitan.py")
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--set", action="append", default=[], help="a config override of the model")
    p.add_argument(
        "--compile-mtp", type=int, default=0, help="1: compile the MTP blocks too (0.3.0 does not)"
    )
    p.add_argument("--out", default="", help="the kit's JSON, with what this script adds")
    args, rest = p.parse_known_args()
    out, rest = _take_out([r for r in rest if r != "--"])
    args.out = args.out or out
    shape, flops = our_shape(args.model, args.layers, args.seq, args.set)
    argv = ["--seq", str(args.seq), *rest, *([f"--out={args.out}"] if args.out else [])]
    extra = run_kit(load_kit(args.kit), shape, flops, argv, bool(args.compile_mtp))
    extra.update(model=args.model, layers=args.layers, overrides=args.set)
    print("PEER " + json.dumps(extra), flush=True)
    if args.out and Path(args.out).is_file():  # the kit's record and ours in one file
        record = json.loads(Path(args.out).read_text())
        Path(args.out).write_text(json.dumps({**record, **extra}) + "\n")


if __name__ == "__main__":
    main()

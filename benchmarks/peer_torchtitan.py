"""torchtitan 0.3.0's Qwen3-MoE training step at the shape of one of our named models.

The peer kit's ``bench_torchtitan.py`` (``--kit DIR``: the folder holding it) runs torchtitan's
own ``Trainer.train_step`` at OLMoE-1B-7B's shape with as many KV heads as query heads. This
script loads that module, points its shape at ``conf/model/NAME.yaml`` cut to ``--layers``
layers (grouped-query heads, ``head_dim``, RoPE theta and the router's width from our config),
counts model FLOPs per token with ``moe_core.model.flops.count`` (the figure ``moe train``
prints, so both sides divide the same FLOPs by their own step time), and runs the kit's
``main`` with the remaining arguments:

    python benchmarks/peer_torchtitan.py --kit KIT --model qwen3-30b-a3b --layers 8 -- \\
        --compile 1 --mbs 4 --seq 4096 --dtype bfloat16 --cuda-graphs 0 --out tt.json

torchtitan's Qwen3 MoE computes what ``qwen3-30b-a3b`` does except its balancing (an expert
bias moved before each optimizer step, no auxiliary loss), which changes no FLOP.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def our_shape(
    model: str, layers: int, seq: int, overrides: list[str] | None = None
) -> tuple[dict, int]:
    """The kit's ``SHAPE`` keys for our named model at ``layers`` (with config ``overrides``,
    e.g. a CPU smoke test's small sizes), and its FLOPs per token."""
    sys.path.insert(0, str(ROOT))
    from moe_core.compose import compose_run
    from moe_core.model.flops import count

    m = compose_run([f"model={model}", f"model.n_layers={layers}", *(overrides or [])]).model
    assert m.qk_norm == "head" and m.n_shared_experts == 0 and m.n_dense_layers == 0, (
        f"{model} is not a Qwen3-MoE block: torchtitan's qwen3 family cannot run it"
    )
    shape = dict(
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
    return shape, count(m, seq).flops_per_token


def model_spec(s: dict, attn: str, seq: int):
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kit", required=True, help="the folder holding bench_torchtitan.py")
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--set", action="append", default=[], help="a config override of the model")
    args, rest = p.parse_known_args()
    rest = [r for r in rest if r != "--"]
    shape, flops = our_shape(args.model, args.layers, args.seq, args.set)
    path = Path(args.kit) / "bench_torchtitan.py"
    spec = importlib.util.spec_from_file_location("bench_torchtitan", path)
    kit = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(kit)
    kit.SHAPE = shape
    kit.FLOPS_PER_TOKEN = flops
    kit.build_model_spec = model_spec
    sys.argv = [str(path), "--seq", str(args.seq), *rest]
    kit.main()


if __name__ == "__main__":
    main()

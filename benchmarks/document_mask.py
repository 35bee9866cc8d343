"""What intra-document attention (``train.document_mask``) costs on one GPU at OLMoE-1B-7B's shape.

    python benchmarks/document_mask.py --layers 16 --commit $(git rev-parse --short HEAD) \
        --out benchmarks/results/document_mask.json

The documents: lengths drawn from a log-normal (median ``--median-doc`` tokens, sigma
``--sigma``: mostly short documents with a long tail, clipped to 16 .. 65,536), each ended by EOS
and packed back to back, as ``moe tokenize`` packs a corpus. Two measurements on the same
documents:

1. The attention core (batch 4, sequence 4096, 16 heads of 128, bf16, forward + backward;
   CUDA events after warm-up, the median): FlashAttention 4 causal over whole rows, FlashAttention
   4 varlen over the rows' documents (what the mask runs), SDPA causal, and compiled
   FlexAttention under the documents' block mask (and the mask's making, apart).
2. ``moe train`` (``trainer_step.trainer_run``: the figure the product prints), one process per
   variant, on a token folder of those documents, attention by FlashAttention 4
   (``parallel.attention=flash4``, what ``auto`` picks where it is installed): the mask off (CUDA
   graphs as configured: on), the mask off without CUDA graphs, and the mask on (varlen; graphs
   off: each micro-batch brings its own number of documents); then SDPA, the core where
   FlashAttention 4 is not installed, mask off and on (under the explicit [B, 1, S, S] mask), and
   FlexAttention under the documents' block mask (``parallel.attention=flex``). The
   printed model TFLOP/s counts attention over whole rows in every variant (the design's
   convention), so the step time and tokens/s compare the variants.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from report import save, stamp  # noqa: E402
from timing import cuda_times_ms  # noqa: E402
from trainer_step import run_shape, trainer_run  # noqa: E402

from moe_core.data.manifest import write_token_folder  # noqa: E402
from moe_core.model.documents import documents_of  # noqa: E402

SEQ, HEADS, HEAD_DIM, MBS = 4096, 16, 128, 4
VOCAB = 50304  # OLMoE-1B-7B's
EOS = 50279


def document_tokens(n_tokens: int, median: float, sigma: float, seed: int) -> np.ndarray:
    """``n_tokens`` ids with an EOS closing each document of log-normal length."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), sigma, n_tokens // 16 + 1), 16, 65536)
    ends = np.cumsum(lengths.astype(np.int64)) - 1
    tokens = rng.integers(0, EOS, n_tokens)
    tokens[ends[ends < n_tokens]] = EOS
    return tokens


def write_folder(path: Path, train: np.ndarray, validation: np.ndarray) -> None:
    """A token folder of ``moe tokenize``'s format holding the given splits (a stand-in
    tokenizer file; the manifest records OLMoE's vocabulary and EOS)."""
    write_token_folder(
        path,
        {"train": train, "validation": validation},
        dtype="uint32",
        shard_tokens=1 << 22,
        vocab_size=VOCAB,
        eos_id=EOS,
        tokenizer=b'{"stand-in": "benchmark documents"}',
    )


def attention_core(tokens: np.ndarray, iters: int) -> dict:
    """Forward + backward of the attention core on the first ``MBS`` rows of ``tokens``."""
    import torch.nn.functional as F
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    rows = torch.from_numpy(tokens[: MBS * SEQ].reshape(MBS, SEQ))
    docs = documents_of(rows, EOS).to(torch.device("cuda"))
    lengths = (docs.cu_seqlens_N[1:] - docs.cu_seqlens_N[:-1]).double()
    work = float((lengths * (lengths + 1) / 2).sum() / (MBS * SEQ * (SEQ + 1) / 2))
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (MBS, SEQ, HEADS, HEAD_DIM)
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        for _ in range(3)
    )
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    def whole() -> None:
        first(flash_attn_func(q, k, v, causal=True)).backward(dy)

    def varlen() -> None:
        flat = [t.view(MBS * SEQ, HEADS, HEAD_DIM) for t in (q, k, v)]
        out = flash_attn_varlen_func(
            *flat,
            cu_seqlens_q=docs.cu_seqlens_N,
            cu_seqlens_k=docs.cu_seqlens_N,
            max_seqlen_q=docs.max_len,
            max_seqlen_k=docs.max_len,
            causal=True,
        )
        first(out).backward(dy.view(MBS * SEQ, HEADS, HEAD_DIM))

    def sdpa() -> None:
        t = [x.transpose(1, 2) for x in (q, k, v)]
        F.scaled_dot_product_attention(*t, is_causal=True).backward(dy.transpose(1, 2))

    # FlexAttention (parallel.attention=flex), compiled, under the documents' block mask (made
    # once per micro-batch, as the model makes it: timed apart)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc_BS = torch.cumsum(docs.positions_BS == 0, dim=1)

    def within_document(b, h, q_idx, kv_idx):
        return (doc_BS[b, q_idx] == doc_BS[b, kv_idx]) & (kv_idx <= q_idx)

    compiled_flex = torch.compile(flex_attention)

    def block_mask():
        return create_block_mask(within_document, MBS, None, SEQ, SEQ, device="cuda", _compile=True)

    mask = block_mask()

    def flex() -> None:
        t = [x.transpose(1, 2) for x in (q, k, v)]
        compiled_flex(*t, block_mask=mask).backward(dy.transpose(1, 2))

    out = {
        "documents": len(lengths),
        "mean_document": float(lengths.mean()),
        "attention_work_share": work,  # the masked causal pairs against whole rows'
    }
    timed = (
        ("flash4_causal", whole),
        ("flash4_varlen", varlen),
        ("sdpa_causal", sdpa),
        ("flex_documents", flex),
        ("flex_block_mask", block_mask),
    )
    for name, fn in timed:
        out[f"{name}_ms"] = statistics.median(cuda_times_ms(fn, 5, iters))
    out["varlen_vs_causal"] = out["flash4_causal_ms"] / out["flash4_varlen_ms"]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--median-doc", type=float, default=400.0)
    p.add_argument("--sigma", type=float, default=1.4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--skip-trainer", action="store_true")
    p.add_argument("--variants", default="", help="comma-separated trainer runs (default: all)")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    args = p.parse_args()
    n_train = (args.warmup + args.steps + 2) * MBS * (SEQ + 1)
    train = document_tokens(n_train, args.median_doc, args.sigma, seed=0)
    result: dict = {
        "benchmark": "document_mask",
        **stamp(args.commit),
        "seq": SEQ,
        "mbs": MBS,
        "documents": {"median": args.median_doc, "sigma": args.sigma, "clip": [16, 65536]},
        "attention": attention_core(train, args.iters),
    }
    if not args.skip_trainer:
        variants = {  # name: (overrides, attention core)
            "mask_off": ([], "flash4"),
            "mask_off_no_graphs": (["parallel.cuda_graph=false"], "flash4"),
            "mask_on": (["train.document_mask=true"], "flash4"),
            "sdpa_mask_off": ([], "sdpa"),
            "sdpa_mask_on": (["train.document_mask=true"], "sdpa"),
            "flex_mask_on": (["train.document_mask=true"], "flex"),
        }
        if args.variants:
            picked = args.variants.split(",")
            unknown = sorted(set(picked) - set(variants))
            if unknown:
                allowed = ", ".join(variants)
                p.error(f"--variants {','.join(unknown)} unknown; choose from {allowed}")
            variants = {k: variants[k] for k in picked}
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "documents"
            held_out = document_tokens(24 * (SEQ + 1), args.median_doc, args.sigma, seed=1)
            write_folder(data, train, held_out)
            runs = {}
            for name, (extra, core) in variants.items():
                shape = run_shape(
                    attention=core,
                    layers=args.layers,
                    warmup=args.warmup,
                    steps=args.steps,
                    skip_bare=True,
                    data_dir=str(data),
                    set=["data.kind=tokens", f"data.dir={data}", *extra],
                )
                run = trainer_run(shape)
                run["command"] = run["command"].replace(str(data), "DIR")  # no machine paths
                run["tokens_per_s"] = MBS * SEQ / run["median_step_s"]
                runs[name] = run
                print(name, f"{run['median_tflops']:.1f} TFLOP/s printed,", end=" ")
                print(f"{run['median_step_s'] * 1e3:.1f} ms/step", flush=True)
        result["trainer"] = runs
        base = {k: "sdpa_mask_off" if "sdpa" in k else "mask_off" for k in runs}
        result["step_time_vs_mask_off"] = {
            k: r["median_step_s"] / runs[base[k]]["median_step_s"]
            for k, r in runs.items()
            if base[k] in runs
        }
    print("RESULT", {k: v for k, v in result.items() if k != "trainer"})
    save(result, args.out)


if __name__ == "__main__":
    main()

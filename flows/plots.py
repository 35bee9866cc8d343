"""Pictures of a training run from its metrics.jsonl: loss, throughput, expert load per layer,
downstream accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def _lines(metrics: Path) -> list[dict]:
    out = []
    for raw in metrics.read_text().splitlines():
        try:
            out.append(json.loads(raw))
        except ValueError:
            break
    return out


def training_plots(metrics: Path, out_dir: Path) -> list[Path]:
    """Write loss.png, tokens_per_s.png, expert_load.png and (with in-training downstream
    evaluation) downstream.png; return their paths."""
    rows = _lines(metrics)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not rows:
        return []
    steps = [r["step"] for r in rows]
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in rows], label="train loss")
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.legend()
    ax.grid(alpha=0.3)
    paths.append(out_dir / "loss.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(steps, [r["tokens_per_s_per_gpu"] for r in rows])
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s / GPU")
    ax.grid(alpha=0.3)
    paths.append(out_dir / "tokens_per_s.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    layers = sorted(rows[-1].get("router", {}), key=lambda n: int(n.split("_")[1]))
    if layers:
        shares = {
            layer: np.array([r["router"][layer]["load_share"] for r in rows if "router" in r])
            for layer in layers
        }
        top = max(float(s.max()) for s in shares.values())
        cols = min(4, len(layers))
        n_rows = -(-len(layers) // cols)
        fig, axes = plt.subplots(
            n_rows, cols, figsize=(3.6 * cols, 2.8 * n_rows), squeeze=False, layout="constrained"
        )
        for ax, layer in zip(axes.flat, layers, strict=False):
            image = ax.imshow(
                shares[layer].T, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=top
            )
            ax.set_title(layer.replace("_", " "), fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.set_ylabel("expert", fontsize=8)
        for ax in list(axes.flat)[len(layers) :]:
            ax.axis("off")
        fig.colorbar(image, ax=axes, shrink=0.8, label="share of routed tokens")
        fig.suptitle("expert load per layer over training")
        paths.append(out_dir / "expert_load.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)

    scored = [r for r in rows if r.get("downstream")]
    if scored:
        fig, ax = plt.subplots(figsize=(7, 4))
        for task in sorted(scored[-1]["downstream"]):
            points = [
                (r["step"], r["downstream"][task]["acc"]) for r in scored if task in r["downstream"]
            ]
            ax.plot(*zip(*points, strict=True), "o-", label=task)
        ax.set_xlabel("step")
        ax.set_ylabel("accuracy (RC: per character, MC: raw)")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        paths.append(out_dir / "downstream.png")
        fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
        plt.close(fig)
    return paths

"""AdamW on the fused ``moe_kernels.adamw`` update: one pass per tensor, no host synchronization.

Moments are kept in each parameter's dtype (as ``torch.optim.AdamW`` keeps them), or, with
``master_weights``, in fp32 beside an fp32 master copy of each lower-precision parameter (the
update writes the parameter from its master in the same pass); the math runs in fp32. The step
count and learning rate live on the device, so a step reads nothing back and can be captured in
a CUDA graph (set ``lr`` between replays with ``set_lr``).

The bare training step's optimizer (``benchmarks/train_step.py --optimizer moe_core``), not the
trainer's: training runs the same update through ``moe_core.parallel.optimizer.ShardedAdamW``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from moe_kernels.adamw import adamw_step_


class AdamW(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        master_weights: bool = False,
    ) -> None:
        if not lr > 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or eps < 0:
            raise ValueError(f"AdamW: lr {lr} must be > 0, betas {betas} in [0, 1), eps >= 0")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.master_weights = master_weights

    def _device_scalars(self, group: dict, device: torch.device) -> None:
        if "lr_t" not in group:
            group["lr_t"] = torch.tensor(group["lr"], dtype=torch.float32, device=device)
            group["step_t"] = torch.zeros((), dtype=torch.float32, device=device)

    def set_lr(self, lr: float) -> None:
        """New learning rate for every group (written on the device: no synchronization)."""
        for group in self.param_groups:
            group["lr"] = lr
            if "lr_t" in group:
                group["lr_t"].fill_(lr)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("AdamW.step takes no closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            self._device_scalars(group, params[0].device)
            group["step_t"] += 1
            beta1, beta2 = group["betas"]
            for p in params:
                state = self.state[p]
                if not state:
                    master = self.master_weights and p.dtype != torch.float32
                    if master:
                        state["master"] = p.detach().float().contiguous()
                    dtype = torch.float32 if master else p.dtype
                    fmt = torch.contiguous_format
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=fmt)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=fmt)
                master = state.get("master")
                adamw_step_(
                    p if master is None else master,
                    p.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    group["lr_t"],
                    group["step_t"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    out=None if master is None else p,
                )

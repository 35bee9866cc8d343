"""Every ``config.Dtype`` name as torch has it: the one map the trainer, planner, converter,
CLI and pipeline read (the model package, so each of them may import it)."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

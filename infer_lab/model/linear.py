"""``Linear``: ``nn.Linear`` whose product goes through :func:`infer_lab.kernels.linear.linear`.

The same parameters, names and state dict as ``nn.Linear`` (everything that reads or quantizes
``nn.Linear`` layers takes it), only the CPU's product is faster at decode's few rows.
"""

from __future__ import annotations

import torch
from torch import nn

from infer_lab.kernels.linear import linear


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

"""Test-session settings."""

from __future__ import annotations

import torch

# Tests compare numbers, they do not time anything. pytest-xdist runs one process per core, and
# two torch threads per process on two cores thrash (measured ~50x slower on a loaded machine).
torch.set_num_threads(1)

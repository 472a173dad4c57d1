from __future__ import annotations

import os

import torch

# Without CUDA, Triton runs only in its interpreter, which must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

"""A colocated worker: Generate computes each prompt here and decodes it; Pooling serves scores and embeddings;
no KV transfer. The defaults of `wiring.Wiring` are exactly this."""
from __future__ import annotations

from pdserve.services.worker.front.wiring import Wiring


class Colocated(Wiring):
    pass

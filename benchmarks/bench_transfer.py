"""KV-transfer throughput: NIXL and TCP through `KVTransfer.write_pages` against the bare transports.

    python benchmarks/bench_transfer.py [--tokens 2048] [--iters 20] [--backends nixl,tcp] [--device cpu|cuda]

Moves one prompt's KV for the default model (30 layers, 3 KV heads, head_dim 64, bf16,
16-token pages: 368,640 bytes per page) between two processes on this machine, and
prints GB/s per case and the interface's share of the raw transport's bandwidth
(target: at least 70%). An in-process memcpy gives the scale. Same as
`pdserve debug bench-transfer --backend B`, for every backend in one run.
"""
from __future__ import annotations

import argparse

import torch

from pdserve.shared.transfer import available_backends
from pdserve.shared.transfer.bench import measure, measure_memcpy, print_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--backends", default=",".join(available_backends()))
    parser.add_argument("--device", default="cpu", help="where both pools live: cpu or cuda")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for backend in args.backends.split(","):
        rows += measure(backend, args.tokens, args.iters, args.device)
    rows.append(measure_memcpy(args.tokens, args.iters, args.device))
    print(f"KV of a {args.tokens}-token prompt ({rows[0].nbytes / 1e6:.1f} MB) between {args.device} pools, "
          f"median of {args.iters} runs:")
    print_rows(rows)


if __name__ == "__main__":
    main()

"""Embedding throughput: pdserve's Encoder against sentence-transformers' `encode`, same model, same run.

    python benchmarks/bench_embeddings.py                      # all-MiniLM-L6-v2, 128-token inputs, batch 64
    python benchmarks/bench_embeddings.py --threads 2 --rounds 5
    python benchmarks/bench_embeddings.py --quantization w8a8_int8   # pdserve in int8, against fp32
    python benchmarks/bench_embeddings.py --st-dtype bfloat16        # sentence-transformers in bf16 too

Both sides start from text and end with normalised fp32 vectors on the host: tokenization, the forward and
pooling are all timed. Inputs are 64 distinct texts cut to exactly 128 tokens, so neither side gains by
sorting lengths. Each side runs `--rounds` timed batches after a warm-up, the two alternating; the median sequences/s is
reported, with the ratio and the cosine between the two sides' vectors (the same model must give the same
answer, or the comparison means nothing).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

WORDS = ("the giant panda is a bear species endemic to china it lives in mountain forests and eats bamboo "
         "serving systems batch many requests together so that matrix units stay busy").split()


def make_texts(tokenizer, count: int, tokens: int) -> list[str]:
    """`count` different texts, each exactly `tokens` tokens long with the special tokens."""
    texts = []
    for k in range(count):
        words = [WORDS[(k * 7 + i * 3) % len(WORDS)] for i in range(tokens * 2)]
        ids = tokenizer(" ".join(words), truncation=True, max_length=tokens)["input_ids"]
        texts.append(tokenizer.decode(ids[1:-1]))
    lengths = {len(tokenizer(t)["input_ids"]) for t in texts}
    if lengths != {tokens}:
        raise RuntimeError(f"texts came out {sorted(lengths)} tokens long, not {tokens}")
    return texts


def median_rates(sides: dict, batch: int, rounds: int) -> dict[str, float]:
    """Median sequences/s of each side; rounds alternate between the sides, so load from other processes on
    the machine falls on both alike."""
    for fn in sides.values():
        fn()  # warm-up: allocator, oneDNN primitives
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: batch / statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="all-MiniLM-L6-v2")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--dtype", default="auto", help="pdserve's compute dtype (auto: Encoder's choice)")
    parser.add_argument("--quantization", default=None, choices=["w8a8_int8"],
                        help="pdserve's int8 matmuls (sentence-transformers stays in fp32)")
    parser.add_argument("--st-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="sentence-transformers' dtype (cosines are always taken against its fp32 vectors)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    from pdserve.shared.encoder import Encoder
    from pdserve.shared.model_files import resolve_model_path

    model_dir = resolve_model_path(args.model_path, quiet=True)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    texts = make_texts(tokenizer, args.batch, args.tokens)
    st = SentenceTransformer(str(model_dir), device="cpu")
    reference = st.encode(texts, batch_size=args.batch, convert_to_tensor=True).float()
    if args.st_dtype != "float32":
        st = SentenceTransformer(str(model_dir), device="cpu", model_kwargs={"dtype": getattr(torch, args.st_dtype)})
    encoder = Encoder(model_dir, None if args.dtype == "auto" else getattr(torch, args.dtype),
                      quantization=args.quantization)

    def ours() -> list[list[float]]:
        return encoder.encode(tokenizer(texts)["input_ids"])

    def theirs():
        return st.encode(texts, batch_size=args.batch, convert_to_tensor=True)

    cosine = torch.nn.functional.cosine_similarity(torch.tensor(ours()), reference).min().item()
    cosine_st = torch.nn.functional.cosine_similarity(theirs().float(), reference).min().item()
    rates = median_rates({"st": theirs, "ours": ours}, args.batch, args.rounds)
    rate_st, rate_ours = rates["st"], rates["ours"]
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    print(f"model {model_dir.name}, {args.batch} x {args.tokens} tokens, {torch.get_num_threads()} threads, "
          f"pdserve dtype {name[encoder.dtype]}"
          + (f" (matmuls {name[encoder.matmul_dtype]})" if encoder.matmul_dtype != encoder.dtype else "")
          + (f", {args.quantization}" if args.quantization else ""))
    print(f"sentence-transformers: {rate_st:8.1f} seq/s ({args.st_dtype}"
          + (f", min cosine {cosine_st:.6f} to its fp32)" if args.st_dtype != "float32" else ")"))
    print(f"pdserve Encoder:       {rate_ours:8.1f} seq/s")
    print(f"ratio {rate_ours / rate_st:.2f}x   min cosine {cosine:.6f} to sentence-transformers' fp32 vectors")


if __name__ == "__main__":
    main()

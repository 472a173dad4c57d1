"""Tiny random-weight checkpoints of each supported architecture, made offline in milliseconds."""
from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "llama3-rope", "qwen3", "qwen2-moe", "qwen3-moe", "mixtral")
MOE_ARCHS = ("qwen2-moe", "qwen3-moe", "mixtral")
# transformers' init (std 0.02) leaves the MLPs' share of the logits below the parity tolerance, so a wrong
# expert block could pass; these archs draw every matrix with std 1/sqrt(fan_in) so each part shows.
SCALED_INIT = ("qwen3",) + MOE_ARCHS


def make_tiny_model(arch: str, out_dir: Path, seed: int = 0, **sizes) -> Path:
    """Save a 2-layer (3 for qwen3-moe), hidden-64 checkpoint of `arch` to `out_dir` (HF format, fp32); `sizes`
    replace the config's (e.g. intermediate_size=2048 for a checkpoint of a few MB)."""
    import transformers as tf
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1) | sizes
    torch.manual_seed(seed)
    if arch == "qwen2":
        config = Qwen2Config(**common, rope_theta=10000.0, tie_word_embeddings=False)
        model = Qwen2ForCausalLM(config)
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=True))
    elif arch == "llama3-rope":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False))
    elif arch == "qwen3":  # head_dim 32 is not hidden / heads: the config's head_dim must win
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True))
    elif arch == "qwen2-moe":  # Qwen1.5-MoE's layout: shared expert with its gate, top-k weights not renormalised
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=96, norm_topk_prob=False, tie_word_embeddings=False))
    elif arch == "qwen3-moe":  # a dense layer in the middle (mlp_only_layers), renormalised top-k
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **{**common, "num_hidden_layers": 3}, head_dim=32, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False))
    elif arch == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                                       tie_word_embeddings=False))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if arch in SCALED_INIT and p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
            if name.endswith("bias"):  # random init leaves biases at zero; make Qwen2's qkv bias matter
                p.normal_(0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # init is all ones: make the weights matter
                p.normal_(1.0, 0.3)
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0, 0.5)  # decisive routing: no near-ties for rounding to flip, every expert used
    model = model.to(torch.float32).eval()
    model.save_pretrained(out_dir)
    make_tiny_tokenizer(out_dir)
    return out_dir


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_tokenizer(out_dir: Path) -> None:
    """A 512-token byte-level BPE with ChatML special tokens, trained offline on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["What is the capital of France? The capital of France is Paris.",
            "Hello! How are you today? I am a small test model.", "one two three four five six seven"] * 20
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|im_end|>")
    fast.chat_template = CHATML
    fast.save_pretrained(out_dir)

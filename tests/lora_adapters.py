"""Seeded random PEFT LoRA adapters, and tiny random Llama bases to make them on, built offline in seconds.

PEFT initialises lora_B to zero, so a fresh adapter changes nothing; `make_peft_adapter` draws A and B from a
seeded normal distribution instead, so every adapted module's output differs from the base model's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch


def make_tiny_llama(out_dir: Path, *, hidden_size: int = 64, intermediate_size: int = 96, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0) -> Path:
    """Save a random Llama (no tokenizer: enough for ModelConfig and PEFT) to `out_dir` in HF format, fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, max_position_embeddings=256, tie_word_embeddings=True)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out_dir)
    return out_dir


def make_peft_adapter(base_model_dir: Path, out_dir: Path, *, rank: int, target_modules: Sequence[str] | str,
                      alpha: float, seed: int, use_rslora: bool = False, std: float = 0.04,
                      **lora_config: Any) -> Path:
    """Make a LoRA on the model in `base_model_dir` with every A and B drawn with `std` from `seed`, and save it
    with PEFT's save_pretrained (safetensors). `lora_config`: further LoraConfig fields (use_dora, ...)."""
    from peft import LoraConfig, get_peft_model

    base = _load_base(base_model_dir)
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                            use_rslora=use_rslora, lora_dropout=0.0, **lora_config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def load_peft_model(base_model_dir: Path, adapter_dir: Path):
    """The base model with the saved adapter applied by PEFT, fp32, eval: the oracle of the LoRA tests."""
    from peft import PeftModel

    return PeftModel.from_pretrained(_load_base(base_model_dir), str(adapter_dir)).eval()


def _load_base(base_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(base_model_dir), dtype=torch.float32).eval()

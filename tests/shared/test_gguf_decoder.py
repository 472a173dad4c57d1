"""`--quantization gguf` on the default model, served from the blocks of its shipped Q4_1 GGUF: the matrices
stay 4-bit (the tied head Q8_0), the greedy answer is right, and the log-probabilities are those of transformers
loaded from the same file (dequantized) in fp32. A model that did not come from a GGUF is refused clearly."""
from __future__ import annotations

import pytest
import torch

from pdserve.shared.config import CacheConfig, RuntimeConfig
from pdserve.shared.engine import Engine
from pdserve.shared.gguf_linear import GGUFLinear
from pdserve.shared.model_files import default_gguf
from pdserve.shared.model_runner import ModelRunner
from pdserve.shared.page_allocator import PageAllocator
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.scheduler import Batch


@pytest.fixture(scope="module")
def gguf_engine(default_model_dir) -> Engine:
    return Engine(RuntimeConfig(model_path=str(default_model_dir), quantization="gguf", dtype="float32",
                                cache=CacheConfig(page_size=16, max_total_tokens=16 * 64)))


def test_the_matrices_stay_as_the_file_stores_them(gguf_engine):
    model = gguf_engine.runner.model
    layers = [lin for layer in model.layers for lin in layer.linears()]
    assert all(isinstance(lin, GGUFLinear) and lin.weight.type_name == "Q4_1" for lin in layers)
    assert isinstance(model.lm_head, GGUFLinear) and model.lm_head.weight.type_name == "Q8_0"
    block_bytes = sum(lin.nbytes for lin in layers + [model.lm_head])
    bf16_bytes = sum(2 * lin.shape.numel() for lin in layers + [model.lm_head])
    assert block_bytes < 0.4 * bf16_bytes


def test_greedy_answer_and_logprobs_match_transformers_on_the_same_file(gguf_engine, chat, tokenizer):
    from transformers import AutoModelForCausalLM

    ids = chat("What is the capital of France?")
    out: list[int] = []
    gguf_engine.add_request(Req(rid="0", input_ids=list(ids), on_output=lambda o: out.extend(o.token_ids),
                                params=SamplingParams(temperature=0, max_new_tokens=12)))
    while gguf_engine.has_work():
        gguf_engine.step()
    gguf_engine.flush_cache()
    assert "Paris" in tokenizer.decode(out)

    runner: ModelRunner = gguf_engine.runner
    seq = list(ids) + out[:-1]
    req = Req(rid="1", input_ids=seq, params=SamplingParams(temperature=0))
    req.pages = PageAllocator(runner.pool.num_pages).allocate(-(-len(seq) // 16))
    ours = runner.forward(Batch([req], is_decode=False, extend_lens=[len(seq)])).float()[0]
    gguf = default_gguf()
    ref_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model(torch.tensor([seq])).logits[0, -1].float()
    assert int(ref.argmax()) == out[-1] == int(ours.argmax())
    diff = (torch.log_softmax(ours, -1) - torch.log_softmax(ref, -1)).abs()
    top = torch.log_softmax(ref, -1).topk(20).indices
    assert diff[top].max() < 1e-3, diff[top].max()


def test_a_model_not_from_a_gguf_file_is_refused(tiny_models):
    with pytest.raises(ValueError, match="--quantization gguf serves a .gguf --model-path"):
        ModelRunner(RuntimeConfig(model_path=str(tiny_models["llama"]), quantization="gguf",
                                  cache=CacheConfig(page_size=4, max_total_tokens=64)))


def test_two_tensor_parallel_ranks_give_the_logits_of_one_process(default_model_dir):
    """The blocks split as the plain weights do (q|k|v and gate|up by rows, o and down at block-aligned
    columns, the tied head by vocabulary): the default model's 2 + 1 head split answers as one process."""
    from test_tensor_parallel import Split, config, steps

    whole = steps(ModelRunner(config(default_model_dir, quantization="gguf")))
    with Split(config(default_model_dir, quantization="gguf"), 2) as runner:
        split = steps(runner)
    torch.testing.assert_close(split, whole, atol=2e-3, rtol=0)

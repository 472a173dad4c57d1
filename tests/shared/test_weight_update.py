"""Live weight updates in the runtime: a checkpoint is read and checked completely before the running model is
touched, every refusal names what is wrong and leaves the old weights serving, and new weights serve exactly as
if they had been loaded at start-up (packed matmuls and all), after the prefix cache is flushed."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures import make_tiny_model

from pdserve.shared.compat import Compat
from pdserve.shared.config import CacheConfig, RuntimeConfig
from pdserve.shared.engine import Engine
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams
from pdserve.shared.compat import WeightsVersion
from pdserve.shared.weights import CheckpointNotFound, WeightsError

PROMPT = [5, 17, 99, 3, 250, 8, 8, 41, 300, 7, 66, 12, 13, 14, 15, 16, 17, 18]
NEW_TOKENS = 8
UP = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """The running checkpoint, the same model with other weights, and broken or foreign checkpoints."""
    root = tmp_path_factory.mktemp("weight-update")
    # Qwen3 because its tiny checkpoints are drawn with weights large enough to decide the greedy tokens.
    base = make_tiny_model("qwen3", root / "base", seed=0)
    out = {"base": base, "new": make_tiny_model("qwen3", root / "new", seed=1),
           "llama": make_tiny_model("llama", root / "llama")}
    out["deeper"] = _edited(base, root / "deeper", config={"num_hidden_layers": 3})
    out["missing"] = _edited(base, root / "missing", tensors=lambda t: t.pop(UP))
    out["reshaped"] = _edited(base, root / "reshaped", tensors=lambda t: t.update({UP: t[UP][:-8].clone()}))
    out["nan"] = _edited(out["new"], root / "nan", tensors=lambda t: t[UP].view(-1)[7:9].fill_(float("nan")))
    out["truncated"] = _edited(out["new"], root / "truncated")
    weights = out["truncated"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    return out


def _edited(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    shutil.copytree(src, dst)
    if config:
        raw = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**raw, **config}))
    if tensors:
        path = dst / "model.safetensors"
        loaded = load_file(path)
        tensors(loaded)
        save_file(loaded, path, metadata={"format": "pt"})
    return dst


def make_engine(model_dir: Path, dtype: str = "float32") -> Engine:
    return Engine(RuntimeConfig(model_path=str(model_dir), dtype=dtype,
                                cache=CacheConfig(page_size=4, max_total_tokens=4 * 64)))


def generate(engine: Engine, ids: list[int] = PROMPT) -> tuple[list[int], int]:
    """Greedy tokens of `ids` and how many prompt tokens came from the prefix cache."""
    outs = []
    engine.add_request(Req(rid="r", input_ids=list(ids), on_output=outs.append,
                           params=SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)))
    while engine.has_work():
        engine.step()
    assert engine.scheduler.check_integrity().ok
    return [t for o in outs for t in o.token_ids], outs[-1].cached_tokens


def update(engine: Engine, path: Path | str, number: int = 1) -> int | None:
    engine.weights.stage(engine.runner.read_weights(str(path)))
    return engine.weights.commit(WeightsVersion(number, str(path)))


def hf_greedy(model_dir: Path) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def test_new_weights_serve_what_transformers_gives_and_the_prefix_cache_is_flushed(ckpts):
    engine = make_engine(ckpts["base"])
    old, _ = generate(engine)
    assert old == hf_greedy(ckpts["base"])
    assert generate(engine)[1] > 0  # the prompt's pages are cached now
    engine.weights.stage(engine.runner.read_weights(str(ckpts["new"])))
    assert generate(engine)[0] == old  # staged, not served
    assert engine.weights.commit(WeightsVersion(1, str(ckpts["new"]))) == 0
    assert engine.cache.num_pages == 0
    new, cached = generate(engine)
    assert cached == 0 and new == hf_greedy(ckpts["new"]) and new != old
    assert engine.weights.version.label == f"1 ({ckpts['new']})" and engine.weights.staged is None


def test_packed_bf16_weights_are_rebuilt_like_at_start_up(ckpts):
    """bf16 on CPU packs every matmul for oneDNN (and keeps a GEMV copy where the CPU has one): an updated
    engine answers bit for bit what an engine started on the new checkpoint answers."""
    engine = make_engine(ckpts["base"], "bfloat16")
    generate(engine)
    update(engine, ckpts["new"])
    fresh = make_engine(ckpts["new"], "bfloat16")
    assert generate(engine)[0] == generate(fresh)[0]
    for got, want in zip(engine.runner.model.layers[0].linears(), fresh.runner.model.layers[0].linears()):
        assert torch.equal(got.dense_weight(), want.dense_weight())


@pytest.mark.parametrize("name,phrase", [
    ("llama", "the checkpoint's architecture is 'LlamaForCausalLM', the running model's is 'Qwen3ForCausalLM'"),
    ("deeper", "the checkpoint's num_layers is 3, the running model's is 2"),
    ("missing", f"tensor '{UP}' is missing from"),
    ("reshaped", f"tensor '{UP}' has shape [120, 64] in"),
    ("truncated", "model.safetensors: Error while deserializing header"),
])
def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_changes(ckpts, name, phrase):
    engine = make_engine(ckpts["base"])
    before, _ = generate(engine)
    with pytest.raises(WeightsError) as err:
        engine.runner.read_weights(str(ckpts[name]))
    assert phrase in str(err.value)
    assert generate(engine)[0] == before and engine.weights.version.number == 0


def test_nan_weights_are_refused_while_building_and_nothing_is_staged(ckpts):
    engine = make_engine(ckpts["base"])
    before, _ = generate(engine)
    with pytest.raises(WeightsError, match=f"tensor '{UP}' holds NaN or infinite values"):
        engine.weights.stage(engine.runner.read_weights(str(ckpts["nan"])))
    assert engine.weights.staged is None
    with pytest.raises(WeightsError, match="no weights are staged"):
        engine.weights.commit(WeightsVersion(1, "x"))
    assert generate(engine)[0] == before


def test_a_path_that_names_nothing_says_so_in_sglangs_words_whatever_is_there(ckpts, tmp_path):
    """A missing path, a folder without a checkpoint and a plain file get the same answer: a caller of the API
    learns nothing about the host's files from it."""
    engine = make_engine(ckpts["base"])
    (tmp_path / "file").write_text("not a model")
    for path in ("qwen/qwen2.5-0.5b-instruct-wrong", str(tmp_path), str(tmp_path / "file"),
                 str(tmp_path / "missing")):
        with pytest.raises(CheckpointNotFound) as refused:
            engine.runner.read_weights(path)
        assert str(refused.value) == f"{path} (repository not found)"


def test_running_requests_finish_first_or_are_aborted_with_the_reason(ckpts):
    engine = make_engine(ckpts["base"])
    outs = []
    engine.add_request(Req(rid="live", input_ids=list(PROMPT), on_output=outs.append,
                           params=SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS)))
    engine.step()
    engine.weights.stage(engine.runner.read_weights(str(ckpts["new"])))
    assert engine.weights.commit(WeightsVersion(1, "new")) is None  # a request runs: nothing changed
    assert engine.weights.version.number == 0 and engine.weights.staged == str(ckpts["new"])
    assert engine.weights.commit(WeightsVersion(1, "new"), abort_reason="weights are being updated") == 1
    assert outs[-1].finish_reason == "abort" and outs[-1].error == "weights are being updated"
    assert engine.weights.version.number == 1 and not engine.has_work()
    assert engine.scheduler.check_integrity().ok


def test_a_prefill_worker_refuses_kv_for_other_weights(ckpts):
    engine = make_engine(ckpts["base"])
    engine.weights.check_peer("0")
    engine.weights.check_peer("")  # a peer that does not say: nothing to compare
    with pytest.raises(WeightsError, match=r"decode worker serves weights version 1 \(x\) and this prefill"):
        engine.weights.check_peer("1 (x)")
    update(engine, ckpts["new"], number=2)
    engine.weights.check_peer(f"2 ({ckpts['new']})")
    with pytest.raises(WeightsError):
        engine.weights.check_peer("0")


def test_moe_weights_update_and_the_expert_recorder_keeps_counting(tmp_path):
    base = make_tiny_model("qwen2-moe", tmp_path / "a", seed=0)
    new = make_tiny_model("qwen2-moe", tmp_path / "b", seed=1)
    engine = make_engine(base)
    engine.experts.start()
    generate(engine)
    update(engine, new)
    engine.experts.dump()
    assert generate(engine)[0] == generate(make_engine(new))[0]
    assert int(engine.experts.dump().sum()) > 0  # the hook moved to the new expert blocks


def test_registration_records_the_weights_version_but_a_restarted_worker_may_rejoin():
    """A worker restarted after an update comes back on its start-up weights: refusing it at registration would
    keep it out of the next update too; its requests are refused one by one instead (above)."""
    mine = Compat("m", "float32", 16, 2, 2, 32, "tcp", weights_version="3 (/ckpt)")
    theirs = Compat("m", "float32", 16, 2, 2, 32, "tcp", weights_version="0")
    assert mine.to_dict()["weights_version"] == "3 (/ckpt)" and mine.mismatches(theirs) == []


def _bare(src: Path, dst: Path) -> Path:
    """`src` saved as a bare decoder (Qwen3Model: no head, no "model." prefix), as embedding checkpoints are."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, "architectures": ["Qwen3Model"]}))
    tensors = load_file(dst / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in tensors.items() if k != "lm_head.weight"},
              dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_a_bare_decoder_takes_the_weights_of_another_bare_checkpoint(ckpts, tmp_path):
    base, new = _bare(ckpts["base"], tmp_path / "a"), _bare(ckpts["new"], tmp_path / "b")
    engine = make_engine(base)
    update(engine, new)
    fresh = make_engine(new)
    assert torch.equal(engine.runner.model.embed, fresh.runner.model.embed)
    got, want = engine.runner.model.layers[1].mlp.down, fresh.runner.model.layers[1].mlp.down
    assert torch.equal(got.dense_weight(), want.dense_weight())

"""A worker's model is built and stepped on one thread (ComputeThread): OpenMP then keeps a single pool."""
from __future__ import annotations

import threading

import pytest

from pdserve.shared.compute_thread import ComputeThread
from pdserve.shared.config import CacheConfig, RuntimeConfig
from pdserve.shared.engine import Engine
from pdserve.shared.model_runner import ModelRunner
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams


def test_run_returns_results_and_raises_errors_on_one_thread():
    compute = ComputeThread()
    first, second = compute.run(threading.get_ident), compute.run(threading.get_ident)
    assert first == second != threading.get_ident()
    with pytest.raises(ValueError, match="bad checkpoint"):
        compute.run(lambda: (_ for _ in ()).throw(ValueError("bad checkpoint")))
    assert compute.run(lambda: 41 + 1) == 42  # an error does not end the thread


def test_engine_steps_on_the_thread_that_loaded_the_model(tiny_models):
    config = RuntimeConfig(model_path=str(tiny_models["llama"]), dtype="float32",
                           cache=CacheConfig(page_size=4, max_total_tokens=256))
    compute = ComputeThread()
    runner, loader = compute.run(lambda: (ModelRunner(config), threading.get_ident()))
    engine = Engine(config, runner=runner)
    stepped_on: set[int] = set()
    step = engine.step
    engine.step = lambda: (stepped_on.add(threading.get_ident()), step())[1]
    done = threading.Event()
    engine.start(compute)
    try:
        engine.call(lambda: engine.add_request(Req(rid="r", input_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=3),
                                                   on_output=lambda out: out.finish_reason and done.set()))).result(10)
        assert done.wait(30)
        assert stepped_on == {loader} and engine.is_alive()
    finally:
        engine.stop()
    assert not compute.is_alive()

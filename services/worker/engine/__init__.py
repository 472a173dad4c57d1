"""A generative worker's engine room: the engine process (`engine_process.py`), what it is built of
(`engine_worker.py`), the handlers of the calls every role serves (`engine_calls.py`, `engine_admin_calls.py`)
and each role's own (`colocated_engine.py`, `prefill_engine.py`, `decode_engine.py`), and its metrics. It
imports the channel room, never the front room (tests/test_import_graph.py)."""

"""A generative worker's front room: its gRPC services, HTTP (/health, /metrics), registration with peers,
spans, and its side of the engine channel (`engine_link.py`); each role's front wiring (`colocated_wiring.py`,
`prefill_wiring.py`, `decode_wiring.py`). It never loads torch or the runtime: it imports the channel room, never the
engine room (tests/test_import_graph.py)."""

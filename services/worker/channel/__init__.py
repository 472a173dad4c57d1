"""What a worker's front and engine share, and all they share: the wire (`wire.py`: frames, their limits, the
peer gate), the declared calls, events and output record that cross it (`messages.py`), and the settings the
engine is started with (`settings.py`, `tier_flags.py`). It imports neither room (tests/test_import_graph.py)."""

"""Capacity planning: traces (`traces`), a machine profile (`profile`), a simulator that runs the project's own
scheduler, prefix cache and router on a virtual clock (`simulator`), and the split search over it (`plan`).

Nothing here is imported by the services; the planner imports the runtime library and the gateway's router, never
the other way round.
"""

"""The colocated role: prompts computed and decoded in one place, the plain case EngineRole (engine_role.py) writes."""
from __future__ import annotations

from pdserve.shared.config import Role
from pdserve.shared.roles.engine_role import EngineRole


class ColocatedRole(EngineRole):
    kind = Role.COLOCATED

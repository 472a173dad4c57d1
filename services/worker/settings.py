"""What a worker app derives from its command line besides the runtime config: its name, its role's wiring and its
expert recording. `cli` parses the flags and builds the app; the apps read these without importing `cli` back."""
from __future__ import annotations

import argparse
import os
import socket
import uuid

from pdserve.services.worker.colocated import Colocated
from pdserve.services.worker.decode import Decode
from pdserve.services.worker.prefill import Prefill
from pdserve.services.worker.wiring import Wiring
from pdserve.shared.config import Role
from pdserve.shared.expert_recorder import MODES as EXPERT_RECORD_MODES
from pdserve.shared.expert_recorder import RecordSettings


def wiring_for(role: Role) -> Wiring:
    return {Role.COLOCATED: Colocated, Role.PREFILL: Prefill, Role.DECODE: Decode}[role]()


def worker_name(role: str, host: str, port: int) -> str:
    return f"{role}-{socket.gethostname()}-{host}:{port}-{uuid.uuid4().hex[:6]}-{os.getpid()}"


def add_expert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--expert-distribution-recorder-mode", default=None, choices=EXPERT_RECORD_MODES,
                        help="MoE models: let /start_expert_distribution_record count how often each layer picks "
                             "each expert (stat: totals per layer and expert); unset, those endpoints are refused")
    parser.add_argument("--expert-distribution-recorder-dir",
                        default=os.environ.get("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR") or "/tmp",
                        help="where /dump_expert_distribution_record writes its .pt files "
                             "(default: $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, else /tmp)")


def expert_settings(args: argparse.Namespace, tag: str) -> RecordSettings:
    return RecordSettings(args.expert_distribution_recorder_mode, args.expert_distribution_recorder_dir, tag)

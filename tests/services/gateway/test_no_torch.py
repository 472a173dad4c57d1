"""The gateway process needs neither torch nor the runtime: `pdserve gateway` builds its app without loading them
(torch comes in only with xgrammar, at the first request that carries a grammar)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
GATEWAY = ROOT / "services" / "gateway"
HEAVY = ("torch", "pdserve.shared.engine", "pdserve.shared.model_runner")

# What `pdserve gateway --worker ...` runs up to serving: the CLI's parser, then `build` (tokenizer, pool, app).
BUILD_GATEWAY = """
import sys
from pdserve.cli import build_parser
from pdserve.services.gateway import cli

argv = ["gateway", "--model-path", sys.argv[1], "--worker", "127.0.0.1:1", "--reasoning-parser", "deepseek-r1"]
parser, _ = build_parser(argv)
app = cli.build(parser.parse_args(argv))
print(" ".join(m for m in {heavy!r} if m in sys.modules) or "none")
"""


def test_building_the_gateway_loads_neither_torch_nor_the_runtime(default_model_dir):
    out = subprocess.run([sys.executable, "-c", BUILD_GATEWAY.format(heavy=HEAVY), str(default_model_dir)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "none", f"the gateway loaded {out.stdout.split()}"


def test_importing_every_gateway_module_loads_neither_torch_nor_the_runtime():
    modules = sorted(f"pdserve.services.gateway.{p.stem}" for p in GATEWAY.glob("*.py") if p.stem != "__init__")
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n" \
           f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules) or 'none')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "none", f"importing the gateway loaded {out.stdout.split()}"


def test_the_tokenizer_is_the_one_auto_tokenizer_loads(default_model_dir, minilm_dir):
    from transformers import AutoTokenizer

    from pdserve.services.gateway.tokenization import load_tokenizer

    text = "Hello <|im_start|> wörld [SEP] 12345"
    for path in (default_model_dir, minilm_dir):
        ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
        assert type(ours) is type(auto)
        assert ours.encode(text) == auto.encode(text) and len(ours) == len(auto)
        assert ours.all_special_ids == auto.all_special_ids and ours.chat_template == auto.chat_template

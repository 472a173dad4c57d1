"""Grammar checks in child processes: a request's grammar is compiled once before any worker is asked, so a bad
one is a 400 naming the field, without xgrammar (which loads torch) in the gateway's own process, and a compile
that runs past its budget ends with the process that runs it.

Lifecycle: up to `size` children, each started at the first check that finds none idle (spawned: it loads the
tokenizer and xgrammar once, a few seconds, and says when it is ready). A check takes an idle child, sends the
SamplingParams and waits `timeout_s` for (field, reason) or None. Past that the child is killed and the check
answers that the grammar did not compile in time; the next check starts a fresh child. At most `size` checks
run at once, on threads of their own, never the event loop's or the default executor's; more wait their turn.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pdserve.shared.sampling_params import SamplingParams

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # for a child to load the tokenizer and xgrammar (not part of any compile's budget)


class CompileTimeout(Exception):
    """The grammar did not compile within the budget; the child compiling it was killed."""


@dataclass(frozen=True)
class GrammarSource:
    """What a child needs to compile grammars as the workers do."""

    tokenizer_path: str
    vocab_size: int
    eos_token_ids: tuple[int, ...] | None


def _child(source: GrammarSource, conn) -> None:
    from pdserve.services.gateway.tokenization import ModelTokenizer
    from pdserve.shared.grammar import GrammarError, Grammars

    grammars = Grammars(ModelTokenizer(source.tokenizer_path).tok, source.vocab_size, source.eos_token_ids)
    conn.send("ready")
    while True:
        try:
            params = conn.recv()
        except (EOFError, OSError):  # the gateway closed the pipe or died
            return
        try:
            grammars.compile(params)
            conn.send(None)
        except GrammarError as exc:
            conn.send((exc.field, str(exc)))


class _Child:
    def __init__(self, source: GrammarSource) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(source, theirs), name="pdserve-grammar-check", daemon=True)
        self.proc.start()
        theirs.close()
        if not self.conn.poll(START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"the grammar checker did not start within {START_TIMEOUT_S:g} s")
        self.conn.recv()

    def check(self, params: SamplingParams, timeout_s: float) -> tuple[str, str] | None:
        try:
            self.conn.send(params)
            if not self.conn.poll(timeout_s):
                self.kill()
                raise CompileTimeout
            return self.conn.recv()
        except (EOFError, OSError):  # it died while compiling (out of memory, say)
            self.kill()
            raise RuntimeError("the grammar checker ended while compiling") from None

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class GrammarChecker:
    def __init__(self, source: GrammarSource, timeout_s: float, size: int = 2) -> None:
        self.source = source
        self.timeout_s = timeout_s
        self._threads = ThreadPoolExecutor(size, thread_name_prefix="grammar-check")
        self._idle: list[_Child] = []
        self._lock = threading.Lock()

    async def check(self, params: SamplingParams) -> tuple[str, str] | None:
        """(field, reason) when params' grammar does not compile, else None; CompileTimeout past the budget."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._check, params)

    def _check(self, params: SamplingParams) -> tuple[str, str] | None:
        with self._lock:
            child = self._idle.pop() if self._idle else None
        if child is None or not child.alive():
            child = _Child(self.source)
        result = child.check(params, self.timeout_s)  # kills the child past the budget
        with self._lock:
            self._idle.append(child)
        return result

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            children, self._idle = self._idle, []
        for child in children:
            child.kill()

"""EngineRole: the points where a role plugs into the engine's step, and what every role does at them.

A worker keeps one role until it is switched while it holds no request (`holds_nothing`). Its engine calls the role on the engine thread:

    admit(req)              a new, validated request: finish it at once (max_new_tokens 0, no logprobs to compute)
                            or queue it
    before_step()           before scheduling (a decode worker reserves pages for prompts here)
    schedule()              the next batch
    family(req)             the choices of a fresh prompt whose KV just completed (n > 1: forks of its pages)
    sampled(reqs, ...)      tokens sampled this step; returns the (request, token, logprob) that go on decoding
    aborted(rid, found, e)  an abort arrived (`found`: the engine held the request)

and reads `has_work()`, `num_queued()`, `idle_wait_s` and `poll()` in its loop. What is written here is the plain
case, prompts computed and decoded in one place: a colocated worker's role (colocated.py) adds nothing to it, and
prefill.py and decode.py change what only they do. A role holds the engine's `StepOps` (shared/step_ops.py),
never the engine.
"""
from __future__ import annotations

from pdserve.shared.config import Role
from pdserve.shared.outputs import TokenLogprobs
from pdserve.shared.req import Req, ReqStatus
from pdserve.shared.sampler import make_generator
from pdserve.shared.scheduler import Batch
from pdserve.shared.step_ops import Sampled, StepOps


class EngineRole:
    kind: Role
    idle_wait_s = 0.05  # how long an idle engine waits for a command before looking again

    def __init__(self, ops: StepOps) -> None:
        self.ops = ops
        self.scheduler = ops.scheduler

    def admit(self, req: Req) -> None:
        p = req.params
        if p.max_new_tokens == 0 and not (p.wants_prompt_logprobs or p.token_ids_logprob):
            self.ops.emit(req, finish_reason="length")
            req.status = ReqStatus.FINISHED
            return
        self.queue(req)

    def queue(self, req: Req) -> None:
        self.scheduler.add(req)

    def before_step(self) -> None:
        pass

    def schedule(self) -> Batch | None:
        return self.scheduler.schedule_mixed()

    def family(self, req: Req) -> list[Req]:
        return [req] + self.fork(req)

    def sampled(self, reqs: list[Req], tokens: list[int], logprobs: list[TokenLogprobs | None],
                compute_s: float) -> Sampled:
        return list(zip(reqs, tokens, logprobs))

    def aborted(self, rid: str, found: bool, error: str | None) -> None:
        pass

    def has_work(self) -> bool:
        """Work beside the scheduler's queues."""
        return False

    def holds_nothing(self) -> bool:
        """No request of its own beside the scheduler's (none waits for KV or a settled fence): the worker may
        take another role now (services/worker/front/role_switch.py)."""
        return not self.has_work()

    def num_queued(self) -> int:
        """Requests waiting beside the scheduler's queue (for the load a worker reports)."""
        return 0

    def poll(self) -> None:
        pass

    def fork(self, req: Req) -> list[Req]:
        """Make the n-1 sibling choices of a request whose prompt KV is complete and cached."""
        scheduler, children = self.scheduler, []
        for index in range(1, req.params.n):
            seed = None if req.params.seed is None else req.params.seed + index
            child = Req(rid=req.rid, input_ids=req.input_ids, params=req.params, on_output=req.on_output,
                        index=index)
            child.generator = make_generator(seed)
            child.grammar = req.grammar.fork() if req.grammar is not None else None
            child.lora = req.lora
            scheduler.hold_adapter(child)  # one more use of the slot the parent holds
            child.cached_tokens = req.cached_tokens
            child.num_computed = req.num_computed
            child.prefix_node = req.prefix_node
            child.num_cached_pages = req.num_cached_pages
            scheduler.cache.lock(req.prefix_node)
            child.pages = req.pages[:req.num_cached_pages]
            for page in req.pages[req.num_cached_pages:]:  # the partly filled last page is copied
                new = scheduler.allocate(1)
                if new is None:
                    scheduler.release(child, cache=False)
                    break
                self.ops.runner.pool.copy_page(page, new[0])
                child.pages.append(new[0])
            else:
                children.append(child)
                continue
            self.ops.emit(child, finish_reason="abort", error="out of KV pages for n > 1")
        return children

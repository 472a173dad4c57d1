"""A prefill worker's engine side: it holds the sending side of KV transfers, writes each prompt's KV into the
pages a decode worker reserved (`write_kv`, under the reservation's fence), and serves the calls only a prefill
worker takes: Prefill (answered after the last write, with the first tokens), Fence (revoke a reservation), and
the decode workers' registration (AddPeer, RemovePeer); those three are every sender's (`kv_sender.py`). Its
metrics count a request done once prefilled."""
from __future__ import annotations

import argparse
import logging
import os
import time
from concurrent.futures import Future

from pdserve.services.worker.engine.colocated_engine import ColocatedEngine, rank_agent
from pdserve.services.worker.engine.engine_calls import params_of, trace_of, wire_lps
from pdserve.services.worker.channel.messages import Prefill
from pdserve.services.worker.engine.engine_worker import handles
from pdserve.services.worker.engine.kv_sender import WRITE_DELAY_ENV, KVSender
from pdserve.services.worker.channel.settings import transfer_backend
from pdserve.shared.config import Role
from pdserve.shared.req import Req, TransferTarget
from pdserve.shared.transfer.fence import Fence as WriteFence

log = logging.getLogger("pdserve.worker")


class PrefillEngine(KVSender, ColocatedEngine):
    role = Role.PREFILL
    serves_pooling_models = False
    switches_roles = True
    ends_at_prefill = True  # its work for a request ends once the KV is written

    def __init__(self, worker) -> None:
        super().__init__(worker)
        self._write_delay_s = float(os.environ.get(WRITE_DELAY_ENV) or 0)

    @staticmethod
    def transfer_spec(args: argparse.Namespace):
        from pdserve.shared.tp_transfer import TransferSpec

        return TransferSpec(transfer_backend(args), args.worker_name)

    transfer_agent = staticmethod(rank_agent)

    def engine_hooks(self) -> dict:
        return {"transfer_fn": self.write_kv}

    def write_kv(self, req: Req) -> float:
        """Engine thread: a prefilled prompt's KV into its decode worker's pages; the seconds it took."""
        transfer, metrics, target = self.worker.transfer, self.worker.metrics, req.transfer
        peer, num_pages = target.peer_name, len(target.dst_pages)
        if self._write_delay_s:
            time.sleep(self._write_delay_s)
        t0 = time.perf_counter()
        try:
            transfer.write_pages(peer, req.pages[:num_pages], target.dst_pages,
                                 fence=WriteFence(target.fence, target.fence_deadline) if target.fence else None)
        except Exception:
            metrics.transfer_failed(peer)
            raise
        seconds = time.perf_counter() - t0
        metrics.transferred(peer, num_pages * transfer.page_bytes, seconds)
        return seconds

    @handles(Prefill, where="here")
    def prefill(self, call: Prefill) -> Future:
        w = self.worker
        if not w.transfer.has_peer(call.peer_name):  # we restarted since it registered
            raise PermissionError(f"decode worker {call.peer_name} is not registered")
        req = Req(rid=call.rid, input_ids=list(call.input_ids), params=params_of(call.sampling),
                  arrival=call.arrival,
                  transfer=TransferTarget(call.peer_name, list(call.dst_pages), call.fence, call.fence_deadline))

        def admit() -> Future:  # no weight swap can come between the check and the admission on this thread
            w.engine.weights.check_peer(call.weights_version)
            return w.engine.role.add(req, call.lora or None, call.lora_version or None)
        answer = Future()

        def answered(f: Future) -> None:
            try:
                r = f.result()
                if isinstance(r, Future):  # admitted: now the prefill's own result
                    r.add_done_callback(answered)
                    return
            except BaseException as exc:
                answer.set_exception(exc)
                return
            answer.set_result({"first_tokens": [(t.token_id, wire_lps(t.logprob)) for t in r.first_tokens],
                               "cached_tokens": r.cached_tokens, "queue_s": r.queue_s, "compute_s": r.compute_s,
                               "transfer_s": r.transfer_s, "tier_tokens": dict(req.tier_tokens),
                               "input_logprobs": [wire_lps(lp) for lp in r.input_logprobs],
                               "trace": trace_of(req, len(call.dst_pages)) if call.traced else None})
        w.admit(req, admit).add_done_callback(answered)
        return answer

"""The step loop's side of the adapter registry: LoadAdapter and UnloadAdapter applied, each job's
agreed outcome applied to the planner's slots and answered to the coordinator, this rank's own
failure reasons sent, and what the live-set digest and RankStatus say of the adapters.

The jobs themselves run in adapter_store.py; slot decisions are adapter_slots.py's.
"""

from __future__ import annotations

import logging

import zmq

from lorad.protocol import AdapterLoaded, AdapterRefused, LoadAdapter, UnloadAdapter, encode
from lorad.workers.adapter_slots import AdapterSlots
from lorad.workers.adapter_store import AdapterStore
from lorad.workers.agreement import StepAgreement

log = logging.getLogger("lorad.worker")


class AdapterJobs:
    def __init__(self, store: AdapterStore, slots: AdapterSlots, rank: int,
                 push: zmq.Socket) -> None:
        self.store = store
        self.slots = slots
        self.rank = rank
        self.push = push
        self._pinned_loads: set[int] = set()  # LoadAdapter ids to pin once registered
        self._refusals_sent: set[int] = set()  # jobs whose failure this rank reported
        self._text: tuple[tuple[int, int], bytes] = ((-1, -1), b"")  # registry_text's, by versions

    def apply(self, msg: LoadAdapter | UnloadAdapter) -> None:
        """At the agreed watermark, on every rank."""
        if isinstance(msg, LoadAdapter):
            self.store.submit_register(msg)  # registered once every rank's outcome is agreed
            if msg.pinned:
                self._pinned_loads.add(msg.adapter_id)
            return
        log.info("adapter id %d unloaded", msg.adapter_id)
        self.store.forget(msg.adapter_id)
        self.slots.forget(msg.adapter_id)

    def report(self) -> tuple[int, int]:
        """This rank's (settled, failed) for the step agreement; a failure's reason goes to the
        coordinator once, from this rank (only it knows why)."""
        settled, failed = self.store.report()
        if failed and failed not in self._refusals_sent:
            self._refusals_sent.add(failed)
            adapter_id, why = self.store.local_failure(failed)
            log.error("adapter id %d: %s", adapter_id, why)
            self.push.send(encode(AdapterRefused(self.rank, adapter_id, why)))
        return settled, failed

    def settle(self, agreed: StepAgreement, planner) -> list[tuple[list[str], str]]:
        """Apply the newly agreed outcomes -> (request ids, why) of the sequences that ended
        because their adapter's copy failed (the leader publishes them as failed)."""
        ended = []
        for done in self.store.settle(agreed.adapter_settled, agreed.adapter_failed):
            if done.kind == "fetch":  # its time: adapter_store._copy's debug line
                failed = planner.adapter_fetched(done.adapter_id, done.slot, done.ok)
                if failed:
                    ended.append((failed, f"adapter id {done.adapter_id} could not be read back "
                                          f"into a device slot on rank(s) "
                                          f"{list(agreed.adapter_failed_ranks)} (its files "
                                          "changed since it was loaded?)"))
                continue
            pinned = done.adapter_id in self._pinned_loads
            self._pinned_loads.discard(done.adapter_id)
            if done.ok:
                log.info("adapter id %d registered (read and keyed in %.0f ms, queued %.0f ms)",
                         done.adapter_id, done.ran_ms, done.queued_ms)
                if pinned:
                    self.slots.pin(done.adapter_id)
            if self.rank == 0:  # the leader answers the LoadAdapter
                failed_ranks = [] if done.ok else list(agreed.adapter_failed_ranks)
                self.push.send(encode(AdapterLoaded(done.adapter_id, failed_ranks)))
        return ended

    def registry_text(self) -> bytes:
        """The registry and the slot map as this rank holds them, for the live-set digest: built
        again only when either changed (for a thousand adapters it takes 0.4 ms)."""
        versions = (self.store.version, self.slots.version)
        if self._text[0] != versions:
            ids = ",".join(f"{i}:{spec.key[:16]}" for i, spec in sorted(self.store.specs.items()))
            self._text = (versions, f"{ids}|{self.slots.digest_text()};".encode())
        return self._text[1]

    def counts(self) -> tuple[int, ...]:
        """RankStatus' adapter counts, in its order."""
        slots = self.slots
        return (len(self.store.specs), slots.num_slots, slots.num_used, slots.num_loads,
                slots.num_evictions, self.store.num_host_hits, self.store.num_disk_reads)

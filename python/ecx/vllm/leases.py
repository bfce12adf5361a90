"""The scheduler's leases: which leased ecx.Items it holds, for what, and
ending them (one ecx.Client.release per step, one round trip per
producer). A lease that is never released ends at its expiry."""
import logging
import time

import ecx

logger = logging.getLogger("ecx.vllm")


class Leases:
    """The leases of one scheduler.

    Today's flow keeps each item's lease on its item state (.leased) until
    every rank holds the item. The synchronous flow keeps the step's
    leased hits (id -> an ecx.Item per rank), and the leases handed to
    workers by request (request -> [time handed, Items]), released if the
    request is freed first."""

    def __init__(self, client, stats, lease_ms):
        self._client = client
        self._stats = stats
        self._lease_ms = lease_ms
        self._ending: list = []  # leased ecx.Items to release
        self.hits: dict = {}
        self.handed: dict = {}

    def end(self, items) -> None:
        """Queues leased Items for the next flush."""
        self._ending.extend(items)

    def end_item(self, it) -> None:
        """Queues the lease of an item state (today's flow), once."""
        if it is not None and it.leased is not None:
            self._ending.append(it.leased)
            it.leased = None

    def flush(self) -> None:
        """Ends the leases no longer needed: one call per step, one round
        trip per producer."""
        items, self._ending = self._ending, []
        if not items or self._client is None:
            return
        self._stats.add("leases_released", len(items))
        try:
            self._client.release(items)
        except ecx.EcxError as e:
            # They end at their expiry instead.
            logger.warning("ECXConnector: releasing %d leases failed: %s",
                           len(items), e)

    def hand_to_request(self, rid, mm_hash) -> None:
        """The synchronous flow: the hit mm_hash's leases go to request
        rid's load (its workers' pulls end them)."""
        leased = self.hits.pop(mm_hash, None)
        if leased is not None:
            self.handed.setdefault(rid, [time.monotonic(), []])[1].extend(
                leased)

    def free_request(self, rid) -> None:
        """Releases the leases of request rid's loads (a no-op at the
        producer for those its pulls ended already)."""
        held = self.handed.pop(rid, None)
        if held is not None:
            self._ending.extend(held[1])

    def end_step(self) -> None:
        """The synchronous flow, each step: the leases of hits no request
        took end now; leases handed to workers end at their pulls, or
        expire: those older than lease_ms are forgotten (an older vLLM
        frees no request through the connector)."""
        for found in self.hits.values():
            self._ending.extend(found)
        self.hits.clear()
        old = time.monotonic() - self._lease_ms / 1000
        while self.handed:
            rid = next(iter(self.handed))
            if self.handed[rid][0] > old:
                break
            del self.handed[rid]

    def close(self, states=()) -> None:
        """Ends every lease held: of the item states given, the hits, the
        ones handed to requests."""
        if self._client is None:
            return
        for it in states:
            self.end_item(it)
        for items in self.hits.values():
            self._ending.extend(items)
        for _, items in self.handed.values():
            self._ending.extend(items)
        self.hits.clear()
        self.handed.clear()
        self.flush()

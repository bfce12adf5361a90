"""PushWorker: one worker rank's side of push mode. It serves a
ControlShard (../push/shard.py) over an ArenaPool in the rank's consumer's
receive arena, from the worker connector's construction to its shutdown,
so upstream's encoder writes straight into the arena over Mooncake's wire.
A pushed item is handed to the engine by the shard's take: the arena bytes
themselves as the encoder-cache tensor (no copy on the CPU; on a GPU the
pull flow's one device copy)."""
import ctypes
import logging

import torch

from ..push import ArenaPool, ControlShard, Refused

logger = logging.getLogger("ecx.vllm")


def arena_view(addr, nbytes, shape, dtype):
    """A tensor over nbytes at addr (no copy), of shape and dtype."""
    buf = (ctypes.c_char * nbytes).from_address(addr)
    t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)
    return t.view(getattr(torch, dtype)).reshape(tuple(shape))


class PushWorker:
    """pcfg: a PushConfig; consumer: the rank's ecx.Consumer (a receive
    arena, the Mooncake wire on); dp_rank, tp, tp_rank: where it sits."""

    def __init__(self, pcfg, consumer, dp_rank, tp, tp_rank):
        pcfg.check_ports(dp_rank, tp)
        self.pool = ArenaPool(consumer, size=pcfg.buffer_size)
        self.shard = ControlShard(
            self.pool, ec_ip=pcfg.ec_ip, ec_port=pcfg.ec_port,
            dp_rank=dp_rank, tp_size=tp, tp_rank=tp_rank, token=pcfg.token,
            ttl=pcfg.ttl_s, control_timeout_s=pcfg.control_timeout_s)
        self._started = False

    def start(self):
        if not self._started:
            self.shard.start()
            self._started = True
            logger.info("ECXConnector: push control shard at %s (events on "
                        "port %s, Mooncake session %s)", self.shard.endpoint,
                        self.shard.event_port, self.pool.session)
        return self

    def take(self, takes, encoder_cache, to_device):
        """Hands each (mm_hash, transfer_id) READY on this rank's shard to
        encoder_cache; returns {mm_hash: why} for those it could not."""
        failed = {}
        for h, tid in takes:
            if h in encoder_cache:
                continue
            try:
                addr, nbytes, shape, dtype = self.shard.take(tid, h)
            except Refused as e:
                failed[h] = str(e)
                logger.error("ECXConnector: pushed item %s (transfer %s) "
                             "is not on this rank: %s", h, tid, e)
                continue
            encoder_cache[h] = to_device(arena_view(addr, nbytes, shape,
                                                    dtype))
        return failed

    def release(self, hashes):
        """The engine freed these: their resident copies are retired
        (kept for a later reserve of the same mm_hash, evictable)."""
        for h in hashes:
            self.shard.release(h)

    def stop(self):
        if self._started:
            self._started = False
            self.shard.stop()

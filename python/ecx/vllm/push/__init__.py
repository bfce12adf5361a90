"""Push mode on upstream vLLM's wire: the consumer's control shard an
encoder reserves in, completes and cancels with, and the ready (and, ecx's,
failure) events it sends the consumer's scheduler; and the encoder's
pusher.

  pool   ReceivePool (what a shard needs of its receive memory and of the
         data plane) and BufferPool (one over memory of this process)
  arena  ArenaPool: one in an ecx Consumer's receive arena, written over
         Mooncake's TCP wire through the C receiver's windows
  wire   envelopes, dtype names, the checks on every request field
  table  ReservationTable: reservations, their states, TTLs, tombstones,
         followers and resident copies
  shard  ControlShard: the REP socket, the server thread, the ops, the
         token, failure events, the hash check at complete
  events the event socket, the queue its events wait in (and the pipe
         that wakes the shard's loop), the ZAP handler of the token
  fetch  Fetches: the loads a shard runs for ecx's ecx_fetch op
  pusher Pusher: the encoder's discovery, reserves, writes, completes
         and abandons
  reqs   the Pusher's REQ clients of the shards (one per thread and
         address, each call bounded), ControlError and ControlTimeout

Nothing here imports vLLM or torch; the connector (../pushflow/) wires it
in. ../../../../docs/vllm.md ("Push mode") says how it is used;
../../../../docs/protocol.md ("Push mode") is the contract.
"""
from .arena import ArenaPool
from .pool import ALIGN, BufferPool, ReceivePool
from .shard import ControlShard, shard_port
from .records import (CANCEL_PENDING, CANCELLED, EXPIRE_PENDING, EXPIRED,
                      READY, WRITING, Reservation)
from .table import TTL_S, Refused, ReservationTable
from .wire import DTYPE_SIZES, TOKEN_FIELD, BadRequest

__all__ = ["ALIGN", "ArenaPool", "BufferPool", "ReceivePool", "ControlShard",
           "shard_port", "Reservation", "ReservationTable", "Refused",
           "BadRequest", "TTL_S", "TOKEN_FIELD", "DTYPE_SIZES", "WRITING",
           "READY", "CANCEL_PENDING", "EXPIRE_PENDING", "CANCELLED",
           "EXPIRED"]

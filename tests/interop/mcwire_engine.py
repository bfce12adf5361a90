"""A stand-in of Mooncake's Python engine (mooncake.engine.TransferEngine)
over this folder's Mooncake TCP wire (mcwire.py, written from Mooncake's
source, not from ecx's code), for run_upstream_push.py --engine mcwire
where Mooncake's module is not built. It is not Mooncake's engine: one
Python connection per write, no pool, no RDMA."""
import ctypes

import mcwire
from ref_producer import Writer


class TransferEngine:
    """The calls upstream makes of mooncake.engine.TransferEngine, TCP:
    initialize starts a handshake server (its port is get_rpc_port) and a
    data-port receiver that takes a write only inside a registered buffer;
    batch_transfer_sync_write writes each entry with ref_producer.Writer
    (the P2P handshake once per session, one acknowledged v2 WRITE each);
    0 on success, -1 on any failure."""

    def initialize(self, host, metadata, protocol, device):
        self.host, self.bufs = host, []
        self.data = mcwire.DataServer(host, self._resolve)
        self.hs = mcwire.HandshakeServer(host, self._describe)
        self.writer = Writer(self._describe, 10.0)
        return 0

    def get_rpc_port(self):
        return self.hs.port

    def _describe(self):
        return mcwire.encode_segment(mcwire.session_name(
            self.host, self.hs.port), self.data.port, list(self.bufs))

    def _resolve(self, addr, size):
        for a, n in list(self.bufs):
            if a <= addr and addr + size <= a + n:
                return memoryview((ctypes.c_char * size).from_address(
                    addr)).cast("B")
        return None

    def batch_register_memory(self, addrs, lengths):
        self.bufs.extend(zip(addrs, lengths))
        return 0

    def batch_unregister_memory(self, addrs):
        self.bufs = [(a, n) for a, n in self.bufs if a not in addrs]
        return 0

    def unregister_memory(self, addr):
        return self.batch_unregister_memory([addr])

    def batch_transfer_sync_write(self, session, srcs, dsts, lengths):
        for s, d, n in zip(srcs, dsts, lengths):
            if self.writer.write(session, ctypes.string_at(s, n), d)[0]:
                return -1
        return 0

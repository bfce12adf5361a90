"""A stand-in of upstream vLLM's Mooncake EC connector on the consumer
side, push mode, written from ../../../shared/reference/vllm/PUSH.md
(sections 1-4) alone, not from ecx's code: it imports nothing of ecx.

One Shard per TP rank: a REP socket at ec_port + dp*tp + rank (one JSON
frame each way, the ok/result/error envelope), a PUSH socket for ready
events on an ephemeral port, and a receive slab registered behind
mcwire's HandshakeServer/DataServer, so bytes arrive on Mooncake's TCP
wire as upstream's engine takes them (a write anywhere inside the slab is
accepted, as Mooncake's validation does; refuse_writes makes the data
port refuse every write, for tests).

The reservation rules kept (PUSH.md section 4, as far as the tests need):
dtype and shape checked against nbytes; idempotent reserve (write:false on
a repeat; a conflicting mm_hash/shape/dtype refused); a resident or
in-flight copy of an mm_hash reused (cached / follower); first-fit in
256-byte units, "EC consumer buffer pool is full" without waiting;
complete (writer -> READY, followers too, events); cancel (tombstone for
an unknown id, CANCEL_PENDING without abandon while writing, abandon frees,
refresh with abandon -> EXPIRED and re-reservable). No TTL reaper.
"""
import ctypes
import json
import math
import threading
import uuid

import zmq

import mcwire

ITEMSIZE = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4,
            "float": 4, "float64": 8, "int8": 1, "uint8": 1, "int32": 4,
            "int64": 8}
ALIGN = 256


class Shard:
    def __init__(self, ec_port, tp_size=1, tp_rank=0, slab=8 << 20,
                 host="127.0.0.1"):
        self.host, self.tp_size, self.base_port = host, tp_size, ec_port
        self.port = ec_port + tp_rank
        self.slab = (ctypes.c_char * slab)()
        self.addr = ctypes.addressof(self.slab)
        self.size = slab
        self.view = memoryview(self.slab).cast("B")
        self.refuse_writes = False
        self.records = {}   # transfer_id -> record dict
        self.allocs = {}    # offset -> length
        self.requests = []  # every request received
        self.lock = threading.Lock()
        self.data = mcwire.DataServer(host, self._resolve)
        self.hs = mcwire.HandshakeServer(host, self._describe)
        self.session = f"{host}:{self.hs.port}"
        self.ctx = zmq.Context()
        self.rep = self.ctx.socket(zmq.REP)
        self.rep.linger = 0
        self.rep.bind(f"tcp://{host}:{self.port}")
        self.pub = self.ctx.socket(zmq.PUSH)
        self.pub.linger = 0
        self.event_port = self.pub.bind_to_random_port(f"tcp://{host}")
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    # ---- Mooncake side ----

    def _describe(self):
        return mcwire.encode_segment(self.session, self.data.port,
                                     [(self.addr, self.size)])

    def _resolve(self, addr, size):
        if self.refuse_writes:
            return None
        off = addr - self.addr
        if off < 0 or off + size > self.size:
            return None
        return self.view[off:off + size]

    def read(self, ptr, n):
        return bytes(self.view[ptr - self.addr:ptr - self.addr + n])

    # ---- the pool ----

    def _alloc(self, n):
        n = -(-n // ALIGN) * ALIGN
        at = 0
        for off in sorted(self.allocs):
            if off - at >= n:
                break
            at = off + self.allocs[off]
        if at + n > self.size:
            return None
        self.allocs[at] = n
        return at

    def _free(self, rec):
        if rec.get("owner"):
            self.allocs.pop(rec["off"], None)
            rec["owner"] = False

    # ---- ops ----

    def _cancelled(self, nbytes):
        return {"reservation_id": "", "dst_session": "", "dst_ptr": 0,
                "nbytes": nbytes, "write": False, "ready": False,
                "cancelled": True}

    def _result(self, rec, write):
        return {"reservation_id": rec["rid"], "dst_session": self.session,
                "dst_ptr": self.addr + rec["off"], "nbytes": rec["nbytes"],
                "write": write, "ready": rec["state"] == "READY",
                "cached": rec.get("cached", False)}

    def _event(self, tid, rec):
        ev = {"transfer_id": tid, "mm_hash": rec["mm_hash"], "ready": True,
              "reservation_id": rec["rid"], "nbytes": rec["nbytes"],
              "shape": rec["shape"], "dtype": rec["dtype"],
              "shard": self.port}
        try:
            self.pub.send(json.dumps(ev).encode(), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def reserve(self, r):
        tid, mm, n = r["transfer_id"], r["mm_hash"], r["nbytes"]
        shape, dtype = list(r["shape"]), r["dtype"]
        if dtype not in ITEMSIZE or math.prod(shape) * ITEMSIZE[dtype] != n:
            raise ValueError("shape and dtype do not match nbytes")
        rec = self.records.get(tid)
        if rec is not None:
            if rec["state"] == "CANCELLED":
                return self._cancelled(n)
            if rec["state"] == "EXPIRED":
                del self.records[tid]
            else:
                if (rec["mm_hash"], rec["shape"], rec["dtype"]) != (
                        mm, shape, dtype):
                    raise ValueError("conflicting reservation for "
                                     "transfer_id")
                if rec["state"] == "CANCEL_PENDING":
                    return self._cancelled(n)
                return self._result(rec, False)
        for other in self.records.values():
            if other["mm_hash"] == mm and other.get("owner"):
                if (other["shape"], other["dtype"]) != (shape, dtype):
                    raise ValueError("conflicting in-flight tensor for "
                                     "mm_hash")
                ready = other["state"] == "READY"
                rec = dict(other, rid=uuid.uuid4().hex, owner=False,
                           cached=ready, follower=not ready,
                           leader=None if ready else other)
                self.records[tid] = rec
                if ready:
                    self._event(tid, rec)
                return self._result(rec, False)
        off = self._alloc(n)
        if off is None:
            raise RuntimeError("EC consumer buffer pool is full")
        rec = {"rid": uuid.uuid4().hex, "mm_hash": mm, "nbytes": n,
               "shape": shape, "dtype": dtype, "off": off, "owner": True,
               "state": "WRITING"}
        self.records[tid] = rec
        return self._result(rec, True)

    def complete(self, r):
        rec = self.records.get(r["transfer_id"])
        if rec is None or rec["rid"] != r["reservation_id"]:
            return {"completed": False, "became_ready": False}
        if rec["state"] == "READY":
            return {"completed": True, "became_ready": False}
        if not rec.get("owner"):
            return {"completed": False, "became_ready": False}
        for tid, f in self.records.items():
            if f.get("leader") is rec and f["state"] == "WRITING":
                f["state"] = "READY"
                self._event(tid, f)
        if rec["state"] in ("CANCEL_PENDING", "EXPIRE_PENDING"):
            rec["state"] = ("CANCELLED" if rec["state"] == "CANCEL_PENDING"
                            else "EXPIRED")
            self._free(rec)
            return {"completed": True, "became_ready": False}
        rec["state"] = "READY"
        self._event(r["transfer_id"], rec)
        return {"completed": True, "became_ready": True}

    def cancel(self, r):
        tid, rid = r["transfer_id"], r.get("reservation_id", "")
        abandon, refresh = r.get("abandon", False), r.get("refresh", False)
        rec = self.records.get(tid)
        if rec is not None and rid and rec["rid"] != rid:
            return {"cancelled": False}
        if rec is None:
            self.records[tid] = {"rid": "", "mm_hash": "", "state":
                                 "CANCELLED", "shape": [], "dtype": "",
                                 "nbytes": 0}
            return {"cancelled": True}
        st = rec["state"]
        if st == "CANCELLED":
            return {"cancelled": True}
        if refresh:
            if not abandon or st not in ("WRITING", "EXPIRE_PENDING"):
                return {"cancelled": False}
            rec["state"] = "EXPIRED"
            self._free(rec)
            return {"cancelled": True}
        if rec.get("follower") and st == "WRITING":
            rec["state"] = "CANCELLED"
            return {"cancelled": True}
        if st in ("CANCEL_PENDING", "EXPIRE_PENDING") and not abandon:
            return {"cancelled": True}
        if st == "WRITING" and not abandon:
            rec["state"] = "CANCEL_PENDING"
            return {"cancelled": True}
        if st == "EXPIRED":
            return {"cancelled": False}
        rec["state"] = "CANCELLED"
        self._free(rec)
        return {"cancelled": True}

    def _serve(self, req):
        op = req["op"]
        if op == "peers":
            return {"ports": [self.base_port + k
                              for k in range(self.tp_size)]}
        if op == "event_port":
            return self.event_port
        if op == "reserve":
            return self.reserve(req)
        if op == "reserve_batch":
            out = []
            for it in req["items"]:
                try:
                    out.append({"ok": True, "result": self.reserve(it)})
                except (KeyError, ValueError, RuntimeError) as e:
                    out.append({"ok": False, "error": str(e)})
            return {"items": out}
        if op == "complete":
            return self.complete(req)
        if op == "complete_batch":
            return {"items": [self.complete(it) for it in req["items"]]}
        if op == "cancel":
            return self.cancel(req)
        raise ValueError(f"unknown control op {op!r}")

    def _loop(self):
        while not self.stopped:
            try:
                if not self.rep.poll(100):
                    continue
                raw = self.rep.recv()
            except zmq.ZMQError:
                return
            try:
                req = json.loads(raw)
                if not isinstance(req, dict):
                    raise ValueError
            except ValueError:
                reply = {"ok": False, "error": "malformed control request"}
            else:
                with self.lock:
                    self.requests.append(req)
                    try:
                        reply = {"ok": True, "result": self._serve(req)}
                    except (KeyError, ValueError, RuntimeError,
                            TypeError) as e:
                        reply = {"ok": False, "error": str(e)}
            try:
                self.rep.send(json.dumps(reply).encode())
            except zmq.ZMQError:
                return

    def stop(self):
        """Stops everything at once (as a killed process would)."""
        self.stopped = True
        self.thread.join()
        self.rep.close(0)
        self.pub.close(0)
        self.ctx.term()
        self.hs.close()
        self.data.close()

"""A stand-in of upstream vLLM's disaggregated-encoder proxy, E+PD mode,
written from ../../../shared/reference/vllm/PUSH.md section 6 alone, not
from ecx's code: it imports nothing of ecx and speaks no HTTP (the tests
hand its bodies to connectors directly).

What it does, as upstream's proxy does per request:
- a fresh transfer_id (uuid4 hex) per multimodal item and attempt;
- picks a consumer: a random decode server i and a round-robin data-parallel
  rank r, the address ec_consumer_zmq_addrs[i*dp_size + r];
- the encoder's body carries "ec_transfer_params": {"consumer_zmq": addr,
  "ec_items": [{"transfer_id": ...}, ...]} in the order of its items (no
  mm_hash);
- from the encoder's response, its top-level ec_transfer_params (what the
  encoder's request_finished returned: {mm_hash: {"metadata",
  "transfer_id"}}), matched to items by uuid, else a single entry;
- the consumer's ec_transfer_params: the original's without consumer_zmq,
  "ec_items": [{"mm_hash": <the encoder's key>, "transfer_id": ...}] in
  item order, and each encoder entry merged in under its mm_hash key; each
  rewritten item is {"type": "<modality>_embeds", "<modality>_embeds":
  metadata, "uuid": uuid}; an item with no entry stays raw media.
"""
import random
import uuid


class Proxy:
    def __init__(self, ec_consumer_zmq_addrs, dp_size=1, seed=None):
        self.addrs = list(ec_consumer_zmq_addrs)
        self.dp_size = int(dp_size)
        if len(self.addrs) % self.dp_size:
            raise ValueError("ec_consumer_zmq_addrs must hold servers x "
                             "dp_size entries")
        self.servers = len(self.addrs) // self.dp_size
        self._rr = 0
        self._rand = random.Random(seed)

    def pick(self):
        """(decode server index, data-parallel rank, consumer address)."""
        i = self._rand.randrange(self.servers)
        r = self._rr % self.dp_size
        self._rr += 1
        return i, r, self.addrs[i * self.dp_size + r]

    def encoder_body(self, items):
        """items: [{"uuid": ..., "modality": ...}] of one encoder request.
        Returns (ec_transfer_params for the encoder, the chosen server and
        rank)."""
        i, r, addr = self.pick()
        params = {"consumer_zmq": addr,
                  "ec_items": [{"transfer_id": uuid.uuid4().hex}
                               for _ in items]}
        return params, (i, r)

    def consumer_body(self, items, enc_params, enc_response):
        """The consumer's (rewritten items, ec_transfer_params) from the
        encoder's: enc_response is its top-level ec_transfer_params."""
        resp = dict(enc_response or {})
        out_items, ec_items = [], []
        merged = {k: v for k, v in enc_params.items()
                  if k not in ("consumer_zmq", "ec_items")}
        for item in items:
            key = item["uuid"] if item["uuid"] in resp else (
                next(iter(resp)) if len(resp) == 1 else None)
            entry = resp.get(key) if key is not None else None
            if entry is None:
                out_items.append(dict(item))  # raw media
                continue
            kind = f"{item['modality']}_embeds"
            out_items.append({"type": kind, kind: entry.get("metadata"),
                              "uuid": item["uuid"]})
            ec_items.append({"mm_hash": key,
                             "transfer_id": entry.get("transfer_id")})
            merged[key] = entry
        merged["ec_items"] = ec_items
        return out_items, merged

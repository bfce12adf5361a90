"""EncoderScheduler: push mode on an encoder's scheduler (ec_producer or
ec_both), as upstream's encoder plans it (PUSH.md sections 5 and 6).

A request whose ec_transfer_params carry consumer_zmq (upstream's proxy
adds it, with ec_items [{transfer_id}] in item order) has each item
still to compute planned as a push when it is first seen
(ensure_cache_available, update_state_after_alloc): its transfer_id
(ec_items matched by position, else by mm_hash, else
"<request_id>:<index>"), and, where the model config says the encoder's
width and dtype, its shape [tokens, width], so that the workers reserve
before the encoder runs. The step's metadata carries the plans
(pushes); the workers push once the output is bound. request_finished
returns the map upstream's proxy expects, {mm_hash: {"metadata": ...,
"transfer_id": ...}}; has_pending_push_work is true while plans are unsent
or the workers say pushes are in flight (the newest report by the
metadata it counts, plus what was planned after it); a push refused at
the worker (a transfer_id already pushed with another payload) makes its
request unavailable, as upstream's failed saves.

Every other request, and every other hook, is the inner scheduler's (the
pull flow's on an encoder: saves published to the registry as before).
"""
import logging

from ..metadata import ECXPushSpec, ECXWorkerMetadata
from ..push.wire import DTYPE_SIZES
from .scheduler import transfer_id_of

logger = logging.getLogger("ecx.vllm")

try:  # today's vLLM: the placeholder metadata the proxy hands on
    from vllm.distributed.ec_transfer.ec_connector.utils import (
        PlaceholderMetadataResolver, collect_ec_item_metadata)
except ImportError:
    PlaceholderMetadataResolver = collect_ec_item_metadata = None


def encoder_output(vllm_config):
    """(width, dtype name) of the encoder's outputs from the model config,
    as upstream reckons them (a vision config's out_hidden_size times one
    plus its deepstack layers, else the inputs-embeds size; the model's
    dtype), or (None, None) where the config does not say."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None:
        return None, None
    try:
        vc = getattr(getattr(mc, "hf_config", None), "vision_config", None)
        out = getattr(vc, "out_hidden_size", None) if vc else None
        deep = getattr(vc, "deepstack_visual_indexes", None) if vc else None
        width = out * (1 + len(deep)) if out is not None and deep else \
            mc.get_inputs_embeds_size()
        dtype = str(mc.dtype).split(".")[-1]
    except Exception as e:  # noqa: BLE001 - the workers use the output's
        logger.info("ECXConnector: the encoder's output width is not known "
                    "from the model config (%s): pushes reserve when the "
                    "output is bound", e)
        return None, None
    if not isinstance(width, int) or width < 1 or dtype not in DTYPE_SIZES:
        return None, None
    return width, dtype


def _consumer(request):
    params = getattr(request, "ec_transfer_params", None) or {}
    c = params.get("consumer_zmq") if isinstance(params, dict) else None
    return c if isinstance(c, str) and c else None


# Steps a report may lag behind the metadata it answers (vLLM's
# asynchronous scheduling builds the next step's first) before reports
# are taken as never coming.
REPORT_LAG_STEPS = 3


class EncoderScheduler:
    """inner: the scheduler every other request and hook goes to."""

    def __init__(self, inner, vllm_config, stats):
        self._inner = inner
        self._stats = stats
        self._width, self._dtype = encoder_output(vllm_config)
        self._resolver = None
        if PlaceholderMetadataResolver is not None:
            try:
                self._resolver = PlaceholderMetadataResolver(
                    vllm_config.model_config)
            except Exception:  # noqa: BLE001 - no metadata then
                self._resolver = None
        self._plans = {}        # transfer_id -> ECXPushSpec, this step
        self._prepared = set()  # transfer_ids planned, until finished
        # Pushes in flight: the workers' newest word (the push_seq of the
        # metadata it counts, its count) and the pushes of the metadata
        # built since (push_seq -> how many). A report can come after
        # newer metadata was built (vLLM's asynchronous scheduling) or
        # after a newer report: neither may undo what is newer.
        self._seq = 0
        self._word = (-1, 0)
        self._since = {}
        self._failed = set()    # request ids whose push was refused
        # Steps built since the workers' last report. vLLM 0.32's V1 model
        # runner drops a producer's EC connector output (the encoder step
        # returns make_empty_encoder_model_runner_output(), which carries
        # none), so no report ever comes: pushes then count as pending
        # only in the step that sends them (they run on the push threads,
        # no step drives them), or the engine would step at full speed
        # for ever after the first push.
        self._unreported = 0
        self._deaf_warned = False

    def __getattr__(self, name):
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    # ---- planning ----

    def _plan(self, request, index):
        consumer = _consumer(request)
        if consumer is None:
            return
        params = request.ec_transfer_params
        h = request.mm_features[index].identifier
        tid = transfer_id_of(params, index, h) or \
            f"{request.request_id}:{index}"
        if tid in self._prepared:
            return
        shape = None
        if self._width is not None:
            try:
                shape = (int(request.get_num_encoder_embeds(index)),
                         self._width)
            except Exception:  # noqa: BLE001 - reserved when bound, then
                shape = None
        self._plans[tid] = ECXPushSpec(
            mm_hash=h, transfer_id=tid, consumer_zmq=consumer,
            request_id=request.request_id, shape=shape,
            dtype=self._dtype if shape is not None else None)
        self._prepared.add(tid)
        self._stats.add("pushes_planned")

    def ensure_cache_available(self, request, num_computed_tokens):
        if _consumer(request) is None:
            return self._inner.ensure_cache_available(request,
                                                      num_computed_tokens)
        # The encoder's own job: encoded here, then pushed.
        for i, f in enumerate(getattr(request, "mm_features", None) or ()):
            pos = getattr(f, "mm_position", None)
            if pos is None or pos.offset + pos.length > num_computed_tokens:
                self._plan(request, i)
        return True

    def has_cache_item(self, identifier):
        return self._inner.has_cache_item(identifier)

    def update_state_after_alloc(self, request, index):
        if _consumer(request) is None:
            self._inner.update_state_after_alloc(request, index)
        else:
            self._plan(request, index)

    def update_state_after_free(self, request, index):
        if _consumer(request) is None:
            self._inner.update_state_after_free(request, index)

    def build_connector_meta(self, scheduler_output):
        meta = self._inner.build_connector_meta(scheduler_output)
        meta.pushes = list(self._plans.values())
        self._plans = {}
        self._seq += 1
        self._unreported += 1
        meta.push_seq = self._seq
        # Pending until a report that counts this metadata says otherwise.
        if meta.pushes:
            self._since[self._seq] = len(meta.pushes)
        return meta

    def _take_word(self, seq, pending):
        if seq < 0:
            # No rank pushes: nothing planned can be in flight (or will
            # ever be pushed), as before.
            self._word, self._since = (-1, 0), {}
        elif seq >= self._word[0]:
            self._word = (seq, pending)
            self._since = {s: n for s, n in self._since.items() if s > seq}
        # else an older report than one taken already: ignored

    @property
    def _pending(self):
        if self._unreported > REPORT_LAG_STEPS:
            if self._since and not self._deaf_warned:
                self._deaf_warned = True
                logger.warning(
                    "ECXConnector: this vLLM returns no reports from the "
                    "encoder's workers (%d steps without one): pushes are "
                    "not waited for in steps, and a failed push is seen in "
                    "the encoder's log only", self._unreported)
            self._since.clear()
            return 0
        return self._word[1] + sum(self._since.values())

    def update_connector_output(self, connector_output):
        wm = getattr(connector_output, "ec_connector_worker_meta", None)
        if isinstance(wm, ECXWorkerMetadata):
            self._unreported = 0
            self._take_word(int(getattr(wm, "pushes_seq", -1)),
                            int(getattr(wm, "pushes_pending", 0) or 0))
            self._failed |= set(getattr(wm, "saves_failed", None) or ())
        self._inner.update_connector_output(connector_output)

    def take_unavailable_requests(self):
        out, self._failed = self._failed, set()
        return out | self._inner.take_unavailable_requests()

    def has_pending_push_work(self):
        f = getattr(self._inner, "has_pending_push_work", None)
        return bool(self._plans) or self._pending > 0 or \
            (f is not None and bool(f()))

    # ---- the proxy's map ----

    def _metadata(self, features):
        """{mm_hash: placeholder metadata} of features (vLLM's own
        collector where it has one; else none, so the proxy leaves the
        media in the consumer's request)."""
        out = {f.identifier: {} for f in features}
        if collect_ec_item_metadata is None or self._resolver is None:
            return out
        try:
            got = collect_ec_item_metadata(features, self._resolver)
        except Exception as e:  # noqa: BLE001 - metadata is optional
            logger.warning("ECXConnector: no placeholder metadata: %s", e)
            return out
        if isinstance(got, dict):
            for h, e in got.items():
                out[h] = dict(e).get("metadata") or {}
        else:  # an older collector: a list in feature order
            for f, e in zip(features, got):
                out[f.identifier] = dict(e).get("metadata") or {}
        return out

    def request_finished(self, request):
        if _consumer(request) is None:
            return self._inner.request_finished(request)
        params = request.ec_transfer_params
        features = list(getattr(request, "mm_features", None) or ())
        meta = self._metadata(features)
        items = {}
        for i, f in enumerate(features):
            tid = transfer_id_of(params, i, f.identifier)
            self._prepared.discard(tid or f"{request.request_id}:{i}")
            entry = {"metadata": meta.get(f.identifier) or {}}
            if tid is not None:
                entry["transfer_id"] = tid
            items[f.identifier] = entry
        self._failed.discard(request.request_id)
        return False, (items or None)

    def shutdown(self):
        self._inner.shutdown()


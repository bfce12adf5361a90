"""Push mode in the connector (upstream vLLM's Mooncake EC wire; the
control shard itself is ../push/), the consumer's side:

  config     upstream's keys (ec_ip, ec_port, ec_buffer_size,
             ec_buffer_device; control_timeout_s, push_wait_timeout_s),
             their defaults and checks
  worker     PushWorker: a rank's ControlShard over an ArenaPool of its
             consumer; hands pushed items to the engine (take)
  scheduler  PushScheduler: ready events from every shard, the records
             and their deadlines, unavailable requests, cancels
  control    the scheduler's control client (discovery, cancels)

and the encoder's side:

  encoder    EncoderScheduler: plans a push per item of a request whose
             ec_transfer_params name consumer_zmq; request_finished's map
             for upstream's proxy; has_pending_push_work
  pushes     EncoderPushes: the worker's reserves, pushes when the output
             is bound, abandons (../push/pusher.py does the wire)
"""
from .config import PushConfig
from .encoder import EncoderScheduler
from .scheduler import PushScheduler
from .worker import PushWorker

__all__ = ["PushConfig", "PushScheduler", "PushWorker", "EncoderScheduler"]

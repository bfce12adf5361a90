"""Push mode in the connector, the consumer's side (upstream vLLM's
Mooncake EC wire; the control shard itself is ../push/):

  config     upstream's keys (ec_ip, ec_port, ec_buffer_size,
             ec_buffer_device; control_timeout_s, push_wait_timeout_s),
             their defaults and checks
  worker     PushWorker: a rank's ControlShard over an ArenaPool of its
             consumer; hands pushed items to the engine (take)
  scheduler  PushScheduler: ready events from every shard, the records
             and their deadlines, unavailable requests, cancels
  control    the scheduler's control client (discovery, cancels)
"""
from .config import PushConfig
from .scheduler import PushScheduler
from .worker import PushWorker

__all__ = ["PushConfig", "PushScheduler", "PushWorker"]

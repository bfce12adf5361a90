"""The stand-in for an older vLLM: its EC connector base class has only the
five abstract methods and the worker-side helpers, none of today's hooks
(ensure_cache_available, take_unavailable_requests, worker metadata).
Tests put it on sys.path, in a process of its own, to check that the
connector keeps working there. Names and signatures from
../../../../shared/VLLM.md."""

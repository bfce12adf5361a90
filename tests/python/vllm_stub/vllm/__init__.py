"""A minimal, faithful stand-in for the parts of vLLM an EC connector
touches (names and signatures from ../../../../shared/VLLM.md). It lives in
the test tree only: ecx's connector imports the real vLLM where it is
installed, and this package only when tests put it on sys.path."""

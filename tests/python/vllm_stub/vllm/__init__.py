"""A minimal, faithful stand-in for the parts of today's vLLM an EC
connector touches (names and signatures from ../../../../shared/VLLM.md and
upstream's base class at the commit named in
../../../../shared/reference/vllm/README.md). It lives in the test tree
only: ecx's connector imports the real vLLM where it is installed, and this
package only when tests put it on sys.path. ../vllm_stub_old stands in for
an older vLLM, whose base class lacks today's hooks."""

#!/bin/sh
# tests/gpu/check.sh - CUDA tensors through ecx (tests/gpu/check.py):
# round trips of every dtype and GB/s beside torch's pinned copies. Exits
# 77 where there is no CUDA device; ctest reports that as a skip.
# ECX_LIBRARY and PYTHONPATH come from ctest (or set them by hand).
set -eu
here=$(dirname "$0")
exec /usr/bin/python3 "$here/check.py"

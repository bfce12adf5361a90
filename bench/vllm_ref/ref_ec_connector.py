"""The reference connector (../shared/reference/ec_mooncake_connector.py.txt,
upstream vLLM's registry-pull ECMooncakeConnector as documented), loaded
into a real vLLM for bench/vllm_epd.py, with four shims and no change to
its code:

1. its imports, supplied from the installed vLLM (the page is rendered
   documentation and carries none);
2. `envs.VLLM_MOONCAKE_SYNC_AFTER_TRANSFER`, which vLLM 0.32 does not
   define, read with a default (false);
3. the host its registry binds, 0.0.0.0 on the page, taken from
   ECX_REF_BIND_HOST (default 127.0.0.1: no benchmark listens beyond
   the machine);
4. the page's title line dropped.

The page's path is ECX_REFERENCE_PAGE (bench/vllm_epd.py sets it).
vLLM loads this module by name: ec_connector
"ReferenceECMooncakeConnector" (vLLM takes the page's own class name for
its built-in push connector), ec_connector_module_path
"ref_ec_connector", with this folder on PYTHONPATH.
"""
import __future__
import json
import logging
import os
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch
import uvicorn
import zmq
from fastapi import FastAPI, HTTPException
from mooncake.engine import TransferEngine
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase, ECConnectorMetadata, ECConnectorRole)
from vllm.utils.network_utils import get_ip

_PAGE = os.environ.get("ECX_REFERENCE_PAGE") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared",
    "reference", "ec_mooncake_connector.py.txt")
_HOST = os.environ.get("ECX_REF_BIND_HOST", "127.0.0.1")


def _load():
    with open(_PAGE) as f:
        text = f.read()
    body = text[text.index("\nclass ") + 1:]  # shim 4
    ns = sys.modules[__name__].__dict__
    ns.update(
        json=json, threading=threading, time=time, dataclass=dataclass,
        field=field, Any=Any, httpx=httpx, torch=torch, uvicorn=uvicorn,
        zmq=zmq, FastAPI=FastAPI, HTTPException=HTTPException,
        TransferEngine=TransferEngine, _MOONCAKE_IMPORT_ERROR=None,
        ECConnectorBase=ECConnectorBase,
        ECConnectorMetadata=ECConnectorMetadata,
        ECConnectorRole=ECConnectorRole, VllmConfig=Any, SchedulerOutput=Any,
        logger=logging.getLogger("vllm.ec_mooncake_reference"),
        envs=types.SimpleNamespace(VLLM_MOONCAKE_SYNC_AFTER_TRANSFER=bool(
            int(os.environ.get("VLLM_MOONCAKE_SYNC_AFTER_TRANSFER", "0")))),
        get_ip=get_ip, is_local_first_rank=lambda: True)
    # The page's annotations stay unevaluated, as under its module's own
    # "from __future__ import annotations".
    exec(compile(body, _PAGE, "exec",
                 flags=__future__.annotations.compiler_flag), ns)
    page_server = ns["ECMooncakeRegistryServer"]

    class ECMooncakeRegistryServer(page_server):  # shim 3
        def __init__(self, host, port):
            super().__init__(_HOST, port)

    ns["ECMooncakeRegistryServer"] = ECMooncakeRegistryServer


_load()

# vLLM maps the name ECMooncakeConnector to its own (push) connector
# before it reads ec_connector_module_path: this one goes by another.
ReferenceECMooncakeConnector = ECMooncakeConnector  # noqa: F821

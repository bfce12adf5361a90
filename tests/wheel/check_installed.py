"""Run by test_wheel.sh with the fresh venv's interpreter, from a folder
outside the repository, with no PYTHONPATH, ECX_LIBRARY or
LD_LIBRARY_PATH: ecx is the installed wheel's, its libecx.so the one
inside the package, every module imports, a tensor goes through a
Producer and a Consumer byte for byte, and vLLM loads ECXConnector the way
it loads any connector named by module path.

Usage: check_installed.py [--no-vllm] VERSION
  --no-vllm: vLLM is not installed here: ecx.vllm's modules must fail on
  the missing vllm alone, and everything else must work.
"""
import importlib
import os
import sys

args = sys.argv[1:]
no_vllm = "--no-vllm" in args
version = [a for a in args if not a.startswith("--")][0]
where = "without vLLM" if no_vllm else "beside vLLM"
bad = []


def ok(msg):
    print(f"ok - {msg} ({where})")


import ecx  # noqa: E402
import torch  # noqa: E402

pkg = os.path.dirname(ecx.__file__)
if not pkg.startswith(sys.prefix):
    bad.append(f"ecx imported from {pkg}, not from this venv ({sys.prefix})")
if os.path.realpath(ecx.LIBRARY_PATH) != os.path.join(os.path.realpath(pkg),
                                                      "libecx.so"):
    bad.append(f"libecx loaded from {ecx.LIBRARY_PATH}, not the package's")
if ecx.__version__ != version:
    bad.append(f"ecx.__version__ {ecx.__version__}, ecx.h says {version}")
if not bad:
    ok(f"ecx {ecx.__version__} from {pkg}, its own libecx.so")

# Every .py file of the installed package is a module to import (pkgutil
# would stop at a package whose import fails, and take libecx.so for an
# extension module).
mods = []
for d, _, files in os.walk(pkg):
    rel = os.path.relpath(d, os.path.dirname(pkg)).replace(os.sep, ".")
    for f in sorted(files):
        if f == "__init__.py":
            mods.append(rel)
        elif f.endswith(".py"):
            mods.append(f"{rel}.{f[:-3]}")
failed = []
want_vllm = []
for name in mods:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if no_vllm and name.startswith("ecx.vllm") and e.name == "vllm":
            want_vllm.append(name)
            continue
        failed.append(f"{name}: {type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 - each module's failure named
        failed.append(f"{name}: {type(e).__name__}: {e}")
if failed:
    bad.extend("import " + f for f in failed)
else:
    ok(f"{len(mods) - len(want_vllm)} of {len(mods)} modules import"
       + (f", the other {len(want_vllm)} (ecx.vllm's) stop at the missing "
          "vllm alone" if want_vllm else ""))
if len(mods) < 30:
    bad.append(f"only {len(mods)} modules found: {mods}")

t = (torch.arange(64 * 3584, dtype=torch.float32) / 7).to(torch.bfloat16)
t = t.reshape(64, 3584)
with ecx.Producer(capacity_bytes=64 << 20, bind_host="127.0.0.1",
                  registry_port=0) as p:
    p.put("wheel-item", t)
    with ecx.Consumer(f"http://127.0.0.1:{p.registry_port}",
                      recv_capacity=16 << 20) as c:
        got = c.load(c.lookup(["wheel-item"]))[0]
        if got.dtype != t.dtype or got.shape != t.shape or \
                not torch.equal(got, t):
            bad.append(f"round trip: {got.dtype} {tuple(got.shape)} "
                       "differs from what was put")
        else:
            ok("a bfloat16 tensor through a Producer and a Consumer")

if not no_vllm:
    from vllm.config import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.base import \
        ECConnectorBase
    from vllm.distributed.ec_transfer.ec_connector.factory import \
        ECConnectorFactory
    cfg = ECTransferConfig(ec_connector="ECXConnector",
                           ec_connector_module_path="ecx.vllm",
                           ec_role="ec_consumer")
    cls = ECConnectorFactory.get_connector_class(cfg)
    if cls is not ecx.vllm.ECXConnector or \
            not issubclass(cls, ECConnectorBase):
        bad.append(f"vLLM's factory gave {cls!r}")
    else:
        ok("vLLM's ECConnectorFactory loads ecx.vllm.ECXConnector")

for b in bad:
    print("FAIL - " + b)
sys.exit(1 if bad else 0)

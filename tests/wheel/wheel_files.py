"""The wheel's file list: exactly one libecx (ecx/libecx.so), every module
of python/ecx and nothing else of the source folder, the ecx command in
the scripts, no byte code. Prints the list; exits 1 naming what is wrong.

Usage: wheel_files.py WHEEL SOURCE  (SOURCE: the checkout's python/)
"""
import os
import sys
import zipfile

wheel, source = sys.argv[1:]
names = zipfile.ZipFile(wheel).namelist()
for n in sorted(names):
    print("  " + n)
wrong = []
libs = [n for n in names if "libecx" in os.path.basename(n)]
if libs != ["ecx/libecx.so"]:
    wrong.append(f"libecx files {libs}, want exactly ['ecx/libecx.so']")
scripts = [n for n in names if "/scripts/" in n]
if [os.path.basename(n) for n in scripts] != ["ecx"]:
    wrong.append(f"scripts {scripts}, want the ecx command alone")
want = set()
for d, _, files in os.walk(os.path.join(source, "ecx")):
    for f in files:
        if f.endswith(".py"):
            want.add(os.path.relpath(os.path.join(d, f), source))
have = {n for n in names if n.endswith(".py")}
if want - have:
    wrong.append(f"modules missing: {sorted(want - have)}")
if have - want:
    wrong.append(f"modules not in the source: {sorted(have - want)}")
if any(n.endswith(".pyc") or "__pycache__" in n for n in names):
    wrong.append("byte code in the wheel")
for w in wrong:
    print("FAIL - " + w)
if wrong:
    sys.exit(1)
print(f"ok - the wheel holds {len(have)} modules, one libecx.so, the command")

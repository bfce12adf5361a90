"""The binding's copy of ecx.h (ecx._cdefs, ecx.errors, ecx.dtypes) against
the C compiler's reading of include/ecx/ecx.h and the library's tables:
every ctypes struct's size and field offsets, every field_mask flag, the
dtype numbers and sizes, the error codes. A small C program, written here
from the Python declarations, is compiled against include/ and run; a
field moved, added or renamed in ecx.h and not in Python fails this."""
import ctypes
import os
import re
import shutil
import subprocess

import pytest

import ecx
from ecx import _cdefs, dtypes, errors

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.normpath(os.path.join(HERE, "..", "..", "include"))
HEADER = os.path.join(INCLUDE, "ecx", "ecx.h")


def _program():
    """C source printing one "key value" line per fact, and the facts the
    Python side holds, by the same keys."""
    lines, want = [], {}

    def emit(key, expr, value):
        lines.append(f'\tprintf("%s %lld\\n", "{key}", (long long)({expr}));')
        want[key] = value

    for s in _cdefs.STRUCTS:
        name = s.__name__
        emit(f"sizeof.{name}", f"sizeof({name})", ctypes.sizeof(s))
        for field, _ in s._fields_:
            emit(f"offsetof.{name}.{field}", f"offsetof({name}, {field})",
                 getattr(s, field).offset)
            emit(f"sizeof.{name}.{field}",
                 f"sizeof((({name} *)0)->{field})", getattr(s, field).size)
    for prefix, flags in _cdefs.PARAM_FLAGS.items():
        for member in flags:
            emit(prefix + member.name, prefix + member.name, int(member))
    emit("ECX_MAX_DIMS", "ECX_MAX_DIMS", _cdefs.MAX_DIMS)
    emit("ECX_ADDR_MAX", "ECX_ADDR_MAX", _cdefs.ADDR_MAX)
    # The tables, from their X-macros: every entry C has.
    lines.append('#define ERR(n, c, m) printf("err.%s %d\\n", #n, c);')
    lines.append("\tECX_ERR_MAP(ERR)")
    lines.append('#define DT(n, s, z) printf("dtype.%s %d %d\\n", s, '
                 'ECX_DTYPE_##n, z);')
    lines.append("\tECX_DTYPE_MAP(DT)")
    src = ("#include <stddef.h>\n#include <stdio.h>\n#include <ecx/ecx.h>\n"
           "int main(void)\n{\n" + "\n".join(lines) + "\n\treturn 0;\n}\n")
    return src, want


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler (cc) to read ecx.h with")
    src, want = _program()
    d = tmp_path_factory.mktemp("abi")
    (d / "abi.c").write_text(src)
    r = subprocess.run([cc, "-std=c11", "-Wall", "-Werror", "-I", INCLUDE,
                        "-o", str(d / "abi"), str(d / "abi.c")],
                       capture_output=True, text=True)
    assert r.returncode == 0, (
        "the C declarations of ecx._cdefs do not compile against ecx.h "
        "(a field or flag renamed or gone?):\n" + r.stderr)
    out = subprocess.run([str(d / "abi")], capture_output=True, text=True,
                         check=True).stdout
    got, errs, dts = {}, {}, {}
    for line in out.splitlines():
        key, *vals = line.split()
        if key.startswith("err."):
            errs[key[4:]] = int(vals[0])
        elif key.startswith("dtype."):
            dts[key[6:]] = (int(vals[0]), int(vals[1]))
        else:
            got[key] = int(vals[0])
    return want, got, errs, dts


def test_struct_sizes_and_offsets_are_the_compilers(compiled):
    want, got, _, _ = compiled
    keys = [k for k in want if k.startswith(("sizeof.", "offsetof."))]
    assert keys
    wrong = {k: (want[k], got[k]) for k in keys if want[k] != got[k]}
    assert not wrong, f"ctypes (python, C) differ: {wrong}"


def test_param_flags_are_the_headers(compiled):
    want, got, _, _ = compiled
    wrong = {k: (want[k], got[k]) for k in want
             if not k.startswith(("sizeof.", "offsetof.")) and
             want[k] != got[k]}
    assert not wrong, f"flags (python, C) differ: {wrong}"
    # Every field_mask bit ecx.h declares for these structs has a flag.
    with open(HEADER) as f:
        header = f.read()
    for prefix, flags in _cdefs.PARAM_FLAGS.items():
        in_c = set(re.findall(re.escape(prefix) + r"([A-Z0-9_]+)\s*=",
                              header))
        assert in_c == {m.name for m in flags}, prefix


def test_error_codes_are_the_librarys_and_the_headers(compiled):
    _, _, errs, _ = compiled
    assert errors.CODES == errs
    for name in errors.CLASSES:
        assert name in errs
    for name, code in errs.items():
        e = errors.error(code, "x")
        assert e.name == name and e.code == code
    assert ecx.EFORK == errs["EFORK"]
    assert isinstance(errors.error(errs["ENOTFOUND"], "x"), ecx.NotFound)


def test_dtypes_are_the_librarys_and_the_headers(compiled):
    _, _, _, dts = compiled
    assert dtypes.DTYPES == dts
    assert ecx.DTYPES is dtypes.DTYPES

#!/usr/bin/python3
"""file-deps.py - which source file uses which other file's external symbols,
and the cycles among them.

Reads the object files of a build (nm: the symbols each defines and the ones
it leaves undefined), links each undefined symbol to the object that defines
it, and prints the files that form cycles (strongly connected components of
more than one file). Exit status: 0 no cycle, 1 a cycle, 2 usage.

  scripts/file-deps.py build/tools/CMakeFiles/ecx.dir        # tools/
  scripts/file-deps.py build/CMakeFiles/ecx_objects.dir/src  # src/
  scripts/file-deps.py --edges DIR...   # also every edge and its symbols

Each DIR is searched for *.o; objects are named by their path under DIR
(CMake names them after their source: bench/cmd_bench.c.o). An object whose
dependency file (OBJ.d) names a source that is gone is skipped (left behind
by a move). A symbol defined in several objects is left out and named on
stderr.
"""
import os
import subprocess
import sys


def source_of(obj):
    """The source an object was built from, as its dependency file (the
    compiler's -MD output beside it, obj + ".d") names it; None without."""
    try:
        with open(obj + ".d") as f:
            text = f.read(4096)
    except OSError:
        return None
    words = text.replace("\\\n", " ").split()
    return words[1] if len(words) > 1 and words[0].endswith(":") else None


def objects(dirs):
    out = {}
    for d in dirs:
        for root, _, files in os.walk(d):
            for f in files:
                if f.endswith(".o"):
                    p = os.path.join(root, f)
                    src = source_of(p)
                    if src is not None and not os.path.exists(src):
                        print("file-deps: skipped %s: its source %s is gone"
                              % (p, src), file=sys.stderr)
                        continue
                    name = os.path.relpath(p, d)
                    out[name[:-2] if name.endswith(".c.o") else name] = p
    return out


def symbols(path):
    res = subprocess.run(["nm", "-P", path], capture_output=True, text=True,
                         check=True)
    defined, undefined = set(), set()
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        sym, kind = parts[0], parts[1]
        if kind == "U":
            undefined.add(sym)
        elif kind in "TDBRGSVWCi":
            defined.add(sym)
    return defined, undefined


def sccs(nodes, edges):
    """Tarjan's strongly connected components."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def main(argv):
    show_edges = "--edges" in argv
    dirs = [a for a in argv if a != "--edges"]
    if not dirs or any(a.startswith("-") for a in dirs):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    objs = objects(dirs)
    if not objs:
        print("file-deps: no object files under " + " ".join(dirs),
              file=sys.stderr)
        return 2
    owner, dup, undef = {}, set(), {}
    for name, path in objs.items():
        d, u = symbols(path)
        undef[name] = u
        for s in d:
            if s in owner and owner[s] != name:
                dup.add(s)
            owner[s] = name
    if dup:
        print("file-deps: defined in more than one object (left out; stale "
              "objects of moved sources?): " + ", ".join(sorted(dup)),
              file=sys.stderr)
    edges = {}
    for name, u in undef.items():
        for s in u:
            o = owner.get(s)
            if o is not None and o != name and s not in dup:
                edges.setdefault(name, {}).setdefault(o, set()).add(s)
    if show_edges:
        for a in sorted(edges):
            for b in sorted(edges[a]):
                print("%s -> %s: %s" % (a, b, ", ".join(sorted(edges[a][b]))))
    cycles = [c for c in sccs(objs, edges) if len(c) > 1]
    for c in cycles:
        print("cycle: " + " ".join(c))
        for a in c:
            for b in sorted(edges.get(a, {})):
                if b in c:
                    print("  %s -> %s: %s"
                          % (a, b, ", ".join(sorted(edges[a][b]))))
    if not cycles:
        print("no cycle among %d files" % len(objs))
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

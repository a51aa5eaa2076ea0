"""Compare the machine code (SASS) of every CUDA kernel in two builds.

    python3 tools/compare_sass.py OLD NEW [--arch sm_80,sm_90a] [--no-encoding] [-v]

OLD and NEW are each a file (an object ``.o``, the extension ``_C.abi3.so``, a
``.cubin``) or a directory (every ``.o`` and ``.so`` under it).  For each
architecture, every kernel of OLD is looked up in NEW by its normalised name
and their instruction streams compared.

Normalisation, so that moving a kernel between files or namespaces does not
count as a change:
- names are demangled (c++filt) and every namespace qualifier is dropped, the
  anonymous namespace (whose mangled name carries the file's name and a hash)
  included: ``fused_ops::(anonymous namespace)::k<fused_ops::Args<float>>``
  becomes ``k<Args<float>>``;
- instruction addresses are dropped; the instruction text and, unless
  ``--no-encoding``, its 128-bit encoding (which carries the scheduling
  control bits) are compared; symbol names inside instructions are normalised
  like kernel names.

Prints one line per kernel that differs or exists on one side only, then a
summary per architecture; exits 1 if anything differs or is missing.  Uses
the cuobjdump on PATH, under CUDA_HOME, or the one ``--cuobjdump`` names.
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
from collections import OrderedDict

_MANGLED = re.compile(r"_Z[A-Za-z0-9_]+")
_QUALIFIER = re.compile(r"(?:\(anonymous namespace\)|[A-Za-z_][A-Za-z0-9_]*)::")
_ADDR = re.compile(r"/\*[0-9a-f]{4,}\*/")
_ENCODING = re.compile(r"/\* (0x[0-9a-f]{16}) \*/")


def find_cuobjdump(explicit):
    candidates = [explicit] if explicit else []
    candidates.append(shutil.which("cuobjdump"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "cuobjdump"))
    candidates += sorted(glob.glob("/usr/local/cuda*/bin/cuobjdump"), reverse=True)
    try:  # triton's wheel ships one
        import triton  # noqa: F401

        candidates.append(
            os.path.join(os.path.dirname(sys.modules["triton"].__file__), "backends", "nvidia", "bin", "cuobjdump")
        )
    except ImportError:
        pass
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    sys.exit("compare_sass: no cuobjdump found (put it on PATH, set CUDA_HOME or pass --cuobjdump)")


def inputs(path):
    if os.path.isdir(path):
        files = sorted(
            glob.glob(os.path.join(path, "**", "*.o"), recursive=True)
            + glob.glob(os.path.join(path, "**", "*.so"), recursive=True)
        )
        if not files:
            sys.exit(f"compare_sass: no .o or .so files under {path}")
        return files
    if not os.path.isfile(path):
        sys.exit(f"compare_sass: {path} does not exist")
    return [path]


def demangler(symbols):
    symbols = sorted(set(symbols))
    if not symbols:
        return {}
    out = subprocess.run(["c++filt"], input="\n".join(symbols), capture_output=True, text=True, check=True)
    return {s: _QUALIFIER.sub("", d) for s, d in zip(symbols, out.stdout.splitlines())}


def kernels(cuobjdump, files, archs, with_encoding):
    """({arch: {normalised name: [instruction lines]}} over all files,
    [(arch, name, file) of every further copy of a kernel that differs from its first])."""
    raw = {a: OrderedDict() for a in archs}
    copies = []
    for f in files:
        text = subprocess.run([cuobjdump, "-sass", f], capture_output=True, text=True).stdout
        arch, name, body = None, None, None
        for line in text.splitlines():
            m = re.match(r"\s*arch = (\S+)", line)
            if m:
                arch, name = m.group(1), None
                continue
            m = re.match(r"\s*Function : (\S+)", line)
            if m:
                name = m.group(1)
                if arch in raw:
                    # A kernel of a shared header's template can sit in several
                    # objects: the first copy is kept, the others must equal it.
                    if name in raw[arch]:
                        body = []
                        copies.append((arch, name, f, body))
                    else:
                        body = raw[arch][name] = []
                continue
            if name is None or arch not in raw:
                continue
            # An instruction line starts with its address (/*0a30*/); the line
            # after it carries the second half of its encoding.  Anything else
            # (headers, the next section's banner) is not part of the kernel.
            enc = _ENCODING.search(line)
            if _ADDR.search(line):
                body.append([_ADDR.sub("", _ENCODING.sub("", line)).strip(), enc.group(1) if enc else ""])
            elif enc and body and not line.split("/*")[0].strip():
                body[-1][1] += enc.group(1)
    names = demangler(
        [n for per in raw.values() for n in per]
        + [t for per in raw.values() for b in per.values() for i, _ in b for t in _MANGLED.findall(i)]
    )
    result = {}
    for arch, per in raw.items():
        result[arch] = {}
        for name, body in per.items():
            lines = [
                _MANGLED.sub(lambda m: names.get(m.group(0), m.group(0)), i) + (" " + e if with_encoding else "")
                for i, e in body
            ]
            result[arch][names.get(name, name)] = lines
    differing = [(arch, names.get(name, name), f) for arch, name, f, body in copies if body != raw[arch][name]]
    return result, differing


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--arch", default="sm_80,sm_90a", help="comma-separated architectures to compare")
    p.add_argument("--no-encoding", action="store_true", help="compare instruction text only")
    p.add_argument("--cuobjdump", default=None)
    p.add_argument("-v", "--verbose", action="store_true", help="also list identical kernels")
    args = p.parse_args(argv)
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    tool = find_cuobjdump(args.cuobjdump)
    old, old_copies = kernels(tool, inputs(args.old), archs, not args.no_encoding)
    new, new_copies = kernels(tool, inputs(args.new), archs, not args.no_encoding)
    bad = 0
    for side, copies in (("OLD", old_copies), ("NEW", new_copies)):
        for arch, name, f in copies:
            print(f"{arch}  {side} has a second, different copy of {name} in {f}")
            bad += 1
    for arch in archs:
        o, n = old[arch], new[arch]
        same = 0
        for name in o:
            if name not in n:
                print(f"{arch}  only in OLD  {name}")
                bad += 1
            elif o[name] != n[name]:
                first = next((i for i, (a, b) in enumerate(zip(o[name], n[name])) if a != b), min(len(o[name]), len(n[name])))
                print(f"{arch}  DIFFERS      {name}  ({len(o[name])} vs {len(n[name])} instructions; first at {first})")
                bad += 1
            else:
                same += 1
                if args.verbose:
                    print(f"{arch}  identical    {name}  ({len(o[name])} instructions)")
        for name in n:
            if name not in o:
                print(f"{arch}  only in NEW  {name}")
                bad += 1
        print(f"{arch}: {same} of {len(o)} kernels identical (OLD {len(o)}, NEW {len(n)})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""ABI audit of the built extension: which torch symbols it imports.

The extension is built on the LibTorch stable ABI, so every symbol it takes
from torch's libraries must belong to the stable C shim: unmangled
``aoti_torch_*`` / ``torch_*`` functions (torch/csrc/inductor/aoti_torch/c/shim.h,
torch/csrc/stable/c/shim.h), which torch keeps from release to release.  A
C++ symbol of ``at::``, ``c10::``, ``torch::`` or any other name from those
libraries would tie the wheel to one torch build.

The check: ``nm -D --undefined-only`` of the library, intersected with what
torch's shared libraries (torch/lib/libtorch*.so, libc10*.so) define; every
symbol in the intersection must be an unmangled ``aoti_torch_``/``torch_``
name.  Prints the imports by group; exits 1 (listing them) on any other.

    python3 -m tools.abi_audit [path/to/_C.abi3.so | path/to/fused_ops-*.whl]
                                      # default: fused_ops._C as imported; a wheel: the library in it
"""

import glob
import os
import re
import subprocess
import sys

STABLE = re.compile(r"^(aoti_torch_|torch_)\w+$")
# The C++ standard library's own names, which torch's libraries also export
# (template instantiations): they bind to libstdc++ as well.
STD = re.compile(r"^((typeinfo|typeinfo name|vtable|VTT) for )?(std::|__cxxabiv1::|__gnu_cxx::|operator (new|delete))")


def _symbols(path, *flags):
    out = subprocess.run(["nm", "-D", *flags, path], check=True, capture_output=True, text=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


def torch_libraries():
    import torch

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    return sorted(glob.glob(os.path.join(lib, "libtorch*.so")) + glob.glob(os.path.join(lib, "libc10*.so")))


def audit(library):
    """``(stable shim imports, other torch imports (demangled), count of the remaining imports)``."""
    undefined = _symbols(library, "--undefined-only")
    from_torch = set()
    for lib in torch_libraries():
        from_torch |= undefined & _symbols(lib, "--defined-only")
    stable = sorted(s for s in from_torch if STABLE.match(s))
    rest = sorted(from_torch - set(stable))
    names = _demangle(rest)
    other = [n for n in names if not STD.match(n)]
    return stable, other, len(undefined) - len(stable) - len(other)


def _demangle(symbols):
    if not symbols:
        return []
    out = subprocess.run(["c++filt"], input="\n".join(symbols), capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def main(argv):
    if len(argv) > 1:
        library = argv[1]
    else:
        import importlib.util

        library = importlib.util.find_spec("fused_ops._C").origin
    if library.endswith(".whl"):
        import tempfile
        import zipfile

        with zipfile.ZipFile(library) as wheel, tempfile.TemporaryDirectory() as tmp:
            (member,) = [n for n in wheel.namelist() if re.fullmatch(r"fused_ops/_C\..*so", n)]
            print(f"{library}: {member}")
            return _report(wheel.extract(member, tmp))
    return _report(library)


def _report(library):
    stable, other, rest = audit(library)
    print(f"{library}: {len(stable)} symbols from torch, all of the stable C shim" if not other else
          f"{library}: {len(other)} symbols from torch outside the stable C shim")
    print("  stable shim:", " ".join(stable))
    print(f"  other imports: {rest} (C/C++ runtime, Python C API, CUDA runtime)")
    if other:
        print("  NOT STABLE:\n    " + "\n    ".join(other))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""The allowlisted file-system view of a sandboxed program: what it may see, planned once per interpreter.

`plan_view(python)` asks the interpreter (run once, outside the sandbox: it is the grader's own) where its
standard library is and which shared libraries it maps after importing every extension module of its
lib-dynload folder, and returns a `ViewPlan`: a list of operations that `init.py` carries out on an empty tmpfs
before it becomes the program's root:

* `("dir", path)`, `("symlink", path, target)`, `("file", path, text)`: the skeleton;
* `("bind", host_path, path)`: a host file or folder shown read-only at `path`;
* `("hide", path)`: an empty read-only folder over `path` (the interpreter's own site-packages);
* `("dev", name)`: the host's /dev/NAME device node; `("proc", path)`: /proc of the program's pid namespace.

The interpreter and its standard library appear under `/python` (`/python/bin/pythonX.Y`,
`/python/lib/pythonX.Y`), wherever they live on the host, so that a Python installed under /root or /home
shows no other part of those folders; libraries installed inside the interpreter's prefix go to `/python/lib`
(found through LD_LIBRARY_PATH), every other library keeps its host path, with the symlinks on the way
(/lib -> usr/lib) recreated. Nothing else of the host is in the view: no /home, /root, /work, /var, /run, /mnt,
/srv, no current directory, no data or test files. /etc holds the loader's cache and three generated files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess

VIEW_PYTHON = "/python"  # where the interpreter's install appears in the view
DEVICES = ("null", "zero", "urandom")
ETC_FILES = {
    "/etc/passwd": ("root:x:0:0:root:/tmp:/usr/sbin/nologin\n"
                    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"),
    "/etc/group": "root:x:0:\nnogroup:x:65534:\n",
    "/etc/hosts": "127.0.0.1 localhost\n::1 localhost\n",
}
SYSTEM_PREFIXES = ("/", "/usr", "/usr/local")  # an interpreter installed here keeps its libraries' host paths
QUERY = """
import json, os, sys, sysconfig
dynload = [os.path.realpath(p) for p in sys.path if p.rstrip('/').endswith('lib-dynload') and os.path.isdir(p)]
for folder in dynload:
    for name in sorted(os.listdir(folder)):
        if name.endswith('.so'):
            try:
                __import__(name.split('.')[0])
            except BaseException:
                pass
loaded = set()
with open('/proc/self/maps') as fh:
    for line in fh:
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith('/') and '.so' in fields[5]:
            loaded.add(fields[5].strip())
print(json.dumps({'executable': os.path.realpath(sys.executable), 'version': '%d.%d' % sys.version_info[:2],
                  'prefix': os.path.realpath(sys.base_prefix), 'stdlib': os.path.realpath(sysconfig.get_path('stdlib')),
                  'dynload': dynload, 'loaded': sorted(loaded)}))
"""


@dataclasses.dataclass(frozen=True)
class ViewPlan:
    """What the program sees: `ops` for init.py, the interpreter's path in the view, and its environment."""

    ops: tuple[tuple, ...]
    python: str  # the interpreter's path inside the view
    env: tuple[tuple[str, str], ...]  # extra environment variables (LD_LIBRARY_PATH for relocated libraries)
    libraries: int  # shared libraries in the view


class ViewError(RuntimeError):
    """The view cannot be planned for this interpreter (it says why)."""


def elf_interpreter(path: str) -> str | None:
    """The dynamic loader an ELF file names (PT_INTERP), or None (static, not ELF, unreadable)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(64)
            if len(head) < 52 or head[:4] != b"\x7fELF":
                return None
            order = "<" if head[5] == 1 else ">"
            wide = head[4] == 2
            if wide:
                phoff, = struct.unpack_from(order + "Q", head, 0x20)
                phentsize, phnum = struct.unpack_from(order + "HH", head, 0x36)
            else:
                phoff, = struct.unpack_from(order + "I", head, 0x1C)
                phentsize, phnum = struct.unpack_from(order + "HH", head, 0x2A)
            for i in range(phnum):
                fh.seek(phoff + i * phentsize)
                ph = fh.read(phentsize)
                if len(ph) < (40 if wide else 24) or struct.unpack_from(order + "I", ph, 0)[0] != 3:  # PT_INTERP
                    continue
                if wide:
                    offset, = struct.unpack_from(order + "Q", ph, 8)
                    size, = struct.unpack_from(order + "Q", ph, 32)
                else:
                    offset, = struct.unpack_from(order + "I", ph, 4)
                    size, = struct.unpack_from(order + "I", ph, 16)
                fh.seek(offset)
                return fh.read(size).split(b"\0", 1)[0].decode() or None
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


def _with_aliases(libraries: list[str]) -> dict[str, list[str]]:
    """Each library file with the names it is loaded by: its own and those of the symlinks beside it that point
    at it (the loader asks for `libz.so.1`, the file is `libz.so.1.2.13`)."""
    out: dict[str, list[str]] = {lib: [os.path.basename(lib)] for lib in libraries}
    for folder in sorted({os.path.dirname(lib) for lib in libraries}):
        try:
            entries = os.listdir(folder)
        except OSError:
            continue
        for name in entries:
            path = os.path.join(folder, name)
            if os.path.islink(path) and os.path.realpath(path) in out and name not in out[os.path.realpath(path)]:
                out[os.path.realpath(path)].append(name)
    return out


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


class _Builder:
    """Collects ops without duplicates, recreating the host's symlinks on the way to each mirrored path."""

    def __init__(self) -> None:
        self.ops: list[tuple] = []
        self.made: dict[str, str] = {}  # view path -> "dir" / "symlink" / "bind" / "file"

    def add(self, op: tuple) -> None:
        path = op[2] if op[0] == "bind" else op[1]
        if path in self.made:
            return
        self.made[path] = op[0]
        self.ops.append(op)

    def folders(self, path: str) -> None:
        parts = [p for p in path.split("/") if p]
        for i in range(1, len(parts)):
            self.add(("dir", "/" + "/".join(parts[:i])))

    def mirror(self, path: str, depth: int = 0) -> None:
        """Show host `path` at the same path: its folders, each symlink on the way, then a bind of the file."""
        if depth > 40:
            raise ViewError(f"too many symlinks resolving {path}")
        parts = [p for p in os.path.normpath(path).split("/") if p]
        for i in range(len(parts)):
            here = "/" + "/".join(parts[: i + 1])
            if os.path.islink(here):
                target = os.readlink(here)
                self.folders(here)
                self.add(("symlink", here, target))
                resolved = os.path.normpath(os.path.join(os.path.dirname(here), target))
                rest = "/".join(parts[i + 1:])
                self.mirror(resolved + ("/" + rest if rest else ""), depth + 1)
                return
        self.folders(path)
        self.add(("bind", path, path))


def query_python(python: str) -> dict:
    """Where an interpreter keeps its files (run outside the sandbox: it is the grader's own, trusted)."""
    try:
        res = subprocess.run([python, "-I", "-S", "-c", QUERY], capture_output=True, text=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ViewError(f"cannot run {python}: {e}") from None
    try:
        info = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ViewError(f"{python} did not describe itself: {res.stderr.strip()[-300:]}") from None
    return info


def plan_view(python: str) -> ViewPlan:
    """The view for programs run by `python` (host path). Raises ViewError when it cannot be laid out."""
    info = query_python(python)
    exe, stdlib, version, prefix = info["executable"], info["stdlib"], info["version"], info["prefix"]
    if not os.path.isdir(stdlib):
        raise ViewError(f"{python}: standard library {stdlib} is not a folder")
    dynload = [d for d in info["dynload"] if os.path.isdir(d)]
    if any(not _under(d, stdlib) for d in dynload):
        raise ViewError(f"{python}: lib-dynload {dynload} lies outside the standard library {stdlib}")
    view_lib = f"{VIEW_PYTHON}/lib"
    b = _Builder()
    for path in ("/tmp", "/dev/shm", "/etc", view_lib, f"{VIEW_PYTHON}/bin"):
        b.folders(path + "/x")
    b.add(("bind", exe, f"{VIEW_PYTHON}/bin/python{version}"))
    b.add(("symlink", f"{VIEW_PYTHON}/bin/python3", f"python{version}"))
    b.add(("bind", stdlib, f"{view_lib}/python{version}"))
    for hidden in ("site-packages", "dist-packages"):
        if os.path.isdir(os.path.join(stdlib, hidden)):
            b.add(("hide", f"{view_lib}/python{version}/{hidden}"))
    loaded = [lib for lib in info["loaded"] if os.path.isfile(lib) and not _under(lib, stdlib)]
    for lib in list(loaded):  # glibc loads libgcc_s at run time (thread exit, unwinding)
        extra = os.path.join(os.path.dirname(lib), "libgcc_s.so.1")
        if os.path.basename(lib).startswith("libc.so") and os.path.isfile(extra):
            loaded.append(extra)
    loaded = sorted({os.path.realpath(lib) for lib in loaded})
    relocated = prefix not in SYSTEM_PREFIXES and any(_under(lib, prefix) for lib in loaded)
    for lib, names in _with_aliases(loaded).items():
        if relocated and _under(lib, prefix):  # e.g. libpython of an interpreter under /root or /home
            for name in names:
                b.add(("bind", lib, f"{view_lib}/{name}"))
            continue
        b.mirror(lib)
        for name in names:
            alias = os.path.join(os.path.dirname(lib), name)
            if alias != lib:
                b.add(("symlink", alias, os.readlink(alias)))
    for name in sorted(os.listdir("/")):  # /lib -> usr/lib: the loader's cache may name either path
        top = "/" + name
        if os.path.islink(top) and any(_under(lib, os.path.realpath(top)) for lib in loaded):
            b.add(("symlink", top, os.readlink(top)))
    loader = elf_interpreter(exe)
    if loader:
        b.mirror(loader)
    if os.path.exists("/etc/ld.so.cache"):
        b.mirror("/etc/ld.so.cache")
    for path, text in ETC_FILES.items():
        b.add(("file", path, text))
    for name in DEVICES:
        b.add(("dev", name))
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        b.add(("symlink", f"/dev/{name}", f"/proc/self/fd/{fd}"))
    b.add(("symlink", "/dev/fd", "/proc/self/fd"))
    b.add(("proc", "/proc"))
    env = (("LD_LIBRARY_PATH", view_lib),) if relocated else ()
    return ViewPlan(ops=tuple(b.ops), python=f"{VIEW_PYTHON}/bin/python{version}", env=env,
                    libraries=len(loaded))

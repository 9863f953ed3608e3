"""One cgroup per sandboxed run: a memory limit over everything the run holds, a process limit, CPU accounting.

`find_backend` looks once per process for a place where this process may create cgroups:

* cgroup v2 (`memory` and `pids` controllers): the folder `SandboxConfig.cgroup_parent` names (a delegated
  subtree, for a grader that is not root), or, as root, the root of the cgroup2 mount;
* cgroup v1, as root: this process's own cgroup in the `memory`, `pids` and `cpuacct` hierarchies (hybrid
  systems mount v2 without those controllers).

`CgroupBackend.create` makes a run's cgroup with `memory.max` (v1: `memory.limit_in_bytes`, with swap
`memory.memsw.limit_in_bytes` where the kernel accounts it) and `pids.max`; the program's process joins it
before it execs (init.py writes "0" to the `cgroup.procs` files it opened), so page cache, tmpfs and
shared memory pages, kernel memory and every child are counted together, and the kernel's OOM killer, when it
acts, acts inside the run's cgroup. `RunCgroup.cpu_seconds` sums the CPU time of all the run's processes (v2
`cpu.stat`, v1 `cpuacct.usage`); the grader polls it to enforce the CPU limit over all of them.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import time

V1_CONTROLLERS = ("memory", "pids", "cpuacct")
V2_CONTROLLERS = ("memory", "pids")
RUN_PREFIX = "vase-sandbox-"  # run cgroups are RUN_PREFIX + "<grader pid>-<random hex>"


class CgroupError(RuntimeError):
    """No usable cgroup (the message says why)."""


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _mounts() -> list[tuple[str, str, str, str]]:
    """(mount root, mount point, fs type, super options) of this process's mounts."""
    rows = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3:
                rows.append((fields[3], fields[4].replace("\\040", " "), tail[0], tail[2]))
    return rows


def _own_cgroups() -> dict[str, str]:
    """Controller (v1) or "" (v2) -> this process's cgroup path in that hierarchy."""
    out = {}
    for line in _read("/proc/self/cgroup").splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            out[""] = path
        for c in controllers.split(","):
            if c:
                out[c] = path
    return out


@dataclasses.dataclass
class RunCgroup:
    """The cgroup(s) of one run: one folder (v2) or one per hierarchy (v1: memory, pids, cpuacct)."""

    version: int
    dirs: dict[str, str]  # controller ("" for v2) -> folder

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in dict.fromkeys(self.dirs.values())]

    def _file(self, controller: str, name: str) -> str:
        return os.path.join(self.dirs["" if self.version == 2 else controller], name)

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system) of every process that ran in the cgroup."""
        try:
            if self.version == 2:
                for line in _read(self._file("cpu", "cpu.stat")).splitlines():
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) / 1e6
                return None
            return int(_read(self._file("cpuacct", "cpuacct.usage"))) / 1e9
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer ended in this cgroup (its memory limit was reached)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in _read(self._file("memory", name)).splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def pids(self) -> set[int]:
        found = set()
        for path in self.procs_files:
            try:
                found.update(int(p) for p in _read(path).split())
            except (OSError, ValueError):
                pass
        return found

    def kill(self) -> None:
        """SIGKILL every process in the cgroup (v2: atomically through cgroup.kill when the kernel has it)."""
        if self.version == 2:
            try:
                _write(self._file("", "cgroup.kill"), "1")
                return
            except OSError:
                pass
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def remove(self, patience: float = 10.0) -> bool:
        """Kill what is left, wait until the cgroup is empty, remove its folders. False if one stayed."""
        deadline = time.monotonic() + patience
        while self.pids() and time.monotonic() < deadline:
            self.kill()
            time.sleep(0.005)
        removed = True
        for d in dict.fromkeys(self.dirs.values()):
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() >= deadline:
                        removed = False
                        break
                    self.kill()
                    time.sleep(0.005)
        return removed


@dataclasses.dataclass(frozen=True)
class CgroupBackend:
    """Where runs' cgroups are made: (controller or "" for v2, parent folder) pairs."""

    version: int
    parents: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        where = ", ".join(sorted({p for _, p in self.parents}))
        names = ", ".join(V2_CONTROLLERS if self.version == 2 else V1_CONTROLLERS)
        return f"cgroup v{self.version} ({names}) under {where}"

    def create(self, memory_bytes: int, max_pids: int) -> RunCgroup:
        """A fresh cgroup with these limits; raises OSError (and leaves nothing) if it cannot be made."""
        name = f"{RUN_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        run = RunCgroup(self.version, {})
        try:
            for controller, parent in self.parents:
                path = os.path.join(parent, name)
                os.mkdir(path)
                run.dirs[controller] = path
            if self.version == 2:
                _write(run._file("", "memory.max"), str(memory_bytes))
                if os.path.exists(run._file("", "memory.swap.max")):
                    _write(run._file("", "memory.swap.max"), "0")
                _write(run._file("", "pids.max"), str(max_pids))
            else:
                _write(run._file("memory", "memory.limit_in_bytes"), str(memory_bytes))
                if os.path.exists(run._file("memory", "memory.memsw.limit_in_bytes")):
                    try:  # memory + swap: no swapping out of the limit
                        _write(run._file("memory", "memory.memsw.limit_in_bytes"), str(memory_bytes))
                    except OSError:
                        pass
                _write(run._file("pids", "pids.max"), str(max_pids))
        except OSError:
            run.remove(patience=1.0)
            raise
        return run


def _v2_backend(parent: str) -> CgroupBackend:
    """A v2 backend under `parent` (its memory and pids controllers enabled for children), or CgroupError."""
    try:
        available = _read(os.path.join(parent, "cgroup.controllers")).split()
    except OSError as e:
        raise CgroupError(f"{parent} is not a cgroup v2 folder ({e.strerror})") from None
    missing = [c for c in V2_CONTROLLERS if c not in available]
    if missing:
        raise CgroupError(f"cgroup v2 at {parent} lacks the {', '.join(missing)} controller(s) (available: "
                          f"{' '.join(available) or 'none'})")
    control = os.path.join(parent, "cgroup.subtree_control")
    enabled = _read(control).split()
    for c in V2_CONTROLLERS:
        if c not in enabled:
            try:
                _write(control, f"+{c}")
            except OSError as e:
                raise CgroupError(f"cannot enable the {c} controller in {control} ({e.strerror})") from None
    return CgroupBackend(2, (("", parent),))


def _v1_backend() -> CgroupBackend:
    """A v1 backend in this process's own memory, pids and cpuacct cgroups, or CgroupError."""
    own = _own_cgroups()
    parents = []
    for controller in V1_CONTROLLERS:
        mount = next(((root, point) for root, point, fstype, opts in _mounts()
                      if fstype == "cgroup" and controller in opts.split(",")), None)
        if mount is None or controller not in own:
            raise CgroupError(f"no cgroup v1 hierarchy with the {controller} controller")
        root, point = mount
        path = own[controller]
        relative = path[len(root):] if root != "/" and path.startswith(root) else path
        parents.append((controller, os.path.normpath(os.path.join(point, relative.lstrip("/")))))
    return CgroupBackend(1, tuple(parents))


def find_backend(parent: str | None) -> CgroupBackend:
    """Where this process can make runs' cgroups (see the module docstring); raises CgroupError saying why not."""
    if not os.path.exists("/proc/self/cgroup"):
        raise CgroupError("this system has no cgroups")
    if parent is not None:
        backend = _v2_backend(parent)
    elif os.geteuid() != 0:
        raise CgroupError("not root, and no delegated cgroup v2 folder given (SandboxConfig.cgroup_parent)")
    else:
        reasons = []
        backend = None
        v2 = next((point for _, point, fstype, _ in _mounts() if fstype == "cgroup2"), None)
        if v2 is not None:
            try:
                backend = _v2_backend(v2)
            except (CgroupError, OSError) as e:
                reasons.append(str(e))
        if backend is None:
            try:
                backend = _v1_backend()
            except (CgroupError, OSError) as e:
                reasons.append(str(e))
        if backend is None:
            raise CgroupError("; ".join(reasons) or "no cgroup file system is mounted")
    try:  # the acid test: make one and remove it
        backend.create(64 << 20, 8).remove(patience=1.0)
    except OSError as e:
        raise CgroupError(f"cannot create a cgroup with {backend.describe()}: {e}") from None
    remove_stale(backend)
    return backend


def remove_stale(backend: CgroupBackend) -> list[str]:
    """Remove the empty run cgroups left by graders that were killed mid-run (their process is gone)."""
    removed = []
    for _, parent in backend.parents:
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            parts = name.split("-")
            if not name.startswith(RUN_PREFIX) or len(parts) != 4 or not parts[2].isdigit():
                continue
            if os.path.exists(f"/proc/{parts[2]}"):
                continue
            try:
                os.rmdir(os.path.join(parent, name))  # refused while a process is still inside
                removed.append(os.path.join(parent, name))
            except OSError:
                pass
    return removed

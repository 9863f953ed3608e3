"""Run untrusted Python programs (model-written code) contained: `run_python`, `SandboxConfig`, `probe`.

Each program runs in its own process group, with a scrubbed environment and resource limits, under a
wall-clock limit that kills the whole group. Where the OS allows (Linux, util-linux `unshare`), it also gets new
network, mount, pid, ipc and uts namespaces: no network at all (not even a usable loopback), a pid namespace
whose death kills every process the program started, and an allowlisted, read-only view of the file system
(`vase_jax/sandbox/view.py`): the interpreter and its standard library, the shared libraries they load, a
minimal /etc and /dev, /proc of its own pid namespace, and a private size-limited tmpfs on /tmp (the working
directory, holding the program's files) and /dev/shm. Nothing else of the host is visible: no home folders, no
current directory, no data or test files; the test input arrives on stdin only. `vase_jax/sandbox/init.py` (the
namespace's pid 1) builds that view; its docstring has the details.

Who the program runs as:

* started as root: a fresh uid/gid from a range no account uses (`UID_BASE` + random), no supplementary groups,
  no capabilities, no-new-privileges. Root ignores RLIMIT_NPROC, an unprivileged uid does not, so the
  process limit holds; and every process left with that uid is killed after the run.
* started as a normal user: inside a user namespace (`unshare --user --map-root-user`) as its root, with no
  capabilities (securebits NOROOT, empty bounding set, no-new-privileges); the kernel sees the caller's uid,
  but the view holds none of the caller's files.

Two more layers where the machine has them (`probe` finds out once per process, and `SandboxInfo.describe`
names what is missing):

* a syscall filter (`vase_jax/sandbox/seccomp.py`, libseccomp through `pyseccomp`): no kernel keyring, no
  memfd or System V / POSIX-queue IPC, no ptrace, no mount or namespace calls, no sockets;
* a cgroup per run (`vase_jax/sandbox/cgroup.py`: v2 as root or in a delegated folder, or v1 as root):
  `memory.max` over everything the run's processes hold (tmpfs and shared memory included) and `pids.max`;
  the CPU time of all its processes is counted, and the run is killed once it reaches the CPU limit.

A run also holds a "lifeline" pipe to the sandbox's first process: if the grader dies mid-run (killed), the
sandbox sees end of file and ends the run, so no program outlives its grader. After `run_python` returns, no
process, file, cgroup, key or IPC object of the run is left.

Limits (`SandboxConfig`): CPU seconds (RLIMIT_CPU per process, and over all processes where a cgroup counts
them), address space (RLIMIT_AS), file size (RLIMIT_FSIZE, which also caps stdout: it is a file), processes and
threads (RLIMIT_NPROC, and pids.max), open files, no core files, the tmpfs size, the cgroup's memory
(`memory_bytes + disk_bytes`), and the wall clock.

When namespaces are not available, programs run in the "plain" mode: process group, limits, scrubbed
environment, temporary folder, privilege drop when root, syscall filter and cgroup where available, but no
read-only view; `SandboxInfo.describe` says so, and `scripts/eval.py` prints it at the start of a run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .cgroup import CgroupBackend, CgroupError, RunCgroup, find_backend
from .seccomp import DESCRIPTION as FILTER_DESCRIPTION
from .seccomp import SeccompUnavailable, build_filter
from .view import ViewError, ViewPlan, plan_view

INIT_SCRIPT = Path(__file__).with_name("init.py")
ISOLATION_MODES = ("auto", "namespaces", "plain")
UID_BASE = 1_600_000_000  # fresh sandbox uids are UID_BASE + [0, UID_SPAN): far above any account's uid
UID_SPAN = 400_000_000
NAMESPACE_FLAGS = ("--fork", "--kill-child", "--pid", "--mount-proc", "--mount", "--net", "--ipc", "--uts",
                   "--propagation", "private")
STDERR_TAIL = 8192
REASON_EXCERPT = 300  # characters of the program's last stderr line that a failure reason may quote
PROGRAM_PATH = "/usr/bin:/bin"
WORK_DIR = "/tmp"  # the program's working folder inside the view
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue")  # swept for a fresh uid's files (plain mode)
CPU_POLL = 0.05  # seconds between two looks at a run's cgroup CPU time


class SandboxError(RuntimeError):
    """The sandbox itself cannot run (not a verdict on a program)."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits of one program run. `timeout` is wall-clock seconds; the CPU limit is ceil(timeout) seconds.

    isolation: "auto" (namespaces when the OS allows, else plain with a warning), "namespaces" (required:
    raise SandboxError when unavailable) or "plain". python: the interpreter for the program; None picks the
    first of this interpreter's base, this interpreter and `python3` on PATH that the sandbox can run.
    cgroup_parent: a cgroup v2 folder this user may create cgroups in (a delegated subtree); None: as root,
    find one (v2, else v1), and as a user go without.
    """

    timeout: float = 30.0
    memory_bytes: int = 2 << 30  # RLIMIT_AS per process; with disk_bytes, the run's cgroup memory.max
    output_bytes: int = 64 << 20  # RLIMIT_FSIZE: stdout, stderr and any file the program writes
    disk_bytes: int = 64 << 20  # size of the private tmpfs: work folder and /dev/shm together (namespaces mode)
    max_processes: int = 8  # RLIMIT_NPROC and pids.max: processes and threads of the program
    max_open_files: int = 256
    isolation: str = "auto"
    python: str | None = None
    tmp_root: str | None = None  # where run folders are made (default: tempfile.gettempdir())
    cgroup_parent: str | None = None

    def validate(self) -> SandboxConfig:
        for name in ("timeout",):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0 or not math.isfinite(v):
                raise ValueError(f"SandboxConfig.{name}={v!r} must be a positive number of seconds")
        for name, low in (("memory_bytes", 32 << 20), ("output_bytes", 1024), ("disk_bytes", 1 << 20),
                          ("max_processes", 1), ("max_open_files", 16)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"SandboxConfig.{name}={v!r} must be an integer >= {low}")
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(f"SandboxConfig.isolation={self.isolation!r}; allowed: {', '.join(ISOLATION_MODES)}")
        if self.tmp_root is not None and not os.path.isdir(self.tmp_root):
            raise ValueError(f"SandboxConfig.tmp_root={self.tmp_root!r} is not an existing folder")
        if self.cgroup_parent is not None and not os.path.isfile(os.path.join(self.cgroup_parent, "cgroup.procs")):
            raise ValueError(f"SandboxConfig.cgroup_parent={self.cgroup_parent!r} is not a cgroup folder (it has "
                             "no cgroup.procs); allowed: None or a cgroup v2 folder this user may create cgroups in")
        return self


@dataclasses.dataclass(frozen=True)
class SandboxInfo:
    """What the sandbox can do on this machine (from `probe`)."""

    mode: str  # "namespaces" or "plain"
    user_namespace: bool  # namespaces created inside a user namespace (the caller is not root)
    drops_to_fresh_uid: bool  # the caller is root: programs run as a fresh unprivileged uid
    python: str  # the interpreter as the program's command line names it (its path in the view)
    readonly_failures: tuple[str, ...]  # mounts that stayed writable (always empty: such a view does not run)
    warnings: tuple[str, ...]  # what is NOT contained, in words
    python_host: str = ""  # the interpreter's path on the host
    syscall_filter: bool = False
    cgroup: str = ""  # the cgroup backend in words ("" when runs get none)
    view: ViewPlan | None = dataclasses.field(default=None, repr=False, compare=False)
    seccomp_bpf: bytes | None = dataclasses.field(default=None, repr=False, compare=False)
    cgroup_backend: CgroupBackend | None = dataclasses.field(default=None, repr=False, compare=False)

    def describe(self) -> str:
        """A few lines for the start of a run: the isolation in force and, clearly, what is missing."""
        if self.mode == "namespaces":
            who = ("a fresh unprivileged uid, no capabilities" if self.drops_to_fresh_uid
                   else "root of a user namespace without capabilities (your uid outside)")
            libraries = self.view.libraries if self.view else 0
            lines = ["sandbox: namespaces (net, mount, pid, ipc, uts); an allowlisted read-only file system (the "
                     f"interpreter, its standard library, {libraries} shared libraries, a minimal /etc and /dev, "
                     "/proc of its pid namespace) with a private size-limited tmpfs on /tmp and /dev/shm; programs "
                     f"run as {who}; python {self.python_host or self.python}"]
        else:
            who = "a fresh unprivileged uid" if self.drops_to_fresh_uid else "your own user"
            lines = [f"sandbox: plain process groups with resource limits, as {who}; python {self.python}"]
        if self.syscall_filter:
            lines.append(f"sandbox: syscall filter (seccomp, libseccomp) refuses {FILTER_DESCRIPTION}")
        if self.cgroup:
            lines.append(f"sandbox: {self.cgroup}: memory.max and pids.max over all of a run's processes, whose "
                         "CPU time is counted together")
        return "\n".join([*lines, *(f"sandbox WARNING: {w}" for w in self.warnings)])


@dataclasses.dataclass(frozen=True)
class ExecResult:
    """How one program run ended. `failure()` is None for a clean exit (code 0), else the reason in words."""

    exit_code: int | None
    signal: int | None
    timed_out: bool  # killed at the wall-clock limit
    output_exceeded: bool  # stdout reached SandboxConfig.output_bytes
    stdout: bytes
    stderr: bytes  # the last STDERR_TAIL bytes
    result: bytes | None  # what the program wrote to its result channel (when asked for)
    cpu_seconds: float | None  # all the run's processes where a cgroup counts them, else those reaped
    wall_seconds: float
    setup_error: str | None = None
    limits: SandboxConfig | None = None
    readonly_failures: tuple[str, ...] = ()  # mounts the sandbox could not make read-only
    cpu_exceeded: bool = False  # killed when the CPU time of all its processes reached the limit (cgroup)
    oom_kills: int = 0  # processes the kernel killed at the run's cgroup memory limit
    uid: int | None = None  # the uid the kernel saw the program run as

    def failure(self) -> str | None:
        if self.setup_error:
            return f"sandbox error: {self.setup_error}"
        if self.oom_kills:  # first: a program whose process was killed for memory may hang or time out after
            limit = (self.limits.memory_bytes + self.limits.disk_bytes) >> 20 if self.limits else 0
            return f"memory limit exceeded (the run's processes together reached {limit} MiB)"
        timeout = self.limits.timeout if self.limits else None
        if self.timed_out:
            return f"time limit exceeded ({timeout:g} s wall clock)" if timeout else "time limit exceeded"
        cpu_limit = math.ceil(timeout) if timeout else None
        if self.cpu_exceeded:
            return f"time limit exceeded ({cpu_limit} s CPU, all processes together)"
        if self.signal == signal.SIGXCPU or (self.signal == signal.SIGKILL and cpu_limit and self.cpu_seconds
                                             and self.cpu_seconds >= cpu_limit):
            return f"time limit exceeded ({cpu_limit} s CPU)" if cpu_limit else "time limit exceeded (CPU)"
        if self.output_exceeded:
            limit = self.limits.output_bytes if self.limits else 0
            return f"output limit exceeded (more than {limit} bytes)"
        tail = self.stderr.decode(errors="replace").strip().splitlines()
        last = tail[-1].strip() if tail else ""
        if "MemoryError" in last:
            return "memory limit exceeded (MemoryError)"
        if self.signal is not None:
            name = signal.Signals(self.signal).name if self.signal in signal.Signals._value2member_map_ else ""
            return f"killed by signal {self.signal} {name}".strip()
        if self.exit_code is None:
            return "ended without a status"
        if self.exit_code != 0:
            return f"runtime error (exit code {self.exit_code})" + (f": {excerpt(last)}" if last else "")
        return None


def excerpt(text: str, limit: int = REASON_EXCERPT) -> str:
    """`text` fit for a one-line reason: control characters as '?', at most `limit` characters."""
    clean = "".join(c if c.isprintable() else "?" for c in text)
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


_probe_cache: dict[tuple, SandboxInfo] = {}
_probe_lock = threading.Lock()


def _unshare_cmd(user_ns: bool) -> list[str]:
    exe = shutil.which("unshare") or ("/usr/bin/unshare" if os.path.exists("/usr/bin/unshare") else None)
    if exe is None:
        raise FileNotFoundError("util-linux `unshare` is not installed")
    return [exe, *(("--user", "--map-root-user") if user_ns else ()), *NAMESPACE_FLAGS]


def _try_namespaces(user_ns: bool) -> str | None:
    """None when `unshare` can create the namespaces here, else why not."""
    if not sys.platform.startswith("linux"):
        return f"namespaces need Linux (this is {sys.platform})"
    try:
        cmd = _unshare_cmd(user_ns)
    except FileNotFoundError as e:
        return str(e)
    try:
        res = subprocess.run([*cmd, "true"], capture_output=True, text=True, timeout=20,
                             env={"PATH": PROGRAM_PATH})
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`unshare` failed: {e}"
    if res.returncode != 0:
        return f"`unshare {' '.join(cmd[1:])}` failed: {res.stderr.strip()[:300]}"
    return None


def probe(config: SandboxConfig | None = None) -> SandboxInfo:
    """Find out (once per setting and process) which isolation works here and which Python the sandbox runs.

    Raises SandboxError when config.isolation is "namespaces" and they are unavailable, when
    config.cgroup_parent cannot hold cgroups, or when no Python interpreter can be run by the sandbox user.
    """
    config = (config or SandboxConfig()).validate()
    key = (config.isolation, config.python, config.tmp_root, config.cgroup_parent)
    with _probe_lock:
        if key in _probe_cache:
            return _probe_cache[key]
        info = _probe(config)
        _probe_cache[key] = info
        return info


def _candidates(config: SandboxConfig) -> list[str]:
    if config.python:
        return [config.python]
    found = (getattr(sys, "_base_executable", None), sys.executable, shutil.which("python3", path=PROGRAM_PATH),
             shutil.which("python3"))
    return list(dict.fromkeys(os.path.realpath(c) for c in found if c))


def _probe(config: SandboxConfig) -> SandboxInfo:
    root = os.geteuid() == 0
    warnings: list[str] = []
    bpf = None
    try:
        bpf, unknown = build_filter()
        if unknown:
            warnings.append("this libseccomp does not know these calls, which stay allowed: " + ", ".join(unknown))
    except SeccompUnavailable as e:
        warnings.append(f"no syscall filter ({e}): programs can use the kernel keyring (keys outlive the run), "
                        "memfd and System V shared memory (memory outside RLIMIT_AS), ptrace and sockets")
    backend = None
    try:
        backend = find_backend(config.cgroup_parent)
    except CgroupError as e:
        if config.cgroup_parent is not None:
            raise SandboxError(f"SandboxConfig.cgroup_parent={config.cgroup_parent!r} cannot hold the runs' "
                               f"cgroups: {e}") from None
        warnings.append(f"no cgroup ({e}): memory is limited per process (RLIMIT_AS times the process limit in "
                        "all), and the CPU time of a program's child processes is not counted together")
    base = SandboxInfo(mode="plain", user_namespace=False, drops_to_fresh_uid=root, python="", readonly_failures=(),
                       warnings=(), syscall_filter=bpf is not None, cgroup=backend.describe() if backend else "",
                       seccomp_bpf=bpf, cgroup_backend=backend)
    tried: list[str] = []
    if config.isolation != "plain":
        why = _try_namespaces(user_ns=not root)
        if why is None:
            ns = dataclasses.replace(base, mode="namespaces", user_namespace=not root)
            info = _first_python(config, ns, tried)
            if info is not None:
                return dataclasses.replace(info, warnings=tuple(warnings))
            why = "no interpreter ran in the namespaces' file-system view: " + "; ".join(tried)
        if config.isolation == "namespaces":
            raise SandboxError(f"isolation='namespaces' is not available here: {why}")
        warnings.append(f"no namespaces ({why}): programs run WITH network access unless the syscall filter "
                        "refuses sockets, and see the whole file system" + ("" if root else "; install util-linux "
                                                                          "or allow unprivileged user namespaces"))
    if root:
        warnings.append("a program can read what any user may read and write wherever any user may (e.g. /tmp; "
                        "its files there are removed after the run), and a process that leaves its group survives "
                        "until the run's end, when every process of its uid is killed")
    else:
        warnings.append("programs run as YOUR user: they can read and change your files and signal your "
                        "processes; run as root or enable user namespaces for real containment")
    info = _first_python(config, base, tried)
    if info is None:
        raise SandboxError("no Python interpreter that the sandbox user can run (pass SandboxConfig(python=...)); "
                           "tried " + "; ".join(tried))
    return dataclasses.replace(info, warnings=tuple(warnings))


def _first_python(config: SandboxConfig, base: SandboxInfo, tried: list[str]) -> SandboxInfo | None:
    """`base` completed with the first candidate interpreter that runs a small program in that mode, or None."""
    probe_config = dataclasses.replace(config, timeout=max(config.timeout, 20.0))
    for exe in _candidates(config):
        plan = None
        if base.mode == "namespaces":
            try:
                plan = plan_view(exe)
            except ViewError as e:
                tried.append(f"{exe}: {e}")
                continue
        info = dataclasses.replace(base, python=plan.python if plan else exe, python_host=exe, view=plan)
        res = _execute([info.python, "-I", "-S", "-c", "import sys; print(sys.version_info >= (3, 8))"], {}, b"",
                       probe_config, info)
        if res.stdout.strip() == b"True" and res.exit_code == 0:
            return info
        tried.append(f"{exe} ({base.mode}): {res.failure() or repr(res.stdout[:100])}")
    return None


def run_python(files: Mapping[str, str | bytes], script: str, args: Sequence[str] = (), stdin: str | bytes = b"",
               config: SandboxConfig | None = None, result_channel: bool = False) -> ExecResult:
    """Run `python -I -B <script> *args` in a fresh sandbox whose work folder holds `files` (name -> content).

    stdin is fed from a file; stdout and stderr go to files capped at `config.output_bytes`. With
    `result_channel`, the program finds a writable file descriptor number in the environment variable
    VASE_RESULT_FD, and what it writes there is `ExecResult.result` (kept apart from stdout). Never raises for
    what the program does; raises SandboxError if the sandbox cannot start (it then never ran the program).
    """
    config = (config or SandboxConfig()).validate()
    for name in files:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"files: name {name!r} must be a plain file name")
    if script not in files:
        raise ValueError(f"script={script!r} is not one of the files")
    info = probe(config)
    res = _execute([info.python, "-I", "-B", script, *args], files, stdin, config, info,
                   result_channel=result_channel)
    if res.setup_error is not None:
        raise SandboxError(res.setup_error)
    return res


def _fresh_uid() -> int:
    return UID_BASE + secrets.randbelow(UID_SPAN)


def _private_file(path: Path, content: bytes = b"") -> None:
    """A file only the grader can read (mode 0600), however the umask is set."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(content)


def _wait(proc: subprocess.Popen, deadline: float, cgroup: RunCgroup | None, cpu_limit: float) -> str | None:
    """Wait for the run's first process: None when it ended, "wall" or "cpu" when a limit was reached first."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return "wall"
        try:
            proc.wait(timeout=min(remaining, CPU_POLL) if cgroup else remaining)
            return None
        except subprocess.TimeoutExpired:
            if cgroup is not None and (cgroup.cpu_seconds() or 0.0) >= cpu_limit:
                return "cpu"


def _execute(argv: list[str], files: Mapping[str, str | bytes], stdin: str | bytes, config: SandboxConfig,
             info: SandboxInfo, result_channel: bool = False) -> ExecResult:
    namespaces = info.mode == "namespaces"
    uid = _fresh_uid() if info.drops_to_fresh_uid else None
    run_dir = Path(tempfile.mkdtemp(prefix="vase-sandbox-", dir=config.tmp_root))
    proc = cgroup = None
    life_r, life_w = os.pipe()  # the run's lifeline: if this process dies, the sandbox sees end of file and ends
    try:
        os.chmod(run_dir, 0o700 if namespaces else 0o711)  # plain: the program's uid passes through to work/
        work = run_dir / "work"
        work.mkdir(mode=0o700)
        src = run_dir / "src"
        src.mkdir(mode=0o700)
        for name, content in files.items():
            _private_file(src / name, content.encode() if isinstance(content, str) else content)
        _private_file(run_dir / "stdin", stdin.encode() if isinstance(stdin, str) else stdin)
        for name in ("stdout", "stderr", "result"):
            _private_file(run_dir / name)
        if namespaces:
            (run_dir / "root").mkdir(mode=0o700)
            (run_dir / "stage").mkdir(mode=0o700)
        if info.cgroup_backend is not None:
            try:
                cgroup = info.cgroup_backend.create(config.memory_bytes + config.disk_bytes, config.max_processes)
            except OSError as e:
                return _setup_failure(f"cannot create the run's cgroup: {e}", config)
        work_path = WORK_DIR if namespaces else str(work)
        env = {"PATH": PROGRAM_PATH, "HOME": work_path, "TMPDIR": work_path, "LANG": "C.UTF-8",
               "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", **dict(info.view.env if info.view else ())}
        result_file = run_dir / "result"
        with open(run_dir / "stdin", "rb") as fin, open(run_dir / "stdout", "wb") as fout, \
                open(run_dir / "stderr", "wb") as ferr, open(result_file, "wb") as fres:
            if result_channel:
                env["VASE_RESULT_FD"] = str(fres.fileno())
            spec = {
                "work": work_path, "root": str(run_dir / "root"), "stage": str(run_dir / "stage"),
                "view": list(info.view.ops) if namespaces and info.view else None,
                "files": {n: str(src / n) for n in files}, "argv": argv, "env": env, "uid": uid, "gid": uid,
                "disk_bytes": config.disk_bytes, "status": str(run_dir / "status.json"), "lifeline_fd": life_r,
                "seccomp": info.seccomp_bpf.hex() if info.seccomp_bpf else None,
                "cgroup_procs": cgroup.procs_files if cgroup else [],
                "rlimits": {"cpu": math.ceil(config.timeout), "as": config.memory_bytes,
                            "fsize": config.output_bytes, "nproc": config.max_processes,
                            "nofile": config.max_open_files, "core": 0},
            }
            _private_file(run_dir / "spec.json", json.dumps(spec).encode())
            init = [sys.executable, "-I", "-S", str(INIT_SCRIPT), str(run_dir / "spec.json")]
            cmd = [*_unshare_cmd(info.user_namespace), *init] if namespaces else init
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr,
                                    pass_fds=(fres.fileno(), life_r), start_new_session=True, cwd=run_dir,
                                    env={"PATH": PROGRAM_PATH, "LANG": "C.UTF-8"})
            os.close(life_r)
            life_r = -1
            limit = _wait(proc, t0 + config.timeout + 1.0, cgroup, math.ceil(config.timeout))  # + interpreters' start
            wall = time.monotonic() - t0
        _stop(proc, uid, namespaces, cgroup)
        cpu = cgroup.cpu_seconds() if cgroup else None
        oom_kills = cgroup.oom_kills() if cgroup else 0
        status = _read_json(run_dir / "status.json")
        out_size = (run_dir / "stdout").stat().st_size
        with open(run_dir / "stdout", "rb") as fh:
            stdout = fh.read(config.output_bytes)
        with open(run_dir / "stderr", "rb") as fh:
            fh.seek(max(0, (run_dir / "stderr").stat().st_size - STDERR_TAIL))
            stderr = fh.read()
        result = result_file.read_bytes()[: config.output_bytes] if result_channel else None
        setup_error = status.get("setup_error") if status else None
        if status is None and limit is None and namespaces:  # the namespaces' pid 1 always writes one
            setup_error = "the sandbox ended without a status: " + stderr.decode(errors="replace").strip()[-300:]
        return ExecResult(
            exit_code=status.get("exit") if status else None, signal=status.get("signal") if status else None,
            timed_out=limit == "wall", output_exceeded=out_size >= config.output_bytes, stdout=stdout,
            stderr=stderr, result=result, cpu_seconds=cpu if cpu is not None else (status or {}).get("cpu_seconds"),
            wall_seconds=wall, setup_error=setup_error, limits=config,
            readonly_failures=tuple(status.get("readonly_failures", ())) if status else (),
            cpu_exceeded=limit == "cpu", oom_kills=oom_kills, uid=uid if uid is not None else os.getuid())
    finally:
        if proc is not None and proc.poll() is None:
            _stop(proc, uid, namespaces, cgroup)
        if cgroup is not None and not cgroup.remove():
            raise SandboxError(f"a process of the run could not be ended: cgroup {cgroup.dirs} stays")
        for fd in (life_r, life_w):
            if fd >= 0:
                os.close(fd)
        if uid is not None and not namespaces:
            _sweep(uid)
        _remove(run_dir)


def _setup_failure(why: str, config: SandboxConfig) -> ExecResult:
    return ExecResult(exit_code=None, signal=None, timed_out=False, output_exceeded=False, stdout=b"", stderr=b"",
                      result=None, cpu_seconds=None, wall_seconds=0.0, setup_error=why, limits=config)


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                out.extend(int(c) for c in fh.read().split())
    except OSError:
        pass
    return out


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _pids_of_uid(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as fh:
                for line in fh:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid and _alive(int(name)):
                            pids.append(int(name))
                        break
        except (OSError, ValueError):
            continue
    return pids


def _stop(proc: subprocess.Popen, uid: int | None, namespaces: bool, cgroup: RunCgroup | None,
          patience: float = 10.0) -> None:
    """Kill the run's process group, wait for its pid 1 (namespace teardown), then kill whatever is left of the
    run: the processes of its cgroup and, for a fresh uid, every process of that uid."""
    inits = _children(proc.pid) if namespaces else []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    deadline = time.monotonic() + patience
    while any(_alive(p) for p in inits) and time.monotonic() < deadline:
        time.sleep(0.005)
    while cgroup is not None and cgroup.pids() and time.monotonic() < deadline:
        cgroup.kill()
        time.sleep(0.005)
    if uid is not None:
        while time.monotonic() < deadline:
            pids = _pids_of_uid(uid)
            if not pids:
                break
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.005)


def _sweep(uid: int) -> None:
    """Plain mode: remove what a fresh uid left in the world-writable folders (in namespaces it sees none)."""
    for folder in WORLD_WRITABLE:
        try:
            entries = os.listdir(folder)
        except OSError:
            continue
        for name in entries:
            path = os.path.join(folder, name)
            try:
                if os.lstat(path).st_uid != uid:
                    continue
                if os.path.isdir(path) and not os.path.islink(path):
                    _remove(Path(path))
                else:
                    os.unlink(path)
            except OSError:
                pass


def _remove(path: Path) -> None:
    def fix(func, p, exc):  # a program may leave folders without permissions (plain mode)
        try:
            os.chmod(p if os.path.isdir(p) else os.path.dirname(p), 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)

"""Run untrusted Python programs (model-written code) contained: `run_python`, `SandboxConfig`, `probe`.

Each program runs in its own process group, in a fresh temporary folder, with a scrubbed environment and
resource limits, under a wall-clock limit that kills the whole group. Where the OS allows (Linux, util-linux
`unshare`), it also gets new network, mount, pid, ipc and uts namespaces: no network at all (not even a usable
loopback), a read-only view of the whole file system with a private size-limited tmpfs on /tmp as its only
writable folder and working directory, and a pid namespace whose death kills every process the program
started. `vase_jax/sandbox/init.py` (the namespace's pid 1) sets that up; its docstring has the details.

Who the program runs as:

* started as root: a fresh uid/gid from a range no account uses (`UID_BASE` + random), no supplementary groups,
  no capabilities, no-new-privileges. Root ignores RLIMIT_NPROC, an unprivileged uid does not, so the
  process limit holds; and every process left with that uid is killed after the run.
* started as a normal user: inside a user namespace (`unshare --user --map-root-user`) as its root, with no
  capabilities (securebits NOROOT, empty bounding set, no-new-privileges); the kernel sees the caller's uid.

A run also holds a "lifeline" pipe to the sandbox's first process: if the grader dies mid-run (killed), the
sandbox sees end of file and ends the run, so no program outlives its grader.

Limits (`SandboxConfig`): CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), file size (RLIMIT_FSIZE, which
also caps stdout: it is a file), processes and threads (RLIMIT_NPROC), open files, no core files, the tmpfs
size, and the wall clock. A program that forks up to the process limit and fills its memory limit in each
process can hold `max_processes * memory_bytes` bytes until the wall clock kills it (a cgroup would bound the
sum; none is used).

When namespaces are not available (`probe` finds out once per process), programs run in the "plain" mode:
process group, limits, scrubbed environment, temporary folder, privilege drop when root, but no network
isolation and no read-only view; `SandboxInfo.describe` says so, and `scripts/eval.py` prints it at the start
of a run.
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

INIT_SCRIPT = Path(__file__).with_name("init.py")
ISOLATION_MODES = ("auto", "namespaces", "plain")
UID_BASE = 1_600_000_000  # fresh sandbox uids are UID_BASE + [0, UID_SPAN): far above any account's uid
UID_SPAN = 400_000_000
NAMESPACE_FLAGS = ("--fork", "--kill-child", "--pid", "--mount-proc", "--mount", "--net", "--ipc", "--uts",
                   "--propagation", "private")
STDERR_TAIL = 8192
PROGRAM_PATH = "/usr/bin:/bin"


class SandboxError(RuntimeError):
    """The sandbox itself cannot run (not a verdict on a program)."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits of one program run. `timeout` is wall-clock seconds; the CPU limit is ceil(timeout) seconds.

    isolation: "auto" (namespaces when the OS allows, else plain with a warning), "namespaces" (required:
    raise SandboxError when unavailable) or "plain". python: the interpreter for the program; None picks the
    first of this interpreter, its base interpreter and `python3` on PATH that the sandbox user can run.
    """

    timeout: float = 30.0
    memory_bytes: int = 2 << 30  # RLIMIT_AS per process
    output_bytes: int = 64 << 20  # RLIMIT_FSIZE: stdout, stderr and any file the program writes
    disk_bytes: int = 64 << 20  # size of the private tmpfs work folder (namespaces mode)
    max_processes: int = 8  # RLIMIT_NPROC: processes and threads of the sandbox user
    max_open_files: int = 256
    isolation: str = "auto"
    python: str | None = None
    tmp_root: str | None = None  # where run folders are made (default: tempfile.gettempdir())

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
        return self


@dataclasses.dataclass(frozen=True)
class SandboxInfo:
    """What the sandbox can do on this machine (from `probe`)."""

    mode: str  # "namespaces" or "plain"
    user_namespace: bool  # namespaces created inside a user namespace (the caller is not root)
    drops_to_fresh_uid: bool  # the caller is root: programs run as a fresh unprivileged uid
    python: str
    readonly_failures: tuple[str, ...]  # mounts that stayed writable (namespaces mode; should be empty)
    warnings: tuple[str, ...]  # what is NOT contained, in words

    def describe(self) -> str:
        """A few lines for the start of a run: the isolation in force and, clearly, what is missing."""
        if self.mode == "namespaces":
            who = ("a fresh unprivileged uid, no capabilities" if self.drops_to_fresh_uid
                   else "root of a user namespace without capabilities (your uid outside)")
            head = ("sandbox: namespaces (net, mount, pid, ipc, uts): no network, read-only file system with a "
                    f"private tmpfs on /tmp as the work folder; programs run as {who}; python {self.python}")
        else:
            who = "a fresh unprivileged uid" if self.drops_to_fresh_uid else "your own user"
            head = f"sandbox: plain process groups with resource limits, as {who}; python {self.python}"
        return "\n".join([head, *(f"sandbox WARNING: {w}" for w in self.warnings)])


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
    cpu_seconds: float | None
    wall_seconds: float
    setup_error: str | None = None
    limits: SandboxConfig | None = None
    readonly_failures: tuple[str, ...] = ()  # mounts the sandbox could not make read-only

    def failure(self) -> str | None:
        if self.setup_error:
            return f"sandbox error: {self.setup_error}"
        timeout = self.limits.timeout if self.limits else None
        if self.timed_out:
            return f"time limit exceeded ({timeout:g} s wall clock)" if timeout else "time limit exceeded"
        cpu_limit = math.ceil(timeout) if timeout else None
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
            return f"runtime error (exit code {self.exit_code})" + (f": {last[:300]}" if last else "")
        return None


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

    Raises SandboxError when config.isolation is "namespaces" and they are unavailable, or when no Python
    interpreter can be run by the sandbox user.
    """
    config = (config or SandboxConfig()).validate()
    key = (config.isolation, config.python, config.tmp_root)
    with _probe_lock:
        if key in _probe_cache:
            return _probe_cache[key]
        info = _probe(config)
        _probe_cache[key] = info
        return info


def _probe(config: SandboxConfig) -> SandboxInfo:
    root = os.geteuid() == 0
    warnings: list[str] = []
    mode = "plain"
    if config.isolation != "plain":
        why = _try_namespaces(user_ns=not root)
        if why is None:
            mode = "namespaces"
        elif config.isolation == "namespaces":
            raise SandboxError(f"isolation='namespaces' is not available here: {why}")
        else:
            warnings.append(f"no namespaces ({why}): programs run WITH network access and WITHOUT a read-only "
                            "file-system view" + ("" if root else "; install util-linux or allow unprivileged "
                                                  "user namespaces to fix this"))
    if mode == "plain":
        if root:
            warnings.append("a program can write wherever any user may (e.g. /tmp), and a process that leaves "
                            "its group survives until the run's end, when every process of its uid is killed")
        else:
            warnings.append("programs run as YOUR user: they can read and change your files and signal your "
                            "processes; run as root or enable user namespaces for real containment")
    info = SandboxInfo(mode=mode, user_namespace=mode == "namespaces" and not root, drops_to_fresh_uid=root,
                       python="", readonly_failures=(), warnings=())
    candidates = [config.python] if config.python else list(dict.fromkeys(
        c for c in (sys.executable, os.path.realpath(sys.executable), getattr(sys, "_base_executable", None),
                    shutil.which("python3", path=PROGRAM_PATH), shutil.which("python3")) if c))
    tried = []
    probe_config = dataclasses.replace(config, timeout=max(config.timeout, 20.0))
    for exe in candidates:
        res = _execute([exe, "-I", "-S", "-c", "import sys; print(sys.version_info >= (3, 8))"], {}, b"",
                       probe_config, info)
        if res.stdout.strip() == b"True" and res.exit_code == 0:
            failures = res.readonly_failures
            if failures:
                warnings.append("these mounts stayed writable inside the sandbox: " + ", ".join(failures))
            return dataclasses.replace(info, python=exe, readonly_failures=failures, warnings=tuple(warnings))
        tried.append(f"{exe}: {res.failure() or res.stdout[:100]!r}")
    raise SandboxError("no Python interpreter that the sandbox user can run (pass SandboxConfig(python=...)); "
                       "tried " + "; ".join(tried))


def run_python(files: Mapping[str, str | bytes], script: str, args: Sequence[str] = (), stdin: str | bytes = b"",
               config: SandboxConfig | None = None, result_channel: bool = False) -> ExecResult:
    """Run `python -I -B <script> *args` in a fresh sandbox whose work folder holds `files` (name -> content).

    stdin is fed from a file; stdout and stderr go to files capped at `config.output_bytes`. With
    `result_channel`, the program finds a writable file descriptor number in the environment variable
    VASE_RESULT_FD, and what it writes there is `ExecResult.result` (kept apart from stdout). Never raises for
    what the program does; raises SandboxError if the sandbox cannot start at all.
    """
    config = (config or SandboxConfig()).validate()
    for name in files:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"files: name {name!r} must be a plain file name")
    if script not in files:
        raise ValueError(f"script={script!r} is not one of the files")
    info = probe(config)
    argv = [info.python, "-I", "-B", script, *args]
    return _execute(argv, files, stdin, config, info, result_channel=result_channel)


def _fresh_uid() -> int:
    return UID_BASE + secrets.randbelow(UID_SPAN)


def _execute(argv: list[str], files: Mapping[str, str | bytes], stdin: str | bytes, config: SandboxConfig,
             info: SandboxInfo, result_channel: bool = False) -> ExecResult:
    uid = _fresh_uid() if info.drops_to_fresh_uid else None
    run_dir = Path(tempfile.mkdtemp(prefix="vase-sandbox-", dir=config.tmp_root))
    proc = None
    life_r, life_w = os.pipe()  # the run's lifeline: if this process dies, the sandbox sees end of file and ends
    try:
        os.chmod(run_dir, 0o711)  # the sandbox user may pass through to work/, not list the rest
        work = run_dir / "work"
        work.mkdir(mode=0o700)
        (run_dir / "root").mkdir(mode=0o700)  # mount point of the read-only view (namespaces mode)
        src = run_dir / "src"
        src.mkdir(mode=0o700)
        for name, content in files.items():
            (src / name).write_bytes(content.encode() if isinstance(content, str) else content)
        (run_dir / "stdin").write_bytes(stdin.encode() if isinstance(stdin, str) else stdin)
        env = {"PATH": PROGRAM_PATH, "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
               "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        result_file = run_dir / "result"
        with open(run_dir / "stdin", "rb") as fin, open(run_dir / "stdout", "wb") as fout, \
                open(run_dir / "stderr", "wb") as ferr, open(result_file, "wb") as fres:
            if result_channel:
                env["VASE_RESULT_FD"] = str(fres.fileno())
            spec = {
                "work": str(work), "root": str(run_dir / "root"), "files": {n: str(src / n) for n in files},
                "argv": argv, "env": env,
                "uid": uid, "gid": uid, "isolate_fs": info.mode == "namespaces",
                "isolate_pids": info.mode == "namespaces", "disk_bytes": config.disk_bytes,
                "status": str(run_dir / "status.json"), "lifeline_fd": life_r,
                "rlimits": {"cpu": math.ceil(config.timeout), "as": config.memory_bytes,
                            "fsize": config.output_bytes, "nproc": config.max_processes,
                            "nofile": config.max_open_files, "core": 0},
            }
            (run_dir / "spec.json").write_text(json.dumps(spec))
            init = [sys.executable, "-I", "-S", str(INIT_SCRIPT), str(run_dir / "spec.json")]
            cmd = [*_unshare_cmd(info.user_namespace), *init] if info.mode == "namespaces" else init
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr,
                                    pass_fds=(fres.fileno(), life_r), start_new_session=True, cwd=run_dir,
                                    env={"PATH": PROGRAM_PATH, "LANG": "C.UTF-8"})
            os.close(life_r)
            life_r = -1
            timed_out = False
            try:
                proc.wait(timeout=config.timeout + 1.0)  # + startup of the interpreters
            except subprocess.TimeoutExpired:
                timed_out = True
            wall = time.monotonic() - t0
        _stop(proc, uid, info.mode == "namespaces")
        status = _read_json(run_dir / "status.json")
        out_size = (run_dir / "stdout").stat().st_size
        with open(run_dir / "stdout", "rb") as fh:
            stdout = fh.read(config.output_bytes)
        with open(run_dir / "stderr", "rb") as fh:
            fh.seek(max(0, (run_dir / "stderr").stat().st_size - STDERR_TAIL))
            stderr = fh.read()
        result = result_file.read_bytes()[: config.output_bytes] if result_channel else None
        setup_error = status.get("setup_error") if status else None
        if status is None and not timed_out:
            setup_error = "the sandbox ended without a status: " + stderr.decode(errors="replace").strip()[-300:]
        return ExecResult(
            exit_code=status.get("exit") if status else None, signal=status.get("signal") if status else None,
            timed_out=timed_out, output_exceeded=out_size >= config.output_bytes, stdout=stdout,
            stderr=stderr, result=result, cpu_seconds=status.get("cpu_seconds") if status else None,
            wall_seconds=wall, setup_error=setup_error, limits=config,
            readonly_failures=tuple(status.get("readonly_failures", ())) if status else ())
    finally:
        if proc is not None and proc.poll() is None:
            _stop(proc, uid, info.mode == "namespaces")
        for fd in (life_r, life_w):
            if fd >= 0:
                os.close(fd)
        _remove(run_dir)


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


def _stop(proc: subprocess.Popen, uid: int | None, namespaces: bool, patience: float = 10.0) -> None:
    """Kill the run's process group, wait for its pid 1 (namespace teardown), then kill any process of its uid."""
    inits = _children(proc.pid) if namespaces else []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    deadline = time.monotonic() + patience
    while any(_alive(p) for p in inits) and time.monotonic() < deadline:
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


def _remove(path: Path) -> None:
    def fix(func, p, exc):  # a program may leave folders without permissions (plain mode)
        try:
            os.chmod(p if os.path.isdir(p) else os.path.dirname(p), 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)

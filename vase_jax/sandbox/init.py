"""The sandbox's first process: set up isolation, then run the untrusted program as an unprivileged child.

Run as `python -I -S init.py SPEC.json` by `vase_jax.sandbox.core` (standard library only: it is executed as a
script, not imported). In the "namespaces" mode it is pid 1 of a fresh pid namespace (started by util-linux
`unshare --fork --kill-child --pid --mount-proc --mount --net --ipc --uts`), root inside its namespaces, and:

1. opens the `cgroup.procs` files of the run's cgroup (if any), for the program to join before it execs;
2. builds the program's root on an empty tmpfs from the plan of `vase_jax/sandbox/view.py`: folders,
   symlinks and generated files, read-only binds of the interpreter, its standard library and the shared
   libraries it loads, the devices null, zero and urandom, a read-only /proc of its pid namespace;
3. mounts the run's size-limited tmpfs (nosuid, nodev, noexec) at a staging point, binds its `work` folder at
   /tmp (the program's working directory, holding the program's files) and its `shm` folder at /dev/shm, so
   that every file the program can write shares one size limit, then detaches the staging mount;
4. makes every other mount of the new root read-only with bind remounts (the source mount's locked
   nosuid/nodev/noexec/atime flags kept) and checks, from /proc/self/mountinfo, that none stayed writable:
   if one did, the program does not run and the status carries a setup error;
5. `pivot_root`s into the new root and detaches the old one: the host's file system is no longer reachable
   from this mount namespace at all (where pivot_root is refused, it moves the new root over / and chroots);
6. makes itself non-dumpable (no ptrace or /proc/1/mem access by a program of the same uid), forks the child,
   which joins the cgroup, sets the resource limits, no-new-privileges, "root has no capabilities" (securebits
   NOROOT, locked), an empty capability bounding set, the unprivileged uid/gid (when the caller was root),
   installs the syscall filter (raw BPF from `vase_jax/sandbox/seccomp.py`) and execs the program;
7. reaps every process until the program ends, writes the status (exit code or signal, CPU seconds of the
   program and of every orphan reaped) and exits, which makes the kernel kill whatever is left in the namespace.

The parent kills this process group at the wall-clock limit; this process was started with the parent-death
signal SIGKILL (`--kill-child`), so the namespace dies with it. If the parent itself dies (killed while a
program sleeps), the "lifeline" pipe it holds reaches end of file and a watcher thread here ends the run the
same way. In the "plain" mode (no namespaces) steps 2-5 are skipped and the work folder is a real folder.

A failure before the program starts is reported through a close-on-exec pipe from the child and ends up in the
status file as `setup_error`.
"""

import ctypes
import json
import os
import platform
import resource
import shutil
import signal
import sys
import threading

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_MOVE, MS_REC = 32, 1024, 2048, 4096, 8192, 16384
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
MNT_DETACH = 2
MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_CAPBSET_DROP = 1, 4, 22, 24
PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 28, 38, 47, 4
SECCOMP_MODE_FILTER = 2
SECBIT_NOROOT, SECBIT_NOROOT_LOCKED = 1 << 0, 1 << 1
RLIMITS = {"cpu": resource.RLIMIT_CPU, "as": resource.RLIMIT_AS, "fsize": resource.RLIMIT_FSIZE,
           "nproc": resource.RLIMIT_NPROC, "nofile": resource.RLIMIT_NOFILE, "core": resource.RLIMIT_CORE}
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}
SKELETON_OPTIONS = "size=4m,nr_inodes=8192,mode=0755"
WORK_INODES = 16384  # files and folders the program may create on its tmpfs

_libc = ctypes.CDLL(None, use_errno=True)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data, what):
    enc = [None if v is None else v.encode() for v in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], flags, enc[3]), what)


def _unescape(path):
    """mountinfo escapes space, tab, newline and backslash as \\ooo octal."""
    out, i = [], 0
    while i < len(path):
        code = path[i + 1:i + 4]
        if path[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def _mounts():
    """(mount point, per-mount options) of this mount namespace, parents before children."""
    with open("/proc/self/mountinfo") as fh:
        rows = [line.split() for line in fh if line.strip()]
    return [(_unescape(r[4]), r[5].split(",")) for r in rows]


def _apply(root, op):
    """Carry out one operation of the view plan (see vase_jax/sandbox/view.py) under `root`."""
    kind = op[0]
    if kind == "dir":
        os.makedirs(root + op[1], mode=0o755, exist_ok=True)
    elif kind == "symlink":
        if not os.path.lexists(root + op[1]):
            os.symlink(op[2], root + op[1])
    elif kind == "file":
        with open(root + op[1], "w") as fh:
            fh.write(op[2])
        os.chmod(root + op[1], 0o644)
    elif kind in ("bind", "dev"):
        source, target = (op[1], root + op[2]) if kind == "bind" else ("/dev/" + op[1], root + "/dev/" + op[1])
        if os.path.isdir(source):
            os.makedirs(target, mode=0o755, exist_ok=True)
        elif not os.path.exists(target):
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            open(target, "a").close()
        _mount(source, target, None, MS_BIND | MS_REC, None, f"bind {source} at {target}")
    elif kind == "hide":
        _mount("tmpfs", root + op[1], "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555",
               "hide " + op[1])
    elif kind == "proc":
        os.makedirs(root + op[1], mode=0o555, exist_ok=True)
        try:
            _mount("proc", root + op[1], "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, None, "mount proc")
        except OSError:  # a fresh proc mount can be refused in a user namespace; unshare's own one is the same
            _mount("/proc", root + op[1], None, MS_BIND | MS_REC, None, "bind /proc")
    else:
        raise OSError(f"unknown view operation {kind!r}")


def make_readonly(root, writable):
    """Remount every mount under `root` but `writable` read-only; return those left writable (view paths)."""
    def inside(point):
        return point == root or point.startswith(root + "/")

    for point, opts in _mounts():
        if not inside(point) or point in writable or "ro" in opts:
            continue
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for opt in opts:
            flags |= MOUNT_FLAGS.get(opt, 0)
        _libc.mount(None, point.encode(), None, flags, None)  # failures are collected below, all at once
    top = {}  # a mount stacked on another at the same point hides it: only the last one is reachable
    for point, opts in _mounts():
        if inside(point):
            top[point] = opts
    return sorted(point[len(root):] or "/" for point, opts in top.items()
                  if "ro" not in opts and point not in writable)


def _pivot(root):
    """Make `root` this mount namespace's root and drop the old one (fallback: move it over / and chroot)."""
    os.chdir(root)
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is not None and _libc.syscall(number, b".", b".") == 0:
        _check(_libc.umount2(b".", MNT_DETACH), "detach the old root")
    else:
        _mount(".", "/", None, MS_MOVE, None, "move the new root over /")
        os.chroot(".")
    os.chdir("/")


def build_view(spec, uid, gid):
    """Steps 2-5 of the module docstring. Returns the mounts that stayed writable (empty when all is well)."""
    root, stage, work = spec["root"], spec["stage"], spec["work"]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, SKELETON_OPTIONS, "mount the view's tmpfs")
    for op in spec["view"]:
        _apply(root, op)
    _mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
           f"size={spec['disk_bytes']},nr_inodes={WORK_INODES},mode=0755", "mount the work tmpfs")
    for name, target in (("work", work), ("shm", "/dev/shm")):
        os.mkdir(os.path.join(stage, name), 0o700)
        os.chown(os.path.join(stage, name), uid, gid)
        os.makedirs(root + target, mode=0o755, exist_ok=True)
        _mount(os.path.join(stage, name), root + target, None, MS_BIND, None, f"bind the work tmpfs at {target}")
    _check(_libc.umount2(stage.encode(), MNT_DETACH), "detach the staging mount")
    copy_files(spec["files"], root + work, uid, gid)
    failures = make_readonly(root, {root + work, root + "/dev/shm"})
    if not failures:
        _pivot(root)
    return failures


def copy_files(files, folder, uid, gid):
    for name, src in files.items():
        dst = os.path.join(folder, name)
        shutil.copyfile(src, dst)
        os.chmod(dst, 0o600)
        os.chown(dst, uid, gid)
    os.chown(folder, uid, gid)
    os.chmod(folder, 0o700)


def drop_privileges(spec):
    """In the child, before exec: limits, no-new-privs, no root capabilities, unprivileged ids."""
    for name, value in spec["rlimits"].items():
        resource.setrlimit(RLIMITS[name], (value, value + 1 if name == "cpu" else value))
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    if os.geteuid() == 0:
        _check(_libc.prctl(PR_SET_SECUREBITS, SECBIT_NOROOT | SECBIT_NOROOT_LOCKED, 0, 0, 0), "securebits")
        _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        cap = 0
        while _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
            cap += 1
    uid, gid = spec["uid"], spec["gid"]
    if uid is not None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise OSError(f"could not switch to uid {uid}")
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")


def install_filter(bpf):
    """Install a raw seccomp BPF program (struct sock_filter[]) for this process and its future children."""
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _SockFprog(len(bpf) // 8, ctypes.addressof(buf))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "install the syscall filter")


def main():
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    status_file = open(spec["status"], "w")  # opened before the host's file system goes out of reach
    status = {"readonly_failures": []}
    work = spec["work"]
    uid = spec["uid"] if spec["uid"] is not None else os.getuid()
    gid = spec["gid"] if spec["gid"] is not None else os.getgid()
    bpf = bytes.fromhex(spec["seccomp"]) if spec.get("seccomp") else None
    try:
        with open("/proc/self/oom_score_adj", "w") as fh:  # the OOM killer takes the run, never the grader
            fh.write("1000")
        cgroup_fds = [os.open(p, os.O_WRONLY | os.O_CLOEXEC) for p in spec.get("cgroup_procs", ())]
        if spec.get("view") is not None:
            status["readonly_failures"] = build_view(spec, uid, gid)
            if status["readonly_failures"]:
                raise OSError("these mounts of the view stayed writable: " + ", ".join(status["readonly_failures"]))
        else:
            copy_files(spec["files"], work, uid, gid)
    except OSError as e:
        status["setup_error"] = f"preparing the sandbox: {e}"
        _write_status(status_file, status)
        return
    spec["env"].update(HOME=work, TMPDIR=work)
    if spec.get("view") is None:  # plain mode: die with the parent; the namespace mode has --kill-child
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    lifeline = spec.get("lifeline_fd")
    if lifeline is not None:
        os.set_inheritable(lifeline, False)  # not for the program
    rfd, wfd = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(rfd)
            for fd in cgroup_fds:
                os.write(fd, b"0")
            os.chdir(work)  # while still root: the folders above it need not be reachable by the program's uid
            drop_privileges(spec)
            if bpf is not None:
                install_filter(bpf)
            os.execve(spec["argv"][0], spec["argv"], spec["env"])
        except BaseException as e:  # noqa: B036 - report anything, then leave without running user code
            try:
                os.write(wfd, (f"{type(e).__name__}: {e}").encode()[:2000])
            finally:
                os._exit(127)
    os.close(wfd)
    for fd in cgroup_fds:
        os.close(fd)
    if lifeline is not None:  # the parent holds the other end: end of file = the parent died, so end the run
        threading.Thread(target=_watch, args=(lifeline, spec.get("view") is not None), daemon=True).start()
    err = b""
    while True:
        chunk = os.read(rfd, 4096)
        if not chunk:
            break
        err += chunk
    os.close(rfd)
    if err:
        status["setup_error"] = "starting the program: " + err.decode(errors="replace")
    cpu = 0.0
    while True:  # reap everything (pid 1 inherits orphans) until the program itself has ended
        try:
            done, wstatus, usage = os.wait4(-1, 0)
        except ChildProcessError:
            break
        cpu += usage.ru_utime + usage.ru_stime  # the program's own time includes the children it reaped
        if done == pid:
            if os.WIFSIGNALED(wstatus):
                status["signal"] = os.WTERMSIG(wstatus)
            else:
                status["exit"] = os.WEXITSTATUS(wstatus)
            break
    status["cpu_seconds"] = cpu
    _write_status(status_file, status)


def _watch(fd, namespace):
    while os.read(fd, 4096):
        pass
    if not namespace:  # plain mode: the program is in this process group
        os.killpg(0, signal.SIGKILL)
    os._exit(1)  # pid 1 of the namespace: its exit kills everything left in it


def _write_status(fh, status):
    with fh:
        json.dump(status, fh)


if __name__ == "__main__":
    main()

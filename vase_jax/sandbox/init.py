"""The sandbox's first process: set up isolation, then run the untrusted program as an unprivileged child.

Run as `python -I -S init.py SPEC.json` by `vase_jax.sandbox.run` (standard library only: it is executed as a
script, not imported). In the "namespaces" mode it is pid 1 of a fresh pid namespace (started by util-linux
`unshare --fork --kill-child --pid --mount-proc --mount --net --ipc --uts`), root inside its namespaces, and:

1. binds the whole tree (`MS_BIND | MS_REC`) at an empty folder of the run and makes each mount of that copy
   read-only with a *bind* remount (`MS_BIND | MS_REMOUNT | MS_RDONLY`, the mount's own nosuid/nodev/noexec/
   atime flags kept), which changes a per-mount flag of this mount namespace only, never a file system's
   superblock: the rest of the machine is untouched;
2. mounts a size-limited tmpfs (nosuid, nodev, noexec) on /tmp of that copy (on the run's work folder if the
   system has no /tmp): the program's only writable place and its working directory, gone with the namespace;
3. copies the program's files into it and chroots into the copy (the program has no capability to leave a
   chroot); then forks the child, which sets the resource limits, sets
   no-new-privileges, locks "root has no capabilities" (securebits NOROOT), drops the capability bounding set,
   switches to the unprivileged uid/gid (when one is given: the caller was root) and execs the program;
4. reaps every process until the program ends, writes the program's status (exit code or signal, CPU seconds)
   to the status file and exits, which makes the kernel kill whatever the program left in the namespace.

The parent kills this process group at the wall-clock limit; this process was started with the parent-death
signal SIGKILL (`--kill-child`, kept because it never changes its credentials), so the namespace dies with it.
If the parent itself dies (killed while a program sleeps), the "lifeline" pipe it holds reaches end of file and
a watcher thread here ends the run the same way.
In the "plain" mode (no namespaces) steps 1-2 are skipped and the work directory is a real folder.

A failure before the program starts is reported through a close-on-exec pipe from the child and ends up in the
status file as `setup_error`.
"""

import ctypes
import json
import os
import resource
import shutil
import signal
import sys
import threading

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
SECBIT_NOROOT, SECBIT_NOROOT_LOCKED = 1 << 0, 1 << 1
RLIMITS = {"cpu": resource.RLIMIT_CPU, "as": resource.RLIMIT_AS, "fsize": resource.RLIMIT_FSIZE,
           "nproc": resource.RLIMIT_NPROC, "nofile": resource.RLIMIT_NOFILE, "core": resource.RLIMIT_CORE}

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


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


def readonly_tree(new_root):
    """Bind the whole file system tree at `new_root`, then make each of its mounts read-only.

    A new bind, not the original mounts: a mount with files open for writing (the run's stdout and status files,
    held by this process) cannot turn read-only. Returns the mount points of the new tree left writable.
    """
    _check(_libc.mount(b"/", new_root.encode(), None, MS_BIND | MS_REC, None), "bind / at " + new_root)

    def inside(point):
        return point == new_root or point.startswith(new_root + "/")

    for point, opts in _mounts():
        if not inside(point) or "ro" in opts:
            continue
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for opt in opts:
            flags |= MOUNT_FLAGS.get(opt, 0)
        _libc.mount(None, point.encode(), None, flags, None)  # failures are collected below, all at once
    top = {}  # a mount stacked on another at the same point hides it: only the last one is reachable
    for point, opts in _mounts():
        if inside(point):
            top[point] = opts
    return sorted(point[len(new_root):] or "/" for point, opts in top.items() if "ro" not in opts)


def mount_work(work, size, uid, gid):
    opts = f"size={size},mode=0700,uid={uid},gid={gid}"
    _check(_libc.mount(b"tmpfs", work.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts.encode()),
           "mount tmpfs on " + work)


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


def main():
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    status_file = open(spec["status"], "w")  # opened before the file system turns read-only; not inherited
    status = {"readonly_failures": []}
    work = spec["work"]
    uid = spec["uid"] if spec["uid"] is not None else os.getuid()
    gid = spec["gid"] if spec["gid"] is not None else os.getgid()
    try:
        new_root = spec["root"] if spec["isolate_fs"] else ""
        if new_root:
            status["readonly_failures"] = readonly_tree(new_root)
            if os.path.isdir(new_root + "/tmp"):  # the private tmpfs replaces /tmp in the view: always reachable,
                work = "/tmp"                      # and the host's /tmp stays out of sight
            mount_work(new_root + work, spec["disk_bytes"], uid, gid)
        for name, src in spec["files"].items():
            dst = os.path.join(new_root + work, name)
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o600)
            os.chown(dst, uid, gid)
        os.chown(new_root + work, uid, gid)
        os.chmod(new_root + work, 0o700)
        if new_root:  # the original, writable tree becomes unreachable (no capabilities to leave a chroot)
            os.chroot(new_root)
            os.chdir("/")
        spec["env"].update(HOME=work, TMPDIR=work)
    except OSError as e:
        status["setup_error"] = f"preparing the sandbox: {e}"
        _write_status(status_file, status)
        return
    if not spec["isolate_pids"]:  # plain mode: die with the parent; the namespace mode has --kill-child
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if spec.get("lifeline_fd") is not None:
        os.set_inheritable(spec["lifeline_fd"], False)  # not for the program
    rfd, wfd = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(rfd)
            os.chdir(work)  # while still root: the folders above it need not be reachable by the program's uid
            drop_privileges(spec)
            os.execve(spec["argv"][0], spec["argv"], spec["env"])
        except BaseException as e:  # noqa: B036 - report anything, then leave without running user code
            try:
                os.write(wfd, (f"{type(e).__name__}: {e}").encode()[:2000])
            finally:
                os._exit(127)
    os.close(wfd)
    lifeline = spec.get("lifeline_fd")
    if lifeline is not None:  # the parent holds the other end: end of file = the parent died, so end the run
        threading.Thread(target=_watch, args=(lifeline, spec["isolate_pids"]), daemon=True).start()
    err = b""
    while True:
        chunk = os.read(rfd, 4096)
        if not chunk:
            break
        err += chunk
    os.close(rfd)
    if err:
        status["setup_error"] = "starting the program: " + err.decode(errors="replace")
    while True:  # reap everything (pid 1 inherits orphans) until the program itself has ended
        try:
            done, wstatus, usage = os.wait4(-1, 0)
        except ChildProcessError:
            break
        if done == pid:
            if os.WIFSIGNALED(wstatus):
                status["signal"] = os.WTERMSIG(wstatus)
            else:
                status["exit"] = os.WEXITSTATUS(wstatus)
            status["cpu_seconds"] = usage.ru_utime + usage.ru_stime
            break
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

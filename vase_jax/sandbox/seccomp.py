"""The sandbox's syscall filter: what a test program never needs, refused with an error (not a kill).

Built once per process with libseccomp (through `pyseccomp`, a ctypes binding) and exported as a raw BPF
program, which `init.py` installs in the program's process just before `execve` (PR_SET_NO_NEW_PRIVS is set
first, so no privilege is needed). The filter allows by default and refuses:

* the kernel keyring (`add_key`, `request_key`, `keyctl`): keys belong to a user, not a process, and would
  outlive the run;
* memory that no file-system size bounds: `memfd_create`, `memfd_secret`, System V shared memory, semaphores
  and message queues, POSIX message queues (a program's files live on its size-limited tmpfs, /dev/shm included);
* other processes' memory: `ptrace`, `process_vm_readv`, `process_vm_writev`, `kcmp`;
* file systems and namespaces: the mount family, `pivot_root`, `chroot`, `unshare`, `setns`, and `clone` with
  any CLONE_NEW* flag (`clone3`, whose flags a filter cannot read, answers ENOSYS, and the C library falls
  back to `clone`);
* sockets: `socket` for every address family (EACCES), so no connection to the network or to a unix socket,
  whatever the file system shows; `socketpair` stays, for pipes between a program's own processes;
* kernel interfaces a program has no use for: io_uring, bpf, perf_event_open, userfaultfd, fanotify,
  file handles, modules, kexec, swap, reboot, accounting, quotas, and the like.

Calls from another ABI (32-bit `int 0x80` on x86-64, x32) kill the process: libseccomp's filter checks the
architecture first.
"""

from __future__ import annotations

import errno
import os
import tempfile

REFUSED = (
    # keys belong to a user and outlive processes
    "add_key", "request_key", "keyctl",
    # memory-backed objects that no tmpfs size limits, and IPC objects that belong to a user or namespace
    "memfd_create", "memfd_secret", "shmget", "shmat", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl",
    "semget", "semop", "semtimedop", "semctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive",
    "mq_notify", "mq_getsetattr",
    # other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # mounts and namespaces
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "mount_setattr", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick",
    # kernel interfaces a test program never uses
    "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "perf_event_open", "userfaultfd",
    "fanotify_init", "name_to_handle_at", "open_by_handle_at", "init_module", "finit_module", "delete_module",
    "kexec_load", "kexec_file_load", "swapon", "swapoff", "reboot", "acct", "quotactl", "quotactl_fd",
    "lookup_dcookie", "syslog", "vhangup", "iopl", "ioperm", "uselib", "personality",
)
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (CLONE_NEWTIME shares clone's signal byte;
# it only exists for clone3 and unshare, both refused)
CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
DESCRIPTION = ("keyring, memfd and System V / POSIX-queue IPC, ptrace, mount and namespace calls, sockets (all "
               "families), io_uring, bpf, perf and other kernel interfaces")


class SeccompUnavailable(RuntimeError):
    """libseccomp (or its binding) is missing here; the message says which and how to get it."""


def build_filter() -> tuple[bytes, tuple[str, ...]]:
    """The filter as raw BPF (struct sock_filter[]) and the refused calls this libseccomp did not know.

    Raises SeccompUnavailable when `pyseccomp` or the libseccomp shared library cannot be loaded.
    """
    try:
        import pyseccomp  # noqa: PLC0415 (optional: its absence is reported and the weaker mode named)
    except (ImportError, RuntimeError, OSError) as e:
        raise SeccompUnavailable(f"pyseccomp / libseccomp cannot be loaded ({e}); `pip install pyseccomp` and the "
                                 "libseccomp2 shared library (Debian/Ubuntu: libseccomp2) are needed") from None
    refuse = pyseccomp.ERRNO(errno.EPERM)
    filt = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    unknown = []
    for name in dict.fromkeys(REFUSED):
        try:
            filt.add_rule(refuse, name)
        except OSError:  # a call this libseccomp version does not know (older than the kernel's list)
            unknown.append(name)
    filt.add_rule(pyseccomp.ERRNO(errno.EACCES), "socket")
    for flag in CLONE_NAMESPACE_FLAGS:
        filt.add_rule(refuse, "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, flag, flag))
    try:
        filt.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    except OSError:
        unknown.append("clone3")
    with tempfile.TemporaryFile() as fh:
        filt.export_bpf(fh)
        fh.seek(0, os.SEEK_SET)
        bpf = fh.read()
    if not bpf or len(bpf) % 8:
        raise SeccompUnavailable(f"libseccomp exported {len(bpf)} bytes, not a BPF program")
    return bpf, tuple(unknown)

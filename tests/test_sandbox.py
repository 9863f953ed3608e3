"""vase_jax.sandbox through LiveCodeBench grading: hostile programs are contained, graded as failures with a
short reason, leave nothing behind (no file outside their folder, no process, key, IPC object, cgroup or run
folder) and the next program runs normally. Limits are small (2 s, 256 MiB, 1 MiB of output) to keep the suite
fast; no timing asserts. The table needs what this machine has (root, namespaces, libseccomp, a cgroup); a case
that needs a missing one is skipped with the reason."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import sys
import tempfile
import typing
import uuid
from pathlib import Path

import pytest

import vase_jax.sandbox.core as core
from vase_jax.sandbox import SandboxConfig, SandboxError, probe, run_python
from vase_jax.sandbox.cgroup import find_backend
from vase_jax.sandbox.core import UID_BASE, UID_SPAN
from vase_jax.tasks.livecodebench import CodeTests, grade

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")

ADD = CodeTests(inputs=("1 2\n", "40 2\n"), outputs=("3\n", "42\n"), fn_name=None)
HIDDEN = ("/home", "/root", "/work", "/var", "/run", "/mnt", "/srv", "/sys", "/opt")


@pytest.fixture
def cfg(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    return SandboxConfig(timeout=2.0, memory_bytes=256 << 20, output_bytes=1 << 20, tmp_root=str(runs))


@pytest.fixture
def uids(monkeypatch):
    """The fresh uids of this test's runs (root only). A spy: the real `_fresh_uid` still picks them; the list
    lets the checks below look at this test's runs only, not at those of another pytest worker."""
    seen: list[int] = []
    real = core._fresh_uid

    def spy() -> int:
        uid = real()
        seen.append(uid)
        return uid

    monkeypatch.setattr(core, "_fresh_uid", spy)
    return seen


@pytest.fixture
def world(tmp_path):
    """World-readable places outside any run: a data folder in /var/tmp holding a release-style file whose only
    test expects 42, a unix socket in /var/tmp and an abstract one, both listening."""
    name = f"vase-test-{uuid.uuid4().hex}"
    data = Path("/var/tmp") / name
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)
    release = data / "release.jsonl"
    release.write_text(json.dumps({"question_id": "q1", "public_test_cases": json.dumps(
        [{"input": "", "output": "42", "testtype": "stdin"}])}) + "\n")
    os.chmod(release, 0o644)
    servers = []
    for address in (str(data / "service.sock"), "\0" + name):
        s = socket.socket(socket.AF_UNIX)
        s.bind(address)
        s.listen()
        s.settimeout(0.2)
        servers.append(s)
    os.chmod(data / "service.sock", 0o777)
    try:
        yield {"release": str(release), "sock": str(data / "service.sock"), "abstract": name, "servers": servers}
    finally:
        for s in servers:
            s.close()
        shutil.rmtree(data, ignore_errors=True)


def _fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


def _processes_of(uids: list[int]) -> list[int]:
    """Live (non-zombie) processes running as one of `uids`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid = int(fields.get("Uid", "0").split()[0])
        if uid in uids and not fields.get("State", "").strip().startswith("Z"):
            found.append(int(name))
    return found


def _own_cgroups_left() -> list[str]:
    """Run cgroups that this process made and that still exist (their names carry this process's pid)."""
    backend = probe().cgroup_backend
    if backend is None:
        return []
    prefix = f"vase-sandbox-{os.getpid()}-"
    return [os.path.join(p, n) for _, p in backend.parents for n in os.listdir(p) if n.startswith(prefix)]


def _assert_clean_and_usable(cfg: SandboxConfig, uids: list[int]) -> None:
    assert os.listdir(cfg.tmp_root) == []  # every run folder removed
    assert _processes_of(uids) == []
    assert _own_cgroups_left() == []
    ok = grade(ADD, _fenced("a, b = map(int, input().split())\nprint(a + b)"), config=cfg, workers=2)
    assert ok.passed, ok.reason  # the run goes on: the next program works


def test_probe_reports_the_isolation_once():
    info = probe()
    assert info is probe()  # cached
    text = info.describe()
    assert text.startswith("sandbox: ")
    if info.mode == "plain" or not info.syscall_filter or not info.cgroup:
        assert "WARNING" in text  # what is missing is named
    else:
        assert info.readonly_failures == ()
        assert "syscall filter" in text and "cgroup" in text


def test_correct_passes_wrong_fails(cfg, uids):
    good = grade(ADD, _fenced("a, b = map(int, input().split())\nprint(a + b)"), config=cfg)
    assert good.passed and good.reason == "passed 2/2 tests" and good.tests_passed == 2
    bad = grade(ADD, _fenced("a, b = map(int, input().split())\nprint(a - b)"), config=cfg)
    assert not bad.passed and bad.failed_test == 0 and "wrong answer at line 1: '-1' != '3'" in bad.reason
    _assert_clean_and_usable(cfg, uids)


def test_program_runs_unprivileged_with_a_scrubbed_environment(cfg, monkeypatch):
    monkeypatch.setenv("VASE_TEST_TOKEN", "hf_secret_value")
    code = ("import os\nprint(os.getuid())\nprint(sorted(os.environ))\nstatus = open('/proc/self/status').read()\n"
            "print(*(status.split(k + ':')[1].split()[0] for k in ('CapEff', 'NoNewPrivs', 'Seccomp')))")
    res = run_python({"p.py": code}, "p.py", config=cfg)
    assert res.failure() is None, res.stderr
    uid, env, flags = res.stdout.decode().split("\n")[:3]
    assert "VASE_TEST_TOKEN" not in env and "hf_secret" not in res.stdout.decode()
    caps, no_new_privs, seccomp = flags.split()
    assert caps == "0000000000000000" and no_new_privs == "1"  # no capabilities, none to gain
    assert seccomp == ("2" if probe(cfg).syscall_filter else "0")  # the filter is in force
    if os.geteuid() == 0:
        assert UID_BASE <= int(uid) < UID_BASE + UID_SPAN and int(uid) == res.uid


def test_the_program_sees_only_the_allowlisted_view(cfg, world):
    """Interpreter, standard library, libraries, a minimal /etc and /dev, its own /proc and its work folder: no
    home, no /work or /var, no current directory of the grader, nothing of the test data."""
    if probe(cfg).mode != "namespaces":
        pytest.skip("no namespaces here: the plain mode has no file-system view (its warning says so)")
    code = ("import os, sys, json\n"
            "paths = sys.argv[1:]\n"
            "print(json.dumps({'root': sorted(os.listdir('/')), 'dev': sorted(os.listdir('/dev')),\n"
            "    'cwd': os.getcwd(), 'work': sorted(os.listdir('.')), 'etc': sorted(os.listdir('/etc')),\n"
            "    'proc': sorted(p for p in os.listdir('/proc') if p.isdigit()),\n"
            "    'site': os.listdir(os.path.join(os.path.dirname(os.__file__), 'site-packages')),\n"
            "    'seen': [p for p in paths if os.path.exists(p)]}))\n"
            "open('/dev/null', 'w').write('x')\nassert len(open('/dev/urandom', 'rb').read(16)) == 16\n"
            "import decimal, ssl, sqlite3, ctypes, threading, multiprocessing\n")
    probes = [*HIDDEN, os.getcwd(), str(Path(core.__file__).parent), world["release"], str(Path.home()),
              str(cfg.tmp_root), sys.executable, sys.prefix]
    res = run_python({"p.py": code}, "p.py", args=probes, config=cfg)
    assert res.failure() is None, res.stderr.decode()[-2000:]
    seen = json.loads(res.stdout)
    assert seen["seen"] == []
    assert set(seen["root"]) <= {"dev", "etc", "proc", "python", "tmp", "usr", "lib", "lib64", "bin", "lib32",
                                 "libx32", "sbin"}
    assert seen["dev"] == ["fd", "null", "shm", "stderr", "stdin", "stdout", "urandom", "zero"]
    assert seen["etc"] == ["group", "hosts", "ld.so.cache", "passwd"] and seen["site"] == []
    assert (seen["cwd"], seen["work"]) == ("/tmp", ["p.py"])
    assert seen["proc"][0] == "1" and len(seen["proc"]) == 2  # its own pid namespace: init and itself


class Case(typing.NamedTuple):
    code: str
    reason: str  # words the verdict's reason must contain
    output: str = "42"  # the test's expected output
    fn_name: str | None = None  # a functional test (input "1") instead of a stdin one (input "")
    needs: tuple[str, ...] = ()  # "namespaces", "filter", "cgroup"
    timeout: float | None = None  # its own CPU and wall limit instead of the fixture's 2 s


MEMORY_FILES = """
import ctypes, os
limit, held, chunk = {limit}, 0, b'\\1' * (16 << 20)
try:  # memfd: RAM in a file that RLIMIT_AS does not count
    for _ in range(64):
        fd = os.memfd_create('m')
        os.write(fd, chunk[:1 << 20])
        held += 1 << 20
except OSError:
    pass
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
for _ in range(4):  # System V shared memory: it stays after shmdt, outside the address space
    shmid = libc.shmget(0, 128 << 20, 0o1000 | 0o600)
    addr = libc.shmat(shmid, None, 0) if shmid >= 0 else None
    if addr in (None, ctypes.c_void_p(-1).value):
        break
    ctypes.memset(addr, 1, 128 << 20)
    libc.shmdt(ctypes.c_void_p(addr))
    held += 128 << 20
for folder in ('/dev/shm', '/tmp'):  # files on a tmpfs: bounded by its size
    for i in range(64):
        try:
            with open(f'{{folder}}/f{{i}}', 'wb') as fh:
                fh.write(chunk[:1 << 20])
            held += 1 << 20
        except OSError:
            break
print('LEAK' if held > limit else 'contained')
"""
FORKED_MEMORY = """
import os, time
for _ in range(4):
    if os.fork() == 0:
        block = b'\\1' * (200 << 20)
        time.sleep(30)
        os._exit(0)
for _ in range(4):
    os.wait()
print(42)
"""
CHILDREN_SPIN = """
import os, time
for _ in range(6):
    if os.fork() == 0:
        while True:
            pass
time.sleep(60)
"""


def _hostile(tmp_path: Path, port: int, world: dict, cfg: SandboxConfig) -> dict[str, Case]:
    open_dir = tmp_path / "open"
    return {
        "infinite loop": Case("while True:\n    pass", "time limit exceeded"),
        "fork bomb": Case("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                          "time limit exceeded"),
        # ~0.3 s of CPU, mostly page faults; once, under the whole suite's memory pressure, it reached the 2 s CPU
        # limit before the 256 MiB one: 10 s keeps the memory limit the one that ends it
        "memory bomb": Case("blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))", "memory limit exceeded",
                            timeout=10.0),
        "1 GB to stdout": Case("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n"
                               "    sys.stdout.write(chunk)", "output limit exceeded"),
        "write outside": Case(f"open({str(open_dir / 'escaped')!r}, 'w').write('x')\n"
                              f"open('/var/tmp/vase-escape-{uuid.uuid4().hex}', 'w').write('x')", "runtime error",
                              needs=("namespaces",)),
        "environment secret": Case("import os, glob\nfound = [os.environ.get('VASE_TEST_SECRET', '')]\n"
                                   "for f in glob.glob('/proc/*/environ'):\n    try:\n"
                                   "        found.append(open(f, 'rb').read().decode(errors='replace'))\n"
                                   "    except OSError:\n        pass\n"
                                   "print('LEAK' if any('s3cr3t-value' in f for f in found) else 'no secret')",
                                   "wrong answer", output="LEAK"),
        "socket to 127.0.0.1": Case(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                                    "s.sendall(b'hello')", "runtime error"),
        "kill the parent": Case(f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\n"
                                "os.kill(os.getppid(), signal.SIGKILL)", "runtime error"),
        # 1: a wrong program reads the test cases from the (world-readable) release file, or searches for them
        "read the test data": Case(
            "import json, os\ntry:\n"
            f"    rows = [json.loads(line) for line in open({world['release']!r})]\n"
            "    print(json.loads(rows[0]['public_test_cases'])[0]['output'])\n"
            "except OSError:\n"
            "    tops = [t for t in os.listdir('/') if t not in ('proc', 'python', 'usr', 'lib', 'lib64')]\n"
            "    found = [os.path.join(d, f) for t in tops for d, _, fs in os.walk('/' + t) for f in fs\n"
            "             if f.endswith('.jsonl')]\n"
            "    print(found or 'nothing')", "wrong answer at line 1: 'nothing' != '42'", needs=("namespaces",)),
        # 2: outputs that made grade() raise
        "sNaN for a number": Case("print('sNaN')", "wrong answer at line 1"),
        "result nested too deep": Case("import os\nos.write(int(os.environ['VASE_RESULT_FD']), b'{\"value\": ' + "
                                       "b'[' * 200000 + b']' * 200000 + b'}')\nos._exit(0)",
                                       "runtime error: no result returned", fn_name="f"),
        "result not UTF-8": Case("import os\nos.write(int(os.environ['VASE_RESULT_FD']), b'{\"value\": \"\\xff\"}')\n"
                                 "os._exit(0)", "runtime error: no result returned", fn_name="f"),
        "forged test-data error": Case("import os\nos.write(int(os.environ['VASE_RESULT_FD']), "
                                       "b'{\"input_error\": \"' + b'x' * 500000 + b'\"}')\nos._exit(0)",
                                       "runtime error: no result returned", fn_name="f"),
        "long error": Case("import os\nos.write(int(os.environ['VASE_RESULT_FD']), "
                           "b'{\"error\": \"' + b'E' * 500000 + b'\"}')\nos._exit(0)", "runtime error: EEEE",
                           fn_name="f"),
        "long stderr line": Case("raise ValueError('x' * 100000 + '\\x1b[2J' + 'tail')",
                                 "runtime error (exit code 1): xxxx"),  # the tail of a 100 kB line
        # 3: memory that RLIMIT_AS does not count
        "memory-backed files": Case(MEMORY_FILES.format(limit=cfg.memory_bytes + cfg.disk_bytes),
                                    "'contained' != 'LEAK'", output="LEAK", needs=("filter",)),
        # four children touching 200 MiB each: ~0.5 s of CPU together, and past 2 s once under the suite's load
        "memory over several processes": Case(FORKED_MEMORY, "memory limit exceeded", needs=("cgroup",),
                                              timeout=10.0),
        "children burn the CPU": Case(CHILDREN_SPIN, "time limit exceeded"),
        # 4: state that would outlive the run (the per-user counts are checked in a test of its own below)
        "keyring": Case("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                        "key = libc.syscall(248, b'user', b'vase-test', b'secret', 6, -4)\n"
                        "print('LEAK' if key > 0 else 'refused')", "'refused' != 'LEAK'",
                        output="LEAK", needs=("filter",)),
        # 5: local services
        "unix sockets": Case("import socket\nfor address in ({sock!r}, '\\0' + {abstract!r}):\n    try:\n"
                             "        s = socket.socket(socket.AF_UNIX)\n        s.connect(address)\n"
                             "        s.sendall(b'hello')\n        print('LEAK')\n"
                             "    except OSError as e:\n        print(type(e).__name__)".format(**world),
                             "wrong answer", output="LEAK"),
    }


HOSTILE = ["infinite loop", "fork bomb", "memory bomb", "1 GB to stdout", "write outside", "environment secret",
           "socket to 127.0.0.1", "kill the parent", "read the test data", "sNaN for a number",
           "result nested too deep", "result not UTF-8", "forged test-data error", "long error", "long stderr line",
           "memory-backed files", "memory over several processes", "children burn the CPU", "keyring",
           "unix sockets"]


def _missing(needs: tuple[str, ...], cfg: SandboxConfig) -> str | None:
    info = probe(cfg)
    have = {"namespaces": info.mode == "namespaces", "filter": info.syscall_filter, "cgroup": bool(info.cgroup)}
    lacking = [n for n in needs if not have[n]]
    return f"this machine has no {', '.join(lacking)} (the sandbox's warning says so)" if lacking else None


@pytest.mark.slow
@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_program_is_contained(name, cfg, uids, tmp_path, monkeypatch, world):
    monkeypatch.setenv("VASE_TEST_SECRET", "s3cr3t-value")
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)  # writable for anyone: only the file-system view can stop the write
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    case = _hostile(tmp_path, server.getsockname()[1], world, cfg)[name]
    why = _missing(case.needs, cfg)
    if why:
        server.close()
        pytest.skip(why)
    before = set(os.listdir("/var/tmp"))
    try:
        tests = CodeTests(inputs=("1" if case.fn_name else "",), outputs=(case.output,), fn_name=case.fn_name)
        config = cfg if case.timeout is None else dataclasses.replace(cfg, timeout=case.timeout)
        verdict = grade(tests, _fenced(case.code), config=config)
        assert not verdict.passed and verdict.failed_test == 0
        assert case.reason in verdict.reason, verdict.reason
        assert len(verdict.reason) <= 400 and verdict.reason.isprintable()  # a short excerpt at most
        for s in (server, *world["servers"]):
            with pytest.raises(TimeoutError):  # nothing ever connected to the host's services
                s.accept()
    finally:
        server.close()
    assert not (tmp_path / "open" / "escaped").exists()
    assert not [f for f in set(os.listdir("/var/tmp")) - before if f.startswith("vase-escape-")]
    _assert_clean_and_usable(cfg, uids)


def test_cpu_time_of_child_processes_is_counted(cfg, uids):
    """Six children spin while their parent sleeps: the run's CPU time is theirs, counted by its cgroup, and
    the run ends at the CPU limit of all processes together or at the wall clock, whichever comes first on a
    busy machine (no timing assert)."""
    if not probe(cfg).cgroup:
        pytest.skip("no cgroup here: only the processes the program reaped are counted (its warning says so)")
    res = run_python({"p.py": CHILDREN_SPIN}, "p.py", config=cfg)
    assert res.failure() in ("time limit exceeded (2 s CPU, all processes together)",
                             "time limit exceeded (2 s wall clock)"), res.failure()
    assert res.cpu_seconds is not None and res.cpu_seconds >= 1.0  # the parent alone slept: ~0.05 s
    if res.cpu_exceeded:
        assert res.cpu_seconds >= 2.0
    _assert_clean_and_usable(cfg, uids)


def test_functional_harness_is_contained_too(cfg, uids):
    tests = CodeTests(inputs=("[1, 2]",), outputs=("3",), fn_name="add")
    code = "class Solution:\n    def add(self, nums):\n        while True:\n            pass"
    verdict = grade(tests, _fenced(code), config=cfg)
    assert not verdict.passed and "time limit exceeded" in verdict.reason
    _assert_clean_and_usable(cfg, uids)


LEAVE_BEHIND = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
made = []
for name, call in [('key', lambda: libc.syscall(248, b'user', b'vase', b'x', 1, -4)),
                   ('session key', lambda: libc.syscall(248, b'user', b'vase', b'x', 1, -3)),
                   ('shm', lambda: libc.shmget(0, 1 << 20, 0o1000 | 0o600)),
                   ('msg', lambda: libc.msgget(0, 0o1000 | 0o600)),
                   ('sem', lambda: libc.semget(0, 1, 0o1000 | 0o600)),
                   ('mqueue', lambda: libc.syscall(240, b'vase-test', 0o100 | 0o2, 0o600, None))]:
    if call() >= 0:
        made.append(name)
for folder in ('/tmp', '/var/tmp', '/dev/shm'):
    try:
        open(f'{folder}/vase-left-{os.getpid()}', 'w').write('x')
        made.append(folder)
    except OSError:
        pass
if os.fork() == 0:  # a daemon: new session, out of the process group, sleeping
    os.setsid()
    if os.fork() == 0:
        time.sleep(300)
    os._exit(0)
os.wait()
print(os.getuid(), *made)
"""


def _key_users() -> dict[int, str]:
    rows = {}
    for line in Path("/proc/key-users").read_text().splitlines():
        uid, _, rest = line.partition(":")
        rows[int(uid)] = rest.strip()
    return rows


def _ipc_owned_by(uid: int) -> list[str]:
    found = []
    for kind in ("shm", "msg", "sem"):
        lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        header = lines[0].split()
        found += [f"{kind} {line}" for line in lines[1:] if int(line.split()[header.index("uid")]) == uid]
    return found


@pytest.mark.parametrize("isolation", ["namespaces", "plain"])
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/proc/key-users"),
                    reason="tells a run's objects by its fresh uid (root only) in /proc/key-users")
def test_nothing_of_a_run_outlives_its_verdict(isolation, request, uids):
    """Keys, System V objects, POSIX queues, files in shared folders and a daemonized process: the kernel's
    per-user counts for the run's uid are the same after the run as before it (none), whatever it tried."""
    runs = Path(tempfile.mkdtemp(prefix="vase-runs-", dir="/var/tmp"))  # plain mode: the uid must reach it
    os.chmod(runs, 0o711)
    request.addfinalizer(lambda: shutil.rmtree(runs, ignore_errors=True))
    cfg = SandboxConfig(timeout=5.0, memory_bytes=256 << 20, output_bytes=1 << 20, tmp_root=str(runs),
                        isolation=isolation)
    if isolation == "namespaces" and probe(cfg).mode != "namespaces":
        pytest.skip("no namespaces here")
    if not probe(cfg).syscall_filter:
        pytest.skip("no syscall filter here (libseccomp missing): keys would outlive the run, as its warning says")
    keys_before = _key_users()
    res = run_python({"p.py": LEAVE_BEHIND}, "p.py", config=cfg)
    assert res.failure() is None, res.stderr.decode()[-2000:]
    uid, *made = res.stdout.decode().split()
    assert int(uid) == res.uid == uids[-1]
    assert not {"key", "session key", "shm", "msg", "sem", "mqueue"} & set(made)  # the filter refused them all
    assert (isolation == "plain") == ("/var/tmp" in made)  # plain mode: the shared folders are writable...
    assert res.uid not in _key_users() and _key_users().keys() <= keys_before.keys() | {0}
    assert _ipc_owned_by(res.uid) == []
    assert _processes_of([res.uid]) == []  # the daemon is gone too
    left = [os.path.join(d, f) for d in ("/tmp", "/var/tmp", "/dev/shm") for f in os.listdir(d)
            if os.lstat(os.path.join(d, f)).st_uid == res.uid]
    assert left == []  # ... and emptied of the run's files after it
    assert _own_cgroups_left() == [] and os.listdir(runs) == []


SNOOP = """
import glob, os, sys, time
found = []
for _ in range(40):  # look for another run's folder, then try to read what it holds
    for run in glob.glob(os.path.join(sys.argv[1], 'vase-sandbox-*')):
        names = ['stdin', 'stdout', 'stderr', 'result', 'spec.json', 'src/v.py', 'work/v.py']  # guessable
        for path in glob.glob(run + '/*') + glob.glob(run + '/*/*') + [os.path.join(run, n) for n in names]:
            try:
                found.append(open(path, 'rb').read())
            except OSError:
                pass
    if any(b'victim-secret' in f for f in found):
        break
    time.sleep(0.05)
print('LEAK' if any(b'victim-secret' in f for f in found) else 'nothing')
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs as fresh uids (root only)")
def test_a_plain_run_cannot_read_another_runs_folder(request, uids):
    """With run folders in a listable place (a TMPDIR outside /tmp) and no file-system view, a program finds
    another run's folder but reads nothing of it: its input, output and files are the grader's (0600)."""
    import threading

    runs = Path(tempfile.mkdtemp(prefix="vase-runs-", dir="/var/tmp"))
    os.chmod(runs, 0o755)  # listable by anyone
    request.addfinalizer(lambda: shutil.rmtree(runs, ignore_errors=True))
    cfg = SandboxConfig(timeout=5.0, memory_bytes=256 << 20, output_bytes=1 << 20, tmp_root=str(runs),
                        isolation="plain")
    probe(cfg)
    victim = threading.Thread(target=run_python, args=({"v.py": "import time\n# victim-secret\ntime.sleep(2)"},
                                                         "v.py"), kwargs={"stdin": "victim-secret", "config": cfg})
    victim.start()
    try:
        res = run_python({"p.py": SNOOP}, "p.py", args=[str(runs)], config=cfg)
    finally:
        victim.join()
    assert res.failure() is None, res.stderr.decode()[-2000:]
    assert res.stdout.decode().strip() == "nothing"
    assert os.listdir(runs) == [] and _processes_of(uids) == []


def test_bad_config_names_the_parameter(tmp_path):
    with pytest.raises(ValueError, match="SandboxConfig.timeout"):
        SandboxConfig(timeout=0).validate()
    with pytest.raises(ValueError, match="SandboxConfig.isolation"):
        SandboxConfig(isolation="docker").validate()
    with pytest.raises(ValueError, match="SandboxConfig.tmp_root"):
        SandboxConfig(tmp_root=str(tmp_path / "missing")).validate()
    with pytest.raises(ValueError, match="SandboxConfig.cgroup_parent=.*not a cgroup folder"):
        SandboxConfig(cgroup_parent=str(tmp_path)).validate()
    with pytest.raises(ValueError, match="script="):
        run_python({"a.py": ""}, "b.py")
    with pytest.raises(SandboxError, match="no Python interpreter"):
        probe(SandboxConfig(python=str(tmp_path / "no-python")))


def test_cgroup_v2_protocol_on_a_delegated_folder_layout(tmp_path):
    """The cgroup v2 path, on a plain folder laid out as a delegated v2 subtree (this host mounts v2 without the
    memory and pids controllers, so the kernel side runs only on v1 here): the controllers are enabled for
    children, a run's cgroup gets memory.max, memory.swap.max = 0 and pids.max, and its CPU time and OOM kills are
    read from cpu.stat and memory.events. A folder without the controllers is refused, saying which are missing."""
    from vase_jax.sandbox.cgroup import CgroupError, _v2_backend

    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    backend = _v2_backend(str(tmp_path))
    assert backend.version == 2 and backend.parents == (("", str(tmp_path)),)
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+pids"  # the last of "+memory", "+pids"
    assert "cgroup v2 (memory, pids)" in backend.describe()

    real_mkdir = os.mkdir

    def mkdir_with_control_files(path, *args):  # what the kernel makes in a new v2 cgroup
        real_mkdir(path, *args)
        for name in ("memory.max", "memory.swap.max", "pids.max", "cgroup.procs", "cgroup.kill"):
            Path(path, name).write_text("max\n" if name.endswith("max") else "")
        Path(path, "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\n")
        Path(path, "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "mkdir", mkdir_with_control_files)
        run = backend.create(256 << 20, 64)
    folder = Path(run.dirs[""])
    assert folder.parent == tmp_path and folder.name.startswith(f"vase-sandbox-{os.getpid()}-")
    assert (folder / "memory.max").read_text() == str(256 << 20)
    assert (folder / "memory.swap.max").read_text() == "0"
    assert (folder / "pids.max").read_text() == "64"
    assert run.procs_files == [str(folder / "cgroup.procs")]
    assert run.cpu_seconds() == 2.5 and run.oom_kills() == 1
    run.kill()
    assert (folder / "cgroup.kill").read_text() == "1"  # the whole cgroup at once

    (tmp_path / "cgroup.controllers").write_text("cpu io\n")
    with pytest.raises(CgroupError, match="lacks the memory, pids controller"):
        _v2_backend(str(tmp_path))


DRIVER = """
import importlib.util, json, os, sys
package, pyseccomp_dir, runs, target, secret, public = sys.argv[1:7]
sys.path.append(pyseccomp_dir)  # the filter's binding, from the test's environment
spec = importlib.util.spec_from_file_location("sandbox", os.path.join(package, "__init__.py"),
                                              submodule_search_locations=[package])
sandbox = importlib.util.module_from_spec(spec)
sys.modules["sandbox"] = sandbox
spec.loader.exec_module(sandbox)
cfg = sandbox.SandboxConfig(timeout=2.0, memory_bytes=256 << 20, output_bytes=1 << 20, tmp_root=runs)
info = sandbox.probe(cfg)
out = {"mode": info.mode, "user_namespace": info.user_namespace, "filter": info.syscall_filter,
       "cgroup": info.cgroup, "warnings": info.warnings}
programs = {
    "caps": "import os; print(os.getuid(), open('/proc/self/status').read().split('CapEff:')[1].split()[0])",
    "write": "open(%r, 'w').write('x')" % target,
    "mount": "import ctypes; print(ctypes.CDLL(None).mount(None, b'/', None, 4096 | 32, None))",
    "fork": "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass",
    "read": "import os\\nfor p in %r:\\n    try:\\n        print(open(p).read())\\n    except OSError as e:\\n"
            "        print(type(e).__name__)\\nprint(sorted(os.listdir('/')))" % ([secret, public],),
    "init": "import os\\nfds = [lambda n=n: open('/proc/1/fd/' + n, 'rb') for n in os.listdir('/proc/1/fd')]\\n"
            "for f in (*fds, lambda: os.readlink('/proc/1/root'), lambda: open('/proc/1/environ').read(),\\n"
            "          lambda: open('/proc/1/mem', 'rb')):\\n"
            "    try:\\n        print(f())\\n    except OSError as e:\\n        print(type(e).__name__)",
}
for name, code in programs.items():
    res = sandbox.run_python({"p.py": code}, "p.py", config=cfg)
    out[name] = [res.failure(), res.stdout.decode()]
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv")
                    or not os.path.exists("/usr/bin/python3"), reason="needs root, setpriv and /usr/bin/python3")
def test_an_unprivileged_grader_gets_a_user_namespace_and_hides_its_own_files():
    """The same sandbox started by a normal user (uid 65533 here, with the system Python): namespaces inside a
    user namespace, no capability, and the grader's own private file and a world-readable one both invisible."""
    import subprocess

    import pyseccomp

    base = Path(tempfile.mkdtemp(prefix="vase-userns-test-", dir="/tmp"))  # reachable by the unprivileged uid
    try:
        os.chmod(base, 0o755)
        home = base / "home"
        home.mkdir()
        (home / "id_token").write_text("PRIVATE-TOKEN-of-65533")
        (base / "public.txt").write_text("PUBLIC-DATA")
        os.chmod(base / "public.txt", 0o644)
        runs = base / "runs"
        runs.mkdir()
        for p in (home, home / "id_token", runs):
            os.chown(p, 65533, 65533)
        os.chmod(home, 0o700)
        os.chmod(home / "id_token", 0o600)
        target = base / "escaped"
        (base / "driver.py").write_text(DRIVER)
        res = subprocess.run(["/usr/bin/setpriv", "--reuid=65533", "--regid=65533", "--clear-groups",
                              "/usr/bin/python3", "-I", str(base / "driver.py"), str(Path(core.__file__).parent),
                              str(Path(pyseccomp.__file__).parent), str(runs), str(target),
                              str(home / "id_token"), str(base / "public.txt")],
                             capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
        assert res.returncode == 0, res.stderr[-2000:]
        out = json.loads(res.stdout.strip().splitlines()[-1])
        if out["mode"] != "namespaces":
            pytest.skip("user namespaces are not allowed for unprivileged users here")
        assert out["user_namespace"] is True and out["filter"] is True
        assert out["cgroup"] == "" and any("no cgroup" in w for w in out["warnings"])  # none delegated: said so
        assert out["caps"] == [None, "0 0000000000000000\n"]  # root of its namespace, but no capability
        assert out["write"][0].startswith("runtime error") and not target.exists()
        assert out["mount"] == [None, "-1\n"]  # cannot remount anything writable
        assert out["fork"][0].startswith("time limit exceeded")
        failure, stdout = out["read"]
        assert failure is None and "PRIVATE" not in stdout and "PUBLIC" not in stdout
        assert stdout.splitlines()[:2] == ["FileNotFoundError", "FileNotFoundError"]
        assert not {"home", "root", "var", "work"} & set(json.loads(stdout.splitlines()[2].replace("'", '"')))
        failure, stdout = out["init"]  # same uid as pid 1 (it holds the status file): no capability, not dumpable
        assert failure is None and set(stdout.split()) == {"PermissionError"} and len(stdout.split()) >= 6
        assert os.listdir(runs) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


KILLED_DRIVER = """
import sys
import vase_jax.sandbox.core as core
cfg = core.SandboxConfig(timeout=300, tmp_root=sys.argv[1])
core.probe(cfg)  # its own short runs first
real = core._fresh_uid
def announce():
    uid = real()
    print(uid, flush=True)
    return uid
core._fresh_uid = announce
core.run_python({'p.py': 'import time; time.sleep(300)'}, 'p.py', config=cfg)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="finds the sandbox's processes by their fresh uid (root only)")
def test_a_killed_grader_takes_its_sleeping_program_down(tmp_path):
    """A program that sleeps (no CPU) would outlive a grader killed mid-run; the lifeline pipe prevents it."""
    import signal
    import subprocess
    import time

    (tmp_path / "runs").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", KILLED_DRIVER, str(tmp_path / "runs")], stdout=subprocess.PIPE,
                            text=True)
    try:
        uid = int(proc.stdout.readline())  # the sleeper's fresh uid, printed when it is picked
        deadline = time.monotonic() + 60
        while not _processes_of([uid]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_of([uid]), "the sandboxed program never started"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while _processes_of([uid]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_of([uid]) == []
    backend = find_backend(None) if probe().cgroup_backend else None  # removes a killed grader's cgroups
    if backend is not None:
        assert [n for _, p in backend.parents for n in os.listdir(p) if n.startswith(f"vase-sandbox-{proc.pid}-")] == []


@pytest.mark.skipif(os.geteuid() != 0, reason="makes cgroups (root here)")
def test_cgroups_of_a_killed_grader_are_removed_by_the_next_one():
    backend = probe().cgroup_backend
    if backend is None:
        pytest.skip("no cgroup here (the sandbox's warning says so)")
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # a pid no process can have
    stale = [os.path.join(p, f"vase-sandbox-{gone}-0123456789ab") for _, p in backend.parents]
    live = [os.path.join(p, f"vase-sandbox-{os.getpid()}-0123456789ab") for _, p in backend.parents]
    for d in stale + live:
        os.mkdir(d)
    try:
        find_backend(None)
        assert [os.path.exists(d) for d in stale + live] == [False] * len(stale) + [True] * len(live)
    finally:
        for d in stale + live:
            if os.path.exists(d):
                os.rmdir(d)

"""vase_jax.sandbox through LiveCodeBench grading: hostile programs are contained, graded as failures with a
reason, leave nothing behind (no file outside their folder, no process, no run folder) and the next program
runs normally. Limits are small (2 s, 256 MiB, 1 MiB of output) to keep the suite fast; no timing asserts."""

from __future__ import annotations

import os
import socket
import sys
import uuid
from pathlib import Path

import pytest

from vase_jax.sandbox import SandboxConfig, SandboxError, probe, run_python
from vase_jax.sandbox.core import UID_BASE, UID_SPAN
from vase_jax.tasks.livecodebench import CodeTests, grade

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")

ADD = CodeTests(inputs=("1 2\n", "40 2\n"), outputs=("3\n", "42\n"), fn_name=None)


@pytest.fixture
def cfg(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    return SandboxConfig(timeout=2.0, memory_bytes=256 << 20, output_bytes=1 << 20, tmp_root=str(runs))


def _fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


def _sandbox_processes() -> list[int]:
    """Live (non-zombie) processes running as a sandbox uid."""
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
        if UID_BASE <= uid < UID_BASE + UID_SPAN and not fields.get("State", "").strip().startswith("Z"):
            found.append(int(name))
    return found


def _assert_clean_and_usable(cfg: SandboxConfig) -> None:
    assert os.listdir(cfg.tmp_root) == []  # every run folder removed
    if os.geteuid() == 0:
        assert _sandbox_processes() == []
    ok = grade(ADD, _fenced("a, b = map(int, input().split())\nprint(a + b)"), config=cfg, workers=2)
    assert ok.passed, ok.reason  # the run goes on: the next program works


def test_probe_reports_the_isolation_once():
    info = probe()
    assert info is probe()  # cached
    text = info.describe()
    assert text.startswith("sandbox: ")
    if info.mode == "plain":
        assert "WARNING" in text
    else:
        assert info.readonly_failures == ()


def test_correct_passes_wrong_fails(cfg):
    good = grade(ADD, _fenced("a, b = map(int, input().split())\nprint(a + b)"), config=cfg)
    assert good.passed and good.reason == "passed 2/2 tests" and good.tests_passed == 2
    bad = grade(ADD, _fenced("a, b = map(int, input().split())\nprint(a - b)"), config=cfg)
    assert not bad.passed and bad.failed_test == 0 and "wrong answer at line 1: '-1' != '3'" in bad.reason
    _assert_clean_and_usable(cfg)


def test_program_runs_unprivileged_with_a_scrubbed_environment(cfg, monkeypatch):
    monkeypatch.setenv("VASE_TEST_TOKEN", "hf_secret_value")
    code = ("import os\nprint(os.getuid())\nprint(sorted(os.environ))\n"
            "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])")
    res = run_python({"p.py": code}, "p.py", config=cfg)
    assert res.failure() is None, res.stderr
    uid, env, caps = res.stdout.decode().split("\n")[:3]
    assert "VASE_TEST_TOKEN" not in env and "hf_secret" not in res.stdout.decode()
    assert caps == "0000000000000000"  # no capabilities
    if os.geteuid() == 0:
        assert UID_BASE <= int(uid) < UID_BASE + UID_SPAN


def _hostile(tmp_path: Path, port: int) -> dict[str, tuple[str, str]]:
    """name -> (program, expected words of the verdict's reason)."""
    open_dir = tmp_path / "open"
    return {
        "infinite loop": ("while True:\n    pass", "time limit exceeded"),
        "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                      "time limit exceeded"),
        "memory bomb": ("blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))", "memory limit exceeded"),
        "1 GB to stdout": ("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)",
                           "output limit exceeded"),
        "write outside": (f"open({str(open_dir / 'escaped')!r}, 'w').write('x')\n"
                          f"open('/tmp/vase-escape-{uuid.uuid4().hex}', 'w').write('x')", "runtime error"),
        "environment secret": ("import os, glob\nfound = [os.environ.get('VASE_TEST_SECRET', '')]\n"
                               "for f in glob.glob('/proc/*/environ'):\n    try:\n"
                               "        found.append(open(f, 'rb').read().decode(errors='replace'))\n"
                               "    except OSError:\n        pass\n"
                               "print('LEAK' if any('s3cr3t-value' in f for f in found) else 'no secret')",
                               "wrong answer"),
        "socket to 127.0.0.1": (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                                "s.sendall(b'hello')", "runtime error"),
        "kill the parent": (f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\n"
                            "os.kill(os.getppid(), signal.SIGKILL)", "runtime error"),
    }


HOSTILE = ["infinite loop", "fork bomb", "memory bomb", "1 GB to stdout", "write outside", "environment secret",
           "socket to 127.0.0.1", "kill the parent"]
NEEDS_NAMESPACES = {"write outside", "socket to 127.0.0.1"}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_program_is_contained(name, cfg, tmp_path, monkeypatch):
    if name in NEEDS_NAMESPACES and probe(cfg).mode != "namespaces":
        pytest.skip("plain mode has no network namespace and no read-only view (its warning says so)")
    monkeypatch.setenv("VASE_TEST_SECRET", "s3cr3t-value")
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)  # writable for anyone: only the read-only view can stop the write
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    before = set(os.listdir("/tmp"))
    try:
        code, expected = _hostile(tmp_path, server.getsockname()[1])[name]
        tests = CodeTests(inputs=("",), outputs=("LEAK" if name == "environment secret" else "42",), fn_name=None)
        verdict = grade(tests, _fenced(code), config=cfg)
        assert not verdict.passed and verdict.failed_test == 0
        assert expected in verdict.reason, verdict.reason
        with pytest.raises(TimeoutError):  # nothing ever connected to the host's loopback
            server.accept()
    finally:
        server.close()
    assert not (tmp_path / "open" / "escaped").exists()
    assert not [f for f in set(os.listdir("/tmp")) - before if f.startswith("vase-escape-")]
    _assert_clean_and_usable(cfg)


def test_functional_harness_is_contained_too(cfg):
    tests = CodeTests(inputs=("[1, 2]",), outputs=("3",), fn_name="add")
    code = "class Solution:\n    def add(self, nums):\n        while True:\n            pass"
    verdict = grade(tests, _fenced(code), config=cfg)
    assert not verdict.passed and "time limit exceeded" in verdict.reason
    _assert_clean_and_usable(cfg)


def test_bad_config_names_the_parameter(tmp_path):
    with pytest.raises(ValueError, match="SandboxConfig.timeout"):
        SandboxConfig(timeout=0).validate()
    with pytest.raises(ValueError, match="SandboxConfig.isolation"):
        SandboxConfig(isolation="docker").validate()
    with pytest.raises(ValueError, match="SandboxConfig.tmp_root"):
        SandboxConfig(tmp_root=str(tmp_path / "missing")).validate()
    with pytest.raises(ValueError, match="script="):
        run_python({"a.py": ""}, "b.py")
    with pytest.raises(SandboxError, match="no Python interpreter"):
        probe(SandboxConfig(python=str(tmp_path / "no-python")))


DRIVER = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("sandbox_core", sys.argv[1])
core = importlib.util.module_from_spec(spec)
sys.modules["sandbox_core"] = core
spec.loader.exec_module(core)
cfg = core.SandboxConfig(timeout=2.0, memory_bytes=256 << 20, output_bytes=1 << 20, tmp_root=sys.argv[2])
info = core.probe(cfg)
out = {"mode": info.mode, "user_namespace": info.user_namespace}
programs = {
    "caps": "import os; print(os.getuid(), open('/proc/self/status').read().split('CapEff:')[1].split()[0])",
    "write": "open(%r, 'w').write('x')" % sys.argv[3],
    "mount": "import ctypes; print(ctypes.CDLL(None).mount(None, b'/', None, 4096 | 32, None))",
    "fork": "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass",
}
for name, code in programs.items():
    res = core.run_python({"p.py": code}, "p.py", config=cfg)
    out[name] = [res.failure(), res.stdout.decode()]
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv")
                    or not os.path.exists("/usr/bin/python3"), reason="needs root, setpriv and /usr/bin/python3")
def test_an_unprivileged_caller_gets_a_user_namespace_without_capabilities():
    """The same sandbox started by a normal user (uid 65533 here): namespaces inside a user namespace."""
    import json
    import shutil
    import subprocess
    import tempfile

    import vase_jax.sandbox.core as core

    base = tempfile.mkdtemp(prefix="vase-userns-test-", dir="/tmp")  # reachable by the unprivileged uid
    try:
        os.chmod(base, 0o777)
        (Path(base) / "runs").mkdir(mode=0o777)
        os.chmod(Path(base) / "runs", 0o777)
        target = Path(base) / "escaped"
        (Path(base) / "driver.py").write_text(DRIVER)
        res = subprocess.run(["/usr/bin/setpriv", "--reuid=65533", "--regid=65533", "--clear-groups",
                              "/usr/bin/python3", "-I", str(Path(base) / "driver.py"), core.__file__,
                              str(Path(base) / "runs"), str(target)],
                             capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})
        assert res.returncode == 0, res.stderr[-2000:]
        out = json.loads(res.stdout.strip().splitlines()[-1])
        if out["mode"] != "namespaces":
            pytest.skip("user namespaces are not allowed for unprivileged users here")
        assert out["user_namespace"] is True
        assert out["caps"] == [None, "0 0000000000000000\n"]  # root of its namespace, but no capability
        assert out["write"][0].startswith("runtime error") and not target.exists()
        assert out["mount"] == [None, "-1\n"]  # cannot remount anything writable
        assert out["fork"][0].startswith("time limit exceeded")
        assert os.listdir(Path(base) / "runs") == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="finds the sandbox's processes by their fresh uid (root only)")
def test_a_killed_grader_takes_its_sleeping_program_down(tmp_path):
    """A program that sleeps (no CPU) would outlive a grader killed mid-run; the lifeline pipe prevents it."""
    import signal
    import subprocess
    import time

    driver = ("import sys\nfrom vase_jax.sandbox import SandboxConfig, run_python\n"
              "run_python({'p.py': 'import time; time.sleep(300)'}, 'p.py', "
              "config=SandboxConfig(timeout=300, tmp_root=sys.argv[1]))\n")
    (tmp_path / "runs").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", driver, str(tmp_path / "runs")])
    try:
        deadline = time.monotonic() + 60
        while not _sandbox_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _sandbox_processes(), "the sandboxed program never started"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while _sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_processes() == []

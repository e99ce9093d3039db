"""The runtime under races, crashes and hostile directories (each case was reproduced on this machine).

Real processes for fork, SIGTERM, SIGKILL and simultaneous start; real threads for same-key races.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from teraio.runtime import Engine, RuntimeConfig
from teraio.runtime.config import default_offload_dir
from teraio.runtime.errors import ChecksumError, ConfigError, UnsafePathError
from teraio.runtime.space import OffloadDir

REPO = Path(__file__).resolve().parents[2]
KIB = 1 << 10


def _subdirs(base: Path) -> list[str]:
    return sorted(n for n in os.listdir(base) if "teraio-" in n) if base.exists() else []


def _run(code: str, *args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


# ------------------------------------------------------------------------------------------ defaults
def test_checksums_are_on_by_default_and_catch_flipped_bytes(tmp_path):
    """Two flipped bytes in the offload file used to change the parameters silently."""
    with Engine(RuntimeConfig(dirs=[tmp_path], backend="posix")) as eng:
        assert eng.config.checksum == "crc32c"
        src = torch.arange(1 << 18, dtype=torch.float32)
        eng.offload("x", src).wait()
        eng.release("x")
        del src
        data = Path(eng.offload_paths[0]) / "data.bin"
        fd = os.open(data, os.O_RDWR)
        try:
            os.pwrite(fd, b"\xff\xff", 5000)
            os.fsync(fd)
        finally:
            os.close(fd)
        with pytest.raises(ChecksumError, match="checksum mismatch for key 'x'"):
            eng.fetch("x")
    with Engine(RuntimeConfig(dirs=[tmp_path], backend="posix", checksum=False)) as eng:
        assert eng.config.checksum is None  # the explicit opt-out


# --------------------------------------------------------------------------------------------- races
def test_same_key_offloaded_by_two_threads_gives_right_bytes_or_a_clear_error(tmp_path):
    """Both threads used to register the key: the later registration won, the other entry leaked,
    and a thread got the other request's bytes. The window (allocation between the key check and the
    registration) is widened by a fault injector that slows every file growth by 20 ms."""
    a = torch.full((1 << 18,), 1.0)
    b = torch.full((1 << 18,), 2.0)

    def slow_growth(action, path, offset, nbytes):
        if action == "preallocate":
            time.sleep(0.02)

    cfg = RuntimeConfig(
        dirs=[tmp_path], backend="posix", chunk_bytes=64 * KIB, io_threads=2, fault_injector=slow_growth
    )
    with Engine(cfg) as eng:
        for i in range(8):
            key = f"k{i}"
            barrier = threading.Barrier(2)
            outcome: dict[str, object] = {}

            def go(name, t, key=key, barrier=barrier, outcome=outcome):
                barrier.wait()
                try:
                    eng.offload(key, t).wait()
                    outcome[name] = "ok"
                except ConfigError as e:
                    outcome[name] = e

            threads = [threading.Thread(target=go, args=(n, t)) for n, t in (("a", a), ("b", b))]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            assert "ok" in outcome.values()
            for v in outcome.values():
                assert v == "ok" or "another thread is offloading the same key" in str(v)
            eng.release(key)
            got = eng.fetch(key)
            winners = [n for n, t in (("a", a), ("b", b)) if torch.equal(got, t)]
            assert winners and outcome[winners[0]] == "ok"  # the bytes of a request that succeeded
            del got
            # One stored copy per key: nothing leaked, nothing freed under a live write.
            assert sum(d.allocator.used_nbytes for d in eng._dirs) == (i + 1) * a.nbytes


def test_drop_racing_an_offload_of_the_same_key_never_corrupts_later_data(tmp_path):
    """A drop that freed the space of a write still in flight let that write land on the next key."""
    with Engine(RuntimeConfig(dirs=[tmp_path], backend="posix", chunk_bytes=64 * KIB, io_threads=2)) as eng:
        for i in range(10):
            big = torch.full((1 << 18,), float(i))
            t = threading.Thread(target=eng.drop, args=("k",), kwargs={"missing_ok": True})
            t.start()
            eng.offload("k", big)
            t.join()
            eng.drop("k", missing_ok=True)
            other = torch.full((1 << 18,), -float(i))
            eng.offload("o", other).wait()
            eng.release("o")
            expected = other.clone()
            del other
            assert torch.equal(eng.fetch("o"), expected)  # checksums on: corruption would raise
            eng.drop("o")


_CLEANER = """
import os, sys
from pathlib import Path
from teraio.runtime.space import clean_stale_subdirs
base, stop = Path(sys.argv[1]), sys.argv[2]
print("go", flush=True)
n = 0
while not os.path.exists(stop):
    n += len(clean_stale_subdirs(base))
print(n, flush=True)
"""


def test_cleanup_in_another_process_never_removes_a_directory_being_created(tmp_path, monkeypatch):
    """Two processes starting at once: one removed the other's live directory (the window between
    creating the lock file and taking the flock). A second process cleans the base in a tight loop
    while this one creates directories, each with that window widened to 20 ms; every directory must
    survive until it is closed."""
    import fcntl

    real_flock = fcntl.flock

    def slow_flock(fd, op):
        if op == fcntl.LOCK_EX | fcntl.LOCK_NB:
            time.sleep(0.02)
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", slow_flock)
    base, stop = tmp_path / "base", tmp_path / "stop"
    base.mkdir(mode=0o700)
    cleaner = _run(_CLEANER, str(base), str(stop))
    try:
        assert cleaner.stdout.readline().strip() == "go"
        for _ in range(60):
            odir = OffloadDir(base, rank=0, direct_io=False, fault_injector=None)
            try:
                assert odir.path.is_dir() and (odir.path / "lock").exists()
                odir.reserve(4096)  # fails if the directory was removed under us
            finally:
                odir.close()
    finally:
        stop.touch()
        out, err = cleaner.communicate(timeout=120)
    assert out.strip() == "0", f"the cleaner removed {out.strip()} live directories: {err[-2000:]}"
    assert _subdirs(base) == []


_STARTER = """
import os, sys, time, torch
from teraio.runtime import Engine, RuntimeConfig
from teraio.runtime.config import default_offload_dir
base, go, k = sys.argv[1], sys.argv[2], float(sys.argv[3])
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
eng = Engine(RuntimeConfig(dirs=[base], backend="posix"))
x = torch.arange(1 << 16, dtype=torch.float32) * k
eng.offload("x", x).wait(); eng.release("x")
del x
time.sleep(0.5)  # the other processes start (and clean) meanwhile
assert torch.equal(eng.fetch("x"), torch.arange(1 << 16, dtype=torch.float32) * k)
eng.close()
print("ok", flush=True)
"""


def test_simultaneous_starts_keep_every_process_data(tmp_path):
    base, go = tmp_path / "base", tmp_path / "go"
    procs = [_run(_STARTER, str(base), str(go), str(i + 1)) for i in range(3)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    go.touch()  # every interpreter has imported torch: they start within a millisecond
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip() == "ok", err[-2000:]
    assert _subdirs(base) == []


# -------------------------------------------------------------------------------- crashes and exits
def test_pid_of_any_size_in_a_directory_name(tmp_path):
    """A teraio-named directory with an out-of-range pid made every later Engine() fail (OverflowError)."""
    for pid in ("99999999999999999999999", "0", "4294967296"):
        (tmp_path / f"teraio-r0-p{pid}-deadbeef").mkdir()
        (tmp_path / f".teraio-new-r0-p{pid}-deadbeef").mkdir()
        with Engine(RuntimeConfig(dirs=[tmp_path], backend="posix")) as eng:
            eng.offload("x", torch.ones(10)).wait()
        assert _subdirs(tmp_path) == []  # dead (impossible) pids: removed


_FORK = """
import os, sys, torch
from teraio.runtime import Engine, RuntimeConfig
from teraio.runtime.config import default_offload_dir
eng = Engine(RuntimeConfig(dirs=[sys.argv[1]], backend="posix"))
x = torch.arange(1000.0)
eng.offload("x", x).wait(); eng.release("x")
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit: atexit hooks run in the child
_, status = os.waitpid(pid, 0)
assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
del x
assert os.path.exists(os.path.join(eng.offload_paths[0], "data.bin")), "the child removed our files"
assert torch.equal(eng.fetch("x"), torch.arange(1000.0))
print("ok", flush=True)
"""


def test_forked_child_exit_leaves_the_parents_files(tmp_path):
    p = _run(_FORK, str(tmp_path))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and out.strip() == "ok", err[-2000:]
    assert _subdirs(tmp_path) == []  # the parent removed them at its own exit


_SIGTERM = """
import os, signal, sys, time, torch
from teraio.runtime import Engine, RuntimeConfig
from teraio.runtime.config import default_offload_dir
if sys.argv[2] == "user-handler":
    def handler(signum, frame):
        open(sys.argv[1] + ".handled", "w").close()
        sys.exit(3)
    signal.signal(signal.SIGTERM, handler)
eng = Engine(RuntimeConfig(dirs=[sys.argv[1]], backend="posix"))
eng.offload("x", torch.ones(1 << 16)).wait()
print(eng.offload_paths[0], flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("mode", ["default", "user-handler"])
def test_sigterm_cleans_up_and_chains_the_users_handler(tmp_path, mode):
    base = tmp_path / "off"
    p = _run(_SIGTERM, str(base), mode)
    path = p.stdout.readline().strip()
    assert path and os.path.isdir(path)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    if mode == "default":
        assert p.returncode == -signal.SIGTERM, err[-2000:]  # still dies of the signal
    else:
        assert p.returncode == 3 and (tmp_path / "off.handled").exists(), err[-2000:]
    assert _subdirs(base) == []


_KILLED = """
import sys, time, torch
from teraio.runtime import Engine, RuntimeConfig
from teraio.runtime.config import default_offload_dir
eng = Engine(RuntimeConfig(backend="posix"))
eng.offload("x", torch.ones(1 << 16)).wait()
print(eng.offload_paths[0], flush=True)
time.sleep(120)
"""


def test_default_offload_dir_is_stable_per_user_so_killed_runs_are_cleaned(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.delenv("TERAIO_OFFLOAD_DIRS", raising=False)
    p = _run(_KILLED, env={"XDG_CACHE_HOME": str(cache)})
    path = Path(p.stdout.readline().strip())
    assert path.parent == cache / "teraio" / "offload"
    p.kill()
    p.communicate(timeout=60)
    assert path.exists()  # SIGKILL: nothing could clean up
    with Engine(RuntimeConfig(backend="posix")) as eng:
        assert Path(eng.offload_paths[0]).parent == path.parent
        assert not path.exists()  # the next start found and removed the leftovers
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700


# ----------------------------------------------------------------------------------- base directories
def test_world_writable_base_without_sticky_bit_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafePathError, match="writable by other users .* without the sticky bit"):
        Engine(RuntimeConfig(dirs=[shared], backend="posix"))
    link = tmp_path / "link"
    link.symlink_to(shared)
    with pytest.raises(UnsafePathError, match="writable by other users"):
        Engine(RuntimeConfig(dirs=[link], backend="posix"))
    assert os.listdir(shared) == []
    shared.chmod(0o1777)  # like /tmp: allowed
    with Engine(RuntimeConfig(dirs=[shared], backend="posix")) as eng:
        eng.offload("x", torch.ones(4)).wait()
    assert os.listdir(shared) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a directory owned by another user")
def test_base_owned_by_another_user_or_their_symlink_is_refused(tmp_path):
    other = tmp_path / "other"
    other.mkdir(mode=0o755)
    os.chown(other, 4242, 4242)
    with pytest.raises(UnsafePathError, match="belongs to uid 4242"):
        Engine(RuntimeConfig(dirs=[other], backend="posix"))
    link = tmp_path / "link"
    link.symlink_to(other)
    with pytest.raises(UnsafePathError, match="belongs to uid 4242"):
        Engine(RuntimeConfig(dirs=[link], backend="posix"))
    mine = tmp_path / "mine"
    mine.mkdir()
    their_link = tmp_path / "their-link"
    their_link.symlink_to(mine)
    os.lchown(their_link, 4242, 4242)
    with pytest.raises(UnsafePathError, match="symbolic link owned by uid 4242"):
        Engine(RuntimeConfig(dirs=[their_link], backend="posix"))
    assert os.listdir(other) == [] and os.listdir(mine) == []


@pytest.fixture
def no_home(tmp_path, monkeypatch) -> Path:
    """No usable home or cache: the default offload directory falls back to a temp dir that the test
    controls (made like /tmp: world-writable with the sticky bit). Returns teraio-<uid> in it."""
    import tempfile

    shared_tmp = tmp_path / "tmp"
    shared_tmp.mkdir()
    shared_tmp.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("TERAIO_OFFLOAD_DIRS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "no-such-home"))
    per_user = shared_tmp / f"teraio-{os.geteuid()}"
    assert default_offload_dir() == per_user / "offload"
    return per_user


def test_temp_dir_fallback_creates_every_level_private_whatever_the_umask(no_home):
    old = os.umask(0)  # os.makedirs gave the parents it created mode 0777 & ~umask
    try:
        with Engine(RuntimeConfig(backend="posix")) as eng:
            eng.offload("x", torch.ones(4)).wait()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(no_home).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(no_home / "offload").st_mode) == 0o700


def _refused(per_user: Path, match: str) -> None:
    before = sorted(os.listdir(per_user)) if per_user.is_dir() else None
    with pytest.raises(UnsafePathError, match=match) as info:
        Engine(RuntimeConfig(backend="posix"))
    assert str(per_user) in str(info.value) and len(str(info.value).splitlines()) == 1
    if before is not None:
        assert sorted(os.listdir(per_user)) == before, "something was created in a refused directory"


def test_temp_dir_fallback_refuses_a_per_user_dir_others_can_write(no_home):
    """Only the leaf (offload/) was checked: a teraio-<uid> made world-writable by someone else was used."""
    no_home.mkdir(mode=0o700)
    # (With the sticky bit it would be accepted, as /tmp is: nobody else could rename offload/ then.)
    for mode in (0o777, 0o770, 0o702):
        no_home.chmod(mode)
        _refused(no_home, f"writable by other users \\(mode {mode:o}\\)")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a directory owned by another user")
def test_temp_dir_fallback_refuses_a_per_user_dir_of_another_user(no_home, tmp_path):
    """Another user created /tmp/teraio-<uid> first (private to them): they could swap offload/ at will."""
    no_home.mkdir(mode=0o700)
    os.chown(no_home, 12345, 12345)
    _refused(no_home, "belongs to uid 12345")
    no_home.rmdir()
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    no_home.symlink_to(mine)  # their link to a directory of ours
    os.lchown(no_home, 12345, 12345)
    _refused(no_home, "symbolic link owned by uid 12345")
    assert os.listdir(mine) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a link owned by another user")
def test_temp_dir_fallback_refuses_another_users_link_to_another_shared_directory(no_home, tmp_path):
    """The sticky-bit check ran before the owner check: another user's /tmp/teraio-<uid> linking to one
    more sticky directory (here /tmp-like, root's) passed as a shared directory of its own."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    elsewhere.chmod(0o1777)  # shared like /tmp, and owned by a trusted user (root)
    no_home.symlink_to(elsewhere)
    os.lchown(no_home, 12345, 12345)
    _refused(no_home, "symbolic link owned by uid 12345")
    assert os.listdir(elsewhere) == []


def test_temp_dir_fallback_names_the_file_in_the_way(no_home):
    """A regular file at /tmp/teraio-<uid> was reported as the offload directory itself."""
    no_home.write_text("not a directory")
    with pytest.raises(ConfigError) as info:
        Engine(RuntimeConfig(backend="posix"))
    msg = str(info.value)
    assert f"{no_home} is not a directory" in msg and len(msg.splitlines()) == 1, msg
    assert no_home.read_text() == "not a directory"


# --------------------------------------------------------------------------------------------- space
def test_reservation_is_split_the_way_requests_are_striped(tmp_path):
    """Large and small requests alternating: plain round-robin put every large one on the first
    directory, which outgrew its share of the reservation mid-step. No file may grow after start."""
    chunk = 64 * KIB
    sizes = [chunk, 4 * KIB] * 8 + [3 * chunk, 4 * KIB, 2 * chunk]
    total = sum(sizes)
    dirs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    cfg = RuntimeConfig(dirs=dirs, backend="posix", chunk_bytes=chunk, reserve_bytes=total)
    with Engine(cfg) as eng:
        start = [d.capacity_nbytes for d in eng._dirs]
        assert sum(start) < total + 4 * chunk  # split, not the whole reservation on each
        keep = []
        for i, n in enumerate(sizes):
            t = torch.full((n,), i % 251, dtype=torch.uint8)
            eng.offload(f"t{i}", t).wait()
            keep.append(t)
        assert [d.capacity_nbytes for d in eng._dirs] == start
        for i, t in enumerate(keep):
            eng.release(f"t{i}")
            assert torch.equal(eng.fetch(f"t{i}"), t)


# ------------------------------------------------------------------ SIGTERM at every submission point
#: One interpreter imports torch once, then forks a child per delivery point. Each child offloads a tensor
#: in several chunks and reads it back, and raises SIGTERM in-line at its n-th call of the instrumented
#: function: inside ``ThreadPoolExecutor.submit`` with the executor's locks held ("submit"), or inside
#: ``OffloadDir.allocate`` with its lock held ("allocate"). The parent reports how each child ended.
_SIGNAL_AT_EVERY_POINT = """
import json, os, signal, sys, time
import torch
from concurrent.futures import thread as futures_thread

base, mode = sys.argv[1], sys.argv[2]
DEADLINE_S = 20.0


def child(where, n, counts_path):
    torch.set_num_threads(1)
    from teraio.runtime import Engine, RuntimeConfig
    from teraio.runtime import space

    if mode == "user-handler":
        def handler(signum, frame):
            sys.exit(3)  # a graceful shutdown: atexit closes the engines
        signal.signal(signal.SIGTERM, handler)
    calls = [0]

    def deliver_at(fn):
        def wrapper(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                signal.raise_signal(signal.SIGTERM)  # handled at once, inside the caller's locks
            return fn(*args, **kwargs)
        return wrapper

    if where == "submit":
        futures_thread._WorkItem.__init__ = deliver_at(futures_thread._WorkItem.__init__)
    else:
        space.ExtentAllocator.allocate = deliver_at(space.ExtentAllocator.allocate)
    eng = Engine(RuntimeConfig(dirs=[base], backend="posix", chunk_bytes=64 << 10, io_threads=2))
    for key in ("a", "b"):
        x = torch.arange(4 * (16 << 10), dtype=torch.float32)  # 4 chunks of 64 KiB
        eng.offload(key, x).wait()
        eng.release(key)
        del x
        eng.prefetch(key).wait()
        eng.fetch(key)
    eng.drop("a")
    if n == 0:
        with open(counts_path, "w") as f:
            f.write(str(calls[0]))
    eng.close()
    os._exit(0)


def run(where, n, counts_path=""):
    pid = os.fork()
    if pid == 0:
        try:
            child(where, n, counts_path)
        except SystemExit as e:  # what an interpreter exit does next: the atexit hooks
            import atexit
            atexit._run_exitfuncs()
            os._exit(e.code if isinstance(e.code, int) else 1)
        finally:
            os._exit(99)  # any other exception in the child
    deadline = time.monotonic() + DEADLINE_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hang"
        time.sleep(0.01)
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit {os.WEXITSTATUS(status)}"


results = []
for where in ("submit", "allocate"):
    counts = os.path.join(base, f"..{where}-calls")
    assert run(where, 0, counts) == "exit 0"
    with open(counts) as f:
        total = int(f.read())
    os.unlink(counts)
    for n in range(1, total + 1):
        outcome = run(where, n)
        left = sorted(e for e in os.listdir(base) if "teraio" in e)
        results.append({"where": where, "n": n, "outcome": outcome, "left": left})
        for name in left:  # so that each point is judged on its own
            import shutil
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
print(json.dumps(results))
"""


@pytest.mark.parametrize(("mode", "expected"), [("default", "signal 15"), ("user-handler", "exit 3")])
def test_sigterm_at_every_submission_point_cleans_up_and_ends_the_process(tmp_path, mode, expected):
    """SIGTERM delivered while the engine submitted I/O hung 1 run in 20: the handler ran inside
    ThreadPoolExecutor.submit, then Engine.close called shutdown, which waits on the lock submit holds;
    the offload files stayed until SIGKILL. Every submission and allocation point is tried: each process
    must end as SIGTERM's default action would (or as the user's handler says), its files removed."""
    base = tmp_path / "off"
    base.mkdir(mode=0o700)
    p = _run(_SIGNAL_AT_EVERY_POINT, str(base), mode)
    try:
        out, err = p.communicate(timeout=500)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    assert p.returncode == 0, err[-3000:]
    results = json.loads(out.strip().splitlines()[-1])
    points = {w: [r for r in results if r["where"] == w] for w in ("submit", "allocate")}
    assert len(points["submit"]) >= 10 and len(points["allocate"]) >= 2, points  # writes and reads
    bad = [r for r in results if r["outcome"] != expected or r["left"]]
    assert bad == [], bad

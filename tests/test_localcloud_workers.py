"""Worker SSH servers: real asyncssh clients against real servers on 127.0.0.1, real local processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import asyncssh
import pytest

from conftest import process_alive
from tpuctl.localcloud import workers
from tpuctl.localcloud.workers import ANY_USER, MARKER_VAR, WorkerPool, marker, parse_ssh_keys

pytestmark = pytest.mark.timeout(60)


def _key_line(user: str, key: asyncssh.SSHKey) -> str:
    return f"{user}:{key.export_public_key('openssh').decode().strip()} {user}"


@pytest.fixture(scope="module")
def alice_key() -> asyncssh.SSHKey:
    return asyncssh.generate_private_key("ssh-ed25519")


@pytest.fixture(scope="module")
def mallory_key() -> asyncssh.SSHKey:
    return asyncssh.generate_private_key("ssh-ed25519")


def _marked_under(root: Path) -> list[int]:
    """Pids of live (non-zombie) processes that any worker under ``root`` started."""
    prefix = f"{MARKER_VAR}={marker(root)}".encode()
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if any(var.startswith(prefix) for var in environ.split(b"\0")):
            pids.append(int(entry.name))
    return pids


@pytest.fixture
def root(tmp_path) -> Path:
    return (tmp_path / "workers").absolute()


@pytest.fixture
def pool(root):
    pool = WorkerPool(root)
    yield pool
    pool.close()
    assert _marked_under(root) == []


def _connect(ep, key, user="alice"):
    known = asyncssh.import_known_hosts(f"[{ep.host}]:{ep.port} {ep.host_key}\n")
    return asyncssh.connect(ep.host, ep.port, username=user, client_keys=[key], known_hosts=known)


def pool_dir(root: Path, key: str, index: int) -> Path:
    return root / key / str(index)


def ssh(ep, key, command, user="alice", stdin=None) -> asyncssh.SSHCompletedProcess:
    async def go():
        async with _connect(ep, key, user) as conn:
            return await conn.run(command, input=stdin, encoding=None)

    return asyncio.run(go())


def test_parse_ssh_keys_skips_malformed_lines(alice_key, mallory_key):
    bare = mallory_key.export_public_key("openssh").decode().strip() + " mallory@laptop:work"
    keys = parse_ssh_keys([_key_line("alice", alice_key), "no-colon-here", "bob:ssh-ed25519 not-base64", "",
                           bare])
    assert keys == {"alice": {alice_key.public_data}, ANY_USER: {mallory_key.public_data}}


def test_key_auth_accepts_listed_user_key_and_rejects_others(pool, alice_key, mallory_key):
    (ep,) = pool.start_node("p/z/auth", 1, {}, [_key_line("alice", alice_key)], None)
    assert ep.host == "127.0.0.1" and ep.host_key.startswith("ssh-ed25519 AAAA")
    assert ssh(ep, alice_key, "whoami; echo $USER").stdout.split()[-1] == b"alice"
    with pytest.raises(asyncssh.PermissionDenied):
        ssh(ep, mallory_key, "true")
    with pytest.raises(asyncssh.PermissionDenied):
        ssh(ep, alice_key, "true", user="bob")


def test_a_bare_key_line_admits_any_user(pool, alice_key, mallory_key):
    bare = alice_key.export_public_key("openssh").decode().strip()
    (ep,) = pool.start_node("p/z/bare", 1, {}, [bare], None)
    assert ssh(ep, alice_key, "echo $USER", user="carol").stdout == b"carol\n"
    with pytest.raises(asyncssh.PermissionDenied):
        ssh(ep, mallory_key, "true", user="carol")


def test_update_keys_takes_effect_for_new_connections(pool, alice_key, mallory_key):
    (ep,) = pool.start_node("p/z/rotate", 1, {}, [_key_line("alice", alice_key)], None)
    pool.update_keys("p/z/rotate", [_key_line("mallory", mallory_key)])
    with pytest.raises(asyncssh.PermissionDenied):
        ssh(ep, alice_key, "true")
    assert ssh(ep, mallory_key, "echo ok", user="mallory").stdout == b"ok\n"


def test_commands_stream_output_stdin_and_exit_status(pool, root, alice_key):
    env = {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:1"}
    (ep,) = pool.start_node("p/z/cmd", 1, env, [_key_line("alice", alice_key)], None)
    done = ssh(ep, alice_key, "echo out; echo err >&2; exit 7")
    assert (done.stdout, done.stderr, done.exit_status) == (b"out\n", b"err\n", 7)

    assert ssh(ep, alice_key, "tr a-z A-Z", stdin=b"hello\n").stdout == b"HELLO\n"
    assert ssh(ep, alice_key, "wc -c", stdin=b"z" * 3_000_000).stdout.strip() == b"3000000"
    assert ssh(ep, alice_key, "exit 3", stdin=b"unread" * 500_000).exit_status == 3
    big = ssh(ep, alice_key, "head -c 5000000 /dev/zero")
    assert len(big.stdout) == 5_000_000 and big.exit_status == 0

    probe = "echo $STORAGE_EMULATOR_HOST; pwd; echo $HOME; " \
            "python -c 'import sys; print(sys.executable)'"
    lines = ssh(ep, alice_key, probe).stdout.decode().splitlines()
    worker_dir = str(pool_dir(root, "p/z/cmd", 0))
    assert lines[0] == "http://127.0.0.1:1"
    assert lines[1:3] == [worker_dir, worker_dir]
    assert Path(lines[3]).parent == Path(sys.executable).parent

    killed = ssh(ep, alice_key, "kill -KILL $$")
    assert killed.exit_signal[0] == "KILL"


def test_signal_request_reaches_the_command(pool, alice_key):
    (ep,) = pool.start_node("p/z/sig", 1, {}, [_key_line("alice", alice_key)], None)

    async def go():
        async with _connect(ep, alice_key) as conn:
            proc = await conn.create_process("echo started; exec sleep 30")
            assert await proc.stdout.readline() == "started\n"
            proc.send_signal("TERM")
            return await proc.wait()

    assert asyncio.run(go()).exit_signal[0] == "TERM"


def test_pty_sessions_get_a_real_terminal(pool, alice_key):
    (ep,) = pool.start_node("p/z/pty", 1, {}, [_key_line("alice", alice_key)], None)

    async def go():
        async with _connect(ep, alice_key) as conn:
            done = await conn.run("tty; echo $TERM; stty size", term_type="xterm", term_size=(100, 30))
            shell = await conn.create_process(term_type="xterm", term_size=(80, 24))
            shell.stdin.write("stty size; sleep 30\n")
            await shell.stdout.readuntil("24 80")
            await asyncio.sleep(0.3)
            shell.stdin.write("\x03")  # ^C through the terminal reaches the foreground job
            shell.change_terminal_size(120, 40)
            shell.stdin.write("echo interrupted $?; stty size; exit 4\n")
            output = await asyncio.wait_for(shell.stdout.read(), 10)
            return done, output, (await shell.wait()).exit_status

    done, output, status = asyncio.run(go())
    assert done.stdout.startswith("/dev/pts/") and done.stdout.endswith("\r\nxterm\r\n30 100\r\n")
    assert "interrupted 130" in output and "40 120" in output
    assert status == 4


def test_detached_processes_survive_the_session_and_die_with_the_node(pool, root, alice_key):
    (ep,) = pool.start_node("p/z/detach", 1, {}, [_key_line("alice", alice_key)], None)
    launch = (
        "nohup sleep 300 > nohup.log 2>&1 < /dev/null & echo $!; "
        "setsid bash -c 'sleep 301 & wait' > /dev/null 2>&1 < /dev/null & echo $!"
    )
    pids = [int(p) for p in ssh(ep, alice_key, launch).stdout.split()]  # the session is closed now
    deadline = time.monotonic() + 10
    while len(grandchildren := _marked_under(pool_dir(root, "p/z/detach", 0))) < 3:
        assert time.monotonic() < deadline, grandchildren  # nohup sleep, setsid bash and its sleep
        time.sleep(0.05)
    assert all(process_alive(pid) for pid in pids)

    pool.stop_node("p/z/detach")
    assert not any(process_alive(pid) for pid in grandchildren)
    with pytest.raises(OSError):
        ssh(ep, alice_key, "true")
    pool.stop_node("p/z/detach")  # idempotent


def test_without_proc_processes_are_found_through_ps(tmp_path, alice_key, monkeypatch):
    monkeypatch.setattr(workers, "_PROC", Path("/nonexistent-proc"))  # as on macOS
    root = (tmp_path / "Application Support" / "workers").absolute()  # ps separates fields with spaces
    pool = WorkerPool(root)
    try:
        (ep,) = pool.start_node("p/z/noproc", 1, {}, [_key_line("alice", alice_key)], None)
        pid = int(ssh(ep, alice_key, "setsid sleep 300 > /dev/null 2>&1 < /dev/null & echo $!").stdout)
        time.sleep(0.2)
        assert process_alive(pid)
        pool.stop_node("p/z/noproc")
        assert not process_alive(pid)
    finally:
        pool.close()
    assert _marked_under(root) == []


def test_kill_worker_stops_one_worker_and_start_node_revives_it(pool, alice_key):
    keys = [_key_line("alice", alice_key)]
    eps = pool.start_node("p/z/kill", 2, {}, keys, None)
    pid = int(ssh(eps[1], alice_key, "nohup sleep 300 > /dev/null 2>&1 & echo $!").stdout)

    pool.kill_worker("p/z/kill", 1)
    assert not process_alive(pid)
    with pytest.raises(OSError):
        ssh(eps[1], alice_key, "true")
    assert ssh(eps[0], alice_key, "basename $HOME").stdout == b"0\n"

    revived = pool.start_node("p/z/kill", 2, {}, keys, None)
    assert revived == eps  # same port (it was free again) and the same persisted host key
    assert ssh(revived[1], alice_key, "basename $HOME").stdout == b"1\n"


def test_guest_commands_start_with_sshds_signal_defaults_whatever_the_host_ignores(pool, alice_key):
    """A host run under nohup (or anything ignoring SIGHUP/SIGINT/SIGTERM/SIGQUIT) must not pass that on: on a
    real VM, sshd sets them back to SIG_DFL before a session starts, so a hang-up or ^C reaches the command."""
    watched = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in watched}
    try:
        (ep,) = pool.start_node("p/z/signals", 1, {}, [_key_line("alice", alice_key)], None)
        show = "awk '/^SigIgn/ {print $2}' /proc/self/status"

        async def on_pty():
            async with _connect(ep, alice_key) as conn:
                return await conn.run(show, term_type="xterm")

        masks = [ssh(ep, alice_key, show).stdout.decode(), asyncio.run(on_pty()).stdout]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # Ignoring nothing but SIGPIPE (as Python does), the host spawns without a preexec function: the same defaults.
    masks.append(ssh(ep, alice_key, show).stdout.decode())
    for mask in masks:
        ignored = int(mask.strip(), 16)
        assert not [s.name for s in (*watched, signal.SIGPIPE) if ignored & (1 << (s - 1))], mask


def test_drop_connections_breaks_sessions_and_hangs_up_foreground_commands(pool, alice_key):
    (ep,) = pool.start_node("p/z/drop", 1, {}, [_key_line("alice", alice_key)], None)

    async def go():
        async with _connect(ep, alice_key) as conn:
            proc = await conn.create_process("echo $$; exec sleep 30")
            pid = int(await proc.stdout.readline())
            pool_call = asyncio.get_running_loop().run_in_executor(None, pool.drop_connections, "p/z/drop")
            await pool_call
            with pytest.raises((asyncssh.Error, OSError)):
                await asyncio.wait_for(conn.run("true", check=True), 10)
            return pid

    pid = asyncio.run(go())
    deadline = time.monotonic() + 5
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(pid)
    assert ssh(ep, alice_key, "echo back").stdout == b"back\n"


def test_four_workers_serve_in_parallel(pool, tmp_path, alice_key):
    eps = pool.start_node("p/z/v3-32", 4, {}, [_key_line("alice", alice_key)], None)
    assert len({ep.port for ep in eps}) == 4
    assert len({ep.host_key for ep in eps}) == 4
    # A barrier across the four sessions: it only opens if all four commands run at the same time.
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    command = (f"touch {barrier}/$(basename $HOME); for i in $(seq 200); do "
               f"[ $(ls {barrier} | wc -l) -eq 4 ] && basename $HOME && exit 0; sleep 0.05; done; exit 1")

    async def one(ep):
        async with _connect(ep, alice_key) as conn:
            return await conn.run(command, check=True)

    async def all_of_them():
        return await asyncio.gather(*(one(ep) for ep in eps))

    assert [r.stdout for r in asyncio.run(all_of_them())] == ["0\n", "1\n", "2\n", "3\n"]


def test_each_worker_has_its_own_metadata_server_until_its_node_stops(pool, alice_key):
    def tree(index):
        return {"instance": {"attributes": {"agent-worker-number": str(index)}}}

    eps = pool.start_node("p/z/md", 2, {}, [_key_line("alice", alice_key)], None, metadata=tree)
    read = ("curl -sf -H 'Metadata-Flavor: Google' "
            "http://$GCE_METADATA_HOST/computeMetadata/v1/instance/attributes/agent-worker-number")
    assert [ssh(ep, alice_key, read).stdout for ep in eps] == [b"0", b"1"]
    hosts = [ssh(ep, alice_key, "echo $GCE_METADATA_HOST $GCE_METADATA_IP").stdout.split() for ep in eps]
    assert all(host == ip and host.startswith(b"127.0.0.1:") for host, ip in hosts) and hosts[0] != hosts[1]
    # A worker revived after a fault keeps its metadata server: its environment names that port.
    pool.kill_worker("p/z/md", 1)
    revived = pool.start_node("p/z/md", 2, {}, [_key_line("alice", alice_key)], None, metadata=tree)
    assert ssh(revived[1], alice_key, read).stdout == b"1"
    pool.stop_node("p/z/md")
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{hosts[0][0].decode()}/", timeout=5)


def test_startup_script_runs_detached_once_per_boot_with_a_log(pool, root, alice_key):
    script = "#!/bin/bash\necho booted worker $(basename $HOME)\nsleep 300\n"
    pool.start_node("p/z/boot", 2, {}, [_key_line("alice", alice_key)], script)
    logs = [pool_dir(root, "p/z/boot", i) / "startup-script.log" for i in range(2)]
    deadline = time.monotonic() + 10
    while not all(log.exists() and log.read_text() for log in logs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [log.read_text() for log in logs] == ["booted worker 0\n", "booted worker 1\n"]
    pool.start_node("p/z/boot", 2, {}, [_key_line("alice", alice_key)], script)  # already up: no second run
    time.sleep(0.2)
    assert logs[0].read_text() == "booted worker 0\n"
    assert _marked_under(pool_dir(root, "p/z/boot", 0))  # the script's sleep is still running


def test_host_keys_and_ports_persist_across_pool_restart(tmp_path, alice_key):
    keys = [_key_line("alice", alice_key)]
    first = WorkerPool(tmp_path)
    try:
        before = first.start_node("p/z/persist", 1, {}, keys, None)
    finally:
        first.close()
    second = WorkerPool(tmp_path)
    try:
        after = second.start_node("p/z/persist", 1, {}, keys, None)
        assert after[0].host_key == before[0].host_key
        assert ssh(after[0], alice_key, "echo hi").stdout == b"hi\n"
    finally:
        second.close()
    assert _marked_under(tmp_path.absolute()) == []


def test_a_new_pool_kills_what_a_crashed_pool_left_under_its_root(tmp_path):
    root = (tmp_path / "workers").absolute()
    mine = subprocess.Popen(["sleep", "300"], env={**os.environ, MARKER_VAR: marker(root / "node" / "0")},
                            start_new_session=True)
    other = subprocess.Popen(["sleep", "300"], env={**os.environ, MARKER_VAR: marker(tmp_path / "elsewhere" / "0")},
                             start_new_session=True)
    try:
        WorkerPool(root).close()
        assert not process_alive(mine.pid)
        assert process_alive(other.pid)  # another pool's worker
    finally:
        other.kill()
        mine.wait()
        other.wait()


def test_sftp_and_scp_read_and_write_the_worker_dir(pool, tmp_path, alice_key):
    (ep,) = pool.start_node("p/z/sftp", 1, {}, [_key_line("alice", alice_key)], None)
    local = tmp_path / "bundle.tar"
    local.write_bytes(b"code" * 1000)

    async def go():
        async with _connect(ep, alice_key) as conn:
            async with conn.start_sftp_client() as sftp:
                async with sftp.open("hello.txt", "w") as f:
                    await f.write("from sftp")
            await asyncssh.scp(str(local), (conn, "bundle.tar"))
            return await conn.run("cat hello.txt; wc -c < bundle.tar", check=True)

    assert asyncio.run(go()).stdout == "from sftp4000\n"


def test_bad_keys_are_rejected(pool):
    with pytest.raises(ValueError):
        pool.start_node("../escape", 1, {}, [], None)
    with pytest.raises(KeyError):
        pool.update_keys("p/z/nothing", [])

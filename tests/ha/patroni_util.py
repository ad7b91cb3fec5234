"""A real Patroni cluster for the HA tests: two PostgreSQL nodes and a Raft controller, on loopback.

``patroni[raft]`` (the ``ha`` extra) brings Patroni and its own Raft store (pysyncobj), so the whole cluster
runs on one machine without etcd: each node's Patroni is a Raft member, and ``patroni_raft_controller`` is
the third vote that keeps a quorum when one node dies.  Everything lives in one temporary directory and
listens on free loopback ports; as root, every process runs as the unprivileged OS user of
``pgbroker._embedded.server_os_user`` (PostgreSQL refuses root), with the server binaries of
``server_bin_dir``.  Patroni's timings are small (ttl 10 s, loop_wait 1 s, retry_timeout 3 s), so a
failover takes about ttl seconds.

Stopping is reliable: every process is started in a session of its own and its whole process group is
killed at the end, and the postmasters (and their children) by pid as well.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import yaml

from pgbroker._embedded import _reachable_by_others, free_port, server_bin_dir, server_os_user

SCOPE = "pgbroker-ha"
NAMESPACE = "/pgbroker-test/"
TTL, LOOP_WAIT, RETRY_TIMEOUT = 10, 1, 3
START_TIMEOUT = 120.0  # seconds for a node to come up as primary or streaming replica


def patroni_missing() -> str | None:
    """Why the Patroni tests cannot run here (None: they can)."""
    for module in ("patroni", "pysyncobj", "yaml"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed: pip install -e '.[ha]' (patroni[raft])"
    return None


def _python_for_server_user() -> tuple[str, dict[str, str]]:
    """An interpreter the server's OS user can run that imports Patroni, and the environment it needs.

    Not root: this interpreter.  Root: this interpreter if its real path is reachable by others (a system
    Python, as in CI), else a system ``python3.X`` of the same version, given this environment's
    site-packages on PYTHONPATH (a pyenv Python under /root is not reachable).
    """
    import patroni

    site = str(Path(patroni.__file__).resolve().parent.parent)
    env = {"PYTHONPATH": site, "PYTHONDONTWRITEBYTECODE": "1"}
    if os.geteuid() != 0:
        return sys.executable, env
    if not _reachable_by_others(Path(site)):
        raise RuntimeError(
            f"the HA tests run Patroni as the OS user {server_os_user()!r}, who cannot reach {site}: "
            "make the virtual environment readable by others (chmod o+rx on it and its parents)"
        )
    real = Path(os.path.realpath(sys.executable))
    if _reachable_by_others(real):
        return str(real), env
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (Path("/usr/bin") / version, Path("/usr/local/bin") / version):
        if candidate.exists() and _reachable_by_others(candidate):
            return str(candidate), env
    raise RuntimeError(
        f"the HA tests run Patroni as the OS user {server_os_user()!r}, who cannot run {real} "
        f"and no system {version} exists"
    )


def _http_json(url: str, timeout: float = 2.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - loopback only
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:  # Patroni answers 503 on a role check that fails, with a body
        body = exc.read()
        return exc.code, json.loads(body) if body else None


@dataclass
class Node:
    name: str
    directory: Path
    pg_port: int
    rest_port: int
    raft_port: int
    process: subprocess.Popen | None = None
    log_files: list[Path] = field(default_factory=list)

    @property
    def config_file(self) -> Path:
        return self.directory / "patroni.yml"

    @property
    def datadir(self) -> Path:
        return self.directory / "data"

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.pg_port}/{dbname}?connect_timeout=3"

    def status(self) -> dict[str, Any] | None:
        """Patroni's GET /patroni (role, state, timeline...); None when the REST API does not answer."""
        try:
            return _http_json(f"http://127.0.0.1:{self.rest_port}/patroni")[1]
        except (OSError, ValueError):
            return None

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.datadir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def is_primary(self) -> bool:
        try:
            with psycopg.connect(self.url(), autocommit=True) as conn:
                return conn.execute("SELECT NOT pg_is_in_recovery()").fetchone()[0]
        except psycopg.Error:
            return False

    def is_streaming_replica(self) -> bool:
        status = self.status()
        return bool(status and status.get("role") == "replica" and status.get("replication_state") == "streaming")


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def _kill(pid: int | None, sig: int = signal.SIGKILL) -> None:
    if pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class PatroniCluster:
    """Two Patroni nodes (``node1`` bootstraps the cluster, ``node2`` clones it) and a Raft controller.

    ``synchronous``: Patroni's synchronous_mode (the replica is a synchronous standby: a commit returns
    once it has the WAL, so a failover loses no acknowledged write).
    """

    def __init__(self, *, synchronous: bool = False) -> None:
        self.synchronous = synchronous
        self.base = Path(tempfile.mkdtemp(prefix="pgbroker-patroni-"))
        self.base.chmod(0o755)
        self.python, self.env = _python_for_server_user()
        self.bin_dir = server_bin_dir()
        self.nodes = [Node(f"node{i}", self.base / f"node{i}", free_port(), free_port(), free_port()) for i in (1, 2)]
        self.controller_port = free_port()
        self.controller: subprocess.Popen | None = None
        self._user = pwd.getpwnam(server_os_user()) if os.geteuid() == 0 else None
        for node in self.nodes:
            node.directory.mkdir()
            self._own(node.directory)
            node.config_file.write_text(yaml.safe_dump(self._node_config(node)))
        (self.base / "controller").mkdir()
        self._own(self.base / "controller")
        (self.base / "controller.yml").write_text(yaml.safe_dump(self._controller_config()))
        (self.base / "patronictl.yml").write_text(yaml.safe_dump(self._ctl_config()))

    # -- configuration

    def _raft_addr(self, port: int) -> str:
        return f"127.0.0.1:{port}"

    def _all_raft(self) -> list[str]:
        return [self._raft_addr(n.raft_port) for n in self.nodes] + [self._raft_addr(self.controller_port)]

    def _node_config(self, node: Node) -> dict[str, Any]:
        me = self._raft_addr(node.raft_port)
        return {
            "scope": SCOPE,
            "namespace": NAMESPACE,
            "name": node.name,
            "restapi": {"listen": f"127.0.0.1:{node.rest_port}", "connect_address": f"127.0.0.1:{node.rest_port}"},
            "raft": {
                "data_dir": str(node.directory / "raft"),
                "self_addr": me,
                "partner_addrs": [a for a in self._all_raft() if a != me],
            },
            "bootstrap": {
                "dcs": {
                    "ttl": TTL,
                    "loop_wait": LOOP_WAIT,
                    "retry_timeout": RETRY_TIMEOUT,
                    "maximum_lag_on_failover": 64 * 1024 * 1024,
                    "synchronous_mode": self.synchronous,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "wal_log_hints": "on",
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "max_connections": 200,
                            "wal_keep_size": "256MB",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C.UTF-8"}],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.pg_port}",
                "connect_address": f"127.0.0.1:{node.pg_port}",
                "data_dir": str(node.datadir),
                "bin_dir": str(self.bin_dir),
                "pgpass": str(node.directory / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": "postgres"},
                    "replication": {"username": "replicator", "password": "replicator"},
                    "rewind": {"username": "rewinder", "password": "rewinder"},
                },
                "parameters": {"unix_socket_directories": str(node.directory), "fsync": "off"},
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.1/32 trust",
                    "host replication all 127.0.0.1/32 trust",
                ],
            },
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False, "nosync": False},
        }

    def _controller_config(self) -> dict[str, Any]:
        me = self._raft_addr(self.controller_port)
        return {
            "raft": {
                "data_dir": str(self.base / "controller"),
                "self_addr": me,
                "partner_addrs": [a for a in self._all_raft() if a != me],
            }
        }

    def _ctl_config(self) -> dict[str, Any]:
        return {"scope": SCOPE, "namespace": NAMESPACE, "raft": {"partner_addrs": self._all_raft()}}

    # -- processes

    def _own(self, path: Path) -> None:
        if self._user is not None:
            os.chown(path, self._user.pw_uid, self._user.pw_gid)
            path.chmod(0o700)

    def _spawn(self, code: str, config: Path, log: Path) -> subprocess.Popen:
        env = {
            "PATH": "/usr/bin:/bin",
            "LC_ALL": "C.UTF-8",
            "LANG": "C.UTF-8",
            "HOME": str(config.parent),
            **self.env,
        }
        extra: dict[str, Any] = {}
        if self._user is not None:
            extra = {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}
        out = log.open("ab")
        try:
            return subprocess.Popen(
                [self.python, "-c", code, str(config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(config.parent),
                start_new_session=True,
                **extra,
            )
        finally:
            out.close()

    def start_controller(self) -> None:
        code = (
            "import sys; sys.argv = ['patroni_raft_controller', sys.argv[1]];"
            " from patroni.raft_controller import main; main()"
        )
        self.controller = self._spawn(code, self.base / "controller.yml", self.base / "controller.log")

    def start_node(self, node: Node) -> None:
        log = node.directory.parent / f"{node.name}.log"
        node.log_files.append(log)
        code = "import sys; sys.argv = ['patroni', sys.argv[1]]; from patroni.__main__ import main; main()"
        node.process = self._spawn(code, node.config_file, log)

    def start(self) -> PatroniCluster:
        """Start the controller and node1, wait for it to lead, then node2, and wait for it to stream."""
        try:
            self.start_controller()
            self.start_node(self.nodes[0])
            self.wait_for(self.nodes[0].is_primary, "node1 to bootstrap the cluster")
            self.start_node(self.nodes[1])
            self.wait_for(self.nodes[1].is_streaming_replica, "node2 to stream from node1")
            if self.synchronous:
                self.wait_for(self.has_sync_standby, "node2 to become the synchronous standby")
        except BaseException:
            self.stop()
            raise
        return self

    def kill_node(self, node: Node) -> None:
        """SIGKILL the node's Patroni, its postmaster and the postmaster's children: the node dies at once."""
        postmaster = node.postmaster_pid()
        if node.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(node.process.pid, signal.SIGKILL)
            _kill(node.process.pid)
        children = _children(postmaster) if postmaster else []
        _kill(postmaster)
        for pid in children:
            _kill(pid)
        if node.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(10)
        deadline = time.monotonic() + 10
        while postmaster and time.monotonic() < deadline and Path(f"/proc/{postmaster}").exists():
            time.sleep(0.02)

    def stop(self) -> None:
        """Kill everything and remove the directory (idempotent)."""
        for node in self.nodes:
            self.kill_node(node)
        if self.controller is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.controller.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.controller.wait(10)
            self.controller = None
        shutil.rmtree(self.base, ignore_errors=True)

    # -- state

    def leader(self) -> Node | None:
        """The node that is a running primary by Patroni's REST API and by pg_is_in_recovery()."""
        for node in self.nodes:
            status = node.status()
            if status and status.get("role") == "primary" and status.get("state") == "running" and node.is_primary():
                return node
        return None

    def other(self, node: Node) -> Node:
        return next(n for n in self.nodes if n is not node)

    def has_sync_standby(self) -> bool:
        for node in self.nodes:
            with contextlib.suppress(OSError, ValueError):
                code, body = _http_json(f"http://127.0.0.1:{node.rest_port}/cluster")
                if code == 200 and body:
                    return any(
                        m.get("role") == "sync_standby" and m.get("state") == "streaming" for m in body["members"]
                    )
        return False

    def healthy(self) -> bool:
        leader = self.leader()
        if leader is None or not self.other(leader).is_streaming_replica():
            return False
        return not self.synchronous or self.has_sync_standby()

    def multihost_url(self, dbname: str) -> str:
        hosts = ",".join(f"127.0.0.1:{n.pg_port}" for n in self.nodes)
        return f"postgresql://postgres@{hosts}/{dbname}?target_session_attrs=read-write&connect_timeout=2"

    def patronictl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        code = "import sys; sys.argv = ['patronictl', *sys.argv[1:]]; from patroni.ctl import ctl; ctl()"
        return subprocess.run(
            [sys.executable, "-c", code, "-c", str(self.base / "patronictl.yml"), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.env},
        )

    def logs(self, lines: int = 40) -> str:
        """The tail of every log, for a failure message."""
        parts = []
        for path in sorted(self.base.glob("*.log")):
            with contextlib.suppress(OSError):
                parts.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(parts)

    def wait_for(self, check, what: str, timeout: float = START_TIMEOUT) -> float:
        """Poll ``check`` every 20 ms until true; the time.monotonic() it became true."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(psycopg.Error, OSError):
                if check():
                    return time.monotonic()
            for proc in [self.controller, *(n.process for n in self.nodes)]:
                if proc is not None and proc.poll() is not None and proc.returncode not in (-signal.SIGKILL,):
                    raise AssertionError(
                        f"a Patroni process exited ({proc.returncode}) waiting for {what}\n{self.logs()}"
                    )
            time.sleep(0.02)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs()}")

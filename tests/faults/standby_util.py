"""A streaming standby of a test's primary, for the failover tests (pg_basebackup -R, promoted by hand)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psycopg

from pgbroker._embedded import (
    SERVER_OPTIONS,
    EmbeddedPostgres,
    find_pg_bin,
    free_port,
    pg_ctl_command,
    server_bin_dir,
    server_os_user,
)

# What a primary needs to stream to a standby.
PRIMARY_OPTIONS = "-c wal_level=replica -c max_wal_senders=4"


def as_server_user(*args: str) -> list[str]:
    return ["runuser", "-u", server_os_user(), "--", *args] if os.geteuid() == 0 else list(args)


def wait_for(check, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except psycopg.Error:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def stop_immediately(server: EmbeddedPostgres) -> None:
    """The server dies: an immediate shutdown (no checkpoint, crash recovery on the next start)."""
    pg_ctl = str(server.datadir.parent / "pg_ctl") if os.geteuid() == 0 else str(find_pg_bin() / "pg_ctl")
    subprocess.run(
        [pg_ctl, "stop", "-D", str(server.datadir), "-m", "immediate"], check=True, capture_output=True, timeout=60
    )


class Standby:
    """A streaming standby of ``primary``, made with pg_basebackup -R, in its own directory.

    ``options``: more server settings for the standby (``-c name=value ...``).
    """

    def __init__(self, primary: EmbeddedPostgres, directory: Path, options: str = "") -> None:
        self.port = free_port()
        self.directory = directory
        self.options = options
        self.pg_ctl_path = pg_ctl_command(directory)  # (root: hands the directory to the server's OS user)
        self.datadir = directory / "data"
        done = subprocess.run(
            as_server_user(
                str(server_bin_dir() / "pg_basebackup"),
                "-h", primary.host, "-p", str(primary.port), "-U", "postgres",
                "-D", str(self.datadir), "-R", "-X", "stream", "-c", "fast", "--no-sync",
            ),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr

    def url_for(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    @property
    def log(self) -> Path:
        return self.directory / "log"

    def pg_ctl(self, *args: str) -> None:
        done = subprocess.run(
            [self.pg_ctl_path, *args, "-D", str(self.datadir)], capture_output=True, text=True, timeout=120, cwd="/"
        )
        log = self.log
        assert done.returncode == 0, (done.stderr or done.stdout) + (log.read_text()[-2000:] if log.exists() else "")

    def start(self) -> None:
        # The primary's settings: a standby needs max_connections and the like at least as high.
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.directory} {SERVER_OPTIONS}"
            f" {self.options}"
        )
        self.pg_ctl("start", "-w", "-l", str(self.log), "-o", options)

    def kill(self) -> None:
        """Stop it at once, whatever state it is in (teardown; errors ignored)."""
        subprocess.run([self.pg_ctl_path, "stop", "-D", str(self.datadir), "-m", "immediate"], capture_output=True)

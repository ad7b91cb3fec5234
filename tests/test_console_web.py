"""`pgbroker console` end to end: a real server (`pgbroker console`, a child process), a real PostgreSQL of this
module's own (it is stopped and started again), and Debian's Chromium driven through Selenium and its
chromedriver, headless.

The tests skip, saying why, only where Chromium, chromedriver or the console's extra are missing; on CI
(CI=true) they fail instead, as .ci/run installs them.  PGBROKER_UPDATE_REFERENCE=1 rewrites the screenshot
pgbroker/README.md shows (pgbroker/console.png); otherwise the test takes it into a temporary file and checks
the committed one is there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from pgbroker import install
from pgbroker._embedded import EmbeddedPostgres, free_port

REPO = Path(__file__).resolve().parent.parent
SCREENSHOT = REPO / "pgbroker" / "console.png"
CHROMIUM = os.environ.get("PGBROKER_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("PGBROKER_CHROMEDRIVER", "/usr/bin/chromedriver")
ROLES = {
    "console_reader": ["pgbroker_reader"],
    "console_values": ["pgbroker_reader", "pgbroker_user"],
    "console_admin": ["pgbroker_admin"],
    "console_nobody": [],
}
WAIT_S = 20.0  # how long a test waits for the page to show something before it fails


def _missing() -> str | None:
    for path, what in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            return f"{path} is missing (apt-get install {what})"
    for module in ("selenium", "starlette", "uvicorn", "psycopg_pool"):
        try:
            __import__(module)
        except ImportError:
            return f"the Python module {module} is missing (pip install -e '.[test]')"
    return None


_WHY = _missing()
if _WHY is not None:
    if os.environ.get("CI") == "true":
        raise RuntimeError(f"the console's browser tests cannot run on CI: {_WHY}")
    pytest.skip(f"the console's browser tests need a browser: {_WHY}", allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.select import Select  # noqa: E402

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------
# The database, the console server, the browser


@pytest.fixture(scope="module")
def pg() -> Iterator[EmbeddedPostgres]:
    """A server of this module's own: one test stops and starts it."""
    with EmbeddedPostgres() as server:
        install.migrate(server.url)
        with psycopg.connect(server.url, autocommit=True) as conn:
            for role, granted in ROLES.items():
                conn.execute(f"CREATE ROLE {role} LOGIN")
                for g in granted:
                    conn.execute(f"GRANT {g} TO {role}")
        yield server


def _sql(pg: EmbeddedPostgres, statement: str, params: object = None) -> list[tuple]:
    with psycopg.connect(pg.url, autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


class ConsoleProcess:
    def __init__(self, proc: subprocess.Popen[str], base: str, log: Path) -> None:
        self.proc, self.base, self.log = proc, base, log

    def get(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def post(self, path: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, dict]:
        request = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def output(self) -> str:
        return self.log.read_text()


@pytest.fixture(scope="module")
def start_console(
    pg: EmbeddedPostgres, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., ConsoleProcess]]:
    started: list[subprocess.Popen[str]] = []

    def start(role: str = "console_reader", *args: str) -> ConsoleProcess:
        port = free_port()
        log = tmp_path_factory.mktemp("console") / "console.log"
        out = log.open("w")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pgbroker.cli",
                "console",
                "--url",
                pg.url_for("postgres", user=role),
                "--port",
                str(port),
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
        )
        started.append(proc)
        console = ConsoleProcess(proc, f"http://127.0.0.1:{port}", log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"the console exited: {console.output()}"
            with contextlib.suppress(OSError):
                if console.get("/api/info")[0] == 200:
                    return console
            time.sleep(0.2)
        raise AssertionError(f"the console did not answer within 60 s: {console.output()}")

    yield start
    for proc in started:
        proc.terminate()
    for proc in started:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    profile = tempfile.mkdtemp(prefix="pgbroker-console-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_for(what: str, check: Callable[[], object], timeout: float = WAIT_S) -> object:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as exc:  # the element is being redrawn
            last = exc
        else:
            if last:
                return last
        time.sleep(0.05)
    raise AssertionError(f"the page did not show {what} within {timeout} s (last: {last!r})")


def click(driver: webdriver.Chrome, selector: str) -> None:
    """Click what the selector finds, again if the page redrew it in between (its tables are redrawn live)."""

    def once() -> bool:
        driver.find_element(By.CSS_SELECTOR, selector).click()
        return True

    wait_for(f"{selector} to click", once)


def shows(driver: webdriver.Chrome, element_id: str, expected: str) -> None:
    wait_for(f"{expected!r} in #{element_id}", lambda: text_of(driver, element_id) == expected)


def text_of(driver: webdriver.Chrome, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def cells(driver: webdriver.Chrome, table_id: str) -> list[list[str]]:
    rows = driver.find_elements(By.CSS_SELECTOR, f"#{table_id} tbody tr")
    return [[td.text for td in row.find_elements(By.TAG_NAME, "td")] for row in rows]


# A process that holds a lease until killed: prints its backend pid and epoch.
HOLDER = textwrap.dedent("""
    import sys, time, psycopg
    conn = psycopg.connect(sys.argv[1], autocommit=True, application_name=sys.argv[3])
    epoch = conn.execute("SELECT pgbroker.broker_claim(%s, info => %s)", (sys.argv[2], sys.argv[4])).fetchone()[0]
    print(conn.info.backend_pid, epoch, flush=True)
    while True:
        time.sleep(0.2)
        conn.execute("SELECT pgbroker.broker_heartbeat(%s)", (sys.argv[2],))
""")

# A process that takes a lease over N times, each from a new session, a pause apart; prints each epoch.
TAKEOVERS = textwrap.dedent("""
    import sys, time, psycopg
    url, name, n, pause = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    held = []
    for i in range(n):
        conn = psycopg.connect(url, autocommit=True, application_name=f"standby-{i}")
        claim = "SELECT pgbroker.broker_claim(%s, wait => '10 s', takeover => true)"
        epoch = conn.execute(claim, (name,)).fetchone()[0]
        print(epoch, flush=True)
        held.append(conn)
        time.sleep(pause)
    for conn in held:
        conn.close()
""")


@contextlib.contextmanager
def holder(pg: EmbeddedPostgres, name: str, application: str, info: str = "") -> Iterator[tuple[int, int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, pg.url, name, application, info], stdout=subprocess.PIPE, text=True
    )
    try:
        pid, epoch = (int(v) for v in proc.stdout.readline().split())
        yield pid, epoch
    finally:
        proc.kill()
        proc.wait(10)


def open_page(driver: webdriver.Chrome, console: ConsoleProcess, tab: str = "brokers") -> None:
    driver.get(f"{console.base}/#{tab}")
    wait_for("the live badge", lambda: text_of(driver, "db-status") == "live")
    driver.execute_script("window.__sameDocument = true")


# ---------------------------------------------------------------------------
# The tests


def test_the_page_shows_the_holder_and_takeovers_reach_the_timeline_without_a_reload(pg, start_console, browser):
    console = start_console("console_reader")
    with holder(pg, "orders", "orders-broker-A", "host a, pid 1") as (pid, epoch):
        open_page(browser, console)
        wait_for("the holder's pid", lambda: text_of(browser, "holder-pid") == str(pid))
        shows(browser, "holder-application", "orders-broker-A")
        shows(browser, "holder-epoch", str(epoch))
        shows(browser, "holder-info", "host a, pid 1")
        assert "held by a live holder" in text_of(browser, "broker-detail")

        n = 20
        out = subprocess.run(
            [sys.executable, "-c", TAKEOVERS, pg.url, "orders", str(n), "0.4"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        epochs = [int(line) for line in out.stdout.split()]
        assert len(epochs) == n

    def marker(e: int) -> dict | None:
        return browser.execute_script(
            "const g = document.querySelector(`#timeline g.tl-event[data-epoch='${arguments[0]}']"
            "[data-event='takeover']`); return g && {at: +g.dataset.atMs, shown: +g.dataset.shownMs};",
            e,
        )

    latencies = []
    for e in epochs:
        seen = wait_for(f"the takeover of epoch {e} on the timeline", lambda e=e: marker(e), timeout=10)
        latencies.append(seen["shown"] - seen["at"])
    assert browser.execute_script("return window.__sameDocument === true"), "the page was reloaded"
    shows(browser, "holder-epoch", str(epochs[-1]))
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    print(
        f"\nlease event (its 'at', in the claiming transaction) -> drawn on the page, {n} takeovers: "
        f"p50 {statistics.median(latencies):.0f} ms, p99 {p99:.0f} ms, max {latencies[-1]:.0f} ms "
        "(target: p99 < 1000 ms)"
    )
    # A live page, not a benchmark: each event arrived without a reload, in seconds at worst.
    assert latencies[-1] < 5000, latencies

    # The screenshot of pgbroker/README.md: a standby claims the freed lease and registers a few clients.
    target = SCREENSHOT if os.environ.get("PGBROKER_UPDATE_REFERENCE") else Path(tempfile.mkdtemp()) / "console.png"
    with holder(pg, "orders", "orders-broker-B", "host b, pid 4242") as (pid, epoch):
        with psycopg.connect(pg.url, autocommit=True) as conn:
            for i in range(3):
                conn.execute(
                    "SELECT pgbroker.client_register(%s, %s::jsonb, 'orders', %s)",
                    (f"device-{i}", json.dumps({"addr": f"10.0.0.{i}:5000"}), epoch),
                )
                conn.execute(
                    "SELECT pgbroker.subscribe(%s, 'initech.objects', to_jsonb(%s), 'orders', %s)",
                    (f"device-{i}", i, epoch),
                )
        wait_for("the standby", lambda: text_of(browser, "holder-pid") == str(pid))
        wait_for("its clients counted", lambda: text_of(browser, "count-clients").startswith("3"))
        browser.set_window_size(1280, 900)
        time.sleep(0.5)
        browser.save_screenshot(str(target))
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert SCREENSHOT.exists(), "pgbroker/console.png is missing: PGBROKER_UPDATE_REFERENCE=1 makes it"


def test_a_lock_taken_in_psql_appears_in_the_lock_list(pg, start_console, browser):
    console = start_console("console_reader")
    open_page(browser, console, "locks")
    assert pg.bin_dir is not None
    psql = subprocess.Popen(
        [
            str(pg.bin_dir / "psql"),
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            pg.url,
            "-c",
            "SELECT pgbroker.lock_acquire('reports/nightly')",
            "-c",
            "SELECT pg_sleep(60)",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PGAPPNAME": "psql-nightly"},
    )
    try:
        row = wait_for(
            "the lock taken in psql", lambda: [r for r in cells(browser, "locks") if r[0] == "reports/nightly"]
        )
        pid = _sql(pg, "SELECT pid FROM pg_stat_activity WHERE application_name = 'psql-nightly'")[0][0]
        assert row[0][1] == "exclusive" and row[0][2] == str(pid), row
        _sql(pg, "SELECT pg_terminate_backend(%s)", (pid,))  # its session ends: the server frees the lock
    finally:
        psql.kill()
        psql.wait(10)
    wait_for(
        "the lock gone once psql ends", lambda: not [r for r in cells(browser, "locks") if r[0] == "reports/nightly"]
    )


HOSTILE = "<script>window.__pwned = 1</script><img src=x onerror='window.__pwned = 2'>"


def test_hostile_names_and_values_are_shown_as_text(pg, start_console, browser):
    _sql(
        pg, "SELECT pgbroker.kv_set(%s, %s::jsonb)", ("evil/<img src=x onerror=window.__pwned=3>", json.dumps(HOSTILE))
    )
    _sql(pg, "SELECT pgbroker.counter_add(%s, 7)", (HOSTILE,))
    console = start_console("console_values")
    with holder(pg, "evil", HOSTILE, HOSTILE), psycopg.connect(pg.url, autocommit=True) as conn:
        epoch = conn.execute("SELECT epoch FROM pgbroker.brokers WHERE name = 'evil'").fetchone()[0]
        conn.execute(
            "SELECT pgbroker.client_register(%s, %s::jsonb, 'evil', %s)",
            (HOSTILE, json.dumps({"addr": HOSTILE}), epoch),
        )
        open_page(browser, console)
        click(browser, "#brokers tr[data-name='evil']")
        wait_for("the hostile holder info as text", lambda: text_of(browser, "holder-info") == HOSTILE)
        shows(browser, "holder-application", HOSTILE[:63])  # application_name keeps 63 bytes

        browser.get(f"{console.base}/#kv")
        browser.find_element(By.ID, "kv-prefix").send_keys("evil/")
        wait_for(
            "the hostile key",
            lambda: [r for r in cells(browser, "kv") if r[0] == "<img src=x onerror=window.__pwned=3>"],
        )
        # JSON.stringify of the value, as text
        wait_for("the hostile value", lambda: [r for r in cells(browser, "kv") if r[1] == json.dumps(HOSTILE)])

        browser.get(f"{console.base}/#counters")
        wait_for("the hostile counter name", lambda: [r for r in cells(browser, "counters") if r[0] == HOSTILE])

        browser.get(f"{console.base}/#clients")
        wait_for(
            "the broker list", lambda: browser.find_elements(By.CSS_SELECTOR, "#clients-broker option[value='evil']")
        )
        Select(browser.find_element(By.ID, "clients-broker")).select_by_value("evil")
        row = wait_for("the hostile client", lambda: [r for r in cells(browser, "clients") if r[0] == HOSTILE])
        assert json.loads(row[0][1]) == {"addr": HOSTILE}

        # Nothing ran, and no element came out of the data: every table holds text only.
        assert browser.execute_script("return window.__pwned") is None
        for tag in ("script", "img"):
            assert browser.find_elements(By.CSS_SELECTOR, f"main {tag}") == []
        assert len(browser.find_elements(By.TAG_NAME, "script")) == 1  # the console's own


def test_the_script_never_puts_data_in_as_markup():
    source = (REPO / "pgbroker" / "console" / "static" / "console.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in source, sink


def test_the_console_says_so_while_the_database_restarts_and_comes_back_live(pg, start_console, browser):
    console = start_console("console_reader")
    open_page(browser, console)
    pg._run("stop", "-w", "-D", str(pg.datadir), "-m", "fast")
    try:
        wait_for("that the database is unreachable", lambda: "database unreachable" in text_of(browser, "db-status"))
        status, body = console.get("/api/brokers")
        assert status == 503 and body["error"] == "DatabaseUnavailable", (status, body)
    finally:
        pg._start_server()
    wait_for("the live badge again", lambda: text_of(browser, "db-status") == "live", timeout=40)
    # The LISTEN connection is back: a claim after the restart reaches the timeline without a reload.
    with holder(pg, "after-restart", "restarted-broker") as (pid, epoch):
        wait_for(
            "the new lease in the list",
            lambda: browser.find_elements(By.CSS_SELECTOR, "#brokers tr[data-name='after-restart']"),
        )
        click(browser, "#brokers tr[data-name='after-restart']")
        wait_for("its holder", lambda: text_of(browser, "holder-pid") == str(pid))
    assert browser.execute_script("return window.__sameDocument === true"), "the page was reloaded"


def test_read_only_refuses_writes(pg, start_console, browser):
    console = start_console("console_values")
    with holder(pg, "guarded", "guarded-broker") as (pid, epoch):
        open_page(browser, console)
        assert browser.find_elements(By.ID, "handover") == []
        shows(browser, "mode", "read-only")
        csrf = console.get("/api/info")[1]["csrf"]
        status, body = console.post(
            "/api/admin/takeover", {"name": "guarded", "confirm": "guarded"}, {"X-CSRF-Token": csrf}
        )
        assert status == 403 and "read-only" in body["message"], body
        status, body = console.post(
            "/api/admin/revoke",
            {"kind": "kv", "prefix": "", "role": "console_values", "confirm": "kv::console_values"},
            {"X-CSRF-Token": csrf},
        )
        assert status == 403, body
        assert _sql(pg, "SELECT holder_pid, epoch, alive FROM pgbroker.brokers WHERE name = 'guarded'") == [
            (pid, epoch, True)
        ]


def test_the_pool_of_the_console_cannot_write(pg):
    """Its sessions are default_transaction_read_only: even a write slipped into a page would fail (25006)."""
    import asyncio

    from pgbroker.console import check_role
    from pgbroker.console.app import Console

    url = pg.url_for("postgres", user="console_values")  # may call counter_add, but not through the console

    async def attempt() -> str | None:
        console = Console(url, check_role(url), admin=False)
        await console.start()
        try:
            assert await console.rows("SELECT pgbroker.counter_get('console-write')") == [{"counter_get": 0}]
            try:
                await console.rows("SELECT pgbroker.counter_add('console-write', 1)")
            except psycopg.Error as exc:
                return exc.sqlstate
            return None
        finally:
            await console.stop()

    assert asyncio.run(attempt()) == "25006"
    assert _sql(pg, "SELECT count(*) FROM pgbroker.counters WHERE name = 'console-write'") == [(0,)]


def test_admin_hands_a_lease_over_and_revokes_a_grant_each_confirmed_and_audited(pg, start_console, browser):
    console = start_console("console_admin", "--admin")
    _sql(pg, "SELECT pgbroker.name_grant('counter', 'billing/', 'console_values', 'write')")
    with holder(pg, "hung", "hung-broker") as (pid, epoch):
        open_page(browser, console)
        click(browser, "#brokers tr[data-name='hung']")
        wait_for("the holder", lambda: text_of(browser, "holder-pid") == str(pid))
        # Without the typed confirmation: refused, nothing happens.
        click(browser, "#handover")
        wait_for("the refusal", lambda: "refused" in text_of(browser, "handover-result"))
        assert _sql(pg, "SELECT holder_pid, alive FROM pgbroker.brokers WHERE name = 'hung'") == [(pid, True)]
        # Without the CSRF token: refused.
        status, _ = console.post("/api/admin/takeover", {"name": "hung", "confirm": "hung"})
        assert status == 403
        browser.find_element(By.ID, "handover-confirm").send_keys("hung")
        click(browser, "#handover")
        wait_for("the hand-over", lambda: "done" in text_of(browser, "handover-result"))
        events = _sql(
            pg, "SELECT event, previous_pid, info FROM pgbroker.lease_history WHERE name = 'hung' ORDER BY id"
        )
        assert [e[0] for e in events] == ["claim", "takeover", "release"], events
        assert events[1][1] == pid and "hand-over by console_admin via the console" in events[1][2], events
        wait_for(
            "the release on the timeline",
            lambda: browser.find_elements(By.CSS_SELECTOR, "#timeline g.tl-event[data-event='release']"),
        )

    browser.get(f"{console.base}/#grants")
    wait_for("the grant", lambda: [r for r in cells(browser, "grants") if r[1] == "billing/"])
    click(browser, "#grants button.revoke")
    browser.find_element(By.ID, "revoke-confirm").send_keys("counter:billing/:console_values")
    click(browser, "#revoke-go")
    wait_for("the revoke", lambda: text_of(browser, "revoke-result") == "revoked")
    assert _sql(pg, "SELECT count(*) FROM pgbroker.name_grants WHERE prefix = 'billing/'") == [(0,)]
    wait_for("the audit log lines", lambda: "AUDIT name_revoke" in console.output(), timeout=5)
    assert "AUDIT hand-over of lease 'hung' by console_admin" in console.output()


def test_the_console_refuses_a_superuser_a_role_without_reader_and_admin_without_the_role(pg):
    from pgbroker import cli
    from pgbroker.console import ConsoleRefused, check_role

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pgbroker.cli", "console", "--port", str(free_port()), *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )

    done = run("--url", pg.url)
    assert done.returncode == cli.EXIT_FAILURE
    assert "refusing to run as postgres, a superuser" in done.stderr and "--allow-superuser" in done.stderr
    assert check_role(pg.url, allow_superuser=True).superuser
    with pytest.raises(ConsoleRefused, match="not a member of pgbroker_reader"):
        check_role(pg.url_for("postgres", user="console_nobody"))
    done = run("--url", pg.url_for("postgres", user="console_reader"), "--admin")
    assert done.returncode == cli.EXIT_FAILURE and "--admin needs a role with pgbroker_admin" in done.stderr
    assert check_role(pg.url_for("postgres", user="console_admin"), admin=True).admin


def test_pages_are_bounded_and_keyset_paginated(pg, start_console):
    _sql(pg, "SELECT pgbroker.kv_set('page/' || lpad(i::text, 4, '0'), to_jsonb(i)) FROM generate_series(1, 450) i")
    console = start_console("console_values")
    seen: list[str] = []
    after = ""
    while True:
        status, page = console.get(f"/api/kv?prefix=page/&after={urllib.request.quote(after)}&limit=1000")
        assert status == 200
        assert len(page["rows"]) <= 200
        seen += [r["key"] for r in page["rows"]]
        if not page["more"]:
            break
        after = page["rows"][-1]["key"]
    assert seen == [f"page/{i:04d}" for i in range(1, 451)]
    # The tree, a level at a time, also a child per page: folders end with /, a key equal to a folder's name is
    # the folder's, 'tree/b0' sorts right after every key of 'tree/b/'.
    for key in ("tree/a/1", "tree/a/2", "tree/b/", "tree/b/x/1", "tree/b0", "tree/c", "treeless"):
        _sql(pg, "SELECT pgbroker.kv_set(%s, '1')", (key,))

    def level(prefix: str, limit: int) -> list[str]:
        children, after = [], ""
        for _ in range(20):
            status, page = console.get(
                f"/api/kv/tree?prefix={prefix}&after={urllib.request.quote(after)}&limit={limit}"
            )
            assert status == 200 and page["supported"], page
            children += [r["child"] for r in page["rows"]]
            if not page["more"]:
                return children
            after = page["rows"][-1]["child"]
        raise AssertionError(children)

    for limit in (1, 2, 50):
        assert level("tree/", limit) == ["tree/a/", "tree/b/", "tree/b0", "tree/c"], limit
    assert level("tree/b/", 1) == ["tree/b/x/"]
    assert "tree/" in level("", 200) and "treeless" in level("", 200)
    assert len(level("page/", 200)) == 450
    status, body = console.get("/api/kv/tree?prefix=tree")
    assert status == 400 and "must end with /" in body["message"]
    status, body = console.get("/api/kv?limit=x")
    assert status == 400 and body["error"] == "InvalidArgument"
    # Requests for another host (DNS rebinding) are refused.
    request = urllib.request.Request(console.base + "/api/info", headers={"Host": "evil.example:80"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 400


def test_forged_lease_notifications_change_nothing_and_events_keep_flowing(pg, start_console):
    console = start_console("console_reader")
    with urllib.request.urlopen(console.base + "/events", timeout=30) as stream:
        assert stream.readline().startswith(b"retry:")
        _sql(
            pg,
            "SELECT pg_notify('pgbroker_lease', 'not json'), pg_notify('pgbroker_lease', '[1]'),"
            " pg_notify('pgbroker_lease', '{\"name\": \"\"}')",
        )
        with holder(pg, "after-forgery", "honest-broker") as (pid, epoch):
            deadline = time.monotonic() + WAIT_S
            seen = []
            while time.monotonic() < deadline:
                line = stream.readline()
                if line.startswith(b"data: "):
                    message = json.loads(line[6:])
                    seen.append(message)
                    if message["type"] == "lease" and message["event"]["name"] == "after-forgery":
                        assert message["event"]["pid"] == pid and message["event"]["epoch"] == epoch
                        break
            else:
                raise AssertionError(f"no lease event after the forged ones: {seen}")
    assert console.get("/api/info")[1]["db"]["state"] == "connected"
    assert "reconnecting" not in console.output()


def test_a_clients_subscriptions_show_its_filters_page_by_page(pg, start_console):
    """Filters (issue 43): a client's subscriptions by filter show one point per row, keyset-paginated with keys."""
    with psycopg.connect(pg.url, autocommit=True) as holder:
        holder.execute("SELECT pgbroker.broker_claim('filtered')")
        holder.execute("SELECT pgbroker.client_register('c', name => 'filtered')")
        holder.execute("SELECT pgbroker.subscribe('c', 'initech.objects', '5', name => 'filtered')")
        holder.execute(
            "SELECT pgbroker.subscribe('c', 'initech.objects', name => 'filtered',"
            """ filter => '{"kind": {"in": ["a", "b", "c"]}}')"""
        )
        try:
            console = start_console()
            rows, after = [], ("", "")
            for _ in range(10):
                query = urllib.parse.urlencode(
                    {"name": "filtered", "client": "c", "after_table": after[0], "after_key": after[1], "limit": 1}
                )
                status, page = console.get(f"/api/subscriptions?{query}")
                assert status == 200
                rows += page["rows"]
                if not page["more"]:
                    break
                after = (page["rows"][-1]["table"], page["rows"][-1]["cursor"])
            got = sorted((json.dumps(r["key"]), json.dumps(r["filter"])) for r in rows)
            assert got == sorted([("5", "null")] + [("null", json.dumps({"kind": k})) for k in "abc"]), rows
        finally:
            holder.execute("SELECT pgbroker.broker_release('filtered')")

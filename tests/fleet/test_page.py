"""The page in a real browser (docs/operating.md: The page): two real replicas, headless Chromium.

One small fleet for the whole module: `page-a` has a token (its actions are
on), `page-b` has none (its actions are off). Each test looks at what is on
the page, never at how fast it came. Tests ask for the browser before the
fleet, so that where Chromium is missing no fleet is started for nothing.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.fleet.tools import require
from tests.support import Fleet, cli, free_port, wait_for, with_database

# One fleet and one browser for the module: its tests stay on one xdist worker.
pytestmark = [pytest.mark.fleet, pytest.mark.xdist_group("page")]

TOKEN = "page-test-token-0123456789"
SCHEDULES = {
    "page_steady": {"interval": "1s"},
    "page_fails": {"interval": "1s", "fail_alert_after": 2},
    "page_paused": {"interval": "1s"},
    "page_toggle": {"cron": "0 3 * * *"},
}
XSS = "<script>window.injected = 1</script><b>not bold</b> & broken"
WAIT = 60  # seconds: generous, for a loaded machine


@dataclass
class Site:
    fleet: Fleet
    ports: dict[str, int]

    def url(self, replica: str, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.ports[replica]}{path}"

    def status(self) -> dict[str, Any]:
        done = cli(self.fleet, "status", "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def job(self, name: str) -> dict[str, Any]:
        (found,) = [j for j in self.status()["jobs"] if j["name"] == name]
        return found

    def history(self, name: str) -> list[dict[str, Any]]:
        done = cli(self.fleet, "history", name, "--json", "--limit", "50")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


def fetch(url: str, data: dict[str, str] | None = None, headers: dict[str, str] | None = None):
    body = urllib.parse.urlencode(data).encode() if data is not None else None
    request = urllib.request.Request(url, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture(scope="module")
def site(pg_server, tmp_path_factory) -> Iterator[Site]:
    name = f"scheduler_page_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_server, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    fleet = Fleet(
        tmp_path_factory.mktemp("page"),
        with_database(pg_server, name),
        SCHEDULES,
        settings={"misfire_grace": 5},
        job_files=["page.py"],
    )
    ports = {"page-a": free_port(), "page-b": free_port()}
    try:
        fleet.start(
            "page-a",
            env={"SCHEDULER_HTTP_TOKEN": TOKEN},
            args=["--http-port", str(ports["page-a"])],
        )
        fleet.start("page-b", args=["--http-port", str(ports["page-b"])])
        fleet.wait_ready()
        done = cli(fleet, "pause", "page_paused", "--reason", "<i>vendor</i> down", "--by", "ops")
        assert done.returncode == 0, done.stderr
        here = Site(fleet, ports)
        wait_for(lambda: here.job("page_fails")["alerting"], WAIT, "page_fails to alert")
        wait_for(
            lambda: (
                len([r for r in here.history("page_steady") if r["status"] == "succeeded"]) >= 3
            ),
            WAIT,
            "a few runs of page_steady",
        )
        yield here
    finally:
        fleet.stop()
        with psycopg.connect(pg_server, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def _browser(javascript: bool) -> Any:
    chromium = require("chromium", "chromium")
    driver_path = require("chromedriver", "chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1300",
    ):
        options.add_argument(argument)
    if not javascript:
        options.add_experimental_option(
            "prefs", {"profile.managed_default_content_settings.javascript": 2}
        )
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    driver.set_page_load_timeout(WAIT)
    return driver


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = _browser(javascript=True)
    yield driver
    driver.quit()


def css(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def settled(check: Callable[[], Any], what: str) -> Any:
    """Retry a look at the page: its script may swap the content in between."""
    from selenium.common.exceptions import StaleElementReferenceException

    def attempt() -> Any:
        try:
            return check()
        except StaleElementReferenceException:
            return None

    return wait_for(attempt, WAIT, what, every=0.3)


def _gone(element: Any) -> Any:
    """The page the element was on has been left. Chromium may say so as a stale element,
    or as an element whose node "does not belong to the document" while the next loads."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

    def check(_driver: Any) -> bool:
        try:
            element.is_enabled()
        except StaleElementReferenceException:
            return True
        except WebDriverException as exc:
            return "does not belong to the document" in str(exc)
        return False

    return check


def click(driver: Any, selector: str, then: str) -> None:
    """Click, and wait for the next page: the old one is gone and `then` is on the new one."""
    from selenium.webdriver.support.wait import WebDriverWait

    old = css(driver, "html")[0]
    css(driver, selector)[0].click()
    wait = WebDriverWait(driver, WAIT)
    wait.until(_gone(old))
    try:
        settled(lambda: css(driver, then), f"{then} after clicking {selector}")
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}; the page at {driver.current_url} says:\n{css(driver, 'body')[0].text}"
        ) from None


def test_fleet_jobs_and_problems_first(
    browser, site
):  # the browser first: without one, no fleet starts
    browser.get(site.url("page-a"))
    names = settled(
        lambda: {row.get_attribute("data-instance") for row in css(browser, "tr.instance")},
        "the instances on the page",
    )
    assert names == {"page-a", "page-b"}
    rows = settled(lambda: css(browser, "tr.job"), "the jobs on the page")
    order = [row.get_attribute("data-job") for row in rows]
    assert set(order) == set(SCHEDULES)
    # The problems first: alerting and failing, then paused, then the rest.
    assert order[:2] == ["page_fails", "page_paused"], order
    failing = css(browser, 'tr.job[data-job="page_fails"]')[0]
    assert "alerting" in failing.get_attribute("class").split()
    assert "failing" in failing.get_attribute("class").split()
    paused = css(browser, 'tr.job[data-job="page_paused"]')[0]
    assert "paused" in paused.get_attribute("class").split()
    assert "paused by ops" in paused.text and "<i>vendor</i> down" in paused.text
    # The job's error, HTML and all, is shown as text and never runs.
    assert XSS in failing.text
    assert browser.execute_script("return window.injected === undefined")
    assert not css(browser, "tr.job b")
    steady = css(browser, 'tr.job[data-job="page_steady"]')[0]
    assert "every second" in steady.text and "interval: 1s" in steady.text
    # Every replica shows the same fleet.
    status, other = fetch(site.url("page-b"))
    assert status == 200 and all(f'data-job="{name}"' in other for name in SCHEDULES)
    shot = Path(os.environ.get("SCHEDULER_PAGE_SCREENSHOT") or site.fleet.root / "page.png")
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000


def test_timeline_lanes_and_a_recent_run(
    browser, site
):  # the browser first: without one, no fleet starts
    recent = next(r for r in site.history("page_steady") if r["status"] == "succeeded")
    browser.get(site.url("page-a"))
    lanes = settled(
        lambda: [g.get_attribute("data-lane") for g in css(browser, "svg.timeline g.lane.replica")],
        "the timeline's lanes",
    )
    assert sorted(lanes) == ["page-a", "page-b"]
    bar = settled(
        lambda: css(
            browser,
            f'g.lane[data-lane="{recent["instance"]}"] g.run[data-run="{recent["run_id"]}"]',
        ),
        f"a bar for run {recent['run_id']} on {recent['instance']}",
    )[0]
    assert "s-succeeded" in bar.get_attribute("class")
    browser.execute_script("arguments[0].focus()", bar)
    tip = settled(
        lambda: (
            css(browser, "#tip")[0].text if "page_steady" in css(browser, "#tip")[0].text else None
        ),
        "the focused run's details",
    )
    assert f"run_id {recent['run_id']}" in tip and "duration" in tip
    # A failed run's bar says its error, as text.
    failed = css(browser, "g.run.s-failed title")
    assert failed and XSS in failed[0].get_attribute("textContent")
    # The window is selectable.
    browser.get(site.url("page-a", "/?window=15m"))
    assert settled(lambda: css(browser, "a.current"), "the chosen window")[0].text == "15m"


def test_job_page_shows_its_history(
    browser, site
):  # the browser first: without one, no fleet starts
    # Paging below needs a tick older than the fourth newest: the fixture waits for three.
    rows = wait_for(
        lambda: (found := site.history("page_steady"))[3:] and found, WAIT, "four ticks"
    )
    browser.get(site.url("page-a", "/jobs/page_steady"))
    shown = settled(lambda: css(browser, "tr.tick"), "the job's history")
    runs = {row.get_attribute("data-run") for row in shown}
    assert str(rows[-1]["run_id"]) in runs or len(shown) == 25
    assert len(css(browser, "ol.ticks li")) == 10
    assert css(browser, "svg.plot circle.duration")
    assert "interval: 1s" in css(browser, "#about")[0].text
    # Paging: older ticks than a given one.
    before = rows[2]["scheduled_at"]
    browser.get(site.url("page-a", "/jobs/page_steady?before=" + urllib.parse.quote(before)))
    first = settled(lambda: css(browser, "tr.tick"), "an older page")[0]
    assert str(rows[3]["run_id"] or "") == (first.get_attribute("data-run") or "")
    # The failing job's page says its streak and its alert.
    browser.get(site.url("page-a", "/jobs/page_fails"))
    about = settled(lambda: css(browser, "#about"), "the failing job's page")[0].text
    assert "alerting" in about and XSS in about
    notices = css(browser, "#notices")[0].text
    assert "job.failures_exceeded" in notices
    assert browser.execute_script("return window.injected === undefined")


def test_pause_and_resume_need_the_token(
    browser, site
):  # the browser first: without one, no fleet starts
    from selenium.webdriver.common.by import By

    # No token on page-b: no buttons, and its POSTs answer 403.
    status, body = fetch(site.url("page-b", "/jobs/page_toggle"))
    assert status == 200 and 'id="pause"' not in body and "are off" in body
    status, _ = fetch(site.url("page-b", "/jobs/page_toggle/pause"), {"reason": "x"})
    assert status == 403
    status, _ = fetch(
        site.url("page-b", "/jobs/page_toggle/pause"), {}, {"Authorization": f"Bearer {TOKEN}"}
    )
    assert status == 403
    # page-a without logging in: no buttons; a POST without the token is refused.
    status, _ = fetch(site.url("page-a", "/jobs/page_toggle/pause"), {"reason": "x"})
    assert status == 403
    browser.get(site.url("page-a", "/jobs/page_toggle"))
    assert not css(browser, "#pause")
    click(browser, "#actions a[href^='/login']", "#token")
    browser.find_element(By.ID, "token").send_keys("not-the-token-at-all")
    click(browser, "#log-in", "p[role=alert]")
    assert "That is not the token" in browser.page_source
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    click(browser, "#log-in", "#pause")
    assert TOKEN not in browser.page_source
    cookie = browser.get_cookie("scheduler_session")
    assert cookie and TOKEN not in cookie["value"] and cookie["httpOnly"]
    # The session alone is not enough: a form without its CSRF token is refused.
    status, _ = fetch(
        site.url("page-a", "/jobs/page_toggle/pause"),
        {"reason": "forged"},
        {"Cookie": f"scheduler_session={cookie['value']}"},
    )
    assert status == 403
    assert site.job("page_toggle")["paused"] is None

    browser.find_element(By.NAME, "reason").send_keys("from the page")
    browser.find_element(By.NAME, "by").send_keys("page-tester")
    click(browser, "#pause", "#resume")
    assert "Paused for the fleet." in browser.page_source
    paused = site.job("page_toggle")["paused"]
    assert paused["by"] == "page-tester (page on page-a)"
    assert paused["reason"] == "from the page"
    click(browser, "#resume", "#pause")
    assert "Resumed" in browser.page_source
    assert site.job("page_toggle")["paused"] is None
    # Run now: handed to the fleet; the page says which replica ran it and how it ended.
    click(browser, "#run-now", "p.asked")
    asked = css(browser, "p.asked")[0].text
    assert asked.startswith("Run-now request"), asked

    def outcome() -> str | None:
        browser.refresh()
        said = css(browser, "p.asked")
        return said[0].text if said and "succeeded on page-" in said[0].text else None

    settled(outcome, "the run-now outcome on the page")


def test_the_page_refreshes_itself_with_javascript(browser, site):
    browser.get(site.url("page-a", "/?refresh=2"))
    browser.execute_script("window.sameDocument = true")

    def next_tick() -> str:
        return css(browser, 'tr.job[data-job="page_steady"]')[0].get_attribute("data-next")

    first = settled(next_tick, "page_steady's next tick")
    settled(lambda: next_tick() != first, "the page to refresh in place")
    assert browser.execute_script("return window.sameDocument === true")


def test_the_page_works_without_javascript(browser, site):
    driver = _browser(javascript=False)
    try:
        driver.get(site.url("page-b", "/?q=fail"))
        assert not css(driver, "html.js")  # the script did not run
        rows = [row.get_attribute("data-job") for row in css(driver, "tr.job")]
        assert rows == ["page_fails"]  # filtered on the server
        assert len(css(driver, "svg.timeline g.lane.replica")) == 2
        assert css(driver, "svg.timeline g.run")
        driver.get(site.url("page-b", "/jobs/page_fails"))
        assert css(driver, "tr.tick") and XSS in css(driver, "#about")[0].text
    finally:
        driver.quit()


def test_api_has_the_shapes_of_the_commands(site):
    status, body = fetch(site.url("page-b", "/api/status"))
    assert status == 200
    document = json.loads(body)
    expected = site.status()
    assert document.keys() == expected.keys()
    assert [j["name"] for j in document["jobs"]] == [j["name"] for j in expected["jobs"]]
    assert document["jobs"][0].keys() == expected["jobs"][0].keys()
    assert {i["name"] for i in document["instances"]} == {"page-a", "page-b"}
    # The limit holds once the job has more rows than it: the fixture waits for three runs
    # only, and this test may come first.
    wait_for(lambda: len(site.history("page_steady")) > 5, WAIT, "six ticks of page_steady")
    status, body = fetch(site.url("page-b", "/api/jobs/page_steady/history?limit=5"))
    rows = json.loads(body)
    assert status == 200 and len(rows) == 5
    assert rows[0].keys() == site.history("page_steady")[0].keys()
    assert fetch(site.url("page-b", "/api/jobs/nope/history"))[0] == 404
    # The token is in no page.
    for path in ("/", "/jobs/page_fails", "/api/status", "/login"):
        assert TOKEN not in fetch(site.url("page-a", path))[1]

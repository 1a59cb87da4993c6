"""The playground (GET /) in a real headless browser: Debian's chromium, driven by chromedriver.

Type a prompt, click Generate, see a preview and then the final image; with an API key set on
the server, the page's calls carry it. A screenshot lands in the test's output folder.
"""
from __future__ import annotations

import base64
import io
import os
import shutil
import tempfile

import numpy as np
import pytest
from PIL import Image

from utils_server import RemoteServer

from dvllm.tiny_shapes.reader import read_image

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# CI installs them (.ci/run) and sets DVLLM_REQUIRE_BROWSER=1, so there a missing browser fails loudly.
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER) and not os.environ.get("DVLLM_REQUIRE_BROWSER"),
    reason="Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)",
)
KEY = "playground-key"


@pytest.fixture(scope="module")
def server():
    # No MODEL: the built-in trained model, as a newcomer gets it; one server for the module's tests.
    with RemoteServer(None, ["--device", "cpu", "--dtype", "float32", "--api-key", KEY]) as s:
        yield s


@pytest.fixture
def browser():
    pytest.importorskip("selenium")  # `.[test]`, not the fast tier's `.[dev]`
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, where CSP reports refusals
    profile = tempfile.mkdtemp(prefix="dvllm-chromium-")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1100,800", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def image_of(element) -> np.ndarray:
    src = element.get_attribute("src")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB"))


def csp_refusals(driver) -> list[str]:
    """The console's Content-Security-Policy refusals since the last call (reading the log empties it)."""
    return [e["message"] for e in driver.get_log("browser") if "Content Security Policy" in e["message"]]


def wait_for(driver, condition, timeout: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(condition)


def fill(driver, element_id: str, text: str) -> None:
    from selenium.webdriver.common.by import By

    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(text)


def text_of(driver, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id).text


def generate(driver, server: RemoteServer) -> None:
    """Clicks Generate and waits until the page says it is done, or fails with the page's error."""
    from selenium.webdriver.common.by import By

    driver.execute_script("document.getElementById('status').textContent = ''")
    driver.find_element(By.ID, "generate").click()
    wait_for(driver, lambda d: text_of(d, "status").startswith("done") or "error" in
             d.find_element(By.ID, "status").get_attribute("class"))
    assert text_of(driver, "status").startswith("done"), (text_of(driver, "status"), server.log()[-3000:])


@pytest.mark.slow
def test_playground_generates_with_previews_then_the_image(browser, server, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/")
    wait = WebDriverWait(browser, 60)
    # the server wants a key the page does not have yet: it says so where the model name goes
    wait.until(lambda d: "API key" in d.find_element(By.ID, "model").text)
    prompt = browser.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys("a red circle")
    browser.find_element(By.ID, "seed").send_keys("3")

    browser.find_element(By.ID, "generate").click()  # no key yet: the server refuses, the page says so
    wait.until(lambda d: "API key" in d.find_element(By.ID, "status").text)
    assert "error" in browser.find_element(By.ID, "status").get_attribute("class")

    # A preview lives only until the next one or the final image replaces it (a fraction of a
    # second here), so the page's DOM changes are recorded as they happen, not polled for.
    browser.execute_script(
        "window.seenPreviews = [];"
        "new MutationObserver(() => { const p = document.getElementById('preview');"
        "  if (p) window.seenPreviews.push(p.src); })"
        ".observe(document.getElementById('current'), {childList: true, subtree: true});")
    browser.find_element(By.ID, "key").send_keys(KEY)
    browser.find_element(By.ID, "generate").click()
    wait.until(lambda d: d.find_element(By.ID, "model").text == "model: tiny-shapes")  # the key took
    final = wait.until(ec.presence_of_element_located((By.ID, "final")))
    wait.until(lambda d: d.find_element(By.ID, "status").text.startswith("done"))
    previews = browser.execute_script("return window.seenPreviews")
    assert len(previews) >= 1  # previews appeared while the steps ran, before the final image
    first = np.asarray(Image.open(io.BytesIO(base64.b64decode(previews[0].split(",", 1)[1]))).convert("RGB"))
    assert first.shape == (64, 64, 3)
    browser.save_screenshot(str(tmp_path / "playground.png"))

    pixels = image_of(final)
    assert pixels.shape == (64, 64, 3)
    assert read_image(pixels) == ("red", "circle")
    assert "seed 3" in browser.find_element(By.ID, "current").text
    assert len(browser.find_elements(By.CSS_SELECTOR, "#gallery figure")) == 1
    # all of it ran under the page's Content-Security-Policy, which refused nothing
    assert csp_refusals(browser) == []
    assert (tmp_path / "playground.png").stat().st_size > 10_000


# Every control's box and both panels' boxes, in CSS pixels of the viewport.
LAYOUT_JS = """
const box = (e) => { const r = e.getBoundingClientRect(); return {left: r.left, right: r.right, top: r.top, bottom: r.bottom}; };
const form = document.getElementById("form");
return {viewport: innerWidth, scrollWidth: document.documentElement.scrollWidth,
        form: box(form), stage: box(document.getElementById("stage")),
        controls: [...form.querySelectorAll("input, select, textarea, button")].map((e) => [e.id, box(e)])};
"""


@pytest.mark.parametrize("width", [1280, 800, 480])
def test_playground_layout_keeps_each_control_inside_its_panel(browser, server, width):
    browser.get(server.url + "/")
    # the viewport itself (not the window around it) set to exactly width x 800
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                            {"width": width, "height": 800, "deviceScaleFactor": 1, "mobile": False})
    wait_for(browser, lambda d: d.execute_script("return innerWidth") == width)
    layout = browser.execute_script(LAYOUT_JS)

    form, stage = layout["form"], layout["stage"]
    assert len(layout["controls"]) == 10
    for name, box in layout["controls"]:
        assert box["right"] - box["left"] > 20, (name, box)  # really there, not squeezed to nothing
        inside = (box["left"] >= form["left"] - 0.5 and box["right"] <= form["right"] + 0.5
                  and box["top"] >= form["top"] - 0.5 and box["bottom"] <= form["bottom"] + 0.5)
        assert inside, f"#{name} {box} runs out of the form's panel {form} at {width} px"
    overlap = (min(form["right"], stage["right"]) > max(form["left"], stage["left"])
               and min(form["bottom"], stage["bottom"]) > max(form["top"], stage["top"]))
    assert not overlap, f"the form {form} and the image panel {stage} overlap at {width} px"
    assert stage["right"] <= width and form["right"] <= width
    assert layout["scrollWidth"] <= width  # nothing runs past the viewport's right edge


@pytest.mark.slow
def test_playground_keeps_the_api_key_out_of_web_storage(browser, server):
    browser.get(server.url + "/")
    # a key an earlier version of the page left in localStorage: the page drops it, not reads it
    browser.execute_script("localStorage.setItem('dvllm-key', arguments[0])", KEY)
    browser.refresh()
    wait_for(browser, lambda d: text_of(d, "model") != "connecting...")
    assert browser.find_element("id", "key").get_attribute("value") == ""
    assert "API key" in text_of(browser, "model")  # its first call went without the key
    assert browser.execute_script("return localStorage.getItem('dvllm-key')") is None

    fill(browser, "key", KEY)
    generate(browser, server)  # the key in memory still goes with the page's calls
    generate(browser, server)
    stored = browser.execute_script("return JSON.stringify([{...localStorage}, {...sessionStorage}])")
    assert KEY not in stored, stored


@pytest.mark.slow
def test_playground_shows_and_sends_seeds_past_2_53_exactly(browser, server):
    from selenium.webdriver.common.by import By

    seed = str(2**53 + 1)  # a JS number would round it to 2**53
    browser.get(server.url + "/")
    fill(browser, "key", KEY)
    fill(browser, "seed", seed)

    generate(browser, server)  # n=1: streamed, the seed in the final SSE event
    assert text_of(browser, "current").split() == ["seed", seed]
    assert f"(seed {seed})" in text_of(browser, "gallery")

    fill(browser, "n", "2")  # n>1: one JSON response
    generate(browser, server)
    captions = [f.text for f in browser.find_elements(By.CSS_SELECTOR, "#current figure")]
    assert captions == [f"seed {seed}"] * 2  # the server echoes the seed it got: the page sent it exact too

    # The largest seed, parsed as a browser without the reviver's source text would (the raw-text path).
    biggest = str(2**63 - 1)
    parsed = browser.execute_script(
        "const parse = JSON.parse;"
        "JSON.parse = (text, reviver) => parse(text, reviver && ((k, v) => reviver(k, v)));"
        "try { return parseJSON(arguments[0]); } finally { JSON.parse = parse; }",
        f'{{"data": [{{"seed": {seed}, "b64_json": "x"}}, {{"seed" : {biggest}}}], "seed": null}}')
    assert [d["seed"] for d in parsed["data"]] == [seed, biggest] and parsed["seed"] is None
    assert csp_refusals(browser) == []


def test_playground_is_served_under_a_strict_content_security_policy(browser, server):
    import hashlib
    import re

    import httpx

    r = httpx.get(server.url + "/")
    assert r.status_code == 200
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["referrer-policy"] == "no-referrer"
    policy = dict(d.strip().split(" ", 1) for d in r.headers["content-security-policy"].split(";"))
    assert policy["default-src"] == "'none'"
    assert policy["connect-src"] == "'self'" and policy["img-src"] == "'self' data:"
    # the page's own inline script and style, allowed by hash and nothing else
    for tag in ("script", "style"):
        bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", r.text, re.DOTALL)
        assert len(bodies) == 1
        digest = base64.b64encode(hashlib.sha256(bodies[0].encode()).digest()).decode()
        assert policy[f"{tag}-src"] == f"'sha256-{digest}'"

    # The browser enforces it: a script injected into the page does not run, and the console says why.
    browser.get(server.url + "/")
    wait_for(browser, lambda d: "API key" in text_of(d, "model"))  # the page's own script did run
    assert browser.execute_script(
        "const s = document.createElement('script'); s.textContent = 'window.injected = 1';"
        "document.body.append(s); return window.injected === undefined")
    refusals = []
    wait_for(browser, lambda d: refusals.extend(csp_refusals(d)) or refusals, timeout=30)
    assert "script" in refusals[0]


# -- a video model: frames and fps fields, a job polled to completion, its MP4 played -----------------

@pytest.fixture(scope="module")
def video_server(wan_path):
    with RemoteServer(wan_path, ["--device", "cpu", "--dtype", "float32", "--api-key", KEY]) as s:
        yield s


@pytest.mark.slow
def test_playground_makes_a_video_and_plays_it(browser, video_server, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(video_server.url + "/")
    fill(browser, "key", KEY)
    browser.find_element(By.ID, "prompt").click()  # the key field's change: the page asks /v1/models again
    wait_for(browser, lambda d: d.find_elements(By.ID, "frames"))  # a video model: its fields replace n
    assert not browser.find_elements(By.ID, "n")
    assert "frames" in text_of(browser, "seconds") and browser.find_element(By.ID, "generate").text == "Generate video"
    fill(browser, "frames", "6")  # not 1 + 4k: the browser refuses it before anything is sent
    browser.find_element(By.ID, "generate").click()
    assert not browser.execute_script("return document.getElementById('frames').checkValidity()")
    assert text_of(browser, "status") == ""
    for field, value in (("frames", "5"), ("fps", "8"), ("steps", "2"), ("seed", "3")):
        fill(browser, field, value)
    assert text_of(browser, "seconds") == "5 frames = 0.63 s"
    browser.execute_script("const s = document.getElementById('size'); s.value = s.options[1].value")  # the smallest
    generate(browser, video_server)

    clip = browser.find_element(By.ID, "final-video")
    assert clip.get_attribute("src").startswith("blob:")  # fetched with the key, as a <video> could not
    assert clip.get_attribute("loop") == "true" and clip.get_attribute("controls") == "true"
    policy = browser.execute_script("return fetch('/').then((r) => r.headers.get('content-security-policy'))")
    assert "media-src blob:" in policy, f"a <video> plays the fetched MP4 only if the CSP lets it: {policy}"
    wait_for(browser, lambda d: d.execute_script("return arguments[0].readyState >= 1", clip))  # it decodes
    width, height, duration = browser.execute_script(
        "const v = arguments[0]; return [v.videoWidth, v.videoHeight, v.duration]", clip)
    size = browser.execute_script("return document.getElementById('size').value")
    assert f"{width}x{height}" == size and duration == pytest.approx(5 / 8, abs=0.05)
    assert "seed 3, 5 frames at 8 fps" in text_of(browser, "current")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#gallery figure video")) == 1
    assert csp_refusals(browser) == []
    browser.save_screenshot(str(tmp_path / "playground-video.png"))

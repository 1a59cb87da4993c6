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

from shape_checker import read_image
from utils_server import RemoteServer

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# CI installs them (.ci/run) and sets DVLLM_REQUIRE_BROWSER=1, so there a missing browser fails loudly.
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER) and not os.environ.get("DVLLM_REQUIRE_BROWSER"),
    reason="Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)",
)
KEY = "playground-key"


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
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


def test_playground_generates_with_previews_then_the_image(browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    # No MODEL: the built-in trained model, as a newcomer gets it.
    with RemoteServer(None, ["--device", "cpu", "--dtype", "float32", "--api-key", KEY]) as server:
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
    assert (tmp_path / "playground.png").stat().st_size > 10_000

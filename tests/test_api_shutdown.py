"""`dvllm serve` shutting down: SIGTERM lets running requests finish within the grace period, aborts
those that outlive it (503), and exits 0."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from utils_server import (
    BASE_ARGS,
    ENDLESS,
    FAST,
    MAX_STEPS,
    WAIT,
    RemoteServer,
    assert_error,
    png_pixels,
    running,
    wait_until,
)

# -- graceful shutdown --------------------------------------------------------------------------------
# Two servers: "finishes what runs" needs a grace period longer than any request could take here, and
# "aborts what outlives the grace period" a request longer than the grace period. One grace period for
# both is a bet on the machine's speed.

@pytest.mark.slow
def test_sigterm_finishes_running_requests_and_exits_0():
    # No MODEL: `dvllm serve` alone serves the built-in tiny-shapes. --log-level info: the drain logs how
    # many requests were in flight when it began. A grace period of WAIT: reached only if the drain is broken.
    with RemoteServer(None, [*BASE_ARGS, "--shutdown-grace", str(WAIT), "--log-level", "info"]) as s:
        assert httpx.get(s.url + "/v1/models", timeout=WAIT).json()["data"][0]["id"] == "tiny-shapes"
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT)
        # A stream's headers go out with its first step's output: when generate() returns, the request
        # is running, with 9 steps to go (a signal takes microseconds; the log below checks it was in time).
        stream = client.images.generate(prompt="bye", size="16x16", stream=True,
                                        extra_body={"num_inference_steps": 10})
        s.signal()
        events = list(stream)
        assert [e.type for e in events] == ["image_generation.completed"]
        assert png_pixels(events[0].b64_json).shape == (16, 16, 3)
        assert s.proc.wait(WAIT) == 0
        # It was still in flight when the drain began: the test did not pass by signalling too late.
        assert "shutting down: 1 request(s) in flight" in s.log(), s.log()[-3000:]


@pytest.mark.slow
def test_sigterm_aborts_requests_that_outlive_the_grace_period():
    with RemoteServer(None, [*BASE_ARGS, *MAX_STEPS, "--shutdown-grace", "10"]) as s, ThreadPoolExecutor(1) as pool:
        endless = pool.submit(httpx.post, s.url + "/v1/images/generations", timeout=WAIT,
                              json={"prompt": "bye", **ENDLESS})
        wait_until(lambda: running(s.url) == 1, what="the request to run")
        s.signal()

        def health() -> int:
            return httpx.get(s.url + "/health", timeout=WAIT).status_code
        # ENDLESS keeps the server draining for the whole grace period, however fast it steps.
        wait_until(lambda: health() == 503, what="/health to answer 503")
        # The server drains (no way back): a new request is refused whatever the timing.
        assert_error(httpx.post(s.url + "/v1/images/generations", json={"prompt": "late", **FAST}, timeout=WAIT),
                     503)
        assert_error(endless.result(), 503)  # aborted when the grace period ended
        assert s.proc.wait(WAIT) == 0

"""HTTP byte ranges (entrypoints/byte_ranges.py) with numbers of any length: Python's int() refuses strings of more
than 4,300 digits, and a satisfiable range whose end had more was answered 416. (The served MP4's ranges end to end:
test_api_videos.py.)"""
from __future__ import annotations

import pytest

from dvllm.entrypoints.byte_ranges import byte_range, ranged_response

SIZE = 1000
LONG = "9" * 5000  # past sys.get_int_max_str_digits()


@pytest.mark.parametrize("header, part", [
    (f"bytes=10-{LONG}", (10, SIZE - 1)),   # an end past the body: up to its end
    (f"bytes=-{LONG}", (0, SIZE - 1)),      # a suffix longer than the body: all of it
    (f"bytes={'0' * 5000}7-9", (7, 9)),     # leading zeros, however many
    ("bytes=-10", (SIZE - 10, SIZE - 1)),
    ("bytes=10-", (10, SIZE - 1)),
    (f"bytes=20-1{'0' * 4999}", (20, SIZE - 1)),
])
def test_a_satisfiable_range_is_served_whatever_its_numbers_length(header, part):
    assert byte_range(header, SIZE) == part
    response = ranged_response(bytes(SIZE), header, "video/mp4", {})
    assert response.status_code == 206
    assert response.headers["content-range"] == f"bytes {part[0]}-{part[1]}/{SIZE}"


@pytest.mark.parametrize("header", [f"bytes={LONG}-", f"bytes={LONG}-{LONG}", f"bytes=-{'0' * 5000}"])
def test_a_range_past_the_end_is_416_whatever_its_numbers_length(header):
    with pytest.raises(ValueError):
        byte_range(header, SIZE)
    response = ranged_response(bytes(SIZE), header, "video/mp4", {})
    assert response.status_code == 416 and response.headers["content-range"] == f"bytes */{SIZE}"


def test_a_reversed_range_with_a_long_end_is_ignored():
    assert byte_range(f"bytes=10-{'0' * 5000}5", SIZE) is None  # end 5 < start 10: malformed, the whole body

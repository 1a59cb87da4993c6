"""HTTP byte ranges (RFC 9110 §14) for the downloads a browser seeks in: a <video> element asks for
`Range: bytes=start-end` and plays only once the server answers 206 with that part."""
from __future__ import annotations

import re

from starlette.responses import Response

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The one range `header` asks of `size` bytes, as (first, last) inclusive; None to send the whole body (no
    header, another unit, several ranges, or a malformed one, which RFC 9110 lets a server ignore). ValueError
    for a range that starts past the end or asks an empty suffix (the answer is 416)."""
    match = _RANGE.fullmatch((header or "").strip())
    if match is None or not any(match.groups()):
        return None
    first, last = match.groups()
    if not first:  # the last N bytes
        if not last.strip("0"):
            raise ValueError("bytes -0: an empty suffix")
        return size - _capped(last, size), size - 1
    start, end = _capped(first, size), _capped(last, size - 1) if last else size - 1
    if start >= size:
        raise ValueError(f"bytes {first[:20]}- start past the end of {size} bytes")
    return None if end < start else (start, end)


def _capped(digits: str, cap: int) -> int:
    """min(int(digits), cap) for digits of any length: int() refuses more than 4,300 digits
    (sys.get_int_max_str_digits), and a range end past the body is as good as its end."""
    digits = digits.lstrip("0") or "0"
    return cap if len(digits) > len(str(max(cap, 0))) else min(int(digits), cap)


def ranged_response(body: bytes, range_header: str | None, media_type: str, headers: dict[str, str]) -> Response:
    """`body` whole (200), or the part `range_header` asks (206), or 416 for a range past its end."""
    headers = {**headers, "Accept-Ranges": "bytes"}
    try:
        part = byte_range(range_header, len(body))
    except ValueError:
        return Response(status_code=416, headers={**headers, "Content-Range": f"bytes */{len(body)}"})
    if part is None:
        return Response(body, media_type=media_type, headers=headers)
    first, last = part
    return Response(body[first:last + 1], status_code=206, media_type=media_type,
                    headers={**headers, "Content-Range": f"bytes {first}-{last}/{len(body)}"})

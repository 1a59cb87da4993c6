"""Encoding images for the wire, and the bounded store behind response_format="url"."""
from __future__ import annotations

import base64
import io
import secrets
import threading
from collections import OrderedDict
from typing import Any

from dvllm.entrypoints.protocol import MEDIA_TYPES


def encode_image(image: Any, output_format: str, compression: int | None) -> bytes:
    """PIL image -> PNG (lossless, so pixels survive exactly), JPEG or WebP bytes.

    output_compression is OpenAI's 0-100 quality knob for the lossy formats (default 100)."""
    buffer = io.BytesIO()
    if output_format == "png":
        image.save(buffer, format="PNG")
    else:
        image.convert("RGB").save(buffer, format=output_format.upper(),
                                  quality=100 if compression is None else compression)
    return buffer.getvalue()


def encode_b64(image: Any, output_format: str, compression: int | None) -> str:
    return base64.b64encode(encode_image(image, output_format, compression)).decode("ascii")


class ImageStore:
    """The newest images, at most `capacity` of them and `max_bytes` in all, least recently used out
    first; ids are random (the id is the capability: whoever has the URL may fetch the image).
    Thread-safe: encoders put from threads."""

    def __init__(self, capacity: int, max_bytes: int = 256 << 20) -> None:
        if capacity < 0:
            raise ValueError(f"image_store_size must be >= 0, got {capacity}")
        if max_bytes < 0:
            raise ValueError(f"image_store_mb must be >= 0, got {max_bytes / (1 << 20)}")
        self.capacity, self.max_bytes = capacity, max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, tuple[bytes, str]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, data: bytes, output_format: str) -> str:
        """Stores the image and returns its id; one larger than max_bytes is not kept (its URL answers 404)."""
        image_id = f"{secrets.token_hex(16)}.{output_format}"
        with self._lock:
            self._items[image_id] = (data, MEDIA_TYPES[output_format])
            self.num_bytes += len(data)
            while self._items and (len(self._items) > self.capacity or self.num_bytes > self.max_bytes):
                _, (old, _) = self._items.popitem(last=False)
                self.num_bytes -= len(old)
        return image_id

    def get(self, image_id: str) -> tuple[bytes, str] | None:
        """(bytes, media type), or None once evicted or never stored."""
        with self._lock:
            item = self._items.get(image_id)
            if item is not None:
                self._items.move_to_end(image_id)
            return item

    def __len__(self) -> int:
        return len(self._items)

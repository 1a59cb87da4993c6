"""Video outputs: frames to MP4 (H.264) and back (mp4.py)."""

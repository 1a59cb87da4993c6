"""Video outputs: frames to MP4 (H.264) and back (mp4.py), and saving a video the engine made (save.py)."""
from dvllm.video.save import save_frames, save_video

__all__ = ["save_frames", "save_video"]

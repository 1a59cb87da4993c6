"""LoRA adapters: checked and named on the driver (registry.py), which hands requests ids (ref.py); read with
diffusers' own loaders (weights.py) by whoever applies them (cache.py); the worker applies many of them in one
batched forward (worker/lora_layers.py)."""

"""LoRA adapters: read with diffusers' own loaders (weights.py), named and cached on the driver
(registry.py); the worker applies many of them in one batched forward (worker/lora_layers.py)."""

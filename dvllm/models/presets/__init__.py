"""Built-in model presets: diffusers configs as data, loaded with random weights."""

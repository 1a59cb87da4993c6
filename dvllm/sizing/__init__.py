"""What fits where, computed rather than measured: a model's memory on a GPU at a given set of flags
(memory_estimate, on fake tensors), quantized weights' bytes, and a worker group's arithmetic per preset."""

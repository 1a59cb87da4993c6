"""Step-cache methods behind one protocol (method.py): one module per method, and the registry that names
them (registry.py). The driver's parts have no torch; each method's worker part runs in the batched forward
that worker/step_cache_hooks.py drives."""

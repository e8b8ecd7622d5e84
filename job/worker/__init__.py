"""Code that runs inside vLLM's TP worker processes (``worker_extension_cls``), apart from the
driver: hidden-state capture and the shared-memory ring it fills for the driver."""

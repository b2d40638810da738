"""The worker process: model execution and per-sequence token sampling."""

"""Inter-process transport between the front end and worker processes: shared-memory rings and eventfd doorbells."""

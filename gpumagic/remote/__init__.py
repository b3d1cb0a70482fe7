"""Running things on the machine: cells (execution) and detached jobs."""

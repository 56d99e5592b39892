"""Emulated edge devices: local nodes with a CPU quota, a memory limit, a disk rate and a link
of their own (`--device`), so that N devices on one machine measure tensor parallelism rather
than processes taking turns on shared cores. A tool, kept apart from the runtime: the runtime
only runs a worker's command as the device wraps it."""

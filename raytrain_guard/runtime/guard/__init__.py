"""The per-worker step guard: step timing, memory probes, the gate fed in batches, the hang
watchdog, local actions."""

"""The node monitor: one per Ray node, sampling GPUs (NVML) and the host (psutil)."""

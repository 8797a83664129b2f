"""Updates: the per-unit optimizer step, optimizer states on NVMe, speculation, the update worker."""

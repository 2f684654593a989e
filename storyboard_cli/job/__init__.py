"""The job stage: the job file to batches, checked before any model loads (no torch)."""

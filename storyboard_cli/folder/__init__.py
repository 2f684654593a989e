"""The folder stage: what a render leaves on disk, its layout, writers and readers (no torch)."""

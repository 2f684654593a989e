"""The engine stage's compiled kernels: the export, the artifacts, their builds, the calls on them, the FP8 recipe."""

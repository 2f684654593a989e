"""The engine's compiled kernels: what the export sees, the artifacts (key, build, load check), the builds in child
processes, the step's calls on loaded kernels, and the FP8 recipe (engine/variants.py names each variant's)."""

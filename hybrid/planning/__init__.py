"""The floor that chooses how to run: hardware and cost models, per-layer profiling, the
search over meshes, micro-batches, schedules and remat, and its reports."""

"""Where a mesh lives beyond one process: TensorFlow clusters (multi-host), TPU slices
(placement on the torus) and Cloud TPU supervision."""

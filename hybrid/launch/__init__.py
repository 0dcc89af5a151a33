"""absl-flagged entry points: the only place in the project where flags live."""

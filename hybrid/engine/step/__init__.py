"""One training step on the mesh: the stage copies on their devices, the lowering of a schedule
into their ops, the reductions across replicas, boundary compression and the devices' clocks."""

"""The floor that runs a step with TensorFlow: simulated devices, stage programs on their
devices, collectives, lowering of a schedule into ops, and ``Pipeline``."""

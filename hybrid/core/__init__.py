"""The floor without TensorFlow: run configuration and its one validator, the device mesh,
balancing, and schedules as data (IR, generators, validation, simulation).

Importing anything here never loads TensorFlow; the launcher checks its flags with it
before the runtime starts.
"""

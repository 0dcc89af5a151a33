"""What the user holds: ``Pipeline`` with Keras's compile/fit/evaluate/predict, the batches it
takes, its metrics, the feed, export and summary, and the executors that run its steps."""

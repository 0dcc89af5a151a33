"""The user's Keras model as the engine sees it: its layer calls and their cut, losses and
objective, where each variable lives, which gradients are sparse, BatchNormalization, costs."""

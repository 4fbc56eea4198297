"""Training-side building blocks: models (and, later, the trainer loop, data and checkpoints)."""

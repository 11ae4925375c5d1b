"""Release artefacts written next to exported weights: the model card and the training-data summary."""

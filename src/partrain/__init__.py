"""partrain: train and serve PyTorch models in parallel with one training loop."""
__version__ = "0.1.0"

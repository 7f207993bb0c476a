"""fxplanner: plan PTD-P training from torch.fx graphs and fill the pipeline bubbles."""

__version__ = "0.1.0"

"""Runtime: execute a plan on torch.distributed and run fill jobs in the pipeline bubbles."""

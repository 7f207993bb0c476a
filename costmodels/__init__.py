"""costmodels."""

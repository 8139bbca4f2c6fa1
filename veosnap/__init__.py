"""veosnap: golden-reference snapshot regression for ML model implementations."""

__version__ = "0.1.0"

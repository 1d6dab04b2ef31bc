"""The package version (one place: the package, its cache keys and the wheel read it here)."""

__version__ = "0.1.0"

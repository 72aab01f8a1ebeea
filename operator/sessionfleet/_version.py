"""The distribution's version, read by setuptools and `sessionfleet version`."""

__version__ = "0.1.0"

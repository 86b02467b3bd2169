"""The release of watchdogd."""

__version__ = "0.1.0"

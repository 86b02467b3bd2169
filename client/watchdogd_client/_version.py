"""The release of watchdogd-client."""

__version__ = "0.1.0"

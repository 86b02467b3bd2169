"""``python -m watchdogd`` runs the daemon, like the ``watchdogd`` command."""

from .cli import main

main()

"""``python -m watchdogd`` runs the daemon, like the ``watchdogd`` command."""

from .cli.watchdogd import main

main()

"""The commands: `watchdogd` (the daemon's), `watchdogctl` (the control tool's, with
its replies in words in `render` and the child of ``watchdogctl run`` in `run`), the
man pages made from their help (`manpage`), and where the reference pages are
installed (`reference`, both commands' ``--docs-path``).
"""

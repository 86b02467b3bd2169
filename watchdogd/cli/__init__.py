"""The commands: `watchdogd` (the daemon's), `watchdogctl` (the control tool's, with
its replies in words in `render` and the child of ``watchdogctl run`` in `run`) and
the man pages made from their help (`manpage`).
"""

"""The commands: `watchdogd` (the daemon's), `watchdogctl` (the control tool's) and
the man pages made from their help (`manpage`).
"""

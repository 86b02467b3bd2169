"""The commands: `watchdogd` (the daemon's), `watchdogctl` (the control tool's; its
replies in words are `render`) and the man pages made from their help (`manpage`).
"""

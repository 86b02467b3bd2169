"""The state's files, as `watchdogd.store.Store` reads and writes them.

`journal`: the append-only journals of changes, their records and their replay.
`database`: the SQLite database that journals are folded into. `schema`: the form a
timer is stored in, and how loaded timers are decoded. `faults`: what can be wrong
with a file, and moving one aside, never deleting it. When each is written, and what
a failing disk does to the daemon, is the store's to decide.
"""

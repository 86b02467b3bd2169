"""The state on disk: `store` (the `Store`: what is written when, and what a failing
disk does to the daemon), the journals of changes (`journal`), the SQLite database
they are folded into (`database`), the form a timer is stored in and the
migrations from older schemas (`schema`), moving aside a file that cannot be read,
never deleting it (`faults`), opening only regular files, without blocking, and
writing files whole (`files`), the record of events and incidents
(`record_file`), and the history of how long each scope ran (`history_file`).
"""

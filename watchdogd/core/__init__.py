"""The daemon's sans-IO core: the rules, with no system call in them.

The timer table and its deadline heap (`timers`, `heap`), request handling and
authorization (`service`, `session`), policies (`policies`), the state machine
of a policy run (`expiry`) and the starvation rule some of them apply first
(`starvation`), the events ring (`events`) and
the incident log (`incidents`) with the per-uid shares they keep (`shares`), the
counters (`counters`) and the config model (`config`). Nothing here
imports trio, sqlite3, socket, subprocess or prometheus_client, or reads a clock:
the caller passes ``now``. The core tells the runtime modules beside it (server,
scheduler, executor, store, systemd) what must happen through a few narrow ports: a
process port to open and watch processes, a journal to persist and forget timers,
a callback to wake the scheduler at a deadline, the expiries it returns for
their policies to run, and the effects a policy run returns for the executor to
carry out. A test imports this package in a fresh interpreter and
checks that none of those modules was loaded.
"""

"""The daemon's sans-IO core: the rules, with no system call in them.

The timer table and its deadline heap (`timers`, `heap`), request handling and
authorization (`service`, `session`), policies (`policies`) and the starvation
rule some of them apply first (`starvation`), the events ring (`events`) and
the incident log (`incidents`) with the per-uid shares they keep (`shares`), the
counters (`counters`), the config model (`config`) and what the core wants logged
(`logline`). Nothing here imports trio, sqlite3, socket, subprocess,
prometheus_client, select, threading, time, logging, secrets, random or os, or a
module of watchdogd outside the core but its errors and version; nothing reads a
clock, writes a log, draws a random number or opens a file. The runtime passes
``now`` to each call, and at start the clocks, the log sink and the incident id
maker. The core tells the runtime modules beside it (server, scheduler, actions,
store, systemd) what must happen through a few narrow ports: a process port to
open and watch processes, a journal to persist and forget timers, a callback to
wake the scheduler at a deadline, and the expiries it returns for their policies to
run. tests/test_core.py checks the imports of every module here.
"""

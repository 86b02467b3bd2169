"""The daemon's sans-IO core: the rules, with no system call in them.

The timer table and its deadline order (`timers`, `deadlines`); the service
(`service`), a thin front over its parts: connections, arming and authorization
(`timer_requests`), the pages that only read (`pages`), expiry with the starvation rule
and incident peers (`firing`), restore and exits (`lifecycle`) and the fleet
bridge (`bridge`), on the config in force (`rules`); the state machine of a
policy run (`expiry`), whose effects the runtime's executor carries out; one
connection's protocol state (`session`); policies (`policies`) and the
starvation rule (`starvation`), the events ring (`events`) and the incident log
(`incidents`) with the per-uid shares they keep (`shares`) and the bytes of
evidence it keeps (`evidence_budget`), each hang's fingerprint (`fingerprint`),
the jobs' table of hangs (`repeats`) and what is done with them (`hangs`), the
history of
timeouts (`history`), the counters (`counters`), the config model (`config`), who
calls and whom it may signal (`identity`), and what it wants logged (`logline`).

Nothing here imports trio, sqlite3, socket, subprocess, prometheus_client,
select, threading, time, logging, secrets, random or os, or a module of watchdogd
outside the core but its errors and version; nothing reads a clock, writes a log,
draws a random number or opens a file. The runtime passes ``now`` to each call,
and at start the clocks, the log sink and the incident id maker. The core tells
the runtime modules beside it what must happen through a few narrow ports
(`ports`): a process port to open and watch processes, a journal to persist and
forget timers, a callback to wake the scheduler at a deadline, and the expiries it
returns for their policies to run. tests/unit/test_core.py checks the imports of every
module here.
"""

"""The fleet: daemons on many hosts that coordinate through etcd.

`watchdogd.fleet.member` is this daemon as a member of the fleet: it registers this
host, watches the others and follows its jobs' incidents; what it writes to etcd
is `watchdogd.fleet.publish`'s, what it keeps of the other hosts
`watchdogd.fleet.view`'s, and every key it reads is decoded by
`watchdogd.fleet.records`. `watchdogd.fleet.etcd` is the etcd client: its calls go
through `watchdogd.fleet.transport`, its watches are `watchdogd.fleet.watch`, and
what they send and read is `watchdogd.fleet.gateway`; `watchdogd.fleet.http1` is
the bounded HTTP/1.1 client (httptools' parser, on trio streams) that etcd's
gateway is spoken over. Nothing in this package is on the path of a local expiry.
"""

"""The fleet: daemons on many hosts that coordinate through etcd.

`watchdogd.fleet.etcd` is the etcd client; `watchdogd.fleet.http1` is the bounded
HTTP/1.1 client (h11 on trio streams) that etcd's gateway is spoken over. Nothing in
this package is on the path of a local expiry.
"""

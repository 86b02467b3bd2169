"""What the tests share: real daemons, real processes, a real etcd, and the fakes of
the core's unit tests. No test module imports another: what two need lives here."""

"""The daemon at run time: its wiring (`daemon`), the socket server (`server`),
the scheduler of deadlines (`scheduler`), the executor of policy runs (`executor`),
hooks and dumps (`hooks`), the config read and reloaded (`reload`) and the metrics'
rendering (`metrics`). These run on
trio, as `watchdogd.fleet` does and the adapters that wait on the host or the disk
(`watchdogd.host.exits`, `watchdogd.host.targets`, `watchdogd.host.users`,
`watchdogd.storage.store`, `watchdogd.storage.history_file`); `watchdogd.core` never
does.
"""

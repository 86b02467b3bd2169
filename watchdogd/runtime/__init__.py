"""The daemon at run time: its wiring (`daemon`), the socket server (`server`),
the scheduler of deadlines (`scheduler`), the executor of policy runs (`executor`),
hooks and dumps (`hooks`) and the metrics' rendering (`metrics`). Only this
package and `watchdogd.fleet` run on trio.
"""

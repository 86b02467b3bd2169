"""Adapters of the host's kernel: processes by pidfd (`process`), the targets of a
policy (`targets`), cgroups (`cgroups`), pressure and CPU samples (`pressure`), the
exit watcher (`exits`), timerfd (`timerfd`), systemd's notify and socket
activation (`systemd`) and user names (`users`).
"""

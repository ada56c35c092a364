"""The host daemon's shared memory: ``kvtier serve --shm NAME`` and ``local://NAME``.

- :mod:`kvtier.shm.files`: the arena file under ``/dev/shm``, its lock and socket paths.
- :mod:`kvtier.shm.leases`: the daemon's table of slots handed to engine processes.
- :mod:`kvtier.shm.protocol`: the control channel's messages (JSON over a Unix socket).
- :mod:`kvtier.shm.server`: the daemon side (an aiohttp app on a Unix socket).
- :mod:`kvtier.shm.client`: the engine side, used by :class:`kvtier.tiers.local.LocalTier`.
"""

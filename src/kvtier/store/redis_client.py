"""redis-py clients for the Redis tier, and what their exceptions mean to the tier.

make_client(url, cluster, timeout_s) -> client   short timeouts, no retries; a cluster that
                                                 does not answer yet is reached later; values
                                                 sent from the caller's memory (`python_packer`,
                                                 a cluster's nodes through `packed_connection`)
classify(exc) -> str                             "timeout", "full" or "error" (metrics)
"""

from __future__ import annotations

import threading

BUFFER_CUTOFF = 6000  # redis-py's: a value past this many bytes goes to the socket as its own buffer


def make_client(
    url: str, cluster: bool = False, timeout_s: float = 0.5, connect_timeout_s: float | None = None
):
    """A redis-py client with short timeouts and no retries: a slow or dead server must cost
    one timeout and turn into a miss, not stall the serving loop through retries."""
    from redis import Redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kwargs = dict(
        socket_timeout=timeout_s,
        socket_connect_timeout=connect_timeout_s if connect_timeout_s is not None else timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
    if cluster:
        # Each node's connections pack as the standalone client does (a rediss:// URL names its
        # own TLS connection class, which takes redis-py's default packer)
        kwargs["connection_class"] = packed_connection()
        return PendingCluster(url, kwargs).connect(raise_errors=False)
    return Redis.from_url(url, command_packer=python_packer(), **kwargs)


def python_packer():
    """redis-py's command packer written in Python, also where hiredis is installed: it hands a
    large value to the socket as the caller's memory, where hiredis's packer first copies the whole
    command into one buffer. hiredis still parses the replies: in C, a chunk's value read in a few
    steps of the interpreter rather than one per 64 KiB, which is what keeps a read beside the
    engine's forward thread cheap."""
    from redis._parsers.encoders import Encoder
    from redis.connection import PythonRespSerializer

    return PythonRespSerializer(BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode)


def packed_connection() -> type:
    """redis-py's connection class packing commands with `python_packer`: a Redis Cluster's nodes
    take a connection class, not a packer."""
    from redis.connection import Connection

    class PackedConnection(Connection):
        def __init__(self, *args, **kwargs) -> None:
            kwargs.setdefault("command_packer", python_packer())
            super().__init__(*args, **kwargs)

    return PackedConnection


class PendingCluster:
    """A Redis Cluster client made once some node answers. redis-py's ``RedisCluster`` reads the
    slot map when it is made, so a cluster that is down at start would fail it: until a node
    answers, every use tries again and raises redis-py's ``ConnectionError`` (the tier's circuit
    breaker spaces the tries out), and from then on this object hands every call to the client."""

    def __init__(self, url: str, kwargs: dict) -> None:
        self._url, self._kwargs = url, kwargs
        self._client = None
        self._lock = threading.Lock()  # one slot-map read at a time; the client is made once

    def connect(self, raise_errors: bool = True):
        """The cluster's client, made now if it was not yet; ``self`` while no node answers
        (``raise_errors``: the ConnectionError instead)."""
        from redis.cluster import RedisCluster
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import RedisClusterException, RedisError

        with self._lock:
            if self._client is None:
                try:
                    self._client = RedisCluster.from_url(self._url, **self._kwargs)
                except (RedisClusterException, RedisError, OSError) as exc:
                    if raise_errors:
                        raise RedisConnectionError(str(exc)) from exc
                    return self
        return self._client

    def __getattr__(self, name: str):
        client = self._client  # once made, no lock: every call of the tier comes through here
        return getattr(client if client is not None else self.connect(), name)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def classify(exc: Exception) -> str:
    """The metrics kind of a failure: timeout, full (server out of memory), or error."""
    from redis.exceptions import OutOfMemoryError, ResponseError
    from redis.exceptions import TimeoutError as RedisTimeout

    if isinstance(exc, RedisTimeout | TimeoutError):
        return "timeout"
    # A pipeline rewrites the message ("Command # 1 ... caused error: ..."), not the class.
    if isinstance(exc, OutOfMemoryError) or (isinstance(exc, ResponseError) and "maxmemory" in str(exc)):
        return "full"
    return "error"

"""redis-py clients for the Redis tier, and what their exceptions mean to the tier."""

from __future__ import annotations


def make_client(
    url: str, cluster: bool = False, timeout_s: float = 0.5, connect_timeout_s: float | None = None
):
    """A redis-py client with short timeouts and no retries: a slow or dead server must cost
    one timeout and turn into a miss, not stall the serving loop through retries."""
    from redis import Redis
    from redis.backoff import NoBackoff
    from redis.cluster import RedisCluster
    from redis.retry import Retry

    kwargs = dict(
        socket_timeout=timeout_s,
        socket_connect_timeout=connect_timeout_s if connect_timeout_s is not None else timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
    if cluster:
        return RedisCluster.from_url(url, **kwargs)
    return Redis.from_url(url, **kwargs)


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

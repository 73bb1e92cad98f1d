"""RedisTier: the shared tier — one Redis (or Valkey) server, or a Redis Cluster.

Value formats under ``{prefix}{key hex}``:

    b"M" + nonce(8) nparts(u32) part_bytes(u64) + header     a manifest; the payload is in
    ``{prefix}{key hex}:{nonce hex}:{i}`` for i < nparts      (spread over cluster slots)
    b"S" + header + payload                       a chunk in one value (read; written by
                                                  earlier versions, which copied it to send it)

A manifest is published only once all its parts are written (``redis_write``), so a reader
never finds a manifest whose parts were not all written. Parts are never overwritten (each put
has its own nonce), so a reader never mixes two writers' bytes; a part evicted by the server,
or bytes that fail the header checksum, make a miss. Capacity and eviction are the server's
(``maxmemory`` with ``maxmemory-policy allkeys-lru``): several serving hosts share this tier,
so no one client's bookkeeping could see what the others store — and the server evicts
orphans of failed puts.

With a key ring (``auth``, `auth.KeyRing`) every chunk is sealed as it is written and opened as
it is read. A value its ring cannot open (planted, sealed under a key the ring does not hold, or
plain) is a miss counted ``forged``, and is deleted, so the next put stores it sealed. Without a
ring, a sealed value is a miss counted ``unverifiable``, and is left for the instances with keys.

A server that does not answer when the tier is made (a closed port, a wrong password, a db it
does not have) is a warning then, naming the URL (password masked: ``url``) and what failed; the
tier starts as a miss, its breakers open, and it reconnects on its own once the server answers.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from .auth import KeyRing, Rejected, check_seal, open_chunk, stored_len
from .header import ChunkHeader, HeaderError
from .health import CircuitBreaker
from .keys import check_key
from .metrics import StoreMetrics
from .redis_client import classify, make_client
from .redis_url import check_url, mask_url
from .redis_write import MANIFEST, PRESENT, STORED, Target, put_chunks
from .tier import DestTooSmall, TierReads, check_put_args

log = logging.getLogger(__name__)


class _Corrupt(Exception):
    """The stored value is not this key's intact chunk."""

    def __init__(self, message: str, part_missing: bool = False, kind: str = "corrupt", drop: bool = True):
        super().__init__(message)
        self.part_missing, self.kind, self.drop = part_missing, kind, drop


# A sealed value is encrypted in batches of at most this many payload bytes: each ciphertext is
# a copy that lives until its batch is sent.
SEAL_BATCH_BYTES = 256 << 20


# Delete a manifest only if it is still the one read: a concurrent put may have replaced it,
# and deleting the new manifest would orphan its parts.
_DEL_IF_SAME = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class RedisTier(TierReads):
    """client: a redis-py ``Redis`` or ``RedisCluster`` (or give ``url`` and ``cluster``).
    part_bytes: payloads go out in parts of this size (one part for a payload that fits).
    parts_per_batch: parts a read fetches a round trip. ttl_s: optional expiry of every key.
    timeout_s: per-command socket timeout when the client is made here.
    url: ``redis://``, ``rediss://`` (TLS) or ``unix://``, as redis-py takes it; checked here
    (ValueError naming ``url``). ``self.url`` is it with the password masked, for logs and stats.
    auth: the `KeyRing` that seals what is written and opens what is read (None: plain chunks; a
    `KVStore` with ``auth_keys`` gives its ring to a tier built without one).
    The server is asked once here (PING): no answer is a warning, never an exception.
    """

    def __init__(
        self,
        client=None,
        *,
        url: str | None = None,
        cluster: bool = False,
        prefix: str = "kvtier:",
        part_bytes: int = 4 << 20,
        ttl_s: int | None = None,
        timeout_s: float = 0.5,
        name: str = "redis",
        metrics: StoreMetrics | None = None,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        parts_per_batch: int = 16,
        auth: KeyRing | None = None,
    ) -> None:
        if (client is None) == (url is None):
            raise ValueError("give exactly one of client or url")
        if not isinstance(part_bytes, int) or part_bytes < 4096:
            raise ValueError(f"part_bytes must be an int >= 4096, got {part_bytes!r}")
        if ttl_s is not None and (not isinstance(ttl_s, int) or ttl_s < 1):
            raise ValueError(f"ttl_s must be None or an int >= 1, got {ttl_s!r}")
        if not isinstance(parts_per_batch, int) or parts_per_batch < 1:
            raise ValueError(f"parts_per_batch must be an int >= 1, got {parts_per_batch!r}")
        if not isinstance(prefix, str):
            raise ValueError(f"prefix must be a str, got {prefix!r}")
        if auth is not None and not isinstance(auth, KeyRing):
            raise ValueError(f"auth must be a KeyRing or None, got {type(auth).__name__}")
        self.auth = auth
        if client is None:
            check_url(url, "url")
            client = make_client(url, cluster, timeout_s)
            self.url = mask_url(url)
        else:  # a RedisCluster routes by slot; a plain Redis has no nodes to list
            cluster = callable(getattr(client, "get_nodes", None))
            self.url = _address(client)
        self.name = name
        self.prefix = prefix
        self.part_bytes = part_bytes
        self.ttl_s = ttl_s
        self.parts_per_batch = parts_per_batch
        self._target = Target(client, prefix, part_bytes, ttl_s, parts_per_batch, name, cluster)
        self._m = (metrics if metrics is not None else StoreMetrics()).tier(name)
        self._m.occupancy(0, 0, 0, 0)  # the server owns capacity; these stay unknown (0)
        self._read_health = CircuitBreaker(failure_threshold, cooldown_s)
        self._write_health = CircuitBreaker(failure_threshold, cooldown_s)
        self._check_at_start()

    # -- public API ---------------------------------------------------------------------

    @property
    def client(self):
        """The redis-py client every command goes through."""
        return self._target.client

    @client.setter
    def client(self, client) -> None:
        """Swap the client (e.g. a wrapper that counts round trips); later commands use it."""
        self._target = dataclasses.replace(self._target, client=client)

    def put(self, key: bytes, header: ChunkHeader, payload) -> bool:
        return self.put_many([(key, header, payload)])[0]

    def put_many(self, items) -> list[bool]:
        """``put`` of each ``(key, header, payload)``, the payloads sent from the caller's memory
        in one pipelined round trip for the whole batch (two on a cluster: ``redis_write``);
        each chunk is stored whole or not at all."""
        sealed = self.auth is not None
        checked = [
            (key, header, check_put_args(key, header, payload, sealed)) for key, header, payload in items
        ]
        if not checked:
            return []
        t0 = time.perf_counter()
        if not self._write_health.allow():
            for _ in checked:
                self._m.put_failed("skipped")
            return [False] * len(checked)
        kinds = self._put_sealed(checked) if self.auth is not None else put_chunks(self._target, checked)
        dt = (time.perf_counter() - t0) / len(checked)
        for (_, _, view), kind in zip(checked, kinds, strict=True):
            if kind == STORED:
                self._m.stored(view.nbytes, dt)
            elif kind == PRESENT:
                self._m.present()
            else:
                self._m.put_failed(kind)
        # Full is the server answering; unreachable or slow ones trip the breaker, once a batch.
        if any(kind not in (STORED, PRESENT, "full") for kind in kinds):
            self._write_health.record_failure()
        else:
            self._write_health.record_success()
        return [kind in (STORED, PRESENT) for kind in kinds]

    def _put_sealed(self, checked: list) -> list[str]:
        """``put_chunks`` of the sealed chunks, in batches of at most SEAL_BATCH_BYTES of payload
        (an encrypted payload is a copy, alive until its batch is sent)."""
        kinds: list[str] = []
        limit = SEAL_BATCH_BYTES if self.auth.encrypt else float("inf")  # a MAC alone copies nothing
        while len(kinds) < len(checked):
            batch, sealed, nbytes = [], [], 0
            for key, header, view in checked[len(kinds) :]:
                if batch and nbytes + view.nbytes > limit:
                    break
                nbytes += view.nbytes
                try:
                    sealed.append((key, *self.auth.seal(header, view)))
                    batch.append(None)
                except ValueError as exc:  # a payload the seal refuses: this chunk is not stored
                    log.warning("redis tier %s: put %s: %s", self.name, key.hex(), exc)
                    batch.append("error")
            got = iter(put_chunks(self._target, sealed) if sealed else ())
            kinds += [kind or next(got) for kind in batch]
        return kinds

    def contains(self, key: bytes) -> bool:
        check_key(key)
        if not self._read_health.allow():
            return False
        try:
            found = bool(self.client.exists(self._target.key(key)))
        except Exception as exc:
            log.warning("redis tier %s: contains failed: %s", self.name, exc)
            self._read_health.record_failure()
            return False
        self._read_health.record_success()
        return found

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """``contains`` of each key in one pipelined round trip (on a cluster, one per node)."""
        for key in keys:
            check_key(key)
        if not keys or not self._read_health.allow():
            return [False] * len(keys)
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._target.key(key))
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:
            log.warning("redis tier %s: contains of %d keys failed: %s", self.name, len(keys), exc)
            self._read_health.record_failure()
            return [False] * len(keys)
        self._read_health.record_success()
        return [not isinstance(r, Exception) and bool(r) for r in replies]

    def delete(self, key: bytes) -> bool:
        check_key(key)
        try:
            rec = self.client.get(self._target.key(key))
            return rec is not None and self._drop(key, rec)
        except Exception as exc:
            log.warning("redis tier %s: delete %s failed: %s", self.name, key.hex(), exc)
            return False

    def stats(self) -> dict[str, int | float]:
        out = self._m.snapshot()
        out.update(
            read_skipping=int(self._read_health.is_open), write_skipping=int(self._write_health.is_open)
        )
        out.update(authenticated=int(self.auth is not None))
        out.update(encrypted=int(self.auth is not None and self.auth.encrypt))
        return out

    def close(self) -> None:
        try:
            self.client.close()
        except Exception as exc:  # closing a client of a dead server is not worth an exception
            log.debug("redis tier %s: close: %s", self.name, exc)

    # -- internals ----------------------------------------------------------------------

    def _check_at_start(self) -> None:
        """PING once; no answer: a warning naming the URL, and both breakers open, so the first
        requests miss at once instead of each paying a timeout until the server answers."""
        try:
            self.client.ping()
        except Exception as exc:  # any failure: the tier starts as a miss, not as an error
            log.warning(
                "kvtier: redis tier %s at %s does not answer at start (%s: %s); it runs as a miss "
                "and reconnects when the server answers",
                self.name,
                self.url,
                type(exc).__name__,
                exc,
            )
            self._read_health.trip()
            self._write_health.trip()

    def _get(self, key: bytes, dest: memoryview | None) -> tuple[ChunkHeader, memoryview] | None:
        check_key(key)
        t0 = time.perf_counter()
        if not self._read_health.allow():
            self._m.miss("skipped")
            return None
        rec = None
        try:
            rec = self.client.get(self._target.key(key))
            got = None if rec is None else self._decode(key, memoryview(rec), dest)
        except DestTooSmall:
            self._read_health.record_success()
            raise
        except _Corrupt as exc:
            self._read_health.record_success()  # the server answered, with bad bytes
            try:
                # A part missing because a concurrent delete removed this manifest first is
                # a plain miss; a part missing under a live manifest (evicted) is corruption.
                if exc.part_missing and self.client.get(self._target.key(key)) != rec:
                    self._m.miss(None, time.perf_counter() - t0)
                    return None
                what = "dropped" if exc.drop else "left for the tiers with keys"
                log.warning(
                    "redis tier %s: chunk %s is %s (%s); %s", self.name, key.hex(), exc.kind, exc, what
                )
                if exc.drop:
                    self._drop(key, rec)
            except Exception as cleanup:  # the miss stands; cleanup is best-effort
                log.debug("redis tier %s: dropping %s failed: %s", self.name, key.hex(), cleanup)
            self._m.miss(exc.kind, time.perf_counter() - t0)
            return None
        except Exception as exc:
            kind = classify(exc)
            log.warning("redis tier %s: get %s failed (%s): %s", self.name, key.hex(), kind, exc)
            self._read_health.record_failure()
            self._m.miss(kind, time.perf_counter() - t0)
            return None
        self._read_health.record_success()
        if got is None:
            self._m.miss()
            return None
        self._m.hit(got[0].payload_len, time.perf_counter() - t0)
        return got

    def _decode(self, key: bytes, rec: memoryview, dest: memoryview | None) -> tuple[ChunkHeader, memoryview]:
        """The chunk in value ``rec``: its header parsed, and its seal checked before any part is
        fetched or a byte lands in ``dest``; then its payload opened (`auth.open_chunk`)."""
        kind = bytes(rec[:1])
        try:
            if kind == b"S":
                header, hlen = ChunkHeader.unpack(rec[1:])
            elif kind == b"M" and rec.nbytes > 1 + MANIFEST.size:
                manifest = MANIFEST.unpack_from(rec, 1)
                header, _ = ChunkHeader.unpack(rec[1 + MANIFEST.size :])
            else:
                raise _Corrupt(f"unknown record kind {kind!r}")
        except HeaderError as exc:
            raise _Corrupt(str(exc)) from None
        if header.key != key:
            raise _Corrupt(f"value holds key {header.key.hex()}")
        try:
            check_seal(self.auth, header)
            n = header.payload_len
            if dest is not None and dest.nbytes < n:
                raise DestTooSmall(f"dest holds {dest.nbytes} bytes, chunk needs {n}")
            # Where the stored bytes land: dest, unless they are ciphertext (decrypted into dest).
            land = dest if dest is not None and not header.encrypted else None
            if kind == b"S":
                stored = _single(rec[1 + hlen :], header, land)
            else:
                stored = self._parts(key, manifest, header, land)
            return open_chunk(self.auth, header, stored, dest)
        except Rejected as exc:
            # A value its ring cannot open is dropped, so the next put stores it sealed (a put
            # never replaces a value: left, it would hold the name while readers refresh it). A
            # tier without keys cannot judge a sealed value: left for the tiers with keys.
            raise _Corrupt(str(exc), kind=exc.kind, drop=exc.kind != "unverifiable") from None

    def _parts(self, key: bytes, manifest: tuple, header: ChunkHeader, land: memoryview | None) -> memoryview:
        """A manifest's parts, fetched ``parts_per_batch`` a round trip, into ``land`` or a new
        buffer (an encrypted payload's with room for its tag)."""
        nonce, nparts, part_bytes = manifest
        n = header.payload_len
        if part_bytes < 1 or nparts != -(-n // part_bytes):
            raise _Corrupt(f"manifest of {nparts} parts of {part_bytes} bytes cannot hold {n} bytes")
        payload = land if land is not None else memoryview(bytearray(stored_len(header)))
        names = self._target.part_keys(key, nonce, nparts)
        for batch in range(0, nparts, self.parts_per_batch):
            pipe = self.client.pipeline(transaction=False)
            for name in names[batch : batch + self.parts_per_batch]:
                pipe.get(name)
            for i, part in enumerate(pipe.execute(), start=batch):
                want = min(part_bytes, n - i * part_bytes)
                if part is None:  # evicted by the server, or deleted under us
                    raise _Corrupt(f"part {i} of {nparts} missing", part_missing=True)
                if len(part) != want:
                    raise _Corrupt(f"part {i} is {len(part)} bytes, expected {want}")
                payload[i * part_bytes : i * part_bytes + want] = part
        return payload[: stored_len(header)]

    def _drop(self, key: bytes, rec: bytes) -> bool:
        """Delete the value ``rec`` read under ``key`` and, for a manifest, its parts."""
        name = self._target.key(key)
        if rec[:1] != b"M" or len(rec) < 1 + MANIFEST.size:
            return bool(self.client.delete(name))  # no parts: nothing can be orphaned
        if not self.client.eval(_DEL_IF_SAME, 1, name, rec):
            return False  # already gone or replaced: its parts are someone else's to delete
        nonce, nparts, _ = MANIFEST.unpack_from(rec, 1)
        self._target.delete(self._target.part_keys(key, nonce, min(nparts, 1 << 20)), raise_errors=True)
        return True


def _single(payload: memoryview, header: ChunkHeader, land: memoryview | None) -> memoryview:
    """A one-value chunk's payload (written by earlier versions): copied into ``land``, else as
    read (an encrypted one copied, with room for its tag)."""
    n = header.payload_len
    if payload.nbytes != n:
        raise _Corrupt(f"payload is {payload.nbytes} bytes, header says {n}")
    if land is None and not header.encrypted:
        return payload
    out = land if land is not None else memoryview(bytearray(stored_len(header)))
    out[:n] = payload
    return out[: stored_len(header)] if land is None else out[:n]


def _address(client) -> str:
    """Where a redis-py client given to the tier points (no password), for logs."""
    try:
        kw = client.connection_pool.connection_kwargs
        if "path" in kw:
            return f"unix://{kw['path']}?db={kw.get('db', 0)}"
        return f"redis://{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"
    except Exception:  # a cluster or a wrapper: its nodes are its own business
        return f"<{type(client).__name__}>"

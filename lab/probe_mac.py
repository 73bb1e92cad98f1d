"""Which keyed MAC seals a chunk fastest on this CPU: candidates against the plain xxh3-64 checksum
kvtier computed before keys, on payloads of the sizes of stored chunks (issue 44).

    python lab/probe_mac.py [--mib 4 8 16 32] [--reps 9]

GB/s per candidate and size, best and median of ``reps`` runs, the candidates interleaved (a
neighbour loading the host weighs on each alike). "gmac" is what `kvtier.store.auth` does per
chunk without encryption: a write key derived from a random salt (keyed BLAKE2b), then AES-256-GCM
with the payload as associated data; "aes-256-gcm" rows are the encryption at rest. BLAKE3 rows
need the `blake3` package (not a kvtier dependency): skipped without it.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import time

import xxhash
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.poly1305 import Poly1305

KEY, HEAD, NONCE = os.urandom(32), os.urandom(120), bytes(12)


def _write_key(person: bytes) -> bytes:
    return hashlib.blake2b(os.urandom(16) + HEAD, key=KEY, digest_size=32, person=person).digest()


def candidates(nbytes: int) -> dict:
    out = {
        "xxh3_64 (unkeyed, before)": lambda b: xxhash.xxh3_64_intdigest(b),
        "blake2b keyed": lambda b: hashlib.blake2b(b, key=KEY, digest_size=32).digest(),
        "hmac-sha256": lambda b: hmac.new(KEY, b, hashlib.sha256).digest(),
        "gmac (aes-256-gcm, key per write)": lambda b: AESGCM(_write_key(b"gmac")).encrypt(NONCE, HEAD, b),
    }

    def poly(b):
        p = Poly1305(_write_key(b"poly"))
        p.update(b)
        return p.finalize()

    out["poly1305 (key per write)"] = poly
    try:
        import blake3

        def b3(b):
            h = blake3.blake3(HEAD, key=KEY)
            h.update(b)  # the payload where it is: no copy, as every candidate here
            return h.digest()

        out["blake3 keyed"] = b3
    except ImportError:
        print("blake3 not installed: its rows skipped (pip install blake3)")
    ct, pt, aead = bytearray(nbytes + 16), bytearray(nbytes), AESGCM(KEY)
    out["aes-256-gcm encrypt_into"] = lambda b: aead.encrypt_into(NONCE, b, HEAD, ct)
    out["aes-256-gcm decrypt_into"] = lambda b: aead.decrypt_into(NONCE, ct, HEAD, pt)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, nargs="+", default=[4, 8, 16, 32], help="payload sizes, MiB")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args(argv)
    for mib in args.mib:
        buf = memoryview(os.urandom(int(mib * (1 << 20))))
        cands = candidates(buf.nbytes)
        cands["aes-256-gcm encrypt_into"](buf)  # the ciphertext decrypt_into reads
        times: dict[str, list[float]] = {name: [] for name in cands}
        for _ in range(args.reps):
            for name, fn in cands.items():
                t0 = time.perf_counter()
                fn(buf)
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            best, med = buf.nbytes / min(ts) / 1e9, buf.nbytes / statistics.median(ts) / 1e9
            print(f"{mib:5g} MiB  {name:36s} best {best:6.2f} GB/s  median {med:6.2f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Redis URLs: checked as redis-py will take them, and shown with the password masked.

    check_url(url, name) -> str   the URL, or ValueError naming ``name`` and the (masked) URL
    mask_url(url) -> str          ``redis://:***@host:6379/0``: what logs, errors and stats show

The schemes are redis-py's: ``redis://`` (TCP), ``rediss://`` (TLS; its ``ssl_*`` query options
pass through to redis-py) and ``unix://`` (a socket path). A user and password go in the URL's
user part (``redis://user:secret@host``) or as ``?password=``; either is masked. A db index the
server does not have (it knows its own ``databases``) can only be found by asking it: that is a
warning when the tier starts (``RedisTier``), not an error here.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlsplit

SCHEMES = ("redis", "rediss", "unix")
_HOST = re.compile(r"[A-Za-z0-9._-]+|[0-9A-Fa-f:.]+")  # a name, an IPv4, or an IPv6 (bracketed in the URL)


def mask_url(url: str) -> str:
    """``url`` with its password (user part or ``?password=``) replaced by ``***``; anything
    that does not parse as a URL is shown as ``<unparsable URL>`` (it may hold a secret)."""
    if not isinstance(url, str):
        return repr(url)
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        if ":" in user:
            user = user.split(":", 1)[0] + ":***"
        netloc = f"{user}@{host}"
    query = "&".join(
        f"{k}=***" if k == "password" else (f"{k}={v}" if v else k)
        for k, v in parse_qsl(parts.query, keep_blank_values=True)
    )
    out = f"{parts.scheme}://{netloc}{parts.path}"
    return out + (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")


def check_url(url, name: str = "url") -> str:
    """``url`` if redis-py can connect with it; else ValueError naming ``name`` and what is wrong:
    the scheme, the host (empty, or spaces), the port (not a number in 1-65535), the db index
    (not an int >= 0), or an option redis-py refuses."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{name} must be a redis://, rediss:// or unix:// URL, got {url!r}")
    shown = mask_url(url)

    def bad(what: str) -> ValueError:
        return ValueError(f"{name}={shown!r}: {what}")

    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise bad(f"not a URL ({exc})") from None
    if parts.scheme not in SCHEMES:
        raise bad(f"the scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
    if parts.scheme == "unix":
        if not parts.path:
            raise bad("a unix:// URL names the socket's path (unix:///run/redis.sock)")
    else:
        host = parts.hostname
        if not host:
            raise bad("no host (redis://host:6379/0)")
        if not _HOST.fullmatch(host):
            raise bad(f"the host {host!r} is not a host name or address")
        try:
            port = parts.port
        except ValueError:
            raise bad("the port must be a number in 1-65535") from None
        if port == 0:
            raise bad("the port must be a number in 1-65535")
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise bad(f"the db index must be an int >= 0 (redis://host:6379/0), got {db!r}")
    from redis.connection import parse_url

    try:
        parse_url(url)
    except ValueError as exc:  # an option redis-py refuses (e.g. ?db=x)
        raise bad(str(exc)) from None
    return url

"""libpq URLs, multi-host ones included, for the parts of pgbroker that are not psycopg.

psycopg hands a URL to libpq, which takes every form libpq documents, among
them the multi-host URLs an HA setup uses
(``postgresql://u@h1:p1,h2:p2/db?target_session_attrs=read-write``, or
``?host=h1,h2&port=p1,p2``).  SQLAlchemy parses URLs itself and wants one
port: this module converts.  Its callers check the URL first
(:func:`pgbroker.install.check_url`), so here it is a valid libpq URL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import sqlalchemy

DRIVER = "postgresql+psycopg"


def hosts(libpq: str) -> list[tuple[str, str]]:
    """(host, port) of every host the URL names, in order; '' where it gives none (libpq's default)."""
    from psycopg.conninfo import conninfo_to_dict

    info = conninfo_to_dict(libpq)
    names = str(info.get("host") or info.get("hostaddr") or "").split(",")
    ports = str(info.get("port") or "").split(",")
    if len(ports) == 1:  # one port for every host
        ports = ports * len(names)
    ports += [""] * (len(names) - len(ports))
    return list(zip(names, ports, strict=False))


def describe_hosts(libpq: str) -> str:
    """``h1:p1, h2:p2`` (``local socket`` for none), for messages."""
    named = [f"{h or 'local socket'}{':' + p if p else ''}" for h, p in hosts(libpq)]
    return ", ".join(named)


def to_sqlalchemy(libpq: str) -> str:
    """The URL in SQLAlchemy's psycopg form.

    One host: the same URL with SQLAlchemy's scheme.  Several: SQLAlchemy's
    multi-host form, ``postgresql+psycopg://user:password@/dbname?host=h1:p1&host=h2:p2``
    with the other parameters kept (SQLAlchemy joins the hosts and ports back
    into libpq's comma lists).  A host that contains ``:`` (an IPv6 address)
    cannot be written that way: :func:`create_engine` takes any URL.
    """
    from sqlalchemy.engine import URL

    found = hosts(libpq)
    if len(found) < 2:
        return DRIVER + "://" + libpq.split("://", 1)[1]
    if any(":" in h for h, _ in found):
        raise ValueError("SQLAlchemy's multi-host URL form has no room for an IPv6 host: use pgbroker's create_engine")
    from psycopg.conninfo import conninfo_to_dict

    info = {k: str(v) for k, v in conninfo_to_dict(libpq).items()}
    query: dict[str, Any] = {k: v for k, v in info.items() if k not in ("user", "password", "dbname", "host", "port")}
    query["host"] = [f"{h}:{p}" if p else h for h, p in found]
    url = URL.create(DRIVER, username=info.get("user"), password=info.get("password"), database=info.get("dbname"))
    return url.update_query_dict(query).render_as_string(hide_password=False)


def create_engine(libpq: str, **kwargs: Any) -> sqlalchemy.Engine:
    """A SQLAlchemy engine whose connections are ``psycopg.connect(libpq)``: libpq reads the URL, every form of it."""
    import psycopg
    import sqlalchemy

    return sqlalchemy.create_engine(DRIVER + "://", creator=lambda: psycopg.connect(libpq), **kwargs)

"""Throw-away databases on the test PostgreSQL server (TEST_DATABASE_URL)."""

from __future__ import annotations

import secrets


def fresh_postgres_database(server_url: str, template: str | None = None) -> tuple[str, str]:
    """Create a throw-away database on the test server, empty or a copy of ``template`` (which nobody
    may be connected to); returns (url, name)."""
    import sqlalchemy as sa

    from service.core.settings import Settings

    url = Settings(DATABASE_URL=server_url).database_url
    name = f"rloo_test_{secrets.token_hex(6)}"
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else "")))
    engine.dispose()
    return url.rsplit("/", 1)[0] + "/" + name, name


def drop_postgres_database(server_url: str, name: str) -> None:
    import sqlalchemy as sa

    from service.core.settings import Settings

    url = Settings(DATABASE_URL=server_url).database_url
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    engine.dispose()

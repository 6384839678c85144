"""``python -m worker.tinymodels DIR``, the spelling of earlier releases: kept for one release, the
models are built by ``worker.tiny.models`` (``python -m worker.tiny.models DIR``)."""

from __future__ import annotations

from worker.tiny.models import main

if __name__ == "__main__":
    raise SystemExit(main())

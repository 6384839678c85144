"""What both tiers stand on, with no HTTP and no job logic: settings, the database (``db``, the
tables in ``tables``, ``crud``, ``migrate``), logs, project identity (API keys), strict JSON
parsing, validation wording and the domain errors (``errors``)."""

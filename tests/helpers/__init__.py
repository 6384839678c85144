"""What the tests share, in one place: ``data`` (the example dataset and job bodies), ``api`` (calling
the API and checking its answers), ``live`` (the stack as real processes), ``training`` (the loop
in-process on the tiny models), ``scoring`` (an http grader's endpoint), ``databases`` (fresh
PostgreSQL databases). Fixtures live in ``tests/conftest.py``."""

"""The ``rloo`` command: the stack and its parts, keys and migrations, a job in the foreground, the demo.

One module a group of commands, each importing what it needs when it runs (torch loads only in
the processes that train):

* ``admin``: ``rloo db upgrade``, ``rloo keys create|revoke|list``, ``rloo projects create|list|archive|restore``;
* ``serve``: ``rloo api``, ``rloo worker`` (over ``worker.jobs.celery_worker`` and ``worker.serving``);
* ``stack``: ``rloo up``, the local stack as child processes;
* ``training``: ``rloo train``, ``rloo score``, ``rloo demo`` (``demo`` holds the demo itself);
* ``client``: ``rloo files|jobs|checkpoints|graders …``, any server over HTTP (``http``: the
  requests and streams; ``watch``: ``rloo jobs watch``); ``evaluations``: ``rloo jobs evaluations …``;
  ``evals``: ``rloo evals …`` (OpenAI's Evals API);
  ``tinker``: ``rloo tinker runs|checkpoints``.
"""

from __future__ import annotations

from worker.cli import admin, client, evals, evaluations, serve, stack, tinker, training  # noqa: F401 (each registers its commands)
from worker.cli.app import app


def main() -> None:
    app()

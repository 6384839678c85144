"""``python -m worker.serving WORKER_ID``: one inference worker process (its supervisor starts it)."""

from __future__ import annotations

import logging
import sys

from service.core.logs import configure
from service.core.settings import get_settings
from worker.engine.processes import die_with_parent
from worker.serving.inference_worker import main

logging.basicConfig(format="[%(asctime)s: %(levelname)s/serve] %(message)s", level=logging.INFO)
configure(get_settings().log_format)
die_with_parent()
main(sys.argv[1])

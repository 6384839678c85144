"""The house's shape, checked: no import cycles among the project's modules (counting imports inside
functions, which only hide a cycle), and no docstring or comment pointing at a document that is not
in the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers.data import ROOT

PACKAGES = ("service", "worker")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports anywhere in its file. ``from package import module``
    counts as importing the module; a package's ``__init__`` is not counted for its submodules."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    return {m for m in out if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    assert graph["worker.engine.prepare"] >= {"worker.engine.resume", "worker.engine.modeling"}  # the scan sees imports
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


DESIGN_DOCS = re.compile(r"\b(API|RLOO|ARCHITECTURE|STYLE)\.md\b|\.\./shared|\bissue \d+")


DOCS_PAGE = re.compile(r"\bdocs/([\w-]+\.md)\b")


def _text_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder in (*PACKAGES, "tests", "benchmarks", "docs", "examples", "migrations"):
        files += [p for p in sorted((ROOT / folder).rglob("*")) if p.suffix in (".py", ".md", ".json", ".yml")]
    return [p for p in files if p.is_file() and p.name != "test_layout.py"]


def test_nothing_points_outside_the_repository() -> None:
    """Users read the repository's docs (docs/, README.md): a design note they cannot open, or a docs
    page that does not exist, is no reference."""
    offenders = []
    for path in _text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            missing = [page for page in DOCS_PAGE.findall(line) if not (ROOT / "docs" / page).is_file()]
            if DESIGN_DOCS.search(line) or missing:
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


REPO_PATH = re.compile(r"`((?:service|worker|tests|benchmarks|docs|examples|docker|migrations|\.ci)/[\w./-]*\w)`")


def test_paths_the_docs_name_exist() -> None:
    """A file or folder the README or docs/ name in backticks (``worker/engine/methods/rloo.py``) is there."""
    named = {
        (doc.relative_to(ROOT), path)
        for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for path in REPO_PATH.findall(doc.read_text())
    }
    assert len(named) > 20  # the scan finds the paths
    assert sorted(f"{doc}: {path}" for doc, path in named if not (ROOT / path).exists()) == []


def test_the_workers_import_no_http_layer() -> None:
    """Only the API imports fastapi and starlette: a training worker's task, the inference worker's
    loop, the CLI's worker commands and ``rloo train`` (which checks a spec with the API's own code)
    load neither (a worker that did would drag the HTTP layer, and what it imports, into every job's
    process)."""
    import subprocess
    import sys

    code = (
        "import sys, worker.jobs.tasks, worker.serving.inference_worker, worker.serving.evaluate, "
        "worker.jobs.database_recorder, worker.engine.standalone, worker.jobs.celery_worker, "
        "worker.jobs.reconciler, worker.jobs.preload, worker.jobs.job_config, worker.jobs.metrics_server, "
        "worker.cli.serve; "
        "print(sorted(m for m in ('fastapi', 'starlette') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


# The training engine (worker/engine) is torch alone: no Celery, broker, SQL or HTTP layer, nothing of
# the worker's other tiers, and of service/ only what a job's spec, its graders and its files need.
ENGINE_NEVER_IMPORTS = ("celery", "kombu", "redis", "sqlalchemy", "alembic", "fastapi", "starlette", "httpx")
ENGINE_MAY_IMPORT = {
    "service.core.settings",  # the operator's settings (models root, precision, remote reward queue)
    "service.graders",  # scoring a batch
    "service.tools",  # a rollout's tool calls: read, checked and run
    "service.jobs.hyperparameters",  # the hyperparameters a job's spec holds
    "service.infra.artifacts",  # checkpoints on disk or S3
    "service.files.upload_sweep",  # paths confined to their roots
    "service.files.datasets",  # `rloo train`: a local file checked as an upload is
    "service.jobs.spec",  # `rloo train`: a local spec checked as the API checks a job's
    "service.core.validation",  # `rloo train`: the same messages as the API's
    "service.core.strictjson",  # `rloo train`: the spec parsed as the API parses a body
    "service.core.errors",  # the domain's errors: a job's JobError, `rloo train`'s SpecError
    "service.infra.inference_bus",  # remote reward models: a batch asked of the inference workers
    "service.tinker.loss_specs",  # Tinker's losses: their inputs and config, checked as the API checks them
}
# A remote reward model's batch goes to the inference workers through service.infra.inference_bus,
# which holds the Redis client: the engine itself imports no broker.


def _third_party(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_engine_imports_no_celery_broker_sql_or_http_and_little_of_service() -> None:
    modules = _modules()
    engine = {name: path for name, path in modules.items() if name.startswith("worker.engine")}
    assert len(engine) > 20 and "worker.engine.methods.rloo" in engine  # the scan finds the engine
    offenders = []
    for name, path in sorted(engine.items()):
        offenders += [f"{name} imports {p}" for p in sorted(_third_party(path) & set(ENGINE_NEVER_IMPORTS))]
        for imported in sorted(_imports(path, name, modules)):
            inside = imported.startswith("worker.engine")
            if not inside and not any(imported == m or imported.startswith(m + ".") for m in ENGINE_MAY_IMPORT):
                offenders.append(f"{name} imports {imported}")
    assert offenders == []


def test_the_engine_rule_sees_what_it_forbids(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import celery\nfrom sqlalchemy import orm\nimport torch\nfrom worker import engine\n")
    assert _third_party(bad) == {"celery", "sqlalchemy", "torch", "worker"}


def test_the_top_of_worker_holds_at_most_eight_loose_modules() -> None:
    """The worker's folders are its tiers (engine, jobs, serving, cli, tiny): a new module goes in one."""
    loose = sorted(p.name for p in (ROOT / "worker").glob("*.py"))
    assert len(loose) <= 8, loose


HTTP_FRAMEWORK = ("fastapi", "starlette")


def test_only_the_http_layer_imports_the_framework() -> None:
    """FastAPI and Starlette are imported in service/api/ alone (service/main.py only names the app
    it builds): the domain code raises ``service.core.errors.DomainError``s, which
    ``service.api.errors`` answers."""
    modules = _modules()
    assert "service.api.routes.jobs" in modules and "service.api.errors" in modules  # the scan finds them
    offenders = [
        f"{name} imports {package}"
        for name, path in sorted(modules.items())
        if not name.startswith("service.api")
        for package in sorted(_third_party(path) & set(HTTP_FRAMEWORK))
    ]
    assert offenders == []


def test_the_service_never_imports_the_worker() -> None:
    modules = _modules()
    offenders = [
        f"{name} imports {imported}"
        for name, path in sorted(modules.items())
        if name.startswith("service")
        for imported in sorted(_imports(path, name, modules))
        if imported.startswith("worker")
    ]
    assert offenders == []


# service/'s folders are its layers: core (settings, the database, logs, identity, errors) stands on
# nothing else of the service; infra (storage, queues, the Redis bus, egress) on core alone; the domain
# (jobs, registry, files, graders, tools) on both; and only the app imports the HTTP layer.
SERVICE_LAYERS = {
    "service.core": ("service.core",),
    "service.infra": ("service.core", "service.infra"),
    "service.tenancy": ("service.core", "service.infra", "service.tenancy"),  # keys, quotas, usage, audit
    "service.files": ("service.core", "service.infra", "service.files"),
    "service.graders": ("service.core", "service.infra", "service.graders"),
    "service.tools": ("service.core", "service.infra", "service.graders", "service.tools"),  # the graders' sandbox
    "service.registry": ("service.core", "service.infra", "service.files", "service.tenancy", "service.registry"),
    "service.jobs": (
        "service.core",
        "service.infra",
        "service.files",
        "service.graders",
        "service.registry",
        "service.tools",
        "service.tenancy",
        "service.jobs",
    ),
    "service.tinker": ("service.core", "service.infra", "service.registry", "service.tenancy", "service.tinker"),
    "service.evals": (  # OpenAI's Evals: its graders are the jobs' (and checked as a job's are)
        "service.core",
        "service.infra",
        "service.files",
        "service.graders",
        "service.registry",
        "service.jobs",
        "service.evals",
    ),
}


def _service_package(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_the_service_folders_are_layers() -> None:
    modules = _modules()
    assert {"service.core.db", "service.infra.task_queue", "service.api.errors"} <= set(modules)  # the scan finds them
    offenders = []
    for name, path in sorted(modules.items()):
        if not name.startswith("service."):
            continue
        allowed = SERVICE_LAYERS.get(_service_package(name))
        for imported in sorted(_imports(path, name, modules)):
            if not imported.startswith("service."):
                continue
            if allowed is not None and _service_package(imported) not in allowed:
                offenders.append(f"{name} imports {imported}")
            if _service_package(imported) == "service.api" and _service_package(name) not in (
                "service.api",
                "service.main",
            ):
                offenders.append(f"{name} imports the HTTP layer ({imported})")
    assert offenders == []


def test_the_top_of_service_holds_at_most_eight_loose_modules() -> None:
    """The service's folders are its layers (api, core, jobs, registry, files, infra, graders)."""
    loose = sorted(p.name for p in (ROOT / "service").glob("*.py"))
    assert len(loose) <= 8, loose


def _loaded(modules: str, watched: tuple[str, ...]) -> list[str]:
    """Which of ``watched`` a fresh interpreter has loaded once it imported ``modules``."""
    import subprocess
    import sys

    code = f"import sys, {modules}; print(sorted(m for m in {watched!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return list(ast.literal_eval(out.stdout.strip()))


def test_the_engine_loads_no_celery_broker_sql_or_http_through_what_it_imports() -> None:
    """The rule above reads each module's own imports; this one what a process holds once it imported
    the engine's entry points (a training loop, ``rloo train``, a job's ranks): nothing it forbids,
    however indirectly (the one broker client is imported when a remote batch is sent)."""
    entry = "worker.engine.methods.rloo, worker.engine.standalone, worker.engine.distributed.launch"
    assert _loaded(entry, ENGINE_NEVER_IMPORTS) == []


def test_the_celery_parent_and_the_reconciler_never_load_torch() -> None:
    """A training worker's parent forks a pool process a job and the reconciler beside it: with torch
    loaded (or transformers, which initialises devices) a GPU host's children would inherit a CUDA
    state that does not survive a fork. ``preload`` decides when the pool imports it."""
    parent = "worker.celery_app, worker.jobs.celery_worker, worker.jobs.reconciler, worker.jobs.preload"
    assert _loaded(parent, ("torch", "transformers")) == []


def test_the_service_imports_no_torch_or_transformers() -> None:
    """Not one module of service/, whether the app imports it or not (``test_api_ops`` checks the
    app's process as it runs)."""
    modules = _modules()
    offenders = [
        f"{name} imports {package}"
        for name, path in sorted(modules.items())
        if name.startswith("service")
        for package in sorted(_third_party(path) & {"torch", "transformers"})
    ]
    assert len([m for m in modules if m.startswith("service.")]) > 60 and offenders == []

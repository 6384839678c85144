"""What can be checked of the deployment files without a Docker engine: they parse and agree."""

from __future__ import annotations

import re

import yaml

from tests.helpers.data import ROOT


def test_compose_has_the_production_stack() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) >= {"postgres", "redis", "migrate", "api", "worker", "grader-worker"}
    assert services["grader-worker"]["command"] == ["rloo", "worker", "--queue", "rloo-graders"]
    for name in ("migrate", "api", "worker"):
        env = services[name]["environment"]
        assert env["DATABASE_URL"].startswith("postgresql://") and env["REDIS_URL"].startswith("redis://")
    assert services["migrate"]["command"] == ["rloo", "db", "upgrade"]
    for name in ("api", "worker"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    # Volumes the services mount are declared.
    declared = set(compose["volumes"])
    for svc in services.values():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith(".") or source in declared, source


def test_dockerfile_copies_paths_that_exist() -> None:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    for src in re.findall(r"^COPY\s+(.+?)\s+\S+$", text, flags=re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path
    assert "rloo" in text and "USER rloo" in text  # never runs as root


def test_ci_script_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "TEST_DATABASE_URL" in ci and "TEST_REDIS_URL" in ci
    readme = (ROOT / "README.md").read_text()
    first_screen = "\n".join(readme.splitlines()[:20])
    assert "make demo" in first_screen and "make test" in first_screen


def test_python_graders_override_lets_bubblewrap_run_in_the_containers_that_need_it() -> None:
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    override = yaml.safe_load((ROOT / "docker" / "compose.python-graders.yml").read_text())["services"]
    assert set(override) == {"api", "worker", "grader-worker"} and set(override) <= set(base)
    for name, service in override.items():
        assert service["environment"]["RLOO_ALLOW_PYTHON_GRADER"] == "true"
        if name == "api":  # grades nothing: Docker's profiles stay
            assert "security_opt" not in service
        else:
            assert {"seccomp=unconfined", "apparmor=unconfined"} <= set(service["security_opt"])
    for service in base.values():  # the default stack keeps Docker's profiles: python graders are off
        assert "security_opt" not in service
    assert re.search(r"apt-get install .*bubblewrap", (ROOT / "docker" / "Dockerfile").read_text())

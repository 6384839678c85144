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
    assert services["inference-worker"]["command"] == ["rloo", "worker", "--serve"]
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


def test_compose_keeps_files_and_checkpoints_in_minio_and_shares_no_artifacts_volume() -> None:
    """Every service of our image that reads or writes artifacts names the one bucket minio-init
    makes, at MinIO's S3 port, with MinIO's root credentials; none mounts a volume at the artifacts
    directory (each container's is its own cache), so workers may run on any host."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    minio, init = services["minio"], services["minio-init"]
    assert minio["command"][:2] == ["server", "/data"] and "miniodata" in compose["volumes"]
    assert init["depends_on"]["minio"]["condition"] == "service_healthy" and init["restart"] == "no"
    made = re.search(r"mc mb --ignore-existing store/([a-z0-9.-]+)", " ".join(init["command"]))
    assert made, init["command"]
    assert "http://minio:9000" in " ".join(init["command"])
    for name in ("api", "worker", "grader-worker", "inference-worker"):
        service = services[name]
        env = service["environment"]
        bucket = re.fullmatch(r"s3://([^/]+)/.+", env["RLOO_ARTIFACTS_URL"])
        assert bucket and bucket.group(1) == made.group(1), (name, env["RLOO_ARTIFACTS_URL"])
        assert env["RLOO_S3_ENDPOINT_URL"] == "http://minio:9000"
        assert (
            env["AWS_ACCESS_KEY_ID"]
            == minio["environment"]["MINIO_ROOT_USER"]
            == init["environment"]["MINIO_ROOT_USER"]
        )
        assert env["AWS_SECRET_ACCESS_KEY"] == minio["environment"]["MINIO_ROOT_PASSWORD"]
        mounts = [volume.split(":")[1] for volume in service.get("volumes", [])]
        assert env["RLOO_ARTIFACTS_DIR"] not in mounts, name
        if name != "grader-worker":  # (dry runs read no artifacts)
            assert service["depends_on"]["minio-init"]["condition"] == "service_completed_successfully", name
    # The image installs the client the store needs.
    assert re.search(r"pip install .*\[[^\]]*\bs3\b", (ROOT / "docker" / "Dockerfile").read_text())


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


def test_every_compose_command_of_our_image_exists() -> None:
    """Each service of the rloo-service image runs a command and options that exist (their --help
    answers and names each option), and the health checks ask the ports those commands open."""
    import subprocess
    import sys

    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    ours = {name: s for name, s in services.items() if s.get("image") == "rloo-service:latest"}
    assert {"api", "worker", "flower", "grader-worker", "inference-worker", "migrate"} <= set(ours)
    for name, service in ours.items():
        command = service["command"]
        program, args = command[0], command[1:]
        if program == "rloo":
            subcommand = [a for a in args if not a.startswith("-")][:2] if args[0] == "db" else args[:1]
            argv = [sys.executable, "-m", "worker.cli", *subcommand, "--help"]
        else:
            assert program == "celery", name
            argv = [sys.executable, "-m", "celery", *args, "--help"]
            args = args[args.index("flower") + 1 :]  # (--app is celery's own; the app must import)
        out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert out.returncode == 0, (name, out.stderr)
        for option in (a for a in args if a.startswith("--")):
            assert option in out.stdout, (name, option)
    assert "8000/readyz" in " ".join(services["api"]["healthcheck"]["test"])
    assert "9100/healthz" in " ".join(services["worker"]["healthcheck"]["test"])
    assert ours["worker"]["command"][-2:] == ["--metrics-port", "9100"]
    assert ours["flower"]["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?")

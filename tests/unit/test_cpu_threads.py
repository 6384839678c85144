"""A process's torch threads (``worker.engine.cpu_threads``): chosen from ``RLOO_TORCH_THREADS``, the
cores it may use and the torch processes sharing them; put where torch and the processes started
after it read them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.data import ROOT
from worker.engine import cpu_threads
from worker.engine.cpu_threads import apply, cgroup_quota, choose, share


@pytest.mark.parametrize(
    ("cores", "processes", "threads"),
    [(1, 1, 1), (2, 1, 1), (2, 2, 1), (4, 1, 3), (8, 1, 7), (8, 2, 3), (16, 2, 7), (64, 8, 7)],
)
def test_auto_keeps_a_core_for_the_machine_and_shares_the_rest(cores: int, processes: int, threads: int) -> None:
    choice = choose("auto", processes=processes, cores=cores, environ={})
    assert choice.threads == threads
    assert f"{cores} usable cores" in choice.describe()


def test_a_number_or_omp_num_threads_wins_over_auto() -> None:
    assert choose("6", cores=2, environ={"OMP_NUM_THREADS": "1"}).threads == 6  # the setting is the operator's word
    chosen = choose("auto", cores=8, environ={"OMP_NUM_THREADS": "2"})
    assert (chosen.threads, chosen.why) == (2, "OMP_NUM_THREADS")
    assert choose("auto", cores=8, environ={"OMP_NUM_THREADS": "0"}).threads == 7  # not a choice: ignored


def test_apply_sets_the_threads_and_a_brief_spin_only_where_threads_wait_for_each_other() -> None:
    one: dict[str, str] = {}
    apply(choose("1", cores=8, environ=one), one)
    assert one == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    three: dict[str, str] = {}
    apply(choose("3", cores=8, environ=three), three)
    assert three == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3", "GOMP_SPINCOUNT": cpu_threads.SPIN_COUNT}
    users = {"OMP_WAIT_POLICY": "ACTIVE"}  # the user's own wait policy stays theirs
    apply(choose("3", cores=8, environ=users), users)
    assert "GOMP_SPINCOUNT" not in users and users["OMP_NUM_THREADS"] == "3"


def test_ranks_share_the_process_s_threads() -> None:
    assert share(2, environ={"OMP_NUM_THREADS": "7"}) == 3
    assert share(4, environ={"OMP_NUM_THREADS": "2"}) == 1


def test_a_cgroup_quota_caps_the_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # docker run --cpus 1.5 (cgroup v2)
    assert cgroup_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()  # cgroup v1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota(tmp_path) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_quota(tmp_path) is None
    assert cgroup_quota(tmp_path / "absent") is None

    monkeypatch.setattr(cpu_threads, "cgroup_quota", lambda: 1.5)
    assert cpu_threads.usable_cores() == min(2, len(os.sched_getaffinity(0)))


def _threads_in_a_fresh_process(env: dict[str, str], *, cpus: str | None = None) -> list[int]:
    """What a process configured with ``auto`` chose, and what its torch then uses."""
    code = (
        "from worker.engine.cpu_threads import configure; c = configure('auto'); "
        "import torch; print(c.threads, torch.get_num_threads())"
    )
    command = [sys.executable, "-c", code]
    if cpus is not None:
        command = ["taskset", "-c", cpus, *command]
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run(command, env={**clean, **env}, cwd=ROOT, capture_output=True, text=True, check=True)
    return [int(x) for x in out.stdout.split()]


def test_torch_uses_what_was_chosen_before_it_was_imported() -> None:
    cores = len(os.sched_getaffinity(0))
    assert _threads_in_a_fresh_process({}) == [max(1, cores - 1)] * 2
    assert _threads_in_a_fresh_process({"OMP_NUM_THREADS": str(cores)}) == [cores, cores]  # torch caps at cores


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not Path("/usr/bin/taskset").exists(), reason="one core")
def test_auto_reads_the_affinity_mask() -> None:
    assert _threads_in_a_fresh_process({}, cpus="0") == [1, 1]


def test_rloo_up_shares_the_cores_between_its_torch_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.core.settings import get_settings
    from worker.cli.stack import torch_threads_of

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("RLOO_TORCH_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 9)
    get_settings.cache_clear()
    assert torch_threads_of("worker") == torch_threads_of("inference-worker") == {"RLOO_TORCH_THREADS": "4"}
    assert torch_threads_of("grader-worker") == {"RLOO_TORCH_THREADS": "1"}
    assert torch_threads_of("api") == {}
    monkeypatch.setenv("RLOO_TORCH_THREADS", "2")  # the user's choice is every part's
    get_settings.cache_clear()
    assert torch_threads_of("worker") == {}
    get_settings.cache_clear()

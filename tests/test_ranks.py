"""run_ranks (tests/support/ranks.py): ranks forked from the per-session servers are what a cold start makes them;
return codes, hangs and killing are as ``subprocess.Popen`` ranks have them; a start-time variable starts cold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.support.ranks import RanksHung, run_ranks

FINGERPRINT = """
import json, multiprocessing, os, signal, sys
early = sorted(m for m in ("torch", "lightning", "autotune", "tests") if m in sys.modules)
import numpy, torch
ranks = {name: vars(module)["rank_zero_only"].rank for name, module in list(sys.modules.items())
         if hasattr(vars(module).get("rank_zero_only"), "rank")}
fds = {}
for fd in map(int, os.listdir("/proc/self/fd")):
    try:
        fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:  # the listing's own
        pass
seen = {
    "early": early, "argv": sys.argv, "cwd": os.getcwd(), "name": __name__, "path": sys.path,
    "env": {k: os.environ.get(k) for k in ("MASTER_ADDR", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK", "AUTOTUNE_MARK",
                                           "PYTORCH_NVML_BASED_CUDA_CHECK")},
    "rank_zero_only": sorted(set(ranks.values())), "start_method": multiprocessing.get_start_method(),
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "sigchld": signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL, "own_group": os.getpgid(0) == os.getpid(),
    "stdin": fds.get(0), "pipes": sorted(target for target in fds.values() if target.startswith("pipe:")),
    "cuda": torch.cuda.is_initialized(),
    "draws": [hash("x"), torch.initial_seed(), float(numpy.random.random())],
}
Path = __import__("pathlib").Path
Path(f"{os.environ['LOCAL_RANK']}.json").write_text(json.dumps(seen))
print("rank", os.environ["LOCAL_RANK"], "port", os.environ["MASTER_PORT"])
"""


def ended(pid: int, *, within: float) -> bool:
    """Whether process ``pid`` is gone, or a zombie (where nothing reaps orphans), within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_forked_rank_is_what_a_cold_start_would_make_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = script(tmp_path, FINGERPRINT)
    bare = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"],
                          capture_output=True, text=True, check=True)
    draws = []
    for run in range(2):
        proc = run_ranks([path, "--flag", "x y"], env={"AUTOTUNE_MARK": "given"}, timeout=60)
        assert proc.returncode == 0, proc.stderr
        port = proc.stdout.split()[3]
        assert proc.stdout == f"rank 0 port {port}\nrank 1 port {port}\n"  # each rank's output, in rank order
        for rank in range(2):
            seen = json.loads((tmp_path / f"{rank}.json").read_text())
            draws.append(seen.pop("draws"))
            assert seen == {
                "early": ["lightning", "torch"],  # forked: imported by the server; autotune and tests never
                "argv": [path, "--flag", "x y"], "cwd": str(tmp_path), "name": "__main__",
                "path": json.loads(bare.stdout),  # a fresh ``python -c``'s
                "env": {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", "NODE_RANK": "0", "LOCAL_RANK": str(rank),
                        "AUTOTUNE_MARK": "given", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"},  # the last: Lightning's import
                "rank_zero_only": [rank],  # every module's import-time rank (Lightning's, torchmetrics') is this rank
                "start_method": "fork", "sigint": True, "sigchld": True, "own_group": True,
                "stdin": "/dev/null", "pipes": [],  # none of the server's pipes
                "cuda": False,
            }, f"rank {rank}"
    if os.environ.get("PYTHONHASHSEED", "random") == "random":  # ranks differ in their hash seed, as under torchrun
        assert draws[0][0] != draws[1][0]
    assert len({d[1] for d in draws}) == len({d[2] for d in draws}) == 4  # torch's and numpy's seeds are each run's


@pytest.mark.parametrize(("body", "code", "says"), [
    ("pass", 0, ""),
    ("sys.exit(3)", 3, ""),
    ("raise ValueError('bad value 7')", 1, "ValueError: bad value 7"),
    ("os.kill(os.getpid(), signal.SIGTERM)", -15, ""),
])
def test_the_return_code_is_the_failing_ranks_as_popen_reports_it(tmp_path: Path, body: str, code: int,
                                                                   says: str) -> None:
    path = script(tmp_path, f"""
        import os, signal, sys
        print("started", flush=True)
        if os.environ["LOCAL_RANK"] == "1":
            {body}
        """)
    proc = run_ranks([path], timeout=60)
    assert (proc.returncode, proc.stdout) == (code, "started\nstarted\n")
    assert says in proc.stderr.split("--- rank 1")[1]


def test_a_hung_rank_is_reported_with_its_stacks_and_killed_with_its_workers(tmp_path: Path) -> None:
    path = script(tmp_path, """
        import multiprocessing, os, sys, time
        from pathlib import Path

        def wait_for_a_peer_that_never_comes():
            while True:
                time.sleep(0.1)

        if os.environ["LOCAL_RANK"] == "1":
            worker = multiprocessing.Process(target=time.sleep, args=(600,))
            worker.start()
            Path(sys.argv[1]).write_text(str(worker.pid))
            print("waiting", flush=True)
            wait_for_a_peer_that_never_comes()
        """)
    with pytest.raises(RanksHung, match=r"1 of 2 ranks still running after 1 s \(finished: \[0\]\):\nrank 1 hung; "
                                        r"its last output: \['waiting'\]") as hung:
        run_ranks([path, str(tmp_path / "worker.pid")], timeout=1)
    assert "in wait_for_a_peer_that_never_comes" in str(hung.value)  # its stacks, from faulthandler
    worker = int((tmp_path / "worker.pid").read_text())
    assert ended(worker, within=10)  # killed with its rank

def test_stop_peers_ends_the_others_once_one_fails(tmp_path: Path) -> None:
    path = script(tmp_path, """
        import os, sys, time
        if os.environ["LOCAL_RANK"] == "0":
            sys.exit(5)
        time.sleep(600)
        """)
    assert run_ranks([path], timeout=60, stop_peers=True).returncode == 5


@pytest.mark.parametrize("setting", [{"env": {"OMP_NUM_THREADS": "1"}}, {"cold": "1"}])
def test_a_start_time_variable_or_the_switch_starts_the_run_cold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  setting: dict) -> None:
    if "cold" in setting:
        monkeypatch.setenv("AUTOTUNE_TEST_COLD_RANKS", setting["cold"])
    path = script(tmp_path, """
        import os, sys
        print("torch" in sys.modules, os.environ.get("OMP_NUM_THREADS"), os.getpgid(0) == os.getpid())
        """)
    proc = run_ranks([path], ranks=1, env=setting.get("env"), timeout=60)
    assert proc.stdout == f"False {setting.get('env', {}).get('OMP_NUM_THREADS')} True\n"

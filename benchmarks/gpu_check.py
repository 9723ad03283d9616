"""One command for all GPU validation: tests, benchmarks and a realistic search, into one Markdown report (and JSON).

    python benchmarks/gpu_check.py --quick --minutes 12 --wheels .whl  # a lent GPU: 15 minutes of device time
    python benchmarks/gpu_check.py                       # everything in full (about 25 minutes and more)
    python benchmarks/gpu_check.py --device cpu --quick  # the plumbing on a CPU (CI runs it): every step, small

Steps run in the order below, each under its own limit, and none starts once ``--minutes`` are spent (it is reported
"not run"): the most wanted figures come first, issue 47's (a trial against a plain run of its plan, the trial's peak
taken apart, the search under a tight cap, the search on the 310M GPT), whose first three end within 12 minutes in
``--quick`` (limits of 150, 180 and 330 s). ``--wheels DIR`` installs the wheels in DIR first (and this checkout,
editable), in every call: a lent machine may be a fresh one at each call.
Each step runs in a process of its own with its own time limit, so one failure or hang costs that step only; the
report (``gpu_check/report.md`` and ``report.json``) names the device, driver and versions, and for every step its
command, exit status, seconds, the lines that matter and where its full output is (pytest steps keep every failure's
traceback: ``-rA`` output and a junit XML). Steps:

1. a trial against a plain run (``tests/search/test_trial_memory.py``, its ``gpu`` test): on the 310M GPT, each step's
   tensors' peak in a search trial and in a plain Lightning run of the same plan and steps (within 3%; where not,
   the plain run again with the trial's meter, with and without its FLOP count, says which part adds it).
2. a trial against its estimate (``benchmarks/trial_vs_estimate.py``: on a GPU, the realistic search's best plan on
   ``gpt_350m`` built up one feature at a time, each trial's tensors' peak, reserve and context beside the estimate,
   and the first plan fitted again as its trial ran, the tensors alive at its peak listed; ``--quick`` on a CPU: one
   plan of the small GPT example).
3. against the alternatives (``benchmarks/vs_alternatives.py``: naive plan, Lightning's BatchSizeFinder, halving;
   ``--quick``: the GPT example only, under the cap where the CUDA context is most of it, which ended within the
   325 s an H200 run gave the step while the test suite's hungry target did not; on a CPU its options only).
4. a realistic search: ``autotune search benchmarks/gpu_targets.py:gpt_350m`` (310M parameters, context 1024) under a
   16 GiB cap, with MFU from its trials (``--quick`` on a CPU: the small GPT example under 2 GiB, 1 trial).
5. ``pytest -m gpu``: the other tests that need CUDA.
6. the estimator's accuracy (``benchmarks/estimator_accuracy.py``: the CUDA column on a GPU; ``--quick`` on a CPU: its
   options only, its CPU rows are in docs/benchmarks.md).
7. the elastic runtime's overhead and one real OOM's cost (``benchmarks/elastic_overhead.py``; ``--quick`` on a
   CPU: its options only, a run takes minutes).
8. dynamic padding (``benchmarks/dynamic_padding.py``: the tokens and length-squared rules, and on a GPU real memory
   under an allocator cap; ``--quick``: on a GPU real memory only, over the 240 steps and 3 seeds its goal is stated
   for (in 60 steps the first long batches' learning was half the excess), on a CPU its options only: the test
   suite runs its CPU rules).
9. the whole suite with CUDA visible, less the gpu tests (steps 1 and 5), last since it is the longest: in parallel
   on half the cores (pytest-xdist, at most 8 workers; ``--quick``: less the slow tests too; on a CPU the layout tests
   only, in one process). The other pytest steps run in one process: the gpu tests share the device.

``--only`` names steps to run (an unknown name is refused, with the steps' names); ``--suite-paths`` limits the
whole-suite step to some test files (the rest of a suite an earlier run cut at its limit).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import ROOT, machine, machine_line, make_parser, markdown_table  # noqa: E402


@dataclass
class Step:
    """One step of the check: its command and, once run, what happened."""

    name: str
    command: list[str]
    timeout_s: float
    status: str = "not run"  # "ok", "failed", "timed out", "not run"
    returncode: int | None = None
    seconds: float = 0.0
    summary: list[str] = field(default_factory=list)  # the lines that matter
    output: str = ""  # where the whole output is


#: What the steps import: checked before any step runs, so that a machine without them (a fresh one, where an earlier
#: call's install is gone) costs one line, not a suite of import errors (it cost an H200 run 4.5 minutes).
NEEDED = ("autotune.callbacks", "autotune.search_spaces", "optuna", "jsonargparse", "pytest", "xdist", "torchao")


#: The test that holds a trial's tensors to a plain run's (the first step; the gpu-tests step leaves it out).
TRIAL_MEMORY_TEST = "tests/search/test_trial_memory.py"
#: ``--quick`` on a GPU: the limits of the first three steps (issue 47's items 1 and 2), 11 minutes together.
QUICK_LIMITS_S = (150, 180, 330)


def install_wheels(folder: Path, site: Path) -> str | None:
    """Install every wheel in ``folder`` into ``site`` (no index, no dependencies: a lent machine has no network)
    and this checkout in editable mode, and make both importable here and in every step (``sys.path``,
    ``PYTHONPATH``); None when done, else the one line that says why not. Run at every call: a call may land on a
    fresh machine, where what an earlier call installed is gone."""
    import site as site_module
    import sysconfig

    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        return f"--wheels {folder}: no .whl files there"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-cache-dir"]
    for what, command in ((f"the {len(wheels)} wheels of {folder}",
                           [*pip, "--no-compile", "--upgrade", "--target", str(site), *map(str, wheels)]),
                          (f"{ROOT} (editable)", [*pip, "--no-build-isolation", "-e", str(ROOT)])):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
            return f"installing {what} failed: {tail[0]}"
    sys.path.insert(0, str(site))
    site_module.addsitedir(sysconfig.get_paths()["purelib"])  # the editable install's finder (.pth), here too
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    importlib.invalidate_caches()
    return None


def missing_modules(names: tuple[str, ...] = NEEDED) -> list[str]:
    """Those of ``names`` that cannot be imported here."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:  # a parent package that is not there
            found = False
        if not found:
            missing.append(name)
    return missing


def steps(device: str, quick: bool, out: Path, suite_paths: list[str] | None = None) -> list[Step]:
    """The check's steps for ``device`` (``--quick``: small versions; on a CPU the slow benchmarks show their options
    only); ``suite_paths``: the test files or folders the whole-suite step runs (default: all)."""
    python, cuda = sys.executable, device == "cuda"
    cpu_quick = quick and not cuda

    def pytest(name: str, *args: str) -> list[str]:  # one process (the gpu tests share one device), unless args say
        return [python, "-m", "pytest", "-rA", "-p", "no:cacheprovider", f"--junitxml={out / (name + '.xml')}",
                "-n", "0", *args]

    # the suite less the gpu tests (steps 1 and 5 ran them): on a CPU in quick mode the layout tests only; else on
    # half a lent GPU machine's cores (pytest-xdist, at most 8 workers)
    suite = list(suite_paths) if suite_paths else ["tests/test_layout.py"] if cpu_quick else []
    if not cpu_quick:
        suite += ["-n", str(max(2, min(8, (os.cpu_count() or 2) // 2)))]
    search_target, budget, trials = (("examples/gpt/train.py:make", "2GiB", "1") if cpu_quick
                                     else ("benchmarks/gpu_targets.py:gpt_350m", "16GiB", "4" if quick else "8"))
    search = [python, "-m", "autotune", "search", search_target, "--budget", budget, "--trials", trials,
              "--device", device, "--out", str(out / "tuned.yaml"), "--storage", f"sqlite:///{out / 'study.db'}",
              "--steps", "3" if quick else "10", "--warmup", "1" if quick else "3"]
    first = QUICK_LIMITS_S if quick and cuda else (900, 900, 1500)  # issue 47's three, inside 12 minutes in --quick
    return [
        Step("trial against a plain run", pytest("trial-memory", "-q", "-m", "gpu", TRIAL_MEMORY_TEST), first[0]),
        Step("trial against estimate", [python, "benchmarks/trial_vs_estimate.py", "--device", device,
                                        *(["--quick"] if quick else []),
                                        "--json", str(out / "trial_vs_estimate.json")], first[1]),
        Step("against the alternatives", [python, "benchmarks/vs_alternatives.py", "--device", device,
                                          *(["--help"] if cpu_quick else ["--quick", "--cases", "gpt"] if quick
                                            else []),
                                          *([] if cpu_quick else ["--json", str(out / "vs_alternatives.json")])],
             first[2]),
        Step("realistic search", search, 1500),
        Step("gpu tests", pytest("gpu-tests", "-m", "gpu", "-q", f"--ignore={TRIAL_MEMORY_TEST}"), 900),
        Step("estimator accuracy", [python, "benchmarks/estimator_accuracy.py", "--device", device,
                                    *(["--help"] if cpu_quick else ["--quick", "--models", "mlp"] if quick else []),
                                    *([] if cpu_quick else ["--json", str(out / "estimator_accuracy.json")])], 900),
        Step("elastic overhead and one real OOM", [python, "benchmarks/elastic_overhead.py", "--device", device,
                                                   *(["--help"] if cpu_quick else ["--quick"] if quick else []),
                                                   *([] if cpu_quick else ["--json", str(out / "overhead.json")])],
             900),
        Step("dynamic padding", [python, "benchmarks/dynamic_padding.py", "--device", device,
                                 # --quick on a GPU: real memory only, at its goal's length (240 steps, seeds
                                 # 0-2: about 2 minutes), the simulated rules being the CPU's to check (the test
                                 # suite runs them: tests/runtime/test_shapes.py)
                                 *((["--rule", "memory"] if cuda else ["--help"]) if quick else []),
                                 *([] if cpu_quick else ["--json", str(out / "dynamic_padding.json")])], 900),
        # --quick leaves out the slow tests too (99 multi-process and search runs: 12 of CI's 15 minutes)
        Step("whole suite with CUDA visible",
             pytest("suite", "-q", "-m", "not gpu and not slow" if quick else "not gpu", *suite), 1500),
    ]


#: Lines of a step's output worth showing in the report (the rest stays in its log file).
_KEEP = ("passed", "failed", "error", "median", "goal", "largest", "shape-aware", "wrote", "best", "mfu", "FAILED",
         "by size", "split beyond",
         "samples/s", "Traceback", "timed out")


#: Seconds a step has to stop after its Ctrl-C at its limit (taken from its limit) before it is killed.
INTERRUPT_GRACE_S = 20.0


def run_step(step: Step, out: Path) -> Step:
    """Run ``step`` from the repository root, its output to ``out/<name>.log``; fills in what happened."""
    log = out / (step.name.replace(" ", "-") + ".log")
    step.output = str(log.relative_to(out))
    start = time.perf_counter()
    with log.open("w") as sink:
        # a session of its own: at the limit the step gets Ctrl-C (SIGINT to its group), so pytest (and xdist's
        # workers) stop and still print the summary and write the junit XML of what ran; then the group is killed
        # (Ctrl-C at its default in the step, whatever this process has: a check started in the background, with
        # `nohup` or by a shell without job control, ignores SIGINT, and an ignored signal stays ignored across exec)
        proc = subprocess.Popen(step.command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_ctrl_c_at_default)
        try:
            try:
                step.returncode = proc.wait(timeout=max(1.0, step.timeout_s - INTERRUPT_GRACE_S))
                step.status = "ok" if step.returncode == 0 else "failed"
            except subprocess.TimeoutExpired:
                step.status = "timed out"
                _interrupt(proc)
            except KeyboardInterrupt:  # the check's own Ctrl-C: the step's too, so it still writes what it has
                _interrupt(proc)
                raise
        finally:  # nothing of the step outlives it (a worker or rank that ignored Ctrl-C, a check stopped by SIGTERM)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    step.seconds = time.perf_counter() - start
    lines = log.read_text(errors="replace").splitlines()
    step.summary = [line for line in lines if any(k.lower() in line.lower() for k in _KEEP)][-8:] or lines[-3:]
    return step


def _ctrl_c_at_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(proc: subprocess.Popen) -> None:
    """Ctrl-C to the step's process group, and up to ``INTERRUPT_GRACE_S`` for it to stop."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=INTERRUPT_GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass


def driver() -> str | None:
    """The NVIDIA driver's version (NVML), or None without one."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVML (no GPU, no driver): the report says so
        return None


def report(done: list[Step], info: dict[str, Any], quick: bool) -> str:
    rows = [[s.name, s.status, "-" if s.returncode is None else str(s.returncode), f"{s.seconds:.0f}", s.output]
            for s in done]
    lines = ["# GPU check", "", machine_line(info), f"driver: {info.get('driver') or 'none (no NVIDIA driver)'}",
             f"mode: {'quick' if quick else 'full'}", "",
             markdown_table(["step", "status", "exit", "seconds", "output"], rows), ""]
    for s in done:
        lines += [f"## {s.name}: {s.status}", "", "`" + " ".join(Path(c).name if c == sys.executable else c
                                                            for c in s.command) + "`", "", "```",
                  *s.summary, "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="small versions of every step")
    parser.add_argument("--out", type=Path, default=ROOT / "gpu_check", help="report folder (default gpu_check/)")
    parser.add_argument("--only", nargs="+", default=None, metavar="STEP", help="run only these steps (by name)")
    parser.add_argument("--suite-paths", nargs="+", default=None, metavar="PATH",
                        help="the test files or folders the whole-suite step runs (default: all): the rest of a suite "
                             "that an earlier run cut at its limit")
    parser.add_argument("--wheels", type=Path, default=None, metavar="DIR",
                        help="install the wheels in DIR (into --site) and this checkout (editable) before any step")
    parser.add_argument("--site", type=Path, default=Path("/tmp/gpu_check_site"),
                        help="where --wheels installs (default /tmp/gpu_check_site)")
    parser.add_argument("--minutes", type=float, default=25.0,
                        help="start no step once this many minutes are spent; each step ends by then (default 25)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # `timeout`: stop the step as well
    missing = [path for path in args.suite_paths or () if not (ROOT / path).exists()]
    if missing:
        print(f"gpu_check: --suite-paths {missing[0]!r} is not a test file or folder of {ROOT}", file=sys.stderr)
        return 2
    if args.wheels is not None:
        failure = install_wheels(args.wheels, args.site)
        if failure:
            print(f"gpu_check: {failure}", file=sys.stderr)
            return 2
    absent = missing_modules()
    if absent:
        print(f"gpu_check: cannot import {', '.join(absent)}: install the package and its test dependencies first "
              "(pip install -e '.[test]'; on a machine without network, from carried wheels)", file=sys.stderr)
        return 2
    every = steps(args.device, args.quick, args.out, args.suite_paths)
    unknown = [name for name in args.only or () if name not in {s.name for s in every}]
    if unknown:
        print(f"gpu_check: --only {unknown[0]!r} is not a step; the steps: "
              + ", ".join(repr(s.name) for s in every), file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: --device cuda but torch sees no CUDA device; use --device cpu --quick for the plumbing",
                  file=sys.stderr)
            return 2
    elif args.device == "cpu":  # the plumbing: no step touches a GPU this machine may have (the gpu tests skip)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    args.out.mkdir(parents=True, exist_ok=True)
    info = {**machine(args.device), "driver": driver()}
    todo = [s for s in every if args.only is None or s.name in args.only]
    done, deadline = [], time.monotonic() + 60 * args.minutes
    for step in todo:
        left = deadline - time.monotonic()
        if left < 30:
            done.append(step)  # "not run": the time is spent
            continue
        step.timeout_s = min(step.timeout_s, left)
        print(f"gpu_check: {step.name} ...", flush=True)
        done.append(run_step(step, args.out))
        print(f"gpu_check: {step.name}: {step.status} in {step.seconds:.0f} s", flush=True)
    text = report(done, info, args.quick)
    (args.out / "report.md").write_text(text)
    (args.out / "report.json").write_text(json.dumps({"machine": info, "quick": args.quick,
                                                      "steps": [asdict(s) for s in done]}, indent=1, default=str))
    print(f"gpu_check: report in {args.out / 'report.md'}")
    return 0 if all(s.status == "ok" for s in done) else 1


if __name__ == "__main__":
    sys.exit(main())

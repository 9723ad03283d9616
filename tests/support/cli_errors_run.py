"""Run a LightningCLI script's ``main()`` once per command line, each but the last in a forked child that ends as the
interpreter's top level would (``SystemExit``'s code; any other exception through ``sys.excepthook``, then status 1),
and print their exit statuses and outputs (stdout and stderr together) as one JSON line; then run the last one in this
process, unguarded, so that the interpreter's own top level reports it (this process's status and the output after
the JSON line are that run's).

Usage: ``python cli_errors_run.py SCRIPT.py CASES.json``; CASES.json is a list of argument lists (``sys.argv[1:]``).
Importing torch, Lightning and the script once, building the parser once before forking, keeps a case under a second.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile


def _run_child(main, argv: list[str], out_fd: int) -> None:  # noqa: ANN001
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    sys.argv = [sys.argv[1], *argv]
    code = 0
    try:
        main()
    except SystemExit as exc:  # what the interpreter does with it: an int is the status, anything else is printed
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the interpreter's top level: the excepthook shows it, status 1
        sys.excepthook(*sys.exc_info())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    script, cases_file = sys.argv[1], sys.argv[2]
    with open(cases_file) as f:
        cases = json.load(f)
    spec = importlib.util.spec_from_file_location("cli_script", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.argv = [script, "fit", "--help"]
    with open(os.devnull, "w") as devnull:  # build the parser once: the children find jsonargparse's caches warm
        stdout, sys.stdout = sys.stdout, devnull
        try:
            module.main()
        except SystemExit:
            pass
        finally:
            sys.stdout = stdout
    results = []
    for argv in cases[:-1]:
        with tempfile.TemporaryFile() as out:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_child(module.main, argv, out.fileno())
            _, status = os.waitpid(pid, 0)
            out.seek(0)
            results.append({"argv": argv, "status": os.waitstatus_to_exitcode(status),
                            "output": out.read().decode(errors="replace")})
    print(json.dumps(results), flush=True)
    sys.argv = [script, *cases[-1]]
    module.main()


if __name__ == "__main__":
    main()

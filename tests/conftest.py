import os
import sys

# Spawned ranks unpickle test bodies by module name: keep tests/ importable in them too.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning,ignore::FutureWarning")


# ---- the suite's time budget (docs/testing.md) ------------------------------------------
# Each test's time is its setup + call + teardown: a module-scoped fixture (a shared launch,
# a converted checkpoint) counts toward the first test that uses it, as the wall clock does.
_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _seconds:
        return
    import time

    write = terminalreporter.write_line
    started = getattr(terminalreporter, "_session_start", None)
    wall = time.time() - started.time if started is not None else sum(_seconds.values())
    modules: dict[str, list[float]] = {}
    for nodeid, seconds in _seconds.items():
        modules.setdefault(nodeid.split("::")[0], []).append(seconds)
    terminalreporter.section("time budget (docs/testing.md)")
    write(f"total: {wall:.0f} s wall for {len(_seconds)} tests "
          f"({sum(_seconds.values()):.0f} s in tests)")
    write("slowest modules:")
    for path, times in sorted(modules.items(), key=lambda kv: -sum(kv[1]))[:15]:
        write(f"  {sum(times):7.1f} s  {len(times):4d} tests  {path}")
    write("slowest tests:")
    for nodeid, seconds in sorted(_seconds.items(), key=lambda kv: -kv[1])[:15]:
        write(f"  {seconds:7.1f} s  {nodeid}")
    times_file = os.environ.get("MINDSPEED_RL_TEST_TIMES")
    if times_file:  # every test's seconds, for the per-module table of docs/testing.md
        import json

        with open(times_file, "w") as f:
            json.dump({"wall_s": round(wall, 1), "tests": _seconds}, f, indent=1)
        write(f"every test's seconds: {times_file}")
